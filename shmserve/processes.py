"""The deployment's processes as supervisord sees them, and the memory each one holds.

Read over supervisord's XML-RPC unix socket, so any process of the deployment (the CLI, a
frontend answering a scrape) can ask without being supervisord's parent or child.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import xmlrpc.client
from pathlib import Path

import psutil

from shmserve import config, supervisor_files, topology
from shmserve.config import Config


def supervisor(cfg: Config) -> xmlrpc.client.ServerProxy:
    """supervisord's XML-RPC over its unix socket (a context manager that closes it): its
    `supervisor` namespace, and `shmserve` (shmserve.supervisor_rpc)."""
    from supervisor.xmlrpc import SupervisorTransport

    password = supervisor_files.password(cfg)
    transport = SupervisorTransport(supervisor_files.USER if password else None, password,
                                    f"unix://{supervisor_files.socket(cfg)}")
    return xmlrpc.client.ServerProxy("http://localhost", transport)


def info(cfg: Config) -> list[dict]:
    """supervisord's view of every process, over its XML-RPC socket ([] when unreachable)."""
    try:
        with supervisor(cfg) as proxy:
            return proxy.supervisor.getAllProcessInfo()
    except (OSError, xmlrpc.client.Error):
        return []


STARTS = 3  # a program's starts, or a model's loads, that failed before a wait gives up


class StartWatch:
    """The pids each program had while a command waits for it to be ready. A program that
    exits after supervisord counted it started (startsecs: 1 s, less than a worker's import and
    model load) is restarted for ever and never goes FATAL; a third pid means it exited twice
    on its way up, and waiting longer only repeats that."""

    def __init__(self, starts: int = STARTS) -> None:
        self.starts = starts
        self.pids: dict[str, list[int]] = {}

    def see(self, infos: list[dict]) -> str | None:
        """Note each running program's pid; the first program seen with `starts` pids, if any."""
        for proc in infos:
            pids = self.pids.setdefault(proc["name"], [])
            if proc.get("pid") and proc["pid"] not in pids:
                pids.append(proc["pid"])
        return next((name for name, pids in sorted(self.pids.items())
                     if len(pids) >= self.starts), None)


def resident(cfg: Config, infos: list[dict] | None = None) -> dict[str, int]:
    """Resident bytes per program (its process and their children: nginx's workers count as
    nginx), plus supervisord's own; programs that are not running are left out."""
    infos = info(cfg) if infos is None else infos
    out: dict[str, int] = {}
    try:
        supervisord = int(supervisor_files.supervisord_pidfile(cfg).read_text().strip())
        out["supervisord"] = psutil.Process(supervisord).memory_info().rss
    except (OSError, ValueError, psutil.Error):
        pass
    for proc in infos:
        if proc.get("pid"):
            rss = tree_rss(proc["pid"])
            if rss is not None:
                out[proc["name"]] = rss
    return out


# supervisord's process info gives whole seconds: 2 means at least 1 s since a spawn
SPAWN_SETTLE_S = 2


def settle_spawns(cfg: Config, limit_s: float = 3.0) -> None:
    """Wait (up to `limit_s`) until every program was spawned a moment ago at least. A stop
    signal supervisord sends a child that has not exec'd yet runs supervisord's own handler in
    the child and is lost: a `down` right after an `up` waited out nginx's stopwaitsecs before
    its SIGKILL (17 s against 2; an outside check)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        infos = info(cfg)
        if all(i.get("start") and i["now"] - i["start"] >= SPAWN_SETTLE_S for i in infos):
            return  # (none: unreachable, nothing to wait for)
        time.sleep(0.1)


def shutting_down(cfg: Config) -> bool:
    """Whether this deployment's supervisord is stopping its programs (a `down` under way)."""
    try:
        with supervisor(cfg) as proxy:
            return proxy.supervisor.getState()["statename"] == "SHUTDOWN"
    except xmlrpc.client.Fault as exc:
        return exc.faultCode == 6  # SHUTDOWN_STATE, from calls other than getState
    except (OSError, xmlrpc.client.Error, KeyError, TypeError):
        return False


