"""Observability from the outside, on a real stack of two frontends and one CPU worker: metrics
that add up exactly to a known workload, stage headers, request ids in every process's log,
GET /info and the Grafana dashboard against the live exposition (`shmserve status` and what a
killed process leaves behind: test_status_cli.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_workers.metrics import DEVICE_ONLY
from tests.conftest import tiny_overrides
from tests.stack import Stack

STAGES = ("tokenize", "handoff", "queue", "inference", "transfer", "total")
SECRET = "never-log-this-sentence-7f3a"
# Above the tests' 64: a cut answer (test_nginx_says_whether...) must be larger than nginx's
# socket send buffer can hold, or nginx may have written it all before the client's reset.
MAX_TEXTS = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    stack = Stack(tmp_path_factory.mktemp("obs-stack"),
                  tiny_overrides(tiny_model, frontends={"count": 2},
                                 limits={"max_texts_per_request": MAX_TEXTS}))
    stack.up()
    yield stack
    stack.down()


def scrape(stack: Stack) -> dict[str, list[tuple[dict, float]]]:
    status, _, raw = stack.get("/metrics")
    assert status == 200
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(raw.decode()):  # prometheus_client's parser
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples, name: str, **labels: str) -> float:
    return sum(v for l, v in samples.get(name, []) if labels.items() <= l.items())


def log_lines(stack: Stack, program: str) -> list[dict]:
    return stack.log_lines(program)


def send(stack: Stack, requests: list[tuple[str, dict, str]]) -> list[tuple[int, dict, dict]]:
    """POST every (path, body, request id) at once through nginx."""
    async def run():
        async with aiohttp.ClientSession(stack.url) as session:
            async def one(path, body, rid):
                async with session.post(path, json=body, headers={"X-Request-ID": rid}) as resp:
                    return resp.status, dict(resp.headers), await resp.json()
            return await asyncio.gather(*(one(*r) for r in requests))
    return asyncio.run(run())


def test_known_workload_adds_up_exactly_across_frontends(stack):
    words = ["alpha", "shared memory", "a much longer sentence about batching and padding",
             "z", "tokens " * 9]
    work = []
    for i in range(24):
        texts = [f"{words[(i + j) % 5]} {i}-{j}" for j in range(1 + i % 6)]
        work.append(("/predict", {"texts": texts}, f"wl-p{i}"))
    for i in range(16):
        texts = [f"{words[(i * 3 + j) % 5]} e{i}-{j}" for j in range(1 + i % 4)]
        work.append(("/v1/embeddings", {"input": texts}, f"wl-e{i}"))
    n_texts = sum(len(b.get("texts") or b["input"]) for _, b, _ in work)
    before = scrape(stack)
    replies = send(stack, work)
    assert all(status == 200 for status, _, _ in replies), replies
    n_tokens = sum(body["usage"]["prompt_tokens"] for _, _, body in replies)
    # once every request is in (Stack.settled: each frontend writes its metrics as its event
    # loop's turn ends, a moment after the answers it sent in that turn)
    after = stack.settled(lambda: scrape(stack), lambda now: total(
        now, "shmserve_requests_total", model="tiny", status="200") - total(
        before, "shmserve_requests_total", model="tiny", status="200") >= 40)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    for route, count in (("/predict", 24), ("/v1/embeddings", 16)):
        assert delta("shmserve_requests_total", route=route, model="tiny", status="200") == count
        assert delta("shmserve_request_duration_seconds_count", route=route, model="tiny") == count
    for stage in STAGES:
        assert delta("shmserve_stage_duration_seconds_count", stage=stage, model="tiny") == 40
    assert delta("shmserve_texts_total", model="tiny") == n_texts
    assert delta("shmserve_tokens_total", model="tiny") == n_tokens
    assert delta("shmserve_input_tokens_count", model="tiny") == n_texts
    assert delta("shmserve_input_tokens_sum", model="tiny") == n_tokens
    assert delta("shmserve_truncated_texts_total") == 0
    assert delta("shmserve_rejected_requests_total") == 0
    assert delta("shmserve_deadline_exceeded_total") == 0
    # Stages are disjoint parts of the total.
    parts = sum(delta("shmserve_stage_duration_seconds_sum", stage=s) for s in STAGES[:-1])
    assert 0 < parts <= delta("shmserve_stage_duration_seconds_sum", stage="total")
    assert total(after, "shmserve_frontend_inflight_requests") == 0

    # The worker observes each batch just after its replies: wait for the last one.
    def worker_texts():
        return total(scrape(stack), "shmserve_batch_texts_sum", worker="0") - \
            total(before, "shmserve_batch_texts_sum", worker="0")
    stack.wait_until(lambda: worker_texts() >= n_texts, 30, "the worker's batch metrics")
    final = scrape(stack)

    def wdelta(name):
        return total(final, name, worker="0", model="tiny") - \
            total(before, name, worker="0", model="tiny")
    assert wdelta("shmserve_batch_texts_sum") == n_texts
    assert wdelta("shmserve_batch_tokens_sum") == n_tokens
    batches = wdelta("shmserve_batch_texts_count")
    assert 1 <= batches <= n_texts
    for name in ("shmserve_batch_requests_count", "shmserve_batch_tokens_count",
                 "shmserve_batch_padding_ratio_count", "shmserve_batch_forward_seconds_count"):
        assert wdelta(name) == batches, name
    assert wdelta("shmserve_batch_requests_sum") >= 40  # a request may span batches
    assert wdelta("shmserve_batch_padded_tokens_total") >= n_tokens
    assert wdelta("shmserve_batch_padding_ratio_sum") >= batches  # each ratio is >= 1

    # Both frontends served part of it, and each wrote one access line per request.
    def served():
        return {i: [line["request_id"] for line in log_lines(stack, f"frontend-{i}")
                    if line.get("message") == "request" and line["request_id"].startswith("wl-")]
                for i in (0, 1)}
    stack.wait_until(lambda: sum(map(len, served().values())) >= len(work), 30,
                     "supervisord to write the access lines")
    by_frontend = served()
    assert by_frontend[0] and by_frontend[1], by_frontend
    assert sorted(by_frontend[0] + by_frontend[1]) == sorted(rid for _, _, rid in work)


def test_stage_headers_never_exceed_the_total(stack):
    replies = send(stack, [("/predict", {"texts": ["one", "two words", "three words here"]},
                            f"hdr-{i}") for i in range(6)])
    for status, headers, body in replies:
        assert status == 200
        stages = [float(headers[h]) for h in ("X-Tokenization-Time", "X-Queue-Time",
                                              "X-Inference-Time")]
        total_ms = float(headers["X-Total-Time"])
        assert all(0 <= s <= total_ms for s in stages), headers
        assert sum(stages) <= total_ms + 0.002, headers  # headers are rounded to the microsecond
        assert 1 <= int(headers["X-Batch-Size"]) <= 16
        assert headers["X-Model-Revision"] == "tiny-r1"


def test_request_id_is_in_nginx_frontend_and_worker_logs_and_inputs_are_not(stack):
    rid = "trace-me-42"
    # A key in a query string stays out of nginx's log (a security review).
    status, headers, _ = stack.post_json("/predict?api_key=" + SECRET,
                                         {"texts": [SECRET, "second"]}, {"X-Request-ID": rid})
    assert status == 200 and headers["X-Request-ID"] == rid

    def lines_with_id():
        access = [line for i in (0, 1) for line in log_lines(stack, f"frontend-{i}")
                  if line.get("request_id") == rid]
        batches = [line for line in log_lines(stack, "worker-0")
                   if line.get("message") == "batch" and rid in line["request_ids"]]
        nginx = [line for line in log_lines(stack, "nginx") if line.get("request_id") == rid]
        return access, batches, nginx
    stack.wait_until(lambda: all(lines_with_id()), 30, f"{rid} in every log")
    (access,), batches, (nginx,) = lines_with_id()
    assert access["level"] == "info" and access["route"] == "/predict"
    assert access["model"] == "tiny" and access["status"] == 200
    assert access["texts"] == 2 and access["tokens"] > 2 and access["batch_size"] >= 1
    parts = ("tokenize_ms", "handoff_ms", "queue_ms", "inference_ms", "transfer_ms")
    for key in parts:
        assert 0 <= access[key] <= access["total_ms"], key
    assert sum(access[key] for key in parts) <= access["total_ms"] + 0.005  # disjoint
    assert "error" not in access
    batch = batches[0]
    assert batch["level"] == "info" and batch["process"] == "worker-0"
    assert batch["texts"] >= 1 and batch["requests"] >= 1 and batch["forward_ms"] >= 0
    assert batch["padded_tokens"] >= batch["real_tokens"] > 0
    assert nginx["status"] == 200 and nginx["uri"] == "/predict"
    # logging.log_inputs is false: the text is in no log at all.
    for log in (stack.run_dir / "logs").glob("*.log"):
        assert SECRET not in log.read_text(errors="replace"), log.name


def test_failed_request_logs_its_error_type(stack):
    status, _, _ = stack.post_json("/predict", {"texts": ["x"] * (MAX_TEXTS + 1)},
                                   {"X-Request-ID": "too-many"})
    assert status == 413

    def line():
        return [l for i in (0, 1) for l in log_lines(stack, f"frontend-{i}")
                if l.get("request_id") == "too-many"]
    stack.wait_until(line, 30, "the failed request's access line")
    assert line()[0]["error"] == "too_large" and line()[0]["status"] == 413
    assert line()[0]["error_param"] == "texts"  # what was at fault, not only its type


def test_a_refused_request_is_counted_under_the_served_model_it_names(stack):
    # Refused before its model was resolved, it was counted under model="" (an outside check);
    # a name no model has stays "" (a label per made-up name would grow without bound).
    before = scrape(stack)
    sent = [({"model": "tiny", "texts": []}, 1), ({"model": "tiny-alias", "priority": 99,
                                                   "texts": ["x"]}, 1),
            ({"model": "made-up", "texts": []}, 2)]
    for body, times in sent:
        for _ in range(times):
            assert stack.post_json("/predict", body)[0] in (404, 422), body

    def counted(now, **labels):
        return (total(now, "shmserve_requests_total", route="/predict", **labels)
                - total(before, "shmserve_requests_total", route="/predict", **labels))
    after = stack.settled(lambda: scrape(stack), lambda now: counted(now) >= 4)  # all four
    assert counted(after, model="tiny", status="422") == 2
    assert not any(labels.get("model") == "made-up"
                   for labels, _ in after["shmserve_requests_total"])


def test_nginx_logs_the_method_of_a_request_it_answers_itself(stack):
    # Its error page is an internal redirect, which turns $request_method into GET.
    status, _, _ = stack.request("POST", "/predict?q=1", b'{"texts": ["x"]}',
                                 {"Content-Type": "application/json", "Content-Encoding": "zstd",
                                  "X-Request-ID": "nginx-answers"})
    assert status == 415

    def line():
        return [l for l in log_lines(stack, "nginx") if l.get("request_id") == "nginx-answers"]
    stack.wait_until(line, 30, "nginx's access line")
    assert line()[0]["method"] == "POST" and line()[0]["status"] == 415
    assert line()[0]["uri"] == "/predict"  # not its error page's ("/_shmserve_errors/...")
    assert abs(line()[0]["msec"] - time.time()) < 60  # the time to the millisecond too


def test_nginx_says_whether_an_answer_reached_the_client_whole(stack):
    """A client that closes mid-answer (or reads too slowly for nginx.send_timeout_s) cut a
    200 whose access line read as a success (an outside check): `completed` says so."""
    import socket
    import struct

    # ~5.3 MB of JSON rows: more than nginx's socket send buffer can hold (at most
    # net.ipv4.tcp_wmem's last figure, 4 MB on Linux's defaults) and the client's 4 KB of
    # window, so nginx cannot have passed the whole answer to the kernel before the reset.
    texts = ["word " * 60] * MAX_TEXTS
    body = json.dumps({"inputs": texts}).encode()

    def cut_short(request_id: str) -> dict:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # nginx cannot run ahead
            sock.connect(("127.0.0.1", stack.port))
            sock.sendall(b"POST /embed_all HTTP/1.1\r\nHost: x\r\nX-Request-ID: %s\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % (request_id.encode(), len(body)) + body)
            head = sock.recv(1024)
            assert head.startswith(b"HTTP/1.1 200 "), head
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        return access_line(request_id)

    def access_line(request_id: str) -> dict:
        found: list = []
        stack.wait_until(lambda: found.extend(l for l in log_lines(stack, "nginx")
                                              if l.get("request_id") == request_id) or found,
                         30, f"{request_id}'s access line")
        return found[0]

    status, _, answer = stack.request("POST", "/embed_all", body,
                                      {"Content-Type": "application/json"})
    assert status == 200
    try:
        send_buffer_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except OSError:
        send_buffer_max = 4 << 20
    assert len(answer) > send_buffer_max + 65536, (len(answer), send_buffer_max)  # the premise
    name = "shmserve_nginx_incomplete_responses_total"
    before = total(scrape(stack), name, status="200")
    cut = cut_short("cut-short")
    assert cut["status"] == 200 and cut["completed"] is False, cut
    assert cut["bytes_sent"] < len(answer), cut
    # ... and counted: a cut answer was in no metric (an outside check's, cut by nginx
    # itself in a full run directory, neither)
    stack.wait_until(lambda: total(scrape(stack), name, status="200") >= before + 1, 10,
                     "the cut answer counted")
    time.sleep(1.2)  # the reaper reads nginx's file every half second
    counted = total(scrape(stack), name, status="200")
    assert stack.post_json("/predict", {"texts": ["whole"]}, {"X-Request-ID": "whole"})[0] == 200
    whole = access_line("whole")
    assert whole["status"] == 200 and whole["completed"] is True, whole
    time.sleep(1.2)
    assert total(scrape(stack), name, status="200") == counted  # whole answers are not


def test_what_nginx_answers_itself_is_in_metrics_by_status(stack):
    """nginx's own answers (here 415, 405, 431; a rate limit's 429 and 413 alike, see
    tests/unit/test_nginx_pages.py) reach no frontend, and were in no metric: the reaper counts
    them from nginx. What a frontend answered, errors included, is not counted again."""
    name = "shmserve_nginx_responses_total"

    def settled() -> dict:  # the reaper reads nginx's answers every half second: earlier
        first = scrape(stack)  # tests' may still be on their way
        time.sleep(1.2)
        second = scrape(stack)
        return second if first[name] == second[name] else {}
    before: dict = {}
    stack.wait_until(lambda: before.update(settled()) or before, 20, "nginx's counts settled")
    assert {l["status"] for l, _ in before[name]} >= {"413", "429", "499", "502", "504"}
    # A control character in a header value: nginx passes it, the frontend's HTTP parser
    # answers 400, counted as the frontends' (below), not nginx's (an outside check).
    malformed = malformed_request(stack)
    assert stack.request("POST", "/predict", b"{}", {"Content-Type": "application/json",
                                                     "Content-Encoding": "zstd"})[0] == 415
    assert stack.request("TRACE", "/ready", None)[0] == 405
    assert stack.get("/ready", {"X-Big": "b" * 70_000})[0] == 431
    assert stack.post_json("/predict", {"texts": []})[0] == 422  # the frontends'
    assert stack.post_json("/predict", {"texts": ["x"]})[0] == 200
    assert stack.get("/no-such-route")[0] == 404
    # An upload cut off mid-body: nginx's 400 with nothing sent, counted as a client gone
    # (499), not as a malformed request (an outside check).
    import socket
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 1000\r\n\r\n{\"texts\": [")
        time.sleep(0.3)

    def delta() -> dict[str, float]:
        after = scrape(stack)
        return {l["status"]: v - total(before, name, status=l["status"])
                for l, v in after[name] if v != total(before, name, status=l["status"])}
    stack.wait_until(lambda: delta() == {"415": 1, "405": 1, "431": 1, "499": 1}, 10,
                     f"nginx's own answers counted: {delta()}")
    # A frontend's 405 is counted under the route whose path it is, not "unmatched" with the
    # unknown paths (an outside check); a made-up path stays unmatched.
    requests = "shmserve_requests_total"
    counted = scrape(stack)
    assert stack.get("/predict")[0] == 405
    assert stack.request("DELETE", "/v1/models/tiny", None)[0] == 405
    assert stack.request("DELETE", "/no/such/route", None)[0] == 404
    assert malformed_request(stack)
    expected = (("/predict", "405"), ("/v1/models/{model}", "405"), ("unmatched", "404"),
                ("unmatched", "400"))
    after = stack.settled(lambda: scrape(stack), lambda now: all(  # (Stack.settled)
        total(now, requests, route=r, status=s) > total(counted, requests, route=r, status=s)
        for r, s in expected))
    for route, status in expected:
        assert total(after, requests, route=route, status=status) == total(
            counted, requests, route=route, status=status) + 1, (route, status)
    # Its request id: the one the client got, on the frontend's line and nginx's access line.
    def lines() -> list[tuple[str, object]]:
        return [(program[:5], line.get("message", line.get("status")))
                for program in ("frontend-0", "frontend-1", "nginx")
                for line in log_lines(stack, program) if line.get("request_id") == malformed]
    stack.wait_until(lambda: sorted(lines()) == [("front", "http.malformed_request"),
                                                 ("nginx", 400)], 10,
                     f"the 400's lines: {lines()}")


def malformed_request(stack) -> str:
    """A request aiohttp's HTTP parser refuses, through nginx; the X-Request-ID it got."""
    import socket

    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nX-Junk: a\x01b\r\n"
                     b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    assert head[0].startswith("HTTP/1.1 400"), answer[:300]
    (request_id,) = [h.split(":", 1)[1].strip() for h in head if h.lower().startswith(
        "x-request-id:")]
    return request_id


