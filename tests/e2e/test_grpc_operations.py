"""Operations on a stack serving KServe v2 over gRPC (server.grpc_port), through nginx and
supervisord: a locust load, a rolling restart of the frontends under load, an open stream
when its frontend stops, no frontend at all, apply turning gRPC off, on and moving it."""

from __future__ import annotations

import json
import queue
import threading
import time

import grpc
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from frontend import protos
from tests import grpcstack
from tests.grpcstack import AUTH, KEY, status_of, texts
from tests.stack import free_port

stack = grpcstack.stack_fixture("grpc-operations")
client = grpcstack.client


def test_a_locust_load_over_grpc(stack, tmp_path, monkeypatch):
    """scripts/locustfile.py's gRPC user (SHMSERVE_BENCH_API=grpc), as bench's windows run it."""
    from tests.e2e.test_bench import benchkit
    from tests.stack import corpus_path

    corpus = tmp_path / "short.json"  # sentences within the tiny model's 64 tokens
    corpus.write_text(json.dumps([t for t in json.loads(corpus_path().read_text())
                                  if len(t) <= 80]))
    monkeypatch.setenv("SHMSERVE_BENCH_GRPC", f"127.0.0.1:{stack.grpc_port}")
    monkeypatch.setenv("SHMSERVE_BENCH_MODEL", "tiny")
    monkeypatch.setenv("SHMSERVE_API_KEY", KEY)
    # 6 s: a run loaded by other stacks once saw no call end in 3 (the spawn not counted)
    window = benchkit.locust_window("http://unused", benchkit.Scenario("g", 8, "4", api="grpc"),
                                    6, corpus)
    assert window["failures"] == 0 and window["requests"] > 20
    assert window["texts_per_s"] == pytest.approx(window["requests_per_s"] * 4, rel=1e-9)


def test_a_rolling_restart_of_the_frontends_fails_no_call(stack):
    stop = threading.Event()
    done, failed = [0], []

    def load() -> None:
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{stack.grpc_port}") as c:
            while not stop.is_set():
                try:
                    c.infer("tiny", [texts(b"hello there")], headers=AUTH)
                    done[0] += 1
                except InferenceServerException as exc:
                    failed.append((exc.status(), exc.message()))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1)
        stack.cli("restart", "frontends")
        time.sleep(1)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert failed == [] and done[0] > 100
    # The stopped frontends wrote JSON lines only: grpc's shutdown at their interpreter's exit
    # wrote "Error in sys.excepthook:" and two more lines of text into each log (a log
    # shipper's parse error at every stop)
    for program in ("frontend-0", "frontend-1"):
        lines = stack.log(program).splitlines()
        assert any('"frontend.stopped"' in line for line in lines), program
        assert [line for line in lines if not line.startswith("{")] == [], program


def test_an_open_stream_ends_unavailable_when_its_frontend_stops(stack):
    """Not held open to the end of the drain and cut: every request it read is answered, then
    it ends UNAVAILABLE saying to open a new one."""
    pending: queue.Queue = queue.Queue()

    def requests():
        while (item := pending.get()) is not None:
            yield item

    def request(i: int):
        one = protos.ModelInferRequest(model_name="tiny", id=str(i))
        one.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
            b"hello")
        return one

    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stream = grpcstack.model_stream(channel)
        answers = stream(requests(), metadata=list(AUTH.items()))
        pending.put(request(0))
        assert next(answers).infer_response.id == "0"
        restart = threading.Thread(target=stack.cli, args=("restart", "frontends"))
        restart.start()
        try:
            with pytest.raises(grpc.RpcError) as caught:
                for answer in answers:
                    assert not answer.error_message
        finally:
            pending.put(None)
            restart.join()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "is stopping" in caught.value.details() and "new stream" in caught.value.details()


def test_no_frontend_is_unavailable_from_nginx(stack, client):
    stack.ctl("stop", "frontends:*")
    try:
        for call in (lambda: client.infer("tiny", [texts(b"a")], headers=AUTH),
                     client.is_server_ready):
            assert status_of(call) == ("StatusCode.UNAVAILABLE",
                                       "no frontend answered; see `shmserve status`")
    finally:
        stack.ctl("start", "frontends:*")
    # supervisord's start returns once each frontend ran startsecs; its gRPC server may bind a
    # moment later, and until then nginx's UNAVAILABLE is what is_server_ready raises (CI)
    def ready() -> bool:
        try:
            return client.is_server_ready()
        except InferenceServerException as exc:
            assert exc.status() == "StatusCode.UNAVAILABLE", exc
            return False
    stack.wait_until(ready, 60, "gRPC ready through nginx again")


def test_apply_turns_grpc_off_and_on_and_moves_it_only_when_asked(stack, client):
    """Last in the module: it moves the stack's gRPC port."""
    from tests.e2e.test_apply import edit

    old, new = stack.grpc_port, free_port()
    edit(stack, server={"grpc_port": new}, frontends={"count": 1})
    refused = stack.cli("apply", check=False)
    assert refused.returncode != 0
    assert f"gRPC moves from port {old} to port {new}" in refused.stderr
    assert "give --move" in refused.stderr
    assert client.is_server_ready()  # nothing changed

    stack.cli("apply", "--move", timeout=400)
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{new}") as moved:
        assert moved.infer("tiny", [texts(b"a")], headers=AUTH).as_numpy("embedding").shape \
            == (1, 32)
    assert status_of(lambda: client.is_server_ready(client_timeout=10))[0] == \
        "StatusCode.UNAVAILABLE"
    # frontend-1, removed, left no socket file: its gRPC one was its stop's placeholder
    sockets = stack.run_dir / "sockets"
    assert not (sockets / "frontend-1.grpc.sock").exists() and not \
        (sockets / "frontend-1.sock").exists()
    assert (sockets / "frontend-0.grpc.sock").exists()

    edit(stack, server={"grpc_port": 0})
    stack.cli("apply", "--move", timeout=400)
    assert not (stack.run_dir / "sockets" / "frontend-0.grpc.sock").exists()
    assert stack.get("/ready")[0] == 200  # HTTP serves on

    edit(stack, server={"grpc_port": old})  # on again: no client loses anything, no --move
    stack.cli("apply", timeout=400)
    # a channel of its own: grpc's shared one to this port is in its reconnect backoff since
    # the port closed
    with triton_grpc.InferenceServerClient(
            f"127.0.0.1:{old}", channel_args=[("grpc.use_local_subchannel_pool", 1)]) as again:
        assert again.infer("tiny", [texts(b"b")], headers=AUTH).as_numpy("embedding").shape \
            == (1, 32)
