"""Waiting for a started deployment (shmserve.startwait): readiness through nginx and every
frontend, and what is said when it does not come: the key to raise, nginx's bind error, a
program that keeps exiting as it starts, its last error."""

from __future__ import annotations

import json
import os
import time

import pytest

from shmserve import processes, remote, render, startwait, topology
from tests.unit.test_render import free_port, make_config


@pytest.fixture(autouse=True)
def supervised(monkeypatch):
    """supervisord runs (as `up` leaves it) unless a test says otherwise."""
    monkeypatch.setattr(processes, "supervisord_pid", lambda cfg: os.getpid())


def test_wait_ready_stops_when_the_deployment_is_stopped_meanwhile(deployment, capsys,
                                                                   monkeypatch):
    """`down` during `up --wait`: it waited its whole timeout, then said that what started
    keeps running (an outside check)."""
    render.render(deployment)
    monkeypatch.setattr(processes, "supervisord_pid", lambda cfg: None)
    started = time.monotonic()
    assert startwait.wait_ready(deployment, timeout=30) == 1
    assert time.monotonic() - started < 5
    assert "the deployment stopped (`shmserve down`?) before it was ready" in \
        capsys.readouterr().err


def test_wait_ready_gives_up_naming_the_key(deployment, capsys):
    render.render(deployment)
    (topology.log_dir(deployment) / "worker-0.log").write_text("loading...\nboom\n")
    assert startwait.wait_ready(deployment, timeout=0.3) == 1
    err = capsys.readouterr().err
    assert "workers.ready_timeout_s" in err and "boom" in err
    # `down` keeps the logs: a start shows its own lines only, not an earlier deployment's
    # above them (an outside check read the old batch lines as this start's).
    log = topology.log_dir(deployment) / "worker-0.log"
    log.write_text('{"message": "batch", "model": "an earlier one"}\n' * 30)
    starts = startwait.log_sizes(deployment)
    with log.open("a") as file:
        file.write("Traceback ...\nRuntimeError: this start's error\n")
    assert startwait.wait_ready(deployment, timeout=0.3, starts=starts) == 1
    err = capsys.readouterr().err
    assert "this start's error" in err and "an earlier one" not in err, err
    assert "worker-0.log (last 2 lines)" in err


