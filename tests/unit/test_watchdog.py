"""frontend.watchdog (shmserve.hung) against stand-in processes: whom it kills, and whom it
never does."""

import dataclasses
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from frontend.watchdog import Watchdog
from shmserve import config
from shmserve.hung import is_program
from shmserve.protocol import PROTOCOL_VERSION, Heartbeat
from tests.stack import free_port


@pytest.fixture
def cfg(tmp_path):
    return config.from_tree({
        "models": [{"name": "a", "source": "/nonexistent/a"}],
        "server": {"run_dir": str(tmp_path / "run"), "port": free_port()},
        "workers": {"devices": "cpu", "cpu_workers": 1, "heartbeat_timeout_s": 1,
                    "hung_kill_s": 3, "stalled_pass_s": 10}})


@pytest.fixture
def spawn():
    procs = []

    def start(config_path: str, index: int = 0, module: str = "gpu_workers") -> subprocess.Popen:
        # Looks like `python -m MODULE --config PATH --index I` to /proc/PID/cmdline.
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m",
                                 module, "--config", config_path, "--index", str(index)])
        procs.append(proc)
        # Popen returns once the exec began, and for a moment after /proc/PID/cmdline is still
        # empty (the kernel sets the new command line up later), which reads as an exiting
        # process, never killed: the test failed 1 time in ~30 on a loaded machine.
        deadline = time.monotonic() + 10
        while not psutil.Process(proc.pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.001)
        # and until its interpreter has started and sleeps: a frontend whose CPU time moves is
        # taken to run (gpu_workers.watch: unreached, not hung), and a start still under way
        # when a watch took its CPU time spared it (the fresh-clone CI of e5d8196, loaded)
        before = None
        while time.monotonic() < deadline:
            child = psutil.Process(proc.pid)
            now = sum(child.cpu_times()[:2])
            if now == before and child.status() == psutil.STATUS_SLEEPING:
                break
            before = now
            time.sleep(0.1)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def beat(pid: int, pass_s: float = 0.0) -> Heartbeat:
    return Heartbeat(PROTOCOL_VERSION, 0, pid, True, "cpu", (), 0, 10, 0.0, pass_s)


def link_of(watchdog: Watchdog, pid: int, last_beat: float):
    watchdog.heard(0, beat(pid))
    return SimpleNamespace(index=0, beat=beat(pid), last_beat=last_beat)


def killed(proc: subprocess.Popen) -> bool:
    try:
        return proc.wait(timeout=5) == -9
    except subprocess.TimeoutExpired:
        return False


def test_is_program_reads_the_command_line_supervisord_runs():
    argv = ["/venv/bin/python", "-m", "gpu_workers", "--config", "/run/config.json",
            "--index", "1"]
    assert is_program(argv, "gpu_workers", "/run/config.json", 1)
    assert not is_program(argv, "gpu_workers", "/run/config.json", 0)  # another worker
    assert not is_program(argv, "gpu_workers", "/other/config.json", 1)  # another deployment's
    frontend = ["/venv/bin/python", "-m", "frontend", "--config", "/run/config.json",
                "--index", "1"]
    assert not is_program(frontend, "gpu_workers", "/run/config.json", 1)
    assert is_program(frontend, "frontend", "/run/config.json", 1)
    assert not is_program(["gpu_workers", "--config"], "gpu_workers", "/run/config.json", 1)


def test_a_worker_silent_past_hung_kill_s_is_killed_once(cfg, spawn):
    watchdog = Watchdog(cfg, 0)
    proc = spawn(watchdog.hung.config_path)
    now = time.monotonic()
    link = link_of(watchdog, proc.pid, now)
    watchdog.hung.awake_since = now - 10  # this frontend has been awake all along
    watchdog.check(link, now + 2.9)  # silent, but not for hung_kill_s yet
    assert proc.poll() is None
    watchdog.check(link, now + 3.1)
    assert killed(proc)
    watchdog.check(link, now + 4)  # gone: nothing more to do, and no error


def test_a_pid_that_is_not_that_worker_any_more_is_left_alone(cfg, spawn):
    watchdog = Watchdog(cfg, 0)
    stranger = spawn("/elsewhere/config.json")  # another deployment's worker
    other = spawn(watchdog.hung.config_path, index=1)  # another worker of this one
    same = spawn(watchdog.hung.config_path)
    now = time.monotonic()
    watchdog.hung.awake_since = now - 10
    for proc in (stranger, other):
        watchdog.check(link_of(watchdog, proc.pid, now), now + 5)
        assert proc.poll() is None
    # Worker 0's pid, but a process started after the one that heartbeated (pid reuse).
    link = link_of(watchdog, same.pid, now)
    watchdog.hung._starts[0] = (same.pid, watchdog.hung._starts[0][1] - 5)
    watchdog.check(link, now + 5)
    assert same.poll() is None


def test_a_frontend_that_was_stalled_itself_counts_silence_from_when_it_resumed(cfg, spawn):
    watchdog = Watchdog(cfg, 0)
    proc = spawn(watchdog.hung.config_path)
    now = time.monotonic()
    link = link_of(watchdog, proc.pid, now)
    watchdog.tick(now)
    watchdog.tick(now + 20)  # its own loop was 20 s late: it heard nothing, nobody was silent
    watchdog.check(link, now + 20)
    assert proc.poll() is None
    watchdog.tick(now + 20.5)
    watchdog.check(link, now + 23.5)  # 3.5 s of silence while it was awake
    assert killed(proc)


def test_hung_kill_s_0_never_kills(cfg, spawn):
    cfg = dataclasses.replace(cfg, workers=dataclasses.replace(cfg.workers, hung_kill_s=0))
    watchdog = Watchdog(cfg, 0)
    proc = spawn(watchdog.hung.config_path)
    now = time.monotonic()
    watchdog.hung.awake_since = now - 1000
    watchdog.check(link_of(watchdog, proc.pid, now - 1000), now)
    assert proc.poll() is None


