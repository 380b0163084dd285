"""Priority through the real stack: a normal request before a low-priority flood, and queries
before bulk requests that name no priority (frontends.bulk_texts)."""

import asyncio
import collections
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_reliability import MEDIUM, queued_texts, slow_stack
from tests.stack import Stack


def _flood_and_queries(stack: Stack, bulk_headers: dict, first: dict, second: dict
                       ) -> tuple[list[float], list[float]]:
    """Six clients sending 16 medium texts a request (with `bulk_headers`) until a deep queue
    builds; then 12 pairs of one-text requests, one with the headers `first`, then one with
    `second`: each's seconds."""
    async def scenario():
        async with aiohttp.ClientSession(stack.url) as session:
            stop = asyncio.Event()

            async def bulk():
                while not stop.is_set():
                    async with session.post("/predict", json={"texts": [MEDIUM] * 16},
                                            headers=bulk_headers) as resp:
                        assert resp.status == 200

            async def interactive(headers):
                started = time.perf_counter()
                async with session.post("/predict", json={"texts": ["a short query"]},
                                        headers=headers) as resp:
                    assert resp.status == 200
                return time.perf_counter() - started

            flood = [asyncio.create_task(bulk()) for _ in range(6)]
            await asyncio.sleep(0)  # let the flood start before measuring
            while queued_texts(stack) < 48:  # wait on the condition: a deep queue
                await asyncio.sleep(0.05)
            times = [], []
            for _ in range(12):  # interleaved, so drift hits both alike
                times[0].append(await interactive(first))
                times[1].append(await interactive(second))
            stop.set()
            await asyncio.gather(*flood)
            return times

    return asyncio.run(scenario())


def test_priority_keeps_interactive_latency_low_under_a_bulk_flood(tmp_path, slow_model):
    stack = slow_stack(tmp_path / "s", slow_model, frontends={"count": 1},
                       batching={"max_batch_size": 8, "max_batch_tokens": 4096},
                       workers={"torch_threads": 1})
    stack.up()
    try:
        normal, low = _flood_and_queries(stack, {"X-Priority": "low"}, {"X-Priority": "normal"},
                                         {"X-Priority": "low"})
        # The stated bound: under a low-priority flood, a normal-priority request is answered
        # faster than the low-priority one sent right after it. Pair by pair, because the
        # machine's speed drifts: a slow spell late in the run made one normal request (a pass
        # 7x its usual time) slower than the median low one, sent seconds before (CI).
        slower = [(n, l) for n, l in zip(normal, low) if n >= l]
        assert not slower, (slower, normal, low)
    finally:
        stack.down()


def test_a_query_goes_before_bulk_requests_that_name_no_priority(tmp_path, slow_model):
    """A request of frontends.bulk_texts (16) texts or more that names no priority runs a step
    below the default: under a flood of them, a one-text request naming none is answered
    faster than one sent with the flood's priority (low) right after it; the access lines and
    the metrics say which priority each ran at."""
    stack = slow_stack(tmp_path / "s", slow_model, frontends={"count": 1},
                       batching={"max_batch_size": 8, "max_batch_tokens": 4096},
                       workers={"torch_threads": 1})
    stack.up()
    try:
        query, low = _flood_and_queries(stack, {}, {}, {"X-Priority": "low"})
        slower = [(q, lo) for q, lo in zip(query, low) if q >= lo]
        assert not slower, (slower, query, low)
        # A bulk request that names its priority keeps it (normal: the default, not logged)
        assert stack.post_json("/predict", {"texts": ["x"] * 16},
                               {"X-Priority": "normal"})[0] == 200
        stack.wait_until(lambda: any(
            line.get("route") == "/predict" and line.get("texts") == 16
            and "priority" not in line for line in stack.log_lines("frontend-0")), 10,
            "the access line of a 16-text request at normal priority")
        by_texts = collections.defaultdict(collections.Counter)  # (lines written in order)
        for line in stack.log_lines("frontend-0"):
            if line.get("route") == "/predict" and line.get("status") == 200:
                by_texts[line["texts"]][line.get("priority")] += 1
        assert by_texts[16][None] == 1 and by_texts[16][-1] > 12, by_texts  # the flood: -1
        assert set(by_texts[16]) == {None, -1} and by_texts[1] == {None: 12, -1: 12}, by_texts
        # The metrics by priority: the flood and the low queries at -1, the rest at 0
        want = {"-1": by_texts[16][-1] + 12, "0": 13}
        assert stack.settled(lambda: _answered_by_priority(stack), want.__eq__) == want
    finally:
        stack.down()


def _answered_by_priority(stack: Stack) -> dict[str, float]:
    """shmserve_inference_requests_total of status 200, by priority."""
    _, _, raw = stack.get("/metrics")
    return {s.labels["priority"]: s.value
            for f in text_string_to_metric_families(raw.decode()) for s in f.samples
            if s.name == "shmserve_inference_requests_total" and s.labels["status"] == "200"}
