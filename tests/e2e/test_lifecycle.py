"""Process lifecycle through supervisord: kill -9 leaves no shared-memory growth, a clean stop
leaves nothing behind."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shmserve import config, topology
from tests.conftest import tiny_overrides
from tests.tinymodel import widen
from tests.stack import Stack

SHM = Path("/dev/shm")


def segments(stack: Stack) -> list[str]:
    cfg = config.load_resolved(stack.run_dir / "config.json")
    return sorted(p.name for p in SHM.glob(topology.shm_prefix(cfg) + "*"))


@pytest.fixture
def stack(tmp_path, tiny_model):
    s = Stack(tmp_path / "stack", tiny_overrides(tiny_model, frontends={"count": 2}))
    s.up()
    yield s
    s.down()


def test_kill_9_then_restart_keeps_shm_flat_and_down_leaves_nothing(stack):
    before = segments(stack)
    assert len(before) == 2  # one arena per frontend, none for workers

    for program in ("frontends:frontend-0", "workers:worker-0", "frontends:frontend-1"):
        old = stack.pid(program)
        assert old > 0
        os.kill(old, signal.SIGKILL)
        stack.wait_until(lambda: stack.pid(program) not in (0, old), 60,
                         f"supervisord to restart {program}")
        stack.wait_until(lambda: stack.get("/ready")[0] == 200, 90, "ready again")
        # Every request gets its answer after the restart.
        for _ in range(4):
            status, _, body = stack.post_json("/predict", {"texts": ["after a kill"]})
            assert status == 200, (program, body)
        now = segments(stack)
        assert len(now) == 2, now  # the dead frontend's arena was swept, not leaked

    cfg = config.load_resolved(stack.run_dir / "config.json")
    stack.down()
    assert not list(SHM.glob(topology.shm_prefix(cfg) + "*"))
    assert not list((stack.run_dir / "sockets").glob("*"))
    with socket.socket() as probe:  # nginx is gone: nothing listens on the public port
        assert probe.connect_ex(("127.0.0.1", stack.port)) != 0


def test_up_refuses_models_outside_the_roots_and_pickle_only(tmp_path, tiny_model):
    outside = Stack(tmp_path / "outside", {**tiny_overrides(tiny_model),
                                           "model_roots": [str(tmp_path / "elsewhere")]})
    proc = outside.cli("up", check=False)
    assert proc.returncode != 0 and "outside the model roots" in proc.stderr + proc.stdout
    pickled = tmp_path / "models" / "pickled"
    pickled.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (pickled / name).write_bytes((tiny_model / name).read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    overrides = tiny_overrides(tiny_model)
    overrides["models"] = [{"name": "p", "source": str(pickled)}]
    overrides["model_roots"] = [str(pickled.parent)]
    proc = Stack(tmp_path / "pickle", overrides).cli("up", check=False)
    assert proc.returncode != 0 and "safetensors only" in proc.stderr + proc.stdout
    assert not (tmp_path / "pickle" / "run" / "supervisord.pid").exists()  # nothing started


def test_a_sigkilled_supervisord_leaves_nothing_running_after_the_next_up(tmp_path, tiny_model):
    from shmserve import processes

    stack = Stack(tmp_path / "s", tiny_overrides(tiny_model, frontends={"count": 1}))
    stack.up()
    try:
        cfg = config.load_resolved(stack.run_dir / "config.json")
        children = processes.orphans(cfg)
        assert len(children) >= 3  # frontend, worker, reaper (nginx is found by its config)
        old_worker = stack.pid("workers:worker-0")
        supervisord = int((stack.run_dir / "supervisord.pid").read_text())
        os.kill(supervisord, signal.SIGKILL)
        stack.wait_until(lambda: not processes.alive(supervisord), 10, "supervisord gone")
        assert processes.alive(old_worker)  # its children live on
        done = stack.cli("status", check=False)
        assert done.returncode == 1 and "supervisord is not running" in done.stdout, done.stdout
        assert str(old_worker) in done.stdout and f":{stack.port}" in done.stdout
        done = stack.cli("ctl", "status", check=False)  # not supervisorctl's "no such file"
        assert done.returncode == 1 and str(old_worker) in done.stderr, done.stderr
        # `up` sweeps them, then starts afresh, with the config as it loads now: it says how
        # that differs from what the killed deployment ran
        stack.env["SHMSERVE__BATCHING__MAX_WAIT_MS"] = "3"
        done = stack.cli("up", "--wait", "--timeout", "150")
        assert "killed processes a dead supervisord left behind" in done.stdout
        assert "batching.max_wait_ms: 2.0 -> 3.0" in done.stderr, done.stderr
        stack.env.pop("SHMSERVE__BATCHING__MAX_WAIT_MS")
        assert not processes.alive(old_worker)
        assert not set(children) & set(processes.orphans(cfg))
        assert stack.post_json("/predict", {"texts": ["fresh"]})[0] == 200
        # Killed again: `down` stops what it left, and says so.
        worker = stack.pid("workers:worker-0")
        supervisord = int((stack.run_dir / "supervisord.pid").read_text())
        os.kill(supervisord, signal.SIGKILL)
        stack.wait_until(lambda: not processes.alive(supervisord), 10, "supervisord gone")
        done = stack.cli("down")
        assert "supervisord was not running" in done.stdout and str(worker) in done.stdout, \
            done.stdout
        assert not processes.alive(worker) and processes.orphans(cfg) == []
    finally:
        stack.down()
    assert processes.orphans(cfg) == []


def test_a_sigterm_to_supervisord_leaves_no_socket_file_or_arena(tmp_path, tiny_model):
    """What `docker stop` or a pod's stop does (`shmserve down` also sweeps what is left): the
    workers' ipc files were left behind (libzmq does not remove a bound socket's file)."""
    from shmserve import processes

    stack = Stack(tmp_path / "t", tiny_overrides(tiny_model, frontends={"count": 1}))
    stack.up()
    try:
        cfg = config.load_resolved(stack.run_dir / "config.json")
        supervisord = int((stack.run_dir / "supervisord.pid").read_text())
        os.kill(supervisord, signal.SIGTERM)
        stack.wait_until(lambda: not processes.alive(supervisord), 60, "supervisord gone")
        assert processes.orphans(cfg) == []
        assert not list((stack.run_dir / "sockets").glob("*"))
        assert not list(SHM.glob(topology.shm_prefix(cfg) + "*"))
    finally:
        stack.down()


def test_a_running_deployment_without_its_pid_file_is_still_found(tmp_path, tiny_model):
    """The pid file deleted (a tmp cleaner) while the deployment runs: `up` killed its programs
    as a dead supervisord's leftovers, which supervisord started again, and `down` did so and
    removed the control socket, leaving supervisord serving and unreachable (an outside
    check). supervisord is found by its command line."""
    from shmserve import processes

    stack = Stack(tmp_path / "t", tiny_overrides(tiny_model, frontends={"count": 1}))
    stack.up()
    try:
        cfg = config.load_resolved(stack.run_dir / "config.json")
        supervisord = int((stack.run_dir / "supervisord.pid").read_text())
        worker = stack.pid("workers:worker-0")
        (stack.run_dir / "supervisord.pid").unlink()
        status = json.loads(stack.cli("status", "--json").stdout)
        assert status["state"] == "ready", status
        again = stack.cli("up", check=False)
        assert again.returncode == 2 and "already running" in again.stderr, again.stderr
        assert stack.pid("workers:worker-0") == worker  # nothing killed
        stack.cli("down")
        assert not processes.alive(supervisord) and processes.orphans(cfg) == []
    finally:
        stack.down()


def test_down_lets_every_frontend_exit_0(tmp_path, tiny_model):
    """The reaper's SIGTERM starts a frontend's drain and supervisord sends another once nginx
    is gone: the second killed frontends in their exit, after the loop had put the signal's
    default action back (an outside check: "terminated by SIGTERM" for 2 of 3 frontends at
    every `down`)."""
    stack = Stack(tmp_path / "t", tiny_overrides(tiny_model, frontends={"count": 3}))
    stack.up()
    try:
        assert stack.post_json("/v1/embeddings", {"input": ["x"]})[0] == 200
        # a healthy up leaves nginx's log without errors: up --wait asks nginx only once every
        # frontend listens (before, a [crit] connect() to a missing socket at many an up)
        errors = [line for line in stack.log("nginx").splitlines()
                  if "[crit]" in line or "[error]" in line or "[alert]" in line]
        assert errors == [], errors
        # supervisord's socket asks for its password, which supervisorctl (`shmserve ctl`)
        # and the CLI's XML-RPC give
        bare = tmp_path / "bare.conf"
        bare.write_text(f"[supervisorctl]\nserverurl=unix://{stack.run_dir}/supervisor.sock\n")
        plain = subprocess.run([str(Path(sys.executable).with_name("supervisorctl")), "-c",
                                str(bare), "status"], capture_output=True, text=True,
                               check=False)
        assert "RUNNING" not in plain.stdout and "authentication" in plain.stdout.lower(), plain
        assert stack.ctl("status").count("RUNNING") == 6  # 3 frontends, a worker, nginx, reaper
        assert "ready" in stack.cli("status").stdout
    finally:
        stack.down()
    log = stack.log("supervisord")
    assert "terminated by" not in log, log
    for i in range(3):
        assert f"stopped: frontend-{i} (exit status 0)" in log, log
    # No CRIT line at a start, which alerting takes for a fault (outside checks of the logs):
    # as root (CI), user=root, which it is ("Supervisor is running as root"); its socket has
    # a password ("running without any HTTP authentication checking")
    assert " CRIT " not in log, log


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def test_per_gpu_runs_that_many_workers_on_one_device_and_routes_to_all(tmp_path, tiny_model):
    """workers.per_gpu through the real stack: two worker programs for device 0, both ready,
    both given work. Without a GPU, workers.cpu_fallback lets them serve on the CPU, so the
    plumbing runs here as on a GPU."""
    import asyncio
    import json

    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    from shmserve import processes

    stack = Stack(tmp_path / "s", tiny_overrides(
        tiny_model, frontends={"count": 1},
        workers={"devices": [0], "per_gpu": 2, "torch_threads": 1, "cpu_fallback": True}))
    stack.up()
    try:
        cfg = config.load_resolved(stack.run_dir / "config.json")
        assert topology.worker_devices(cfg) == ["0", "0"]
        assert stack.pid("workers:worker-0") and stack.pid("workers:worker-1")
        ready = json.loads(stack.get("/ready")[2])
        assert [w["ready"] for w in ready["workers"]] == [True, True]

        async def flood():
            async with aiohttp.ClientSession(stack.url) as session:
                async def one(i):
                    async with session.post("/predict",
                                            json={"texts": ["word " * 40 + str(i)] * 8}) as r:
                        return r.status
                return await asyncio.gather(*(one(i) for i in range(64)))
        assert set(asyncio.run(flood())) == {200}
        texts = {}
        for family in text_string_to_metric_families(stack.get("/metrics")[2].decode()):
            for sample in family.samples:
                if sample.name == "shmserve_batch_texts_sum":
                    w = sample.labels["worker"]
                    texts[w] = texts.get(w, 0) + sample.value
        assert texts.get("0", 0) > 0 and texts.get("1", 0) > 0, texts
        # A variable set wrong since `up` does not keep `down` from stopping the deployment
        # (it was refused with the variable's error, and nothing stopped: an outside check).
        stack.env["SHMSERVE__FRONTENDS__COUNT"] = "abc"
        done = stack.cli("down")
        assert "frontends.count: expected an integer" in done.stderr, done.stderr
        assert "shmserve: stopped" in done.stdout, done.stdout
        assert processes.orphans(cfg) == []
        stack.env.pop("SHMSERVE__FRONTENDS__COUNT")
    finally:
        stack.down()


def test_a_worker_that_cannot_load_its_model_fails_up_and_restart_fast(tmp_path, tiny_model):
    """A worker whose weights are broken exits after supervisord counted it started, so it is
    restarted for ever and never goes FATAL: `restart` and `up --wait` see its pid change and
    stop waiting, with the error from its log."""
    import shutil
    import time

    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_model, model)
    overrides = tiny_overrides(tiny_model, frontends={"count": 1}, workers={"cpu_workers": 1},
                               admin={"token": "lifecycle-admin-token"})
    overrides["model_roots"] = [str(model.parent)]
    overrides["models"][0]["source"] = str(model)
    stack = Stack(tmp_path / "s", overrides)
    stack.up()
    # "Fast": well before the 200 s the commands are given (they waited it out for a worker
    # that never becomes ready); not a speed bound (64 s was seen on a loaded machine).
    fast = 150
    good = model.parent / "tiny-good"
    shutil.copytree(tiny_model, good)
    try:
        # Weights whose header reads (so `up`'s check passes) and that no BERT of this config
        # can load.
        weights = model / "model.safetensors"
        widen(weights)
        started = time.monotonic()
        done = stack.cli("restart", "worker-0", check=False, timeout=200)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "worker-0 exits before it is ready" in done.stderr
        assert "embeddings.word_embeddings.weight is [30522, 33], the config needs [30522, " \
            "32]" in done.stderr.splitlines()[-1], done.stderr
        assert time.monotonic() - started < fast
        # All at once: it exited 0 once supervisord had started the group, with the workers
        # crash-looping behind it; it waits for each as the rolling restart does.
        started = time.monotonic()
        done = stack.cli("restart", "workers", "--all-at-once", check=False, timeout=200)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "worker-0 exits before it is ready" in done.stderr
        assert "the rest of the workers" not in done.stderr
        assert time.monotonic() - started < fast
        stack.down()

        started = time.monotonic()
        done = stack.cli("up", "--wait", "--timeout", "200", check=False, timeout=250)
        assert done.returncode == 1, done.stdout + done.stderr
        last = done.stderr.splitlines()[-1]
        assert "worker-0 exits before it is ready" in last
        assert "ready_timeout_s" not in done.stderr
        assert time.monotonic() - started < fast
        # Left running, it says why: /ready and `status` said "loading" for ever (an outside
        # check). The worker waits longer after each failure before it exits again.
        status, _, body = stack.get("/ready")
        ready = json.loads(body)
        assert (status, ready["status"]) == (503, "failing"), ready
        worker = ready["workers"][0]
        assert worker["failed_loads"] >= 1, worker
        assert "embeddings.word_embeddings.weight is [30522, 33]" in worker["load_error"]
        shown = stack.cli("status", check=False).stdout
        assert "failing (a worker's models fail to load" in shown, shown
        assert "worker 0: its load failed" in shown and "[30522, 33]" in shown, shown
        # (`up --wait` said its first failure: the next start, seconds later, fails again)
        failures = stack.run_dir / "worker-0.load-failures"
        def failed_loads() -> int:
            try:
                return int(failures.read_text())
            except (OSError, ValueError):  # written in place by the worker: read it again
                return 0
        stack.wait_until(lambda: failed_loads() >= 2, 60, "a second failed load")
        waits = [line["exit_in_s"] for line in stack.logged(("worker-0",), "worker.load_failed",
                                                            2)]
        assert waits[:2] == [1.0, 2.0], waits
        # A request for its model is answered at once, saying why (it waited
        # frontends.no_worker_wait_s for a generic 503: an outside check) ...
        started = time.monotonic()
        status, _, body = stack.post_json("/v1/embeddings", {"input": ["x"]})
        assert status == 503 and body["error"]["code"] == "model_not_loaded", body
        assert "[30522, 33]" in body["error"]["message"] and time.monotonic() - started < 2
        # ... and a reload to good weights mends it: recorded, the worker's next start loads
        # it (its back-off ends when the run state changes), the call answers once it has.
        admin = {"Authorization": "Bearer lifecycle-admin-token"}
        status, _, body = stack.post_json("/admin/models/tiny/reload", {"source": str(good)},
                                          admin)
        assert status == 200 and [w["message"] for w in body["workers"]] == ["loaded"], body
        assert stack.post_json("/v1/embeddings", {"input": ["x"]})[0] == 200
        stack.down()
        assert not failures.exists()

        # A file whose header does not read is refused before anything starts.
        weights.write_bytes(weights.read_bytes()[:2000])  # truncated
        done = stack.cli("up", "--wait", check=False)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "is not a readable safetensors file" in done.stderr
    finally:
        stack.down()


def test_up_wait_past_its_timeout_says_what_still_runs(tmp_path, tiny_model):
    """`up --wait` that times out fails (1) and says that what it started keeps running and
    how to stop it (a new user took the failure for a stop); the server goes on to be ready."""
    stack = Stack(tmp_path / "s", tiny_overrides(tiny_model, frontends={"count": 1},
                                                 workers={"cpu_workers": 1}))
    try:
        done = stack.cli("up", "--wait", "--timeout", "0.2", check=False, timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr
        last = done.stderr.splitlines()[-1]
        assert "not ready after 0.2 s" in last and "keeps running" in last, done.stderr
        assert "`shmserve down` stops it" in last

        def ready() -> bool:
            try:
                return stack.get("/ready")[0] == 200
            except OSError:  # nginx not listening yet
                return False
        stack.wait_until(ready, 120, "ready after all")
    finally:
        stack.down()


@pytest.mark.skipif(gpu_visible(), reason="this machine has a GPU")
def test_a_worker_given_a_gpu_this_machine_lacks_fails_up(tmp_path, tiny_model):
    """workers.devices [0] on a machine without a GPU: the worker refuses to serve on the CPU
    instead, and `up --wait` says why, naming the key, without waiting out its timeout."""
    stack = Stack(tmp_path / "s", tiny_overrides(tiny_model, frontends={"count": 1},
                                                 workers={"devices": [0]}))
    try:
        done = stack.cli("up", "--wait", "--timeout", "200", check=False, timeout=250)
        assert done.returncode == 1, done.stdout + done.stderr
        last = done.stderr.splitlines()[-1]
        assert "worker-0 exits before it is ready" in last
        assert "DeviceError: workers.devices: this worker was given GPU 0" in last
        # an error of configuration: its message, with no traceback at every attempt (`up`
        # said the first failure: the process exits after its wait, 1 s)
        failed = stack.logged(("worker-0",), "worker.failed", 1, timeout=30)
        assert failed and all(line["exception"].startswith("DeviceError: workers.devices")
                              and "Traceback" not in line["exception"] for line in failed)
        assert "Traceback" not in stack.log("worker-0")
    finally:
        stack.down()


def test_a_large_answer_in_transfer_survives_a_graceful_stop(tmp_path, tiny_model):
    """`shmserve down` while a large answer is being computed: nginx waited for it, as a graceful
    stop does, but its worker exited mid-transfer once the frontend had handed it the whole
    (buffered) answer, and the client got a cut body (a 70 MB /embed_all, an outside check).
    Such answers now pass unbuffered."""
    import http.client
    import json
    import threading
    import time

    import msgpack

    stack = Stack(tmp_path, tiny_overrides(tiny_model, limits={"max_texts_per_request": 4096},
                                           workers={"queue_texts": 8192},
                                           frontends={"count": 1}))
    stack.up()
    # 4096 x 64 rows x 32 floats: 34 MB of msgpack (a JSON answer that large is refused, 413)
    texts = [f"{'word ' * 80}{i}" for i in range(4096)]
    got = {}

    def fetch():
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
        conn.request("POST", "/embed_all", json.dumps({"inputs": texts, "truncate": True}),
                     {"Content-Type": "application/json", "Accept": "application/msgpack"})
        response = conn.getresponse()
        got["status"], got["headers"] = response.status, dict(response.headers)
        try:
            got["rows"] = [len(rows) for rows in msgpack.unpackb(response.read())]
        except (http.client.IncompleteRead, ValueError) as exc:
            got["error"] = repr(exc)[:200]
        finally:
            conn.close()

    client = threading.Thread(target=fetch)
    try:
        client.start()
        time.sleep(0.3)  # sent, and being computed: nginx is told to stop before it answers
    finally:
        stack.down()
        client.join(120)
    assert got.get("status") == 200, got
    assert "error" not in got and got["rows"] == [64] * 4096, got.get("error")
    assert "X-Accel-Buffering" not in got["headers"]  # nginx's, not the client's