def stopping(cfg: Config, within_s: float = 5.0) -> bool:
    """Whether this deployment's supervisord is gone, or goes within `within_s` (a `down`
    under way: its RPC answers SHUTDOWN_STATE while it stops its programs)."""
    deadline = time.monotonic() + within_s
    while supervisord_pid(cfg) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def open_files(cfg: Config, infos: list[dict] | None = None) -> dict[str, tuple[int, int]]:
    """Per program, (open file descriptors, their soft limit) of its process or child
    (nginx's workers) nearest its limit; programs not running or without a limit are left
    out. A process at its limit fails quietly: a frontend closes the connections it cannot
    take (nginx tries another, then answers 502), nginx answers bare 500s, and nothing said
    so (an outside check)."""
    out: dict[str, tuple[int, int]] = {}
    for proc in info(cfg) if infos is None else infos:
        try:
            root = psutil.Process(proc["pid"]) if proc.get("pid") else None
            tree = [root, *root.children(recursive=True)] if root else []
        except psutil.Error:
            continue
        for member in tree:
            try:
                used, limit = member.num_fds(), member.rlimit(psutil.RLIMIT_NOFILE)[0]
            except psutil.Error:
                continue  # exited meanwhile
            worst = out.get(proc["name"])
            if limit > 0 and (worst is None or used / limit > worst[0] / worst[1]):
                out[proc["name"]] = (used, limit)
    return out


def tree_rss(pid: int) -> int | None:
    """Resident bytes of a process and all its descendants; None when it is gone."""
    try:
        root = psutil.Process(pid)
        total = root.memory_info().rss
        children = root.children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue  # exited meanwhile
    return total


def orphans(cfg: Config, proc: Path = Path("/proc")) -> list[int]:
    """Processes of this deployment that outlived their supervisord (it was SIGKILLed): every
    program supervisord starts carries SHMSERVE_RUN_DIR=<run_dir> in its environment. (nginx
    writes its title over its environment; shmserve.nginxrun finds nginx by its config.)"""
    marker = f"SHMSERVE_RUN_DIR={cfg.run_dir}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def kill_orphans(cfg: Config, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL this deployment's orphans; return once they are gone (zombies count as gone)."""
    pids = orphans(cfg)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids


def supervisord_pid(cfg: Config) -> int | None:
    """The pid of this deployment's running supervisord: the one its pid file names, if that
    process was started with this run directory's supervisord.conf, else one found so. A pid
    file naming another deployment's supervisord (a killed one's pid taken since) made `up`
    refuse, `down` wait on the other one and `status` show nothing; one deleted (a tmp
    cleaner) or naming another while this one runs made `up` and `down` kill the programs of
    a supervisord they took for dead, which started them again, and `down` removed its control
    socket (outside checks)."""
    conf = supervisor_files.supervisord_conf(cfg)
    try:
        named = int(supervisor_files.supervisord_pidfile(cfg).read_text().strip())
    except PermissionError:
        raise  # another user's run directory: said so (cli.main), not "not running"
    except (OSError, ValueError):
        named = None
    if named is not None and _started_with(named, conf):
        return named
    return next((p.pid for p in psutil.process_iter() if p.pid != named
                 and _started_with(p.pid, conf)), None)


