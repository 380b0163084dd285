"""Whether the running workers speak this installed shmserve's worker protocol
(shmserve.versions): asked of workers that answer as a worker of any version does."""

from __future__ import annotations

import threading

import zmq

from shmserve import config, topology, versions, wire
from shmserve.protocol import PROTOCOL_VERSION, Heartbeat, Kind
from tests.unit.test_render import free_port


class FakeWorkers:
    """ROUTER sockets bound where a deployment's workers bind theirs, each answering every
    message with what `answer(index)` gives (frames)."""

    def __init__(self, cfg, answers: dict[int, list[bytes] | None]) -> None:
        self.ctx = zmq.Context()
        self.halt = threading.Event()
        self.routers = {}
        for index, answer in answers.items():
            router = self.ctx.socket(zmq.ROUTER)
            router.bind(topology.worker_endpoint(cfg, index))
            self.routers[router] = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for router in self.routers:
            poller.register(router, zmq.POLLIN)
        while not self.halt.is_set():
            for router, _ in poller.poll(50):
                peer, *_ = router.recv_multipart()
                if self.routers[router] is not None:  # None: a worker that never answers
                    router.send_multipart([peer, *self.routers[router]])

    def close(self) -> None:
        self.halt.set()
        self.thread.join()
        for router in self.routers:
            router.close(linger=0)
        self.ctx.term()


class FakeFrontend:
    """An HTTP server on a frontend's socket answering GET /health with `health`."""

    def __init__(self, cfg, index: int, health: dict) -> None:
        import http.server
        import json
        import socketserver

        body = json.dumps(health).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def address_string(self):
                return "unix"

            def log_message(self, *args):
                pass

        self.server = socketserver.UnixStreamServer(str(topology.frontend_socket(cfg, index)),
                                                    Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def beat(version: int) -> list[bytes]:
    return wire.encode(Heartbeat(version, 0, 4242, True, "cpu", (), 0, 64, 0.0, 0.0))


def test_a_rolling_restart_across_a_protocol_change_is_refused_with_what_to_do(tmp_path):
    """After an upgrade that changed the worker protocol, a rolling `restart workers` waited
    its whole timeout for a new worker the old frontends ignored, and a rolling restart of the
    frontends then left the old workers unused (checked by hand on a real stack)."""
    cfg = config.from_tree({"server": {"run_dir": str(tmp_path / "run"), "port": free_port()},
                            "models": [{"name": "a", "source": "/nonexistent/a"}],
                            "workers": {"devices": "cpu", "cpu_workers": 4}})
    topology.socket_dir(cfg).mkdir(parents=True)
    workers = FakeWorkers(cfg, {0: beat(PROTOCOL_VERSION), 1: beat(PROTOCOL_VERSION - 1),
                                2: None, 3: [bytes((Kind.HEARTBEAT,)), b"\xc1"]})
    try:
        assert versions.running_protocols(cfg, timeout=0.5) == {0: PROTOCOL_VERSION,
                                                                1: PROTOCOL_VERSION - 1}
        said = versions.protocol_change(cfg, timeout=0.3)
        assert f"worker-1 speaks {PROTOCOL_VERSION - 1}" in said and "worker-0" not in said
        assert "`shmserve down`, then `shmserve up --wait`" in said
    finally:
        workers.close()
    for path in topology.socket_dir(cfg).glob("*.ipc"):
        path.unlink()
    # Every worker restarted on the new code, one frontend still on the old (it says no
    # protocol: it came in with 9): `restart workers` was let through (an outside check).
    workers = FakeWorkers(cfg, {0: beat(PROTOCOL_VERSION), 1: beat(PROTOCOL_VERSION)})
    frontends = [FakeFrontend(cfg, 0, {"status": "ok", "protocol": PROTOCOL_VERSION}),
                 FakeFrontend(cfg, 1, {"status": "ok", "version": "0.1.0"})]
    try:
        assert versions.frontend_protocols(cfg) == {0: PROTOCOL_VERSION, 1: 8}
        said = versions.protocol_change(cfg, timeout=0.3)
        assert said.startswith("running programs speak another worker protocol than this "
                               f"installed shmserve ({PROTOCOL_VERSION}): frontend-1 speaks 8.")
    finally:
        workers.close()
        for frontend in frontends:
            frontend.close()
    for path in topology.socket_dir(cfg).glob("frontend-*.sock"):
        path.unlink()
    # Every worker on this version, or none answering: nothing in the way.
    for path in topology.socket_dir(cfg).glob("*.ipc"):
        path.unlink()
    workers = FakeWorkers(cfg, {0: beat(PROTOCOL_VERSION), 1: beat(PROTOCOL_VERSION)})
    try:
        assert versions.protocol_change(cfg) is None
    finally:
        workers.close()
    for path in topology.socket_dir(cfg).glob("*.ipc"):
        path.unlink()
    assert versions.running_protocols(cfg) == {}


def test_status_says_when_running_workers_speak_another_protocol(deployment, capsys,
                                                                 monkeypatch):
    """After a `git pull`, supervisord restarting a crashed worker runs the new code beside
    frontends of the old, which ignore it: status says why, once."""
    import json

    from shmserve import cli, remote, status_cli

    monkeypatch.setattr(status_cli, "supervisord_pid", lambda cfg: 4242)
    monkeypatch.setattr(status_cli, "process_info", lambda cfg: [])
    monkeypatch.setattr(remote, "http", lambda *a, **k: (None, b""))
    topology.socket_dir(deployment).mkdir(parents=True)
    workers = FakeWorkers(deployment, {0: beat(PROTOCOL_VERSION), 1: beat(PROTOCOL_VERSION)})
    try:
        cli.main(["status"])
        assert "protocol" not in capsys.readouterr().err
    finally:
        workers.close()
    for path in topology.socket_dir(deployment).glob("*.ipc"):
        path.unlink()
    workers = FakeWorkers(deployment, {0: beat(PROTOCOL_VERSION), 1: beat(PROTOCOL_VERSION - 1)})
    try:
        cli.main(["status"])
        err = capsys.readouterr().err
        assert f"warning: running programs speak another worker protocol than this " \
            f"installed shmserve ({PROTOCOL_VERSION}): worker-1 speaks {PROTOCOL_VERSION - 1}" \
            in err
        cli.main(["status", "--json"])
        said = capsys.readouterr()
        assert "worker-1 speaks" in json.loads(said.out)["protocol_change"] and not said.err
    finally:
        workers.close()
