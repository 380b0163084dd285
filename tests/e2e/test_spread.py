"""A large request at light load runs spread over the idle workers of its model
(frontends.spread_part_texts; frontend.dispatch), through nginx, on two CPU workers."""

import time

import numpy as np
import pytest

from tests.e2e.conftest import two_of_each_stack
from tests.e2e.test_observability import scrape, total

# 64 texts (the stack's limits.max_texts_per_request), of different lengths: four times the
# default frontends.spread_part_texts (16), so a part for each of the two workers.
TEXTS = [f"spread {i}: " + " ".join(["word", "other", "more"][: i % 4] * (1 + i % 5))
         for i in range(64)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = two_of_each_stack(tmp_path_factory.mktemp("spread"), tiny_model)
    s.up()
    yield s
    s.down()


def embed(stack, texts: list[str], request_id: str) -> np.ndarray:
    status, _, body = stack.post_json("/v1/embeddings", {"input": texts, "model": "tiny"},
                                      {"X-Request-Id": request_id})
    assert status == 200, body
    return np.array([row["embedding"] for row in body["data"]])


def access_line(stack, request_id: str) -> dict:
    found: list[dict] = []

    def logged() -> bool:
        found[:] = [line for program in ("frontend-0", "frontend-1")
                    for line in stack.log_lines(program, whole=True)
                    if line.get("message") == "request" and line["request_id"] == request_id]
        return bool(found)
    stack.wait_until(logged, 10, f"{request_id}'s access line")
    return found[0]


def idle(stack) -> None:
    """Both workers idle, as each frontend heard: a heartbeat (every 0.5 s) after the last
    request's end."""
    stack.wait_until(stack.all_ready, 60, "every frontend and worker ready")
    time.sleep(1.5)


def test_a_large_request_runs_on_both_idle_workers_and_answers_each_text_in_order(stack):
    alone = np.concatenate([embed(stack, [text], f"alone-{i}") for i, text in enumerate(TEXTS)])
    before = total(scrape(stack), "shmserve_frontend_spread_requests_total", outcome="spread")
    idle(stack)
    spread = embed(stack, TEXTS, "spread-64")
    assert sorted(access_line(stack, "spread-64")["workers"]) == [0, 1]
    # every row that of its own text, as computed alone (fp32: batch noise only)
    np.testing.assert_allclose(spread, alone, atol=1e-5)
    after = stack.settled(lambda: total(scrape(stack), "shmserve_frontend_spread_requests_total",
                                        outcome="spread"), lambda value: value > before)
    assert after == before + 1


def test_under_twice_the_part_size_a_request_runs_on_one_worker(stack):
    idle(stack)
    embed(stack, TEXTS[:31], "whole-31")
    line = access_line(stack, "whole-31")
    assert "workers" not in line and line["worker"] in (0, 1)
