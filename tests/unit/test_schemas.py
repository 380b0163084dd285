import pytest

from frontend.errors import ApiError, STATUS
from frontend.schemas import parse_openai_embeddings, parse_predict, texts
from shmserve.config import LimitsConfig
from shmserve.protocol import ErrorCode

LIMITS = LimitsConfig(max_texts_per_request=4, max_text_chars=20, truncate=True)


def test_one_value_or_a_list_is_resolved_at_the_edge():
    assert parse_openai_embeddings({"input": "a"}, LIMITS).texts == ["a"]
    req = parse_openai_embeddings({"input": ["a", "b"], "model": "m",
                                   "encoding_format": "base64", "user": "u"}, LIMITS)
    assert req.texts == ["a", "b"] and req.model == "m" and req.encoding_format == "base64"
    assert parse_predict({"texts": ["x"]}, LIMITS).model is None
    # One string is one text, as /v1/embeddings takes it (one row back).
    assert parse_predict({"texts": "hello"}, LIMITS).texts == ["hello"]


@pytest.mark.parametrize("value,message", [
    (5, "'texts' must be a string or a list of strings"),
    ({"a": "b"}, "'texts' must be a string or a list of strings"),
    ("", "'texts' must not be empty"),
    ("x" * 21, "'texts' has 21 characters"),
    ([""], "'texts[0]' must not be empty"),
])
def test_predict_texts_refused(value, message):
    with pytest.raises(ApiError) as info:
        parse_predict({"texts": value}, LIMITS)
    assert info.value.param == "texts" and info.value.message.startswith(message)


@pytest.mark.parametrize("value", [None, 5, {"input": "a"}, 1.5])
def test_a_field_that_takes_token_ids_says_so_when_its_type_is_wrong(value):
    with pytest.raises(ApiError) as info:
        parse_openai_embeddings({"input": value}, LIMITS)
    assert info.value.param == "input"
    assert info.value.message == ("'input' must be a string, a list of strings, a list of token "
                                  "ids (integers) or a list of such lists")


def test_a_list_only_field_says_so():
    # TEI's /rerank "texts", /v1/rerank's documents and KServe's tensors take no single string.
    with pytest.raises(ApiError, match="'texts' must be a list of strings$"):
        texts("a", "texts", LIMITS)


def test_token_ids_one_list_or_many():
    one = parse_openai_embeddings({"input": [101, 7592, 102]}, LIMITS)
    assert one.token_ids == [[101, 7592, 102]] and one.texts == []
    many = parse_openai_embeddings({"input": [[1], [2, 3]], "dimensions": 8, "user": "u"},
                                   LIMITS)
    assert many.token_ids == [[1], [2, 3]] and many.dimensions == 8
    # a whole float is that integer, as JSON Schema's integer (the OpenAPI document) says
    whole = parse_openai_embeddings({"input": "a", "dimensions": 8.0}, LIMITS).dimensions
    assert whole == 8 and type(whole) is int
    # token ids and a body's priority too: [1.0] was refused as "a float" while dimensions
    # 1.0 was taken (an outside check, validating by the OpenAPI document)
    for given, ids in (([101.0, 7592, 102.0], [[101, 7592, 102]]), ([[1.0], [2, 3.0]],
                                                                    [[1], [2, 3]])):
        got = parse_openai_embeddings({"input": given, "priority": 1.0}, LIMITS)
        assert got.token_ids == ids and got.priority == 1
        assert all(type(i) is int for row in got.token_ids for i in row)


@pytest.mark.parametrize("body,status,param", [
    ({"input": []}, 422, "input"),
    ({"input": ""}, 422, "input"),
    ({"input": [1.5]}, 422, "input"),
    ({"input": [True]}, 422, "input"),  # a bool is no token id
    ({"input": [[1, 2], []]}, 422, "input"),
    ({"input": [[1, 2], ["a"]]}, 422, "input"),
    ({"input": [[1]] * 5}, 413, "input"),
    ({"input": ["a", 1]}, 422, "input"),
    ({"input": "a", "dimensions": 0}, 422, "dimensions"),
    ({"input": "a", "dimensions": "8"}, 422, "dimensions"),
    ({"input": "a", "dimensions": 8.5}, 422, "dimensions"),
    ({"input": "a", "dimensions": True}, 422, "dimensions"),
    ({"input": "a", "user": 5}, 422, "user"),
    ({"input": "a\ud800"}, 422, "input"),  # a lone surrogate, as JSON can escape one
    ({"input": {"a": 1}}, 422, "input"),
    ({"input": ["a"] * 5}, 413, "input"),
    ({"input": "x" * 21}, 413, "input"),
    ({"input": "a", "model": ""}, 422, "model"),
    ({"input": "a", "encoding_format": 1}, 422, "encoding_format"),
    ("input", 422, None),
])
def test_bad_bodies(body, status, param):
    with pytest.raises(ApiError) as info:
        parse_openai_embeddings(body, LIMITS)
    assert info.value.status == status and info.value.param == param


def test_every_worker_error_code_maps_to_a_status():
    for code in ErrorCode:
        err = ApiError.from_worker(code, "m")
        assert err.status in STATUS.values()
    assert ApiError.from_worker(ErrorCode.OVERLOADED, "m").headers() == {"Retry-After": "1"}
    assert ApiError.from_worker(ErrorCode.DEADLINE, "m").status == 504
    assert ApiError.from_worker(ErrorCode.OUT_OF_MEMORY, "m").status == 507