def test_metrics_expose_gauges_info_and_memory(stack):
    samples = scrape(stack)
    assert [v for l, v in samples["shmserve_worker_ready"]] == [1.0]
    assert len(samples["shmserve_worker_queue_depth"]) == 1
    (labels, value), = samples["shmserve_model_info"]
    assert value == 1 and labels["model"] == "tiny" and labels["revision"] == "tiny-r1"
    assert labels["dtype"] == "fp32" and labels["device"] == "cpu"
    assert total(samples, "shmserve_worker_empty_cache_total") == 0
    rss = {l["program"]: v for l, v in samples["shmserve_process_resident_memory_bytes"]}
    assert set(rss) >= {"supervisord", "reaper", "nginx", "frontend-0", "frontend-1",
                        "worker-0"}
    assert all(v > 1 << 20 for v in rss.values()), rss
    assert not set(DEVICE_ONLY) & set(samples)  # a CPU worker has no device allocator
    # Series an alert takes increase() of exist at zero before their first event (the first
    # crash, the first arena refusal: neither existed until it happened, an outside check).
    exits = {(l["program"], l["expected"]) for l, v in samples["shmserve_process_exits_total"]}
    assert {(p, "false") for p in ("nginx", "frontend-0", "frontend-1", "worker-0")} <= exits
    killed = {(l["worker"], l["frontend"]) for l, v in samples[
        "shmserve_frontend_hung_kills_total"]}
    assert killed == {("0", "0"), ("0", "1")}  # at zero before a worker kills a frontend
    refused = {l["reason"] for l, v in samples["shmserve_frontend_refused_total"]}
    assert refused >= {"inflight", "deadline", "arena"}, refused
    failed = {(l["worker"], l["model"]) for l, v in samples[
        "shmserve_worker_model_load_failures_total"]}
    assert failed == {("0", "tiny")}, failed  # at zero before its first failed load
    reloads = {(l["model"], l["outcome"]) for l, v in samples["shmserve_reloads_total"]}
    assert {("tiny", o) for o in ("ok", "invalid_request", "conflict", "unavailable",
                                  "internal_error")} <= reloads, reloads
    answered = {l["status"] for l, v in samples["shmserve_nginx_responses_total"]}
    assert answered >= {"400", "408", "413", "414", "415", "429", "431", "499", "502", "504"}
    # Shared memory held by requests in flight: none when idle (a soak test had no way to see).
    # The gauge is read every second (frontend.app), so the last request's may show a moment.
    def arena() -> dict[str, float]:
        return {l["frontend"]: v for l, v in scrape(stack)["shmserve_frontend_arena_used_bytes"]}

    stack.wait_until(lambda: arena() == {"0": 0.0, "1": 0.0}, 5, "idle arenas")
    names = {name for name in samples if name.startswith("shmserve_")}
    assert names == set(samples)  # nothing else (no python_gc_*, no process_* of one process)


