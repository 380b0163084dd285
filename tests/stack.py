"""Boot and tear down the real stack (supervisord, nginx, frontends, workers) for a test.

Each stack gets its own run directory under the test's temporary directory and an ephemeral
port on 127.0.0.1, and is driven through the real CLI, exactly as a user would.
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from shmserve.layers import deep_merge

REPO = Path(__file__).resolve().parent.parent


def raise_open_files() -> int:
    """This process's soft limit of open files raised to its hard one, and returned: a login
    session's soft limit (1,024 on Debian) failed the suite's flood test and everything after
    it in its xdist worker, and scripts/burst.py counted the sockets it could not open as
    requests the server never answered (an outside check as an ordinary user)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20  # the kernel's usual nr_open
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


def corpus_path() -> Path:
    """../shared/bench/corpus.json beside the checkout (in a git worktree: beside the main
    checkout, which `git rev-parse --git-common-dir` names)."""
    beside = REPO.parent / "shared" / "bench" / "corpus.json"
    if beside.exists():
        return beside
    common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                            cwd=REPO, capture_output=True, text=True).stdout.strip()
    return Path(common).parent.parent / "shared" / "bench" / "corpus.json" if common else beside


def port_range() -> list[int] | None:
    """The ports SHMSERVE_PORTS=LO-HI names, None without it; ValueError: not LO-HI (the
    benchmark scripts check it before any stack starts, scripts/benchstacks.check_ports)."""
    wanted = os.environ.get("SHMSERVE_PORTS")
    if not wanted:
        return None
    low, _, high = wanted.partition("-")
    if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) < 65536):
        raise ValueError(f"SHMSERVE_PORTS={wanted!r}: expected LO-HI, e.g. 18200-18299")
    return list(range(int(low), int(high) + 1))


def bindable(port: int) -> bool:
    """Whether nothing holds `port` on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port on 127.0.0.1: the kernel's choice, or with SHMSERVE_PORTS=LO-HI the first
    free one in that range from a random point in it (a host where only some ports may be
    used; the benchmark scripts' stacks take theirs here too)."""
    ports = port_range()
    if ports is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        if bindable(port) and _claim(port):
            return port
    raise RuntimeError(f"SHMSERVE_PORTS={os.environ['SHMSERVE_PORTS']}: no free port in the "
                       "range")


CLAIMS = Path("/tmp/shmserve-test-ports")  # one file a port: when a process last took it
CLAIM_S = 60.0


def _claim(port: int) -> bool:
    """Whether no process (the suite's two, a bench beside it) took `port` in the last CLAIM_S
    seconds; if none did, it is this one's now. A port free when asked is bound by the stack's
    nginx seconds later, and two processes in a range of 50 took the same one (an outside
    check: nginx's bind failed with EADDRINUSE). The kernel's own choice needs none of this."""
    import fcntl

    try:
        CLAIMS.mkdir(mode=0o1777, exist_ok=True)  # sticky and shared: every user's suite
        f = open(CLAIMS / str(port), "a+")
    except OSError:  # another user's file: unclaimed, as before
        return True
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        try:
            taken = float(f.read() or 0)
        except ValueError:
            taken = 0.0
        if time.time() - taken < CLAIM_S:
            return False
        f.seek(0)
        f.truncate()
        f.write(str(time.time()))
    return True


