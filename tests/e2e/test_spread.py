"""A large request at light load runs spread over the idle workers of its model
(frontends.spread_part_texts; frontend.dispatch), through nginx, on two CPU workers; and the
default limit of texts a request, OpenAI's 2,048, through the official clients."""

import time

import httpx
import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from shmserve.config import LimitsConfig
from tests.conftest import tiny_overrides
from tests.e2e.test_observability import scrape, total
from tests.stack import Stack

# 64 texts of different lengths: four times the default frontends.spread_part_texts (16), so a
# part for each of the two workers.
QUIET_S = 4  # frontends.spread_quiet_s: room for a loaded CI machine's requests after a query
TEXTS = [f"spread {i}: " + " ".join(["word", "other", "more"][: i % 4] * (1 + i % 5))
         for i in range(64)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """Two frontends and two single-thread CPU workers, with the default limits.max_texts_per_
    request (the suite's other stacks take 64), and QUIET_S."""
    s = Stack(tmp_path_factory.mktemp("spread"), tiny_overrides(
        tiny_model, workers={"devices": "cpu", "cpu_workers": 2, "torch_threads": 1},
        limits={"max_texts_per_request": LimitsConfig().max_texts_per_request},
        frontends={"spread_quiet_s": QUIET_S}))
    s.up()
    yield s
    s.down()


def embed(stack, texts: list[str], request_id: str) -> np.ndarray:
    status, _, body = stack.post_json("/v1/embeddings", {"input": texts, "model": "tiny"},
                                      {"X-Request-Id": request_id})
    assert status == 200, body
    return np.array([row["embedding"] for row in body["data"]])


def access_line(stack, request_id: str) -> dict:
    return logged_by(stack, request_id)[1]


def logged_by(stack, request_id: str) -> tuple[str, dict]:
    """The frontend that answered a request, and its access line."""
    found: list[tuple[str, dict]] = []

    def logged() -> bool:
        found[:] = [(program, line) for program in ("frontend-0", "frontend-1")
                    for line in stack.log_lines(program, whole=True)
                    if line.get("message") == "request" and line["request_id"] == request_id]
        return bool(found)
    stack.wait_until(logged, 10, f"{request_id}'s access line")
    return found[0]


def idle(stack) -> None:
    """Both workers idle, as each frontend heard: a heartbeat (every 0.5 s) after the last
    request's end; and QUIET_S since the last request of fewer than 16 texts."""
    stack.wait_until(stack.all_ready, 60, "every frontend and worker ready")
    time.sleep(QUIET_S + 0.5)


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


def test_a_query_to_either_frontend_keeps_large_requests_whole_on_both(stack):
    # Interactive traffic keeps a worker to itself (frontends.spread_quiet_s: 4 s here). nginx
    # (least_conn) sends queries to the frontend not busy with a bulk client: the other hears
    # of them from the workers' heartbeats (Heartbeat.small_at; an outside check found the
    # bulk client's frontend spreading while queries flowed)
    def held() -> float:
        return total(scrape(stack), "shmserve_frontend_spread_requests_total",
                     outcome="whole_for_queries")

    idle(stack)
    before = held()
    embed(stack, TEXTS[:1], "query")
    time.sleep(1.0)  # a heartbeat (0.5 s apart) from each worker to each frontend
    for i in range(4):
        embed(stack, TEXTS, f"after-query-{i}")
    answered = [logged_by(stack, f"after-query-{i}") for i in range(4)]
    assert {program for program, _ in answered} == {"frontend-0", "frontend-1"}
    assert [line.get("workers") for _, line in answered] == [None] * 4
    # counted, so an operator sees why nothing was spread
    assert stack.settled(held, lambda value: value >= before + 4) == before + 4
    # ... until it has been quiet that long
    idle(stack)
    embed(stack, TEXTS, "quiet-again")
    assert sorted(access_line(stack, "quiet-again")["workers"]) == [0, 1]


def test_openais_limit_of_inputs_a_request_is_the_default(stack):
    # OpenAI takes 2,048 inputs a request: clients that send a call's texts in one request
    # (chroma's and semantic-kernel's OpenAI functions; langchain's default chunk_size, 1000)
    # were refused at 256 (an outside check of the integrations).
    texts = [f"input {i} " + "more " * (i % 9) for i in range(2049)]
    with httpx.Client() as http:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                               http_client=http)
        answer = client.embeddings.create(model="tiny", input=texts[:2048])
        assert [row.index for row in answer.data] == list(range(2048))
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="tiny", input=texts)
        assert "limits.max_texts_per_request" in refused.value.message
        assert "2049" in refused.value.message and "2048" in refused.value.message
        # langchain-openai with its default chunk_size (1000): 1,500 documents in two requests
        docs = texts[:1500]
        got = np.array(OpenAIEmbeddings(model="tiny", base_url=stack.url + "/v1",
                                        api_key="unused", check_embedding_ctx_length=False,
                                        max_retries=0, http_client=http).embed_documents(docs))
    some = [0, 999, 1000, 1499]  # each side of langchain's cut
    alone = np.concatenate([embed(stack, [docs[i]], f"doc-{i}") for i in some])
    np.testing.assert_allclose(got[some], alone, atol=1e-5)
    np.testing.assert_allclose(np.array(answer.data[1499].embedding), alone[3], atol=1e-5)