def test_info_serves_shmserve_and_tei_fields(stack):
    status, _, raw = stack.get("/info")
    assert status == 200
    info = json.loads(raw)
    (model,) = info["models"]
    assert model["name"] == "tiny" and model["revision"] == "tiny-r1"
    assert model["task"] == "embedding" and model["dtype"] == "fp32" and model["dim"] == 32
    assert info["devices"] == [{"worker": 0, "device": "cpu", "name": "cpu", "configured": "cpu",
                                "ready": True}]
    assert info["limits"]["max_batch_tokens"] == 2048
    assert info["limits"]["max_texts_per_request"] == MAX_TEXTS
    assert info["limits"]["max_input_tokens"] == 64
    assert info["frontends"] == 2 and info["workers"] == 1 and info["version"]
    tei = {"model_id": "tiny", "model_sha": "tiny-r1", "model_dtype": "float32",
           "model_type": {"embedding": {"pooling": "mean"}}, "max_input_length": 64,
           "max_batch_tokens": 2048, "max_batch_requests": 16, "max_client_batch_size": MAX_TEXTS,
           "auto_truncate": False, "tokenization_workers": 2,
           "max_concurrent_requests": 2 * 1024}
    assert {k: info[k] for k in tei} == tei
    assert info["version"] == info["version"].strip() and "sha" in info