def _started_with(pid: int, conf: Path) -> bool:
    """Whether `pid` is a live supervisord started with `conf` (`-c`, as `up` starts it)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if not any(b"supervisord" in arg for arg in args[:2]) or b"-c" not in args[:-1]:
            return False
        given = args[args.index(b"-c") + 1].decode(errors="replace")
        return alive(pid) and os.path.samefile(Path(f"/proc/{pid}/cwd") / given, conf)
    except OSError:
        return False


def running_config(cfg: Config) -> Config:
    """The config the deployment in `cfg`'s run directory was started with, while it runs;
    else `cfg`. The processes run what ``shmserve up`` rendered (its port, counts, tokens), so a
    later command (status, restart, reload) must not re-read an environment that may have
    changed since: ``SHMSERVE__SERVER__PORT=9000 shmserve up`` then plain ``shmserve status``
    still finds port 9000."""
    return cfg if supervisord_pid(cfg) is None else as_started(cfg, say_why=True)


def as_started(cfg: Config, say_why: bool = False) -> Config:
    """The config `up` wrote into `cfg`'s run directory (what its processes run, supervised or
    left by a killed supervisord), else `cfg`; `say_why`: a warning where it does not load."""
    path = topology.resolved_config_path(cfg)
    if not path.is_file():
        return cfg
    try:
        return config.load_resolved(path)  # without the key file: no command here needs it
    except (OSError, ValueError, config.ConfigError) as exc:
        # written by another version, say: the caller's own reading is the best left, said so
        if say_why:
            print(f"shmserve: warning: the running deployment's config ({path}) does not load "
                  f"({exc}); using the config named now", file=sys.stderr, flush=True)
        return cfg


def deployment(args) -> Config:
    """The deployment a command line names (`--env`, `--config`), as it was started if it runs:
    what status, restart, ctl, down and the admin commands act on. When the config named now
    does not load (a variable set wrong since `up`, its --config file deleted), the deployment
    in the run directory it names is still found, as started: `down` stopped nothing then."""
    try:
        return running_config(config.from_args(args))
    except config.ConfigError as exc:
        started = _as_started(args)
        if started is None:
            raise
        print(f"shmserve: warning: the config named now does not load ({exc}); acting on the "
              f"deployment in {started.run_dir} as `up` started it", file=sys.stderr, flush=True)
        args.unloadable = True  # said once: restart's drift check says no more of it
        return started


def _as_started(args) -> Config | None:
    """The config `up` wrote into the run directory the command line names, read as far as
    the layers allow (server.run_dir), or None."""
    from shmserve import layers

    run_dir = os.environ.get(f"{layers.ENV_PREFIX}SERVER__RUN_DIR")
    try:
        run_dir = layers.merged(args.env, args.config)["server"]["run_dir"]
    except (config.ConfigError, KeyError, TypeError):
        # the variable, else the last --config file that names one (an env misspelled since
        # `up` hid the files after it: an outside check), else base.yaml's default
        run_dir = run_dir or _run_dir_of(args.config)
    path = Path(run_dir or config.ServerConfig().run_dir)
    path = (path if path.is_absolute() else config.REPO_ROOT / path) / "config.json"
    try:  # without the key file (load_resolved's way), which the command line's config may
        # have failed on: an emptied auth.api_keys_file made even `down` refuse (an outside check)
        return config.load_resolved(path)
    except (OSError, ValueError, config.ConfigError):
        return None


def _run_dir_of(extra) -> str | None:
    """server.run_dir as the --config files (or SHMSERVE_CONFIG's) set it, the last that does;
    None where none does or none reads."""
    from shmserve import layers

    found = None
    try:
        paths = layers.extra_files(extra, os.environ)
    except config.ConfigError:
        return None
    for path in paths:
        try:
            found = layers.read_yaml(path).get("server", {}).get("run_dir") or found
        except (config.ConfigError, AttributeError):
            continue
    return found


def alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped by its parent) is dead."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, OSError):  # OSError: this process out of descriptors (EMFILE),
        return True  # which psutil lets through: cannot tell, so the safe side (slots held)


def not_running(cfg: Config) -> str:
    """What the CLI says when no deployment runs in `cfg`'s run directory: one started with
    another run_dir is reached only by naming it again."""
    return (f"not running (run_dir {cfg.run_dir}; a deployment started with another "
            "server.run_dir is reached with the same --config or SHMSERVE__SERVER__RUN_DIR)")
