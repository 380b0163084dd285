"""The stacks and servers the benchmark scripts start, and their care: each is stopped
whatever ends the script (an error, Ctrl-C, SIGTERM), a server that dies is not waited for,
and what would stop a run (a missing module of the bench extra, SHMSERVE_PORTS, an overlay's
mistake, a revision that is not one) is named before anything starts."""

from __future__ import annotations

import argparse
import contextlib
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

from tests.stack import (bindable, free_port, port_range,  # noqa: E402  (the harness's)
                         raise_open_files)

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
    raise_open_files()  # a burst's or a window's clients hold a socket each
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted; its stacks are stopped", file=sys.stderr)
        sys.exit(130)


def require(*modules: str) -> None:
    """Exit at once, before a stack starts or a window runs, when a module the run needs is
    missing (the bench extra is not in the base install; a missing one used to show only
    when its step came, minutes in)."""
    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except ModuleNotFoundError:  # a dotted name whose parent is missing (tritonclient.grpc
            return True  # raised it: a traceback where grpc_cost meant to say which)

    missing = [m for m in modules if absent(m)]
    if missing:
        raise SystemExit(f"missing Python module{'s' * (len(missing) > 1)} "
                         f"{', '.join(missing)}: install the bench extra, "
                         f".venv/bin/pip install -c constraints.txt -e '.[bench]'")


def refuse(message: str):
    """Exit 2 with one line, as argparse does for a wrong argument (no usage: the mistake is in
    the environment or in what an argument names)."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_ports(needed: int) -> None:
    """Refuse a malformed SHMSERVE_PORTS, or a range without `needed` free ports (one a server
    the run starts): found by tests.stack.free_port once side A was up, as a traceback (an
    outside check)."""
    if needed < 1:
        return
    try:
        ports = port_range()
    except ValueError as exc:
        refuse(str(exc))
    if ports is None:
        return
    free = 0
    for port in ports:
        free += bindable(port)
        if free == needed:
            return
    refuse(f"SHMSERVE_PORTS={os.environ['SHMSERVE_PORTS']}: {free} free port(s) in the range, "
           f"and this run starts {needed} server(s), each on a port of its own")


def revision(text: str) -> str:
    """An argparse type: a git revision of this repository (a CalledProcessError once a stack
    was up, or a worktree made: an outside check)."""
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                           f"{text}^{{commit}}"], capture_output=True, text=True)
    if done.returncode != 0 or text.startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: not a git revision of {REPO}")
    return text


def stack_environ(env: str | None) -> dict[str, str]:
    """The environment a stack's CLI runs in: not the caller's own deployment's settings
    (environment overrides win over the config file, and SHMSERVE__SERVER__PORT exported for the
    stack being measured made this one try that port, and fail after a minute of work)."""
    out = {k: v for k, v in os.environ.items()
           if k != "SHMSERVE_CONFIG" and not k.startswith("SHMSERVE__SERVER__")}
    out["SHMSERVE_ENV"] = env or os.environ.get("SHMSERVE_ENV", "dev")
    return out


def config_problem(env: str | None, overrides: dict, label: str) -> str | None:
    """What this checkout's config loader finds wrong in a stack's config (`overrides` over the
    env), named by `label` (say --a 'YAML'), before any stack starts; None: nothing. Found by
    `shmserve up`, it named the stack's temporary file, deleted by then, and not which overlay
    it was (an outside check)."""
    from shmserve import config as config_mod
    from shmserve.layers import deep_merge

    with tempfile.TemporaryDirectory(prefix="shmserve-bench-check-") as tmp:
        path = Path(tmp) / "bench.yaml"  # the run directory as OwnStack's, a fresh one
        path.write_text(yaml.safe_dump(deep_merge(overrides,
                                                  {"server": {"run_dir": f"{tmp}/run"}})))
        try:
            config_mod.load(env=env, extra=path, environ=stack_environ(env))
        except config_mod.ConfigError as exc:
            message = str(exc)
            return message.replace(str(path), label) if str(path) in message else \
                f"{label}: {message}"
    return None


def _port() -> int:
    """tests.stack.free_port, its errors one line (a range used up since check_ports)."""
    try:
        return free_port()
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {exc}") from None


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
                 repo: Path = REPO, keep_logs: Path | None = None, label: str = "") -> None:
        from shmserve.layers import deep_merge

        self.repo = repo  # the checkout whose code runs (scripts/ab.py's --a-rev: a worktree)
        self.keep_logs = keep_logs  # where its logs go once it is down (a failed start's too)
        self.label = label  # which stack, in a failed start's line (say "side A, --a '{}'")

        self.tmp = tempfile.TemporaryDirectory(prefix="shmserve-bench-")
        self.port = _port()
        tree = yaml.safe_load(Path(extra).read_text()) or {} if extra else {}
        # The overrides go over the file; this stack's own port and run directory over both
        # (a `server:` overlay, say drain_timeout_s, must not drop them).
        tree = deep_merge(deep_merge(tree, overrides),
                          {"server": {"port": self.port, "run_dir": f"{self.tmp.name}/run"}})
        self.config = Path(self.tmp.name) / "bench.yaml"
        self.config.write_text(yaml.safe_dump(tree))
        self.env = stack_environ(env)
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
                which = f" ({self.label})" if self.label else ""
                raise SystemExit(f"{Path(sys.argv[0]).name}: a stack{which} did not start "
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
        self.port = _port()
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


@contextlib.contextmanager
def checkout(rev: str | None):
    """The repository root to run a side from: this one, or a worktree of `rev`."""
    if rev is None:
        yield REPO
        return
    with tempfile.TemporaryDirectory(prefix="shmserve-ab-") as tmp:
        tree = Path(tmp) / "tree"
        made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach",
                               str(tree), rev], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if made.returncode != 0:
            raise SystemExit(f"{Path(sys.argv[0]).name}: no worktree of {rev}: "
                             f"{made.stderr.strip()}")
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           check=False)