def test_a_long_pass_is_reported_as_stalled(cfg):
    watchdog = Watchdog(cfg, 0)
    assert not watchdog.stalled(beat(1, pass_s=9.5))
    assert watchdog.stalled(beat(1, pass_s=10.5))


def test_config_keeps_hung_kill_s_over_the_heartbeat_timeout(tmp_path):
    tree = {"models": [{"name": "a", "source": "/nonexistent/a"}],
            "server": {"run_dir": str(tmp_path / "run"), "port": free_port()},
            "workers": {"devices": "cpu", "cpu_workers": 1, "heartbeat_timeout_s": 3}}
    for value in (0, 3.5):
        config.from_tree({**tree, "workers": {**tree["workers"], "hung_kill_s": value}})
    with pytest.raises(config.ConfigError, match="hung_kill_s: 3 must be over"):
        config.from_tree({**tree, "workers": {**tree["workers"], "hung_kill_s": 3}})


def test_config_keeps_frontends_hung_kill_s_over_two_ping_intervals(tmp_path):
    tree = {"models": [{"name": "a", "source": "/nonexistent/a"}],
            "server": {"run_dir": str(tmp_path / "run"), "port": free_port()},
            "workers": {"devices": "cpu", "cpu_workers": 1, "heartbeat_interval_s": 1,
                        "heartbeat_timeout_s": 60, "hung_kill_s": 120}}
    for value in (0, 2.5, 30):  # not tied to the heartbeat timeout, which may be long
        config.from_tree({**tree, "frontends": {"hung_kill_s": value}})
    with pytest.raises(config.ConfigError, match="frontends.hung_kill_s: 2 must be over twice"):
        config.from_tree({**tree, "frontends": {"hung_kill_s": 2}})


def clocked_watch(cfg, monkeypatch):
    """A worker's FrontendWatch on a test clock: (the watch, the frontends it killed, a
    function advancing the clock by some seconds, ticking every half second)."""
    from gpu_workers import watch

    clock = [time.monotonic()]
    monkeypatch.setattr(watch.time, "monotonic", lambda: clock[0])
    kills = []
    frontends = watch.FrontendWatch(cfg, 0, SimpleNamespace(frontend_killed=kills.append,
                                                            watching=lambda frontend: None))

    def advance(seconds: float) -> None:
        for _ in range(round(seconds / 0.5)):
            clock[0] += 0.5
            frontends.tick()
    return frontends, kills, advance


def test_a_worker_kills_a_frontend_frozen_before_it_started(cfg, spawn, monkeypatch):
    """A worker (re)started while a frontend was frozen never hears its pings: it finds the
    frontends' processes at start and counts their silence from then (gpu_workers.watch)."""
    from shmserve import topology

    cfg = dataclasses.replace(cfg, frontends=dataclasses.replace(cfg.frontends, hung_kill_s=3))
    path = str(topology.resolved_config_path(cfg))
    frozen = spawn(path, index=0, module="frontend")
    stranger = spawn("/elsewhere/config.json", index=1, module="frontend")  # not ours
    frontends, kills, advance = clocked_watch(cfg, monkeypatch)
    advance(3.0)  # not yet
    assert frozen.poll() is None and not kills
    advance(0.5)
    assert killed(frozen) and kills == [0]
    assert stranger.poll() is None


def test_a_new_worker_judges_a_frontend_on_an_older_config_from_its_first_ping(
        cfg, spawn, monkeypatch):
    """`shmserve apply` writes config.json, starts the workers it adds, and restarts the
    frontends last: a frontend started before that write may not know the new worker and never
    pings it, so the new worker must not kill it for its silence (an outside check: every
    frontend SIGKILLed at once, 502s). Once it pings, its silence counts."""
    from shmserve import topology
    from shmserve.protocol import Ping

    cfg = dataclasses.replace(cfg, frontends=dataclasses.replace(cfg.frontends, hung_kill_s=3))
    path = topology.resolved_config_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    older = spawn(str(path), index=0, module="frontend")
    written = time.time() + 10  # the apply's write, after the frontend started
    os.utime(path, (written, written))
    frontends, kills, advance = clocked_watch(cfg, monkeypatch)
    advance(10.0)  # of its silence: it never knew this worker
    assert older.poll() is None and not kills
    frontends.pinged(Ping(time.time(), 0, older.pid))  # restarted frontends ping; so may it
    advance(4.0)
    assert killed(older) and kills == [0]


def test_a_new_worker_spares_a_running_frontend_that_cannot_reach_it(cfg, spawn, monkeypatch):
    """A frontend at its open-files limit has no descriptor for a restarted worker's
    connection: silent to it, it still runs (its CPU time moves, it pings the other workers).
    The new worker SIGKILLed it 30 s on (an outside check); now its silence counts again,
    and a frontend whose CPU time stands still (frozen) is still killed."""
    from gpu_workers import watch
    from shmserve import topology

    cfg = dataclasses.replace(cfg, frontends=dataclasses.replace(cfg.frontends, hung_kill_s=3))
    path = str(topology.resolved_config_path(cfg))
    busy = spawn(path, index=0, module="frontend")
    frozen = spawn(path, index=1, module="frontend")
    monkeypatch.setattr(watch, "cpu_seconds",  # the busy one's moves with the (test's) clock
                        lambda pid: watch.time.monotonic() if pid == busy.pid else 1.0)
    frontends, kills, advance = clocked_watch(cfg, monkeypatch)
    advance(10.0)  # three hung_kill_s
    assert busy.poll() is None
    assert killed(frozen) and kills == [1]
