"""The benchmark scripts' own care of what they start (scripts/benchstacks.py): a stack whose start
fails or is interrupted is stopped, a server that dies is not waited for, a missing module is
named before anything runs, and SIGTERM stops a script as Ctrl-C does."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.stack import REPO

sys.path.insert(0, str(REPO / "scripts"))

import benchstacks  # noqa: E402


def test_a_stack_whose_start_fails_is_stopped_and_its_directory_removed(monkeypatch):
    calls = []

    def cli(self, *args, quiet=False):
        calls.append(args)
        if args[0] == "up":
            raise subprocess.CalledProcessError(1, ["shmserve", *args])
    monkeypatch.setattr(benchstacks.OwnStack, "cli", cli)
    stack = benchstacks.OwnStack(None, None, {})
    tmp = Path(stack.tmp.name)
    # one line after `shmserve up`'s own message, not a CalledProcessError's traceback (an
    # outside check)
    with pytest.raises(SystemExit, match=r"a stack did not start \(`shmserve up` exited 1"):
        with stack:
            pass
    assert calls == [("up", "--wait"), ("down",)]
    assert not tmp.exists()


def test_a_stacks_logs_are_kept_when_asked_whether_it_started_or_not(monkeypatch, tmp_path):
    """scripts/gpu_check.py keeps every stack's logs: on a lent GPU, a failed start's are the
    only account of why (its copy used to run after the run directory was removed)."""
    def cli(self, *args, quiet=False):
        logs = Path(self.tmp.name) / "run" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "worker-0.log").write_text(f"worker log, at {args[0]}\n")
        if args[0] == "up" and fail:
            raise subprocess.CalledProcessError(1, ["shmserve", *args])
    monkeypatch.setattr(benchstacks.OwnStack, "cli", cli)
    for fail in (True, False):
        keep = tmp_path / f"failed-{fail}"
        stack = benchstacks.OwnStack(None, None, {}, keep_logs=keep)
        try:
            with stack:
                pass
        except SystemExit:
            assert fail
        assert (keep / "worker-0.log").read_text() == "worker log, at down\n"
        assert not Path(stack.tmp.name).exists()


def test_an_interrupted_start_is_stopped_too_and_a_failing_down_does_not_hide_it(monkeypatch):
    calls = []

    def cli(self, *args, quiet=False):
        calls.append(args)
        if args[0] == "up":
            raise KeyboardInterrupt
        raise subprocess.CalledProcessError(1, ["shmserve", *args])  # nothing was up
    monkeypatch.setattr(benchstacks.OwnStack, "cli", cli)
    stack = benchstacks.OwnStack(None, None, {})
    with pytest.raises(KeyboardInterrupt):
        stack.__enter__()
    assert calls == [("up", "--wait"), ("down",)]
    assert not Path(stack.tmp.name).exists()


def test_a_server_that_exits_is_not_waited_for():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    started = time.monotonic()
    with pytest.raises(SystemExit, match="exited with status 3 before http://127.0.0.1:9/"):
        benchstacks.wait_http("http://127.0.0.1:9/health", 60, proc)
    assert time.monotonic() - started < 10  # not the 60 s


def test_a_missing_module_is_named_with_the_install_command():
    benchstacks.require("json", "numpy")  # present: nothing
    with pytest.raises(SystemExit) as exc:
        benchstacks.require("json", "no_such_module_xyz", "another_missing_one")
    message = str(exc.value)
    assert "no_such_module_xyz, another_missing_one" in message
    assert "pip install -c constraints.txt -e '.[bench]'" in message


def test_a_missing_package_of_a_dotted_module_is_named_not_raised():
    """grpc_cost's tritonclient.grpc without tritonclient: find_spec raised
    ModuleNotFoundError, a traceback (an outside check)."""
    with pytest.raises(SystemExit) as exc:
        benchstacks.require("json", "no_such_package_xyz.grpc")
    assert "missing Python module no_such_package_xyz.grpc:" in str(exc.value)


def test_the_bench_extra_holds_what_the_bench_scripts_require():
    """tls_cost's trustme and grpc_cost's tritonclient were only in the test extra, while
    require() told a user to install the bench extra (an outside check)."""
    import tomllib

    extra = tomllib.loads((benchstacks.REPO / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["bench"]
    names = {req.split("[")[0].split("=")[0].strip() for req in extra}
    assert {"locust", "sentence-transformers", "matplotlib", "fastapi", "uvicorn", "trustme",
            "tritonclient"} <= names


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_unwind_like_ctrl_c(tmp_path, sig):
    """The context managers that stop a script's stacks run on `kill` and `timeout`."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO / "scripts")!r})
        sys.path.insert(0, {str(REPO)!r})
        import benchstacks

        def main():
            benchstacks.stop_on_term()
            try:
                print("ready", flush=True)
                time.sleep(60)
            finally:
                print("cleaned up", flush=True)

        benchstacks.run_main(main)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert "cleaned up" in out
    # One line, not a traceback that reads as a crash; 130 as a shell reports an interrupt.
    assert proc.returncode == 130
    assert err == "script.py: interrupted; its stacks are stopped\n"