class Stack:
    def __init__(self, root: Path, overrides: dict[str, Any]) -> None:
        self.root = root
        self.run_dir = root / "run"
        self.port = free_port()
        tree = {"server": {"run_dir": str(self.run_dir), "port": self.port, "host": "127.0.0.1",
                           "drain_timeout_s": 5}}
        tree = deep_merge(tree, overrides)
        root.mkdir(parents=True, exist_ok=True)
        self.config_file = root / "stack.yaml"
        self.config_file.write_text(yaml.safe_dump(tree))
        self.env = {**os.environ, "SHMSERVE_ENV": "test", "HF_HUB_OFFLINE": "1"}
        self.env.pop("SHMSERVE_CONFIG", None)
        self.url = f"http://127.0.0.1:{self.port}"
        self._deployed = None  # Stack.deployed
        self._env_at_start = dict(self.env)
        self._logs_from: dict[str, int] = {}  # Stack.begin_test

    def cli(self, *args: str, timeout: float = 180, check: bool = True):
        proc = subprocess.run([sys.executable, "-m", "shmserve.cli", *args, "--config",
                               str(self.config_file)], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"shmserve {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}\n{self.all_logs()}")
        return proc

    def up(self) -> "Stack":
        try:
            self.cli("up", "--wait", "--timeout", "150")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        self.cli("down", check=False, timeout=120)

    def ctl(self, *args: str) -> str:
        return self.cli("ctl", *args, check=False).stdout

    def pid(self, program: str) -> int:
        """A program's pid as supervisord reports it (0 when it is not running), asked over
        its XML-RPC socket from this process, as `shmserve ctl pid` asks it: that command is
        two Python processes (the CLI, supervisorctl), ~0.6 s of CPU a call, which the suite
        made a few hundred times (`ctl` itself is tested through the CLI)."""
        return int(self.info(program).get("pid", 0))

    def info(self, program: str) -> dict:
        """supervisord's getProcessInfo of `program` (group:name): pid, statename, ...; {}
        where supervisord does not answer or has no such program."""
        import xmlrpc.client

        from shmserve import processes

        try:
            with processes.supervisor(self.deployed()) as proxy:
                return proxy.supervisor.getProcessInfo(program)
        except (OSError, ValueError, xmlrpc.client.Error):  # ConfigError: no deployment yet
            return {}

    def processes(self) -> list[dict]:
        """supervisord's view of every process (its getAllProcessInfo: name, group,
        statename, pid, ...), over its socket from this process (`pid`)."""
        from shmserve import processes

        return processes.info(self.deployed())

    def deployed(self):
        """The config the deployment runs with (its run directory's config.json). Read once:
        supervisord's socket and password, which `pid` and `info` ask it for, stay with the
        run directory (3.5 ms a read, in loops polling every 50 ms)."""
        from shmserve.config import load_resolved

        if self._deployed is None:
            self._deployed = load_resolved(self.run_dir / "config.json")
        return self._deployed

    def begin_test(self) -> None:
        """For a stack that several tests share (a module's: each stack's start and stop cost
        ~12 s of CPU): from here on `log` and `log_lines` read what was written since, so a
        test sees its own lines only, and the CLI gets the environment of the stack's start
        (a test may have set a variable in it)."""
        self.env = dict(self._env_at_start)
        self._logs_from = {path.stem: path.stat().st_size
                           for path in (self.run_dir / "logs").glob("*.log")}

    def log(self, program: str, whole: bool = False) -> str:
        """A program's log: since `begin_test`, or `whole`."""
        path = self.run_dir / "logs" / f"{program}.log"
        try:
            with open(path, "rb") as file:
                if (start := 0 if whole else self._logs_from.get(program, 0)) <= \
                        os.fstat(file.fileno()).st_size:  # (else rotated: all of it)
                    file.seek(start)
                return file.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_lines(self, program: str, whole: bool = False) -> list[dict]:
        """A program's JSON log lines (`log`), parsed (lines that are not JSON objects are
        skipped: nginx's own, or the last one, half written)."""
        lines = []
        for line in self.log(program, whole).splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return [line for line in lines if isinstance(line, dict)]

    def logged(self, programs: tuple[str, ...], message: str, count: int,
               timeout: float = 10) -> list[dict]:
        """The lines saying `message` in `programs`' logs, in that order, once there are
        `count`: a process writes its lines out every logging.flush_interval_ms and supervisord
        copies them a moment later, so a line logged just before an answer may not be in the
        file yet (a reload's last worker staged ~0.1 s before the call was answered; CI read
        its log before the line came)."""
        found: list[dict] = []

        def enough() -> bool:
            found[:] = [line for program in programs for line in self.log_lines(program)
                        if line.get("message") == message]
            return len(found) >= count
        self.wait_until(enough, timeout, f"{count} {message} lines in {', '.join(programs)}")
        return found

    def all_logs(self, tail: int = 40) -> str:
        out = []
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        return self.request("GET", path, None, headers)

    def post_json(self, path: str, body: Any, headers: dict[str, str] | None = None):
        status, hdrs, raw = self.request("POST", path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json", **(headers or {})})
        return status, hdrs, json.loads(raw) if raw else None

    def request(self, method: str, path: str, data: bytes | None,
                headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def all_ready(self) -> bool:
        """GET /ready from each frontend's own socket answers 200 with every worker ready
        (its status may be "degraded" still: a model served apart from the run state, as a
        reload's recovery tests make). Not through nginx, which asks one: a
        frontend restarted a moment ago may not serve yet (supervisord counts it RUNNING after
        1 s; under CI's load it made its arena and listened 2-3 s after its start, and a chaos
        test that deleted the other one's arena then had both away: 502s), and with heartbeats
        2 s apart one frontend may hear a restarted worker well before the other."""
        from shmserve import probes, topology

        cfg = self.deployed()
        for index in range(cfg.frontends.count):
            code, answer = probes.ready_answer(str(topology.frontend_socket(cfg, index)))
            if code != 200 or not all(w["ready"] for w in answer["workers"]):
                return False
        return True

    @staticmethod
    def settled(read, ready, timeout: float = 10.0):
        """`read()` once `ready` holds of what it returns (after `timeout` s, as it is then): a
        frontend writes its metrics as its event loop's turn ends, a moment after its answer,
        so a scrape right after an answer (by the other frontend, say) may precede it (CI saw
        counts one short)."""
        deadline = time.monotonic() + timeout
        while not ready(value := read()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return value

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                                     f"{self.all_logs()}")
            time.sleep(0.05)

