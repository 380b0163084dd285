"""/embed_all's JSON answer is bounded (frontend.tasks.json_bound): a request of every token's
row could make 190 MB of JSON, a 580 MB frontend and a 1.5 s stall of its event loop."""

import pytest
from aiohttp.test_utils import make_mocked_request

from frontend.errors import ApiError
from frontend.tasks import JSON_TOKEN_VALUES, json_bound


def test_a_json_answer_past_the_bound_is_a_413_naming_msgpack():
    most = JSON_TOKEN_VALUES // 384
    for accept in ("application/json", "*/*", ""):
        request = make_mocked_request("POST", "/embed_all", headers={"Accept": accept})
        json_bound(request, most, 384)  # at the bound: taken
        with pytest.raises(ApiError) as info:
            json_bound(request, most + 1, 384)
        assert info.value.status == 413 and info.value.param == "inputs"
        assert f"at most {most:,} tokens" in info.value.message
        assert "Accept: application/msgpack" in info.value.message


def test_msgpack_answers_keep_only_the_shared_memory_bound():
    request = make_mocked_request("POST", "/embed_all",
                                  headers={"Accept": "application/msgpack"})
    json_bound(request, 10 * JSON_TOKEN_VALUES, 384)  # dispatch's arena share bounds it