def test_wait_ready_waits_for_every_frontend_not_just_the_one_nginx_asked(deployment,
                                                                             monkeypatch):
    """Each frontend learns a worker is ready from its own heartbeats: nginx's 200 from one is
    not enough while another still answers 503 (what clients would then meet half the time)."""
    import http.server
    import socketserver
    import threading

    render.render(deployment)
    statuses = [200] * deployment.frontends.count
    statuses[-1] = 503

    def frontend(index: int):
        class Ready(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(statuses[index] if self.path == "/ready" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        path = topology.frontend_socket(deployment, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        server = socketserver.UnixStreamServer(str(path), Ready)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    servers = [frontend(i) for i in range(deployment.frontends.count)]
    monkeypatch.setattr(remote, "http", lambda url, **kw: (200, b""))  # nginx: one said 200
    try:
        assert startwait.wait_ready(deployment, timeout=0.6) == 1
        statuses[-1] = 200
        assert startwait.wait_ready(deployment, timeout=5) == 0
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_urls_for_wildcard_hosts(tmp_path):
    cfg = make_config(tmp_path, server={"host": "0.0.0.0", "port": 1234})
    assert startwait.ready_url(cfg) == "http://127.0.0.1:1234/ready"
    cfg = make_config(tmp_path, server={"host": "::", "port": 1234})
    assert remote.base_url(cfg) == "http://[::1]:1234"
    assert remote.http(f"http://127.0.0.1:{free_port()}/ready") == (None, b"")


def test_nginx_bind_error_is_read_from_this_starts_lines(deployment):
    log = topology.log_dir(deployment) / "nginx.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    old = ('2026/11/30 10:00:00 [emerg] 7#7: bind() to 127.0.0.1:8080 failed (98: Address '
           'already in use)\n')
    log.write_text(old)
    start = log.stat().st_size
    assert startwait.nginx_bind_error(deployment, 0) == \
        "7#7: bind() to 127.0.0.1:8080 failed (98: Address already in use)"
    assert startwait.nginx_bind_error(deployment, start) is None  # an earlier start's line
    with log.open("a") as f:
        f.write("2026/11/30 10:01:00 [notice] 9#9: using the \"epoll\" event method\n")
        f.write(old.replace("10:00:00", "10:01:01"))
    assert "Address already in use" in startwait.nginx_bind_error(deployment, start)


def test_a_program_that_keeps_getting_new_pids_is_named_at_its_third():
    watch = processes.StartWatch()
    assert watch.see([{"name": "worker-0", "pid": 10}, {"name": "frontend-0", "pid": 20}]) is None
    assert watch.see([{"name": "worker-0", "pid": 0}, {"name": "frontend-0", "pid": 20}]) is None
    assert watch.see([{"name": "worker-0", "pid": 11}, {"name": "frontend-0", "pid": 20}]) is None
    assert watch.see([{"name": "worker-0", "pid": 12}, {"name": "frontend-0", "pid": 20}]) == \
        "worker-0"
    assert watch.pids == {"worker-0": [10, 11, 12], "frontend-0": [20]}


def test_the_last_error_of_a_log_is_its_exception():
    failed = json.dumps({"level": "error", "message": "worker.failed",
                         "exception": "Traceback ...\n  File x\nValueError: bad header"})
    assert startwait.last_error(["not json", failed, json.dumps({"level": "info"})]) == \
        "ValueError: bad header"
    assert startwait.last_error([json.dumps({"level": "error", "message": "no device"})]) == \
        "no device"
    assert startwait.last_error(["Traceback", "  File x", "OSError: gone", ""]) == "OSError: gone"
    assert startwait.last_error([]) == ""


def test_log_tails_are_this_deployments_programs_only(deployment, capsys):
    """A failed start or restart printed every log in the directory, a 3-worker deployment's
    worker-2.log among them under a 2-worker one (an outside check)."""
    logs = topology.log_dir(deployment)
    logs.mkdir(parents=True, exist_ok=True)
    for name in ("frontend-0", "worker-0", "nginx", "worker-7", "frontend-9"):
        (logs / f"{name}.log").write_text(f"line of {name}\n")
    startwait.print_log_tails(deployment)
    err = capsys.readouterr().err
    assert "line of frontend-0" in err and "line of worker-0" in err and "line of nginx" in err
    assert "worker-7" not in err and "frontend-9" not in err


def test_a_model_that_failed_its_third_load_ends_the_wait():
    """`up --wait` stops at a worker that serves without a model whose load failed three
    times in a row (waiting longer would not change it), naming it and its error; not while
    another worker still loads, which may serve it (a CI run on a loaded machine gave up so
    on a split whose other arm the slow worker was about to serve: /ready 200 "degraded")."""
    def body(failures, other_ready=True):
        return json.dumps({"status": "failing", "workers": [
            {"worker": 0, "ready": other_ready, "unloaded": []},
            {"worker": 1, "ready": True, "unloaded": [{"model": "b", "error": "OSError: gone",
                                                       "failures": failures,
                                                       "retry_in_s": 2.0}]}]}).encode()
    assert startwait.not_loading(body(2)) == ""
    assert startwait.not_loading(body(3)) == (
        "worker 1 serves without b, whose load failed 3 times in a row: OSError: gone")
    assert startwait.not_loading(body(3, other_ready=False)) == ""  # worker 0 still loading
    assert startwait.not_loading(b"<html>") == startwait.not_loading(b"") == ""


def test_wait_ready_stops_at_once_when_nginx_refuses_the_clis_certificate(tmp_path, capsys,
                                                                          monkeypatch):
    """/ready needs no certificate, but the CLI presents nginx.tls_client_certificate and one
    that does not verify (revoked, or a CRL past its nextUpdate) is a 403 on every route: `up
    --wait` waited its whole timeout, then said to raise it (an outside check)."""
    cfg = make_config(tmp_path / "run", nginx={
        "tls_certificate": "s.pem", "tls_key": "s.key", "tls_client_ca": "ca.pem",
        "tls_client_certificate": "cli.pem", "tls_client_key": "cli.key"})
    monkeypatch.setattr(startwait, "process_info", lambda cfg: [])
    refusal = {"error": {"message": "the client certificate did not verify against "
                         "nginx.tls_client_ca (not issued by one of its CAs, expired, not yet "
                         "valid, or revoked: nginx.tls_client_crl)", "type": "forbidden"}}
    monkeypatch.setattr(startwait.tls, "client_context", lambda cfg: None)
    monkeypatch.setattr(remote, "http", lambda url, **kw: (403, json.dumps(refusal).encode()))
    # the frontends listen (loading: 503); nginx is asked once they do
    monkeypatch.setattr(remote, "get_unix", lambda path, target, timeout=2.0: (503, b"{}"))
    started = time.monotonic()
    assert startwait.wait_ready(cfg, timeout=30) == 1
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "nginx refuses the certificate this command presents" in err, err
    assert "cli.pem" in err and "nextUpdate" in err and "raise workers" not in err, err
    # a 403 for another reason (none where one is needed cannot happen on /ready) waits on
    refusal["error"]["message"] = "forbidden"
    assert startwait.certificate_refused(cfg, 403, json.dumps(refusal).encode()) == ""


def test_wait_ready_asks_nginx_only_once_every_frontend_answers_on_its_socket(deployment,
                                                                              monkeypatch):
    """A probe through nginx while a frontend did not listen yet was a [crit] 'connect() ...
    No such file or directory' (or an 'upstream timed out' error) in nginx's log at every
    `up --wait` (an outside check)."""
    import http.server
    import socketserver
    import threading

    render.render(deployment)
    asked: list[str] = []
    monkeypatch.setattr(remote, "http", lambda url, **kw: asked.append(url) or (200, b""))

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    servers = []
    try:
        for index in range(deployment.frontends.count - 1):  # the last one not listening yet
            path = topology.frontend_socket(deployment, index)
            path.parent.mkdir(parents=True, exist_ok=True)
            servers.append(socketserver.UnixStreamServer(str(path), Ready))
            threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        assert startwait.wait_ready(deployment, timeout=0.6) == 1
        assert asked == []
        path = topology.frontend_socket(deployment, deployment.frontends.count - 1)
        servers.append(socketserver.UnixStreamServer(str(path), Ready))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        assert startwait.wait_ready(deployment, timeout=5) == 0
        assert len(asked) == 1
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_wait_ready_stops_at_the_first_failed_start_of_a_worker_it_saw_start(deployment, capsys,
                                                                              monkeypatch):
    """A worker that cannot load its models exits after a wait and is started again, later each
    time: `up --wait` waited for its third start (25 s for a model whose weights did not fit,
    an outside check; 63 s in a loaded CI run). The frontends name the process that failed:
    one this command saw start ends the wait, one from before does not."""
    render.render(deployment)
    (topology.log_dir(deployment) / "worker-0.log").write_text(
        '{"level": "warning", "message": "worker.load_failed"}\n')
    monkeypatch.setattr(startwait, "process_info", lambda cfg: [
        {"name": "worker-0", "group": "workers", "statename": "RUNNING", "pid": 42}])
    failed_pid = [42]

    def get_unix(path, target, timeout=2.0):
        return 503, json.dumps({"status": "failing", "workers": [
            {"worker": 0, "ready": False, "pid": 42, "failed_loads": 1,
             "load_error": "ModelSourceError: weights do not fit", "failed_pid": failed_pid[0]}
        ]}).encode()
    monkeypatch.setattr(remote, "get_unix", get_unix)
    started = time.monotonic()
    assert startwait.wait_ready(deployment, timeout=30) == 1
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(
        "shmserve: worker-0 exits before it is ready (pid 42 failed; supervisord starts it "
        "again, later each time): ModelSourceError: weights do not fit; fix what the end of "), err
    assert "worker.load_failed" in err  # its log's end, above
    failed_pid[0] = 41  # a process before this command's: not this start's failure
    assert startwait.wait_ready(deployment, timeout=0.5) == 1
    assert "not ready after 0.5 s" in capsys.readouterr().err
