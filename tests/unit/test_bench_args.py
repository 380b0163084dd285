"""The benchmark scripts refuse wrong use before anything starts: one line and exit 2, as argparse
does, before the ceiling is built or a stack started (an outside check, following the README,
met tracebacks after ~10 s of work, or after side A's stack was up)."""

import http.server
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.stack import REPO

sys.path.insert(0, str(REPO / "scripts"))

import ab  # noqa: E402
import bench  # noqa: E402
import benchkit  # noqa: E402
import benchreport  # noqa: E402
import burst  # noqa: E402
import tail  # noqa: E402


class Started(Exception):
    """What a test's stand-in for a stack or a ceiling raises: something started."""


def refused(capsys, main, argv: list[str], monkeypatch) -> str:
    """main() run with `argv`, refused with status 2: its stderr."""
    monkeypatch.setattr(sys, "argv", [f"{main.__module__}.py", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def nothing_starts(monkeypatch):
    """No stack, ceiling, signal handler or module check for real: a start is a failure."""
    def start(*args, **kwargs):
        raise Started
    for module in (ab, bench, burst, tail):
        monkeypatch.setattr(module, "OwnStack", start)
        monkeypatch.setattr(module, "stop_on_term", lambda: None)
        if hasattr(module, "require"):
            monkeypatch.setattr(module, "require", lambda *names: None)
    monkeypatch.setattr(bench, "ceiling", start)
    monkeypatch.setattr(tail, "model_alone", start)
    monkeypatch.delenv("SHMSERVE_PORTS", raising=False)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    """An HTTP server on 127.0.0.1 whose answers a test sets: {(method, path): (status, body)};
    anything else is a route 404."""
    answers: dict = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            status, body = answers.get((self.command, self.path), (404, {"detail": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    httpd.answers = answers
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()


EMBEDDING = {"data": [{"index": 0, "embedding": [1.0, 0.0]}]}


def test_bench_url_takes_a_root_or_v1_url_and_refuses_one_without_a_scheme():
    import argparse

    assert bench.server_url("http://127.0.0.1:20913/v1/") == "http://127.0.0.1:20913"
    assert bench.server_url("https://h:1") == "https://h:1"
    for wrong in ("localhost:20913", "127.0.0.1:20913", "ftp://h:1", "http://"):
        with pytest.raises(argparse.ArgumentTypeError, match="http"):
            bench.server_url(wrong)


def test_bench_url_with_nothing_there_or_not_shmserve_is_refused_before_the_ceiling(
        capsys, monkeypatch, nothing_starts, server):
    port = unused_port()
    err = refused(capsys, bench.main, ["--url", f"http://127.0.0.1:{port}", "--no-sweep"],
                  monkeypatch)
    assert f"--url's stack http://127.0.0.1:{port}: GET /info failed" in err
    assert refused(capsys, bench.main, ["--url", "localhost:20913"], monkeypatch).endswith(
        "argument --url: 'localhost:20913': an http(s)://HOST:PORT URL\n")
    # an OpenAI-compatible server that is not shmserve (the FastAPI baseline): no GET /info
    server.answers[("POST", "/v1/embeddings")] = (200, EMBEDDING)
    err = refused(capsys, bench.main, ["--url", server.url + "/v1", "--no-sweep"], monkeypatch)
    assert f"{server.url}: GET /info answered 404: not a shmserve stack" in err
    assert "--compare" in err


def test_bench_measures_the_model_model_names_and_refuses_one_not_served(
        capsys, monkeypatch, nothing_starts, server):
    """A run of a stack's second model reported its first, read its ratio against the first's
    ceiling and failed in parity (an outside check): the model --model names is the one."""
    monkeypatch.setenv("SHMSERVE_BENCH_MODEL", "")  # main() sets it: undone after the test
    info = {"frontends": 1, "workers": 1, "limits": {}, "models": [
        {"name": "m1", "dtype": "bf16", "aliases": ["first"]},
        {"name": "m2", "dtype": "fp32", "aliases": ["second"]}]}
    assert bench.named_model(info["models"], None, "u")["name"] == "m1"
    assert bench.named_model(info["models"], "second", "u")["name"] == "m2"
    assert bench.named_model(info["models"], "m2", "u")["dtype"] == "fp32"
    server.answers[("GET", "/info")] = (200, info)
    server.answers[("POST", "/v1/embeddings")] = (200, EMBEDDING)
    err = refused(capsys, bench.main, ["--url", server.url, "--model", "m3", "--no-sweep"],
                  monkeypatch)
    assert f"--model 'm3': the stack at {server.url} serves no such model (it serves m1, m2)" \
        in err
    err = refused(capsys, bench.main, ["--model", "m3", "--no-sweep"], monkeypatch)
    assert "--model 'm3': the config serves no such model (it serves all-MiniLM-L6-v2)" in err


def test_bench_compare_url_is_probed_before_the_ceiling(capsys, monkeypatch, nothing_starts):
    port = unused_port()
    err = refused(capsys, bench.main, ["--compare", f"http://127.0.0.1:{port}/v1",
                                       "--no-sweep", "--no-null"], monkeypatch)
    assert f"--compare's server http://127.0.0.1:{port}: POST /v1/embeddings failed" in err


def test_a_missing_default_corpus_is_named_with_corpus_before_anything_starts(
        capsys, monkeypatch, nothing_starts, tmp_path):
    import dtype_parity
    import packed_ab

    missing = tmp_path / "shared" / "bench" / "corpus.json"
    monkeypatch.setattr(benchkit, "CORPUS", missing)
    for module, argv in ((bench, ["--no-sweep"]), (ab, ["--a", "{}", "--b", "{}"]),
                         (burst, ["--a", "{}", "--b", "{}"]), (tail, []),
                         (dtype_parity, []), (packed_ab, [])):
        monkeypatch.setattr(module, "CORPUS", missing)
        err = refused(capsys, module.main, argv, monkeypatch)
        assert f"argument --corpus: {missing}: not a readable JSON file" in err, module
        assert "give another with --corpus PATH" in err


def test_what_would_fail_later_is_refused_before_anything_starts(capsys, monkeypatch,
                                                                   nothing_starts, tmp_path):
    """Each of these failed later, or said so in a traceback (an outside check): a corpus
    with an empty text (every request answered 400), burst's --json into no directory (after
    the whole run, its results lost), packed_ab on a device this torch has not."""
    import packed_ab

    corpus = tmp_path / "corpus.json"
    corpus.write_text('["a", "", "b", ""]')
    err = refused(capsys, bench.main, ["--corpus", str(corpus), "--no-sweep"], monkeypatch)
    assert "2 empty string(s), the first at index 1: the server refuses an empty text" in err
    err = refused(capsys, burst.main, ["--a", "{}", "--b", "{}", "--json",
                                       str(tmp_path / "none" / "x.json")], monkeypatch)
    assert f"--json {tmp_path / 'none' / 'x.json'}: no directory {tmp_path / 'none'}" in err
    err = refused(capsys, packed_ab.main, ["--device", "nosuch"], monkeypatch)
    assert "packed_ab.py: error: --device nosuch: " in err, err


@pytest.mark.parametrize("wanted, needed", [("abc", "expected LO-HI"), ("9-1", "expected LO-HI"),
                                            ("one", "expected LO-HI"), ("PORT", "2 server(s)")])
def test_shmserve_ports_malformed_or_too_small_is_refused_before_side_a(
        capsys, monkeypatch, nothing_starts, wanted, needed):
    port = unused_port()
    monkeypatch.setenv("SHMSERVE_PORTS", f"{port}-{port}" if wanted == "PORT" else wanted)
    for module in (ab, burst):
        err = refused(capsys, module.main, ["--a", "{}", "--b", "{}"], monkeypatch)
        assert "error: SHMSERVE_PORTS=" in err and needed in err
    # bench: its own stack, the baseline, the null model's stack
    err = refused(capsys, bench.main, ["--compare", "baseline", "--no-sweep"], monkeypatch)
    assert needed.replace("2", "3") in err


def test_an_overlay_that_is_not_yaml_or_a_revision_that_is_not_one_is_refused(
        capsys, monkeypatch, nothing_starts):
    err = refused(capsys, ab.main, ["--a", "{workers: ", "--b", "{}"], monkeypatch)
    assert "argument" not in err and "error: --a: '{workers: ': not YAML:" in err
    err = refused(capsys, burst.main, ["--a", "{}", "--b", "[1]"], monkeypatch)
    assert "error: --b: '[1]': not a YAML mapping" in err
    for module in (ab, burst):
        err = refused(capsys, module.main, ["--a", "{}", "--b", "{}", "--a-rev", "nosuchrev"],
                      monkeypatch)
        assert "argument --a-rev: 'nosuchrev': not a git revision" in err
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "batcher_bench.py"),
                           "--against", "nosuch"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --against: 'nosuch': not a git revision" in done.stderr


def test_an_overlays_mistake_names_its_side_and_the_overlay_as_given(capsys, monkeypatch,
                                                                      nothing_starts):
    for module in (ab, burst):
        err = refused(capsys, module.main, ["--a", "{}", "--b", "workers: {cpu_workerz: 1}"],
                      monkeypatch)
        assert "workers.cpu_workerz: unknown key" in err
        assert "(set in --b 'workers: {cpu_workerz: 1}')" in err
        assert "shmserve-bench" not in err  # not the temporary file's name


def test_a_closed_loop_window_shorter_than_the_users_spawn_is_refused(capsys, monkeypatch,
                                                                      nothing_starts):
    err = refused(capsys, bench.main, ["--window", "1", "--only", "short"], monkeypatch)
    assert "argument --window: '1': an integer >= 3" in err
    err = refused(capsys, ab.main, ["--a", "{}", "--b", "{}", "--window", "2"], monkeypatch)
    assert "argument --window: 2: a closed-loop window takes 3 s or more" in err
    # an open loop (--rate) has no users to spawn: taken, and the stacks start
    monkeypatch.setattr(sys, "argv", ["ab.py", "--a", "{}", "--b", "{}", "--window", "1",
                                      "--rate", "5"])
    with pytest.raises(Started):
        ab.main()


def test_a_config_bench_cannot_load_is_refused_with_status_2(capsys, monkeypatch,
                                                            nothing_starts, tmp_path):
    """As every wrong argument (it exited 1: an outside check)."""
    overlay = tmp_path / "typo.yaml"
    overlay.write_text("workers: {cpu_workerz: 1}\n")
    err = refused(capsys, bench.main, ["--config", str(overlay)], monkeypatch)
    assert "config: workers.cpu_workerz: unknown key" in err


def test_the_route_hint_is_not_given_for_a_model_not_served(server):
    server.answers[("POST", "/v1/embeddings")] = (404, {"error": {
        "message": "model nosuch is not served", "type": "not_found", "param": "model",
        "code": "model_not_found"}})
    with pytest.raises(SystemExit) as exc:
        benchkit.probe(server.url, "the served stack")
    assert "answered 404: " in str(exc.value) and "server's root" not in str(exc.value)
    server.answers.clear()  # a route 404
    with pytest.raises(SystemExit, match=r"404 \(the URL is the server's root: "):
        benchkit.probe(server.url, "the served stack")


def test_an_open_loop_window_answers_no_faster_than_it_sent(server, tmp_path):
    """Answered over the time to the last answer exceeded sent over the window (the last
    arrival falls before the window's end): both over the window now, where it is longer."""
    server.answers[("POST", "/v1/embeddings")] = (200, EMBEDDING)
    corpus = tmp_path / "corpus.json"
    corpus.write_text('["a text"]')
    window = benchkit.open_loop_window(server.url, 20.0, 1.0, corpus)
    assert window["failures"] == 0 and window["requests"] > 5
    assert window["requests_per_s"] <= window["sent_per_s"]
    assert window["window_s"] == 1.0 and window["measured_s"] >= 1.0


def _sigint_left_default(pid: int) -> bool:
    """Whether process `pid` has numpy loaded and does not catch SIGINT (Python's own handler,
    installed at start, caught it until benchkit reset it)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
        caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return "numpy" in maps and not int(caught.split()[1], 16) & (1 << (signal.SIGINT - 1))


def test_a_ceiling_child_ends_quietly_on_ctrl_c(tmp_path):
    corpus = tmp_path / "corpus.json"
    corpus.write_text('["a text"]')
    # SIGINT as a shell leaves it: pytest-xdist's workers ignore it, and a child inherits that
    # (it then exits 0 when its stdin closes, which failed this test in CI only)
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "benchkit.py"),
                             "ceiling-child", "0", str(corpus)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # past its start (numpy loaded) and its SIGINT back to the default action, not caught
        # (two seconds' sleep was not always enough on a loaded machine: a traceback)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _sigint_left_default(proc.pid):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == -signal.SIGINT


def test_a_stage_ended_by_a_one_line_error_is_recorded_and_the_report_written():
    """Such as the null model's stack finding no free port left in SHMSERVE_PORTS (one line
    now, where a RuntimeError was recorded as the stage's error)."""
    summary = {}
    with benchreport.stage(summary, "null pipeline"):
        raise SystemExit("bench.py: SHMSERVE_PORTS=1-2: no free port in the range")
    assert summary["errors"] == {"null pipeline": "SystemExit: bench.py: SHMSERVE_PORTS=1-2: "
                                                  "no free port in the range"}


def test_tls_cost_refuses_a_count_below_one_before_starting_anything():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "tls_cost.py"), "--rounds",
                           "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "'0': an integer >= 1" in done.stderr, done.stderr


def test_grpc_cost_refuses_fewer_calls_than_clients_before_starting_anything():
    """--calls 5 with 8 clients made no call at all: a ZeroDivisionError once the stack was
    up (an outside check)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "grpc_cost.py"), "--calls",
                           "5"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least --clients (8)" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "grpc_cost.py"), "--rev",
                           "nosuchrev"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "argument --rev: 'nosuchrev': not a git revision" in \
        done.stderr, done.stderr


@pytest.mark.parametrize("env, said", [
    ({"SHMSERVE_BENCH_API": "msgpak"}, "SHMSERVE_BENCH_API='msgpak': one of openai, msgpack, grpc"),
    ({"SHMSERVE_BENCH_TEXTS": "abc"}, "SHMSERVE_BENCH_TEXTS='abc': a count of texts per request"),
    ({"SHMSERVE_BENCH_TEXTS": "0"}, "SHMSERVE_BENCH_TEXTS='0': a count of texts per request"),
    ({"SHMSERVE_BENCH_TEXTS": "\u00b2"}, "SHMSERVE_BENCH_TEXTS='\u00b2': a count of texts")])
def test_the_locustfile_refuses_a_wrong_setting_in_one_line(env, said):
    """A typo in the API ran the openai profile without a word; one in the texts raised a
    traceback (an outside check)."""
    import os

    done = subprocess.run([sys.executable, "-c", "import locustfile"], cwd=REPO / "scripts",
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(said), \
        done.stderr
    assert "Traceback" not in done.stderr


def test_a_ceiling_child_runs_on_its_workers_cores(tmp_path):
    """Each of the ceiling's processes on the cores its worker is pinned to (workers.
    cpu_affinity auto), the layout the served workers run in: unpinned, a loaded machine's
    served / in-process read above 1 (an outside check)."""
    import os

    from shmserve import config, cores

    cfg = config.load(env="dev")
    corpus = tmp_path / "corpus.json"
    corpus.write_text('["a text"]')
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "benchkit.py"),
                             "ceiling-child", "1", str(corpus)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "SHMSERVE_ENV": "dev"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        pinned = os.sched_getaffinity(proc.pid)
    finally:
        proc.communicate(timeout=30)  # its stdin closed: it exits
    mine = cores.worker_cores(1, cfg.workers.cpu_workers, cfg.workers.torch_threads)
    assert pinned == (set(mine) if mine else os.sched_getaffinity(0)), (pinned, mine)