def test_error_body_shape():
    err = ApiError("invalid_request", "bad", param="input")
    assert err.body() == {"error": {"type": "invalid_request", "message": "bad",
                                    "param": "input", "code": None}, "message": "bad"}
    # OpenAI's shape: every key is always there, null when unset; the message again at the
    # top, where TEI's OpenAI-compatible route and Cohere's API put it
    assert ApiError("not_found", "x", code="model_not_found").body() == {"error": {
        "type": "not_found", "message": "x", "param": None, "code": "model_not_found"},
        "message": "x"}
    with pytest.raises(ValueError):
        ApiError("no_such_kind", "x")


@pytest.mark.parametrize("value,message", [
    # orjson reads an integer past 64 bits as a float: it is a bad token id, not a bad text.
    ([1e26], "'input[0]' is 1e+26, an integer past 64 bits; token ids must be integers in "
             "[0, the model's vocabulary size)"),
    ([101, 2.5], "'input[1]' is 2.5, a float; token ids must be integers"),
    ([[101, 102], [101, None]], "'input[1][1]' is null; token ids must be integers"),
    ([[101, 102], "a"], "'input' mixes token-id lists with other values; send a list of texts "
                        "or a list of token-id lists, not both"),
    (["a", [101, 102]], "'input' mixes token-id lists with other values"),
    ([101, "a"], "'input' mixes texts with token ids; send a list of texts or a list of token "
                 "ids, not both"),
])
def test_bad_token_ids_are_named_as_token_ids(value, message):
    with pytest.raises(ApiError) as info:
        parse_openai_embeddings({"input": value}, LIMITS)
    assert info.value.status == 422 and info.value.param == "input"
    assert info.value.message.startswith(message), info.value.message


def test_a_json_integer_past_64_bits_is_named_as_a_token_id():
    from frontend.codec import decode_body

    body = decode_body(b'{"input": [99999999999999999999999999]}', "application/json")
    with pytest.raises(ApiError,
                       match=r"^'input\[0\]' is 1e\+26, an integer past 64 bits; token ids"):
        parse_openai_embeddings(body, LIMITS)


@pytest.mark.parametrize("value,message", [
    ([True, False], "'input[0]' is a boolean; 'input' takes texts (strings) or token ids"),
    (["a", None], "'input[1]' is null; 'input' takes texts (strings) or token ids"),
    ("", "'input' must not be empty"),
])
def test_openai_input_errors_name_what_it_takes(value, message):
    with pytest.raises(ApiError) as info:
        parse_openai_embeddings({"input": value}, LIMITS)
    assert info.value.param == "input" and info.value.message.startswith(message), \
        info.value.message


def test_tei_predict_inputs_are_read_as_tei_reads_them():
    from frontend.tei import predict_inputs

    assert predict_inputs("a", LIMITS) == (["a"], False)
    assert predict_inputs(["a"], LIMITS) == (["a"], False)
    assert predict_inputs(["a", "b"], LIMITS) == ([("a", "b")], False)  # one pair
    assert predict_inputs([["a"], ["b", "c"], ["d"]], LIMITS) == (["a", ("b", "c"), "d"], True)


@pytest.mark.parametrize("value, status, needle", [
    ([], 422, "non-empty batch"),
    (["a", "b", "c"], 422, "a list of 3 strings"),
    ([["a", "b", "c"]], 422, "'inputs[0]' must be [text] or [first, second]"),
    ([["a"], []], 422, "'inputs[1]'"),
    # a batch holds lists, as in TEI (an outside check read "must be a string" for a string)
    ([["a"], "b"], 422, "'inputs[1]' must be [text] or [first, second] (strings): a batch's "
                        "items are lists"),
    ([["a", 1]], 422, "'inputs[0]'"),
    ({"a": 1}, 422, "'inputs' must be"),
    ([["x" * 21]], 413, "'inputs[0][0]'"),
    ([["a"]] * 5, 413, "the limit is 4"),
])
def test_tei_predict_inputs_refused(value, status, needle):
    from frontend.tei import predict_inputs

    with pytest.raises(ApiError) as info:
        predict_inputs(value, LIMITS)
    assert info.value.status == status and needle in info.value.message, info.value.message


def test_a_row_of_token_ids_is_bounded_as_a_texts_characters_are():
    """1.6M ids in a body (12 KB of gzip) were checked id by id on the event loop, ~1 s a
    request: fifty at once starved a frontend's pings until the workers killed it (an outside
    check). A row over limits.max_text_chars is 413 before any pass over its ids."""
    assert parse_openai_embeddings({"input": [7] * 20}, LIMITS).token_ids == [[7] * 20]
    for body, name in (({"input": [7] * 21}, "input"), ({"input": [[1], [7] * 21]}, "input[1]"),
                       ({"input": [7.0] * 21}, "input"), ({"input": [7] * 20 + [True]}, "input")):
        with pytest.raises(ApiError) as info:
            parse_openai_embeddings(body, LIMITS)
        assert info.value.status == 413 and info.value.message == (
            f"{name} has 21 token ids; the limit is 20 (limits.max_text_chars, which bounds a "
            "row of ids as it does a text's characters)"), info.value.message
    # the fast check keeps is_int's rule: a bool is not a token id, a whole float is one
    with pytest.raises(ApiError) as info:
        parse_openai_embeddings({"input": [1, True]}, LIMITS)
    assert info.value.status == 422 and "is a boolean" in info.value.message, info.value.message
    assert parse_openai_embeddings({"input": [1, 2.0]}, LIMITS).token_ids == [[1, 2]]
