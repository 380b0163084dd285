"""The supervisord event listener that forgets exited processes' live gauges."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from shmserve import reaper


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def event(name: str, payload: str, serial: int = 1) -> str:
    return (f"ver:3.0 server:supervisor serial:{serial} pool:reaper poolserial:{serial} "
            f"eventname:{name} len:{len(payload)}\n{payload}")


def test_an_exited_process_loses_its_live_gauges_and_its_counts_are_merged(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    code = ("import os\nfrom prometheus_client import Counter, Gauge\n"
            "Counter('t_exits', 'e').inc(2)\n"
            "Gauge('t_depth', 'd', multiprocess_mode='livemostrecent').set(1)\n"
            "print(os.getpid())\n")
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ,
                                              "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}).stdout)
    (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
    payload = f"processname:worker-0 groupname:workers from_state:RUNNING expected:0 pid:{pid}"
    assert reaper.handle("PROCESS_STATE_EXITED", payload) == [pid]
    assert sorted(p.name for p in tmp_path.glob("*.db")) == ["counter_archive.db"]
    from prometheus_client import mmap_dict
    values = mmap_dict.MmapedDict.read_all_values_from_file(str(tmp_path /
                                                                "counter_archive.db"))
    assert [(key, value) for key, value, _, _ in values] == [
        ('["t_exits", "t_exits_total", {}, "e"]', 2.0)]


def test_exits_are_counted_by_program_and_whether_expected(tmp_path, monkeypatch):
    """A killed frontend showed nowhere in /metrics (an outside check): only supervisord's log
    said it. Stops are not exits."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    def count(program, expected):
        return reaper.EXITS.labels(program, expected)._value.get()
    before = count("frontend-1", "false"), count("frontend-1", "true")
    reaper.handle("PROCESS_STATE_EXITED", "processname:frontend-1 groupname:frontends "
                  "from_state:RUNNING expected:0 pid:999999")
    reaper.handle("PROCESS_STATE_EXITED", "processname:frontend-1 groupname:frontends "
                  "from_state:RUNNING expected:1 pid:999998")
    reaper.handle("PROCESS_STATE_STOPPED", "processname:frontend-1 groupname:frontends "
                  "from_state:STOPPING pid:999997")
    assert (count("frontend-1", "false"), count("frontend-1", "true")) == (
        before[0] + 1, before[1] + 1)


def test_an_exit_while_starting_counts_as_a_crash(tmp_path, monkeypatch):
    """A process that exits before startsecs gets BACKOFF and no EXITED event: a frontend's
    crash at start went uncounted (an outside check: 4 exits counted of 5 SIGBUS exits). FATAL
    (its retries used up) follows a BACKOFF already counted, so it is not an exit."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    before = reaper.EXITS.labels("frontend-0", "false")._value.get()
    for tries in (1, 2):
        reaper.handle("PROCESS_STATE_BACKOFF", "processname:frontend-0 groupname:frontends "
                      f"from_state:STARTING tries:{tries}")
    reaper.handle("PROCESS_STATE_FATAL", "processname:frontend-0 groupname:frontends "
                  "from_state:BACKOFF")
    assert reaper.EXITS.labels("frontend-0", "false")._value.get() == before + 2


def test_events_without_a_pid_still_sweep(tmp_path, monkeypatch):
    """BACKOFF (died while starting) names no pid; the sweep finds the dead one anyway."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pid = dead_pid()
    (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
    payload = "processname:frontend-1 groupname:frontends from_state:STARTING tries:1"
    assert reaper.handle("PROCESS_STATE_BACKOFF", payload) == [pid]
    assert list(tmp_path.iterdir()) == []


def test_without_a_metrics_dir_it_does_nothing(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert reaper.handle("PROCESS_STATE_EXITED", "processname:x pid:1") == []


def test_speaks_supervisords_listener_protocol(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pid = dead_pid()
    (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
    stdin = io.StringIO(event("PROCESS_STATE_EXITED", f"processname:w pid:{pid}", 1) +
                        event("PROCESS_STATE_STOPPED", "processname:w pid:notanumber", 2))
    stdout = io.StringIO()
    reaper.serve(stdin, stdout)  # returns at EOF, as when supervisord goes away
    assert stdout.getvalue() == "READY\nRESULT 2\nOKREADY\nRESULT 2\nOKREADY\n"
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_stops_it_with_exit_status_0(tmp_path):
    # supervisord logged "WARN stopped: reaper (terminated by SIGTERM)" at every stop.
    import signal
    import socket

    from shmserve import render, topology
    from tests.unit.test_render import free_port, make_config

    cfg = make_config(tmp_path / "run", frontends={"count": 2},
                      server={"grpc_port": free_port()})
    render.render(cfg)  # writes run/config.json, which the reaper reads
    # What frontends leave when they stop (their socket files, refusing connections: gRPC's
    # too, left after a foreground stop: an outside check), and a live one's, which stays.
    stopped, live = (topology.frontend_socket(cfg, i) for i in (0, 1))
    stopped_grpc = topology.frontend_grpc_socket(cfg, 0)
    for path in (stopped, live):
        path.parent.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live))
    listener.listen()
    for path in (stopped, stopped_grpc):
        closed = socket.socket(socket.AF_UNIX)
        closed.bind(str(path))
        closed.close()
    with listener, subprocess.Popen([sys.executable, "-m", "shmserve.reaper", "--config",
                           str(tmp_path / "run" / "config.json")],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout.readline() == b"READY\n"  # listening, as under supervisord
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0, proc.stderr.read()
            assert not stopped.exists() and not stopped_grpc.exists() and live.exists()
        finally:
            proc.kill()


def test_every_programs_exit_series_starts_at_zero(tmp_path, monkeypatch):
    """So increase() sees a first crash; the reaper's own was missing (an outside check: a
    killed reaper's series appeared at 1, counted by the next reaper)."""
    from prometheus_client import REGISTRY
    from shmserve import config

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    cfg = config.load(environ={"SHMSERVE__FRONTENDS__COUNT": "2",
                               "SHMSERVE__WORKERS__DEVICES": "cpu",
                               "SHMSERVE__WORKERS__CPU_WORKERS": "2"})
    reaper.start(cfg)
    series = {(s.labels["program"], s.labels["expected"])
              for metric in REGISTRY.collect() if metric.name == "shmserve_process_exits"
              for s in metric.samples if s.name.endswith("_total")}
    for program in ("nginx", "reaper", "frontend-0", "frontend-1", "worker-0", "worker-1"):
        assert {(program, "true"), (program, "false")} <= series, program
