"""A request whose input crashes its worker natively (a segfault, an abort: nothing the worker
can answer) under load, through nginx and supervisord: it is sent again alone, and lost alone it
is answered 500 and never sent a third time; the requests that shared its first pass are served.
Before, it was resubmitted as any lost request (frontends.retry_on_worker_loss, 2): it took down
three workers, and every request batched with it each time was answered 503 with it."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import tiny_overrides
from tests.stack import Stack

# The stack's workers run through this (PYTHONPATH: every Python process of the stack imports
# it at its start; only a worker patches anything): a serving pass whose longest text has
# ABORT_AT tokens or more aborts the process after the worker marked its texts running, as a
# native crash in the model would. Every serving pass takes 0.2 s besides, so the clients'
# requests queue and share passes.
HOOK = """
import os, sys

if sys.orig_argv[1:3] == ["-m", "gpu_workers"]:
    import time
    from gpu_workers import model, worker

    serving = False
    real_run, real_forward = worker.Worker._run, model.Model.forward_groups

    def _run(self, *args, **kwargs):
        global serving
        serving = True
        try:
            return real_run(self, *args, **kwargs)
        finally:
            serving = False

    def forward_groups(self, groups, *args, **kwargs):
        if serving:
            time.sleep(0.2)
            if any(ids.shape[1] >= %d for ids, _, _ in groups):
                os.abort()
        return real_forward(self, groups, *args, **kwargs)

    worker.Worker._run, model.Model.forward_groups = _run, forward_groups
"""
ABORT_AT = 44
INNOCENT = " ".join(["the"] * 36)  # 38 tokens: within max_pad_ratio of the poison, one pass
POISON = " ".join(["the"] * 44)  # 46 tokens


def counted(stack: Stack, name: str) -> dict[str, float]:
    _, _, raw = stack.get("/metrics")
    return {s.labels.get("outcome", ""): s.value
            for f in text_string_to_metric_families(raw.decode()) for s in f.samples
            if s.name == name}


def test_a_request_that_crashes_its_worker_takes_down_two_and_no_other_request(
        tmp_path, tiny_model):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK % ABORT_AT)
    stack = Stack(tmp_path / "stack", tiny_overrides(
        tiny_model, frontends={"count": 1, "no_worker_wait_s": 30, "request_timeout_s": 60},
        workers={"devices": "cpu", "cpu_workers": 2, "torch_threads": 1},
        # a pass waits for the clients' next requests (they resend within milliseconds of
        # their answers): the poison never runs in a pass of its own by chance
        batching={"max_wait_ms": 100}))
    stack.env["PYTHONPATH"] = str(hook)
    stack._env_at_start = dict(stack.env)
    stack.up()
    try:
        statuses: list[int] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                statuses.append(stack.post_json("/v1/embeddings", {
                    "model": "tiny", "input": [INNOCENT]})[0])

        with ThreadPoolExecutor(8) as pool:
            clients = [pool.submit(client) for _ in range(8)]
            stack.wait_until(lambda: len(statuses) >= 16, 60, "the clients served")
            status, _, poisoned = stack.post_json(
                "/v1/embeddings", {"model": "tiny", "input": [POISON]},
                {"X-Request-ID": "poison-1"})
            served = len(statuses)
            # both workers back, and the clients served by them
            stack.wait_until(lambda: json.loads(stack.get("/ready")[2])["status"] == "ready"
                             and len(statuses) >= served + 16, 90, "both workers serving")
            stop.set()
            for each in clients:
                each.result()
        assert status == 500, poisoned
        assert poisoned["error"]["code"] == "worker_crashed", poisoned
        assert "(request id poison-1)" in poisoned["error"]["message"]
        assert set(statuses) == {200}, sorted(set(statuses))
        # Two workers lost, each once: with it in a shared pass, then running it alone
        aborted = [line for line in (stack.run_dir / "logs" / "supervisord.log").read_text()
                   .splitlines() if "exited: worker-" in line]
        assert len(aborted) == 2 and all("SIGABRT" in line for line in aborted), aborted
        suspects = counted(stack, "shmserve_frontend_suspect_requests_total")
        # the poison and the clients' requests in its first pass were isolated; it alone failed
        assert suspects["failed"] == 1 and suspects["isolated"] >= 2, suspects
        said = [line for line in stack.log_lines("frontend-0", whole=True)
                if line.get("message") == "frontend.request_lost_its_worker_twice"]
        assert [line["request_id"] for line in said] == ["poison-1"], said
    finally:
        stack.down()
