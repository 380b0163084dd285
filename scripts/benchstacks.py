"""The stacks and servers the benchmark scripts start, and their care: each is stopped
whatever ends the script (an error, Ctrl-C, SIGTERM), a server that dies is not waited for,
and a missing module of the bench extra is named before anything starts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.stack import free_port  # noqa: E402  (the test harness's, shared)

PYTHON = sys.executable


def stop_on_term() -> None:
    """SIGTERM (`timeout`'s signal, `kill`, a CI runner's cancel) and SIGHUP stop a script as
    Ctrl-C does, through the context managers that stop its stacks: supervisord runs as a
    daemon and would otherwise outlive the script, with its ports, processes and shared
    memory. (A script started with `&` from a non-interactive shell ignores SIGINT.)"""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)


def run_main(main) -> None:
    """Exit with main()'s status; an interrupt (Ctrl-C, or the signals stop_on_term routes
    there) exits 130 with one line once the context managers have stopped the stacks, not with
    a traceback that reads as a crash."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted; its stacks are stopped", file=sys.stderr)
        sys.exit(130)


def require(*modules: str) -> None:
    """Exit at once, before a stack starts or a window runs, when a module the run needs is
    missing (the bench extra is not in the base install; a missing one used to show only
    when its step came, minutes in)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"missing Python module{'s' * (len(missing) > 1)} "
                         f"{', '.join(missing)}: install the bench extra, "
                         f".venv/bin/pip install -c constraints.txt -e '.[bench]'")


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers 200; `proc`: the server's process, whose exit ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{' '.join(map(str, proc.args))} exited with status "
                             f"{proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready after {timeout:.0f} s")
        time.sleep(0.2)


class OwnStack:
    """A shmserve stack in a temporary run directory on a free port, driven by the CLI."""

    def __init__(self, env: str | None, extra: str | None, overrides: dict,
                 repo: Path = REPO, keep_logs: Path | None = None) -> None:
        from shmserve.layers import deep_merge

        self.repo = repo  # the checkout whose code runs (scripts/ab.py's --a-rev: a worktree)
        self.keep_logs = keep_logs  # where its logs go once it is down (a failed start's too)

        self.tmp = tempfile.TemporaryDirectory(prefix="shmserve-bench-")
        self.port = free_port()
        tree = yaml.safe_load(Path(extra).read_text()) or {} if extra else {}
        # The overrides go over the file; this stack's own port and run directory over both
        # (a `server:` overlay, say drain_timeout_s, must not drop them).
        tree = deep_merge(deep_merge(tree, overrides),
                          {"server": {"port": self.port, "run_dir": f"{self.tmp.name}/run"}})
        self.config = Path(self.tmp.name) / "bench.yaml"
        self.config.write_text(yaml.safe_dump(tree))
        # Not the caller's own deployment's settings: environment overrides win over the
        # config file, and SHMSERVE__SERVER__PORT exported for the stack being measured made
        # this one try that port (and fail after a minute of work).
        self.env = {k: v for k, v in os.environ.items()
                    if k != "SHMSERVE_CONFIG" and not k.startswith("SHMSERVE__SERVER__")}
        self.env["SHMSERVE_ENV"] = env or os.environ.get("SHMSERVE_ENV", "dev")
        self.url = f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, quiet: bool = False) -> None:
        """A `shmserve` command on this stack (its config); `quiet`: its stderr too unshown."""
        cmd = [PYTHON, "-m", "shmserve.cli", *args, "--config", str(self.config)]
        subprocess.run(cmd, cwd=self.repo, env=self.env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL if quiet else None)

    def __enter__(self) -> "OwnStack":
        try:
            self.cli("up", "--wait")
        except BaseException as exc:  # a failed or interrupted start: what it started goes too
            try:
                self.cli("down", quiet=True)  # the start's own error is the one to show
            except subprocess.CalledProcessError:
                pass
            finally:
                self._leave()
            if isinstance(exc, subprocess.CalledProcessError):
                # `shmserve up` said why on stderr already: one line more, not a traceback
                # (an overlay's mistake printed its message, then a CalledProcessError's
                # traceback: an outside check)
                raise SystemExit(f"{Path(sys.argv[0]).name}: a stack did not start "
                                 f"(`shmserve up` exited {exc.returncode}, above)") from None
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.cli("down")
        finally:
            self._leave()

    def _leave(self) -> None:
        """Keep the logs (`keep_logs`), then remove the run directory."""
        logs = Path(self.tmp.name) / "run" / "logs"
        try:
            if self.keep_logs is not None and logs.is_dir():
                shutil.copytree(logs, self.keep_logs, dirs_exist_ok=True)
        finally:
            self.tmp.cleanup()


class Baseline:
    """scripts/baseline_server.py on a free port."""

    def __init__(self, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads = threads

    def __enter__(self) -> "Baseline":
        self.proc = subprocess.Popen([PYTHON, str(REPO / "scripts" / "baseline_server.py"),
                                      "--port", str(self.port), "--threads", str(self.threads)],
                                     cwd=REPO)
        try:
            wait_http(self.url + "/health", 120, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)
