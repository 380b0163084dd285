"""Render a deployment's run directory from its validated config.

``render(cfg)`` writes, under ``cfg.run_dir`` (mode 0700)::

    config.json            the config every process loads (workers.devices resolved)
    supervisord.conf       from the template /supervisord.conf
    nginx/nginx.conf       from the template /nginx/nginx.conf, checked with ``nginx -t``
    nginx/errors/*         pre-encoded bodies (.json, .msgpack) of the errors nginx makes itself;
                           errors/v2/* in KServe v2's shape, for the /v2 routes
    sockets/ logs/ metrics/ nginx/temp/

Templates use lower-case ``@NAME@`` placeholders (``$`` and ``%`` belong to nginx and
supervisord); a supervisord section whose header holds ``@index@`` is written once per process
of its kind.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import math
import os
import pwd
import re
import resource
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import msgpack

from shmserve import grpc_nginx, nginx_options, supervisor_files, tls, topology
from shmserve.checks import MAX_CONNECTIONS
from shmserve.config import REPO_ROOT, Config
from shmserve.files import write_private

SUPERVISORD_TEMPLATE = REPO_ROOT / "supervisord.conf"
NGINX_TEMPLATE = REPO_ROOT / "nginx" / "nginx.conf"
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/usr/local/nginx/sbin")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the last one a NUL
_PLACEHOLDER = re.compile(r"@([a-z_]+)@")
_REPEATED = re.compile(r"^\[program:([a-z]+)-@index@\]")

class RenderError(RuntimeError):
    """The config cannot be rendered into a working deployment; the message names the key."""


def metrics_timeout_s(nginx) -> float:
    """How long nginx waits for a frontend's /metrics before it asks the next (`nginx`: the
    config's nginx section): a scrape collects every process's series, so twice a probe's."""
    return 2 * nginx.probe_timeout_s


# Paths of the rendered files, shared with the CLI (supervisord's: shmserve.supervisor_files).

def nginx_dir(cfg: Config) -> Path:
    return cfg.run_dir / "nginx"


def nginx_conf(cfg: Config) -> Path:
    return nginx_dir(cfg) / "nginx.conf"


def render(cfg: Config) -> None:
    cfg = resolved(cfg)
    _check_paths(cfg)
    if (connections := nginx_options.worker_connections(cfg)) > MAX_CONNECTIONS:
        raise RenderError(f"nginx would need {connections} worker_connections for "
                          f"frontends.count x frontends.max_inflight ({cfg.frontends.count} x "
                          f"{cfg.frontends.max_inflight}) requests in flight, over "
                          f"{MAX_CONNECTIONS}: lower frontends.max_inflight")
    binary = nginx_binary(cfg)
    try:
        tls.check(cfg)
    except tls.TlsError as exc:
        raise RenderError(str(exc)) from None
    _make_dirs(cfg)
    # nginx checks the new file before anything is replaced: a config it rejects leaves the
    # run directory as it was. It was written in place first, and a refused `apply` left it
    # there for the next nginx start, which crash-looped on it (an outside check).
    candidate = nginx_conf(cfg).with_name(".nginx.conf.candidate")
    write_private(candidate, render_nginx(cfg))
    try:
        check_nginx(cfg, binary, candidate)
    except RenderError:
        candidate.unlink(missing_ok=True)
        raise
    write_private(topology.resolved_config_path(cfg), cfg.to_json() + "\n")
    _write_error_pages(cfg)
    os.replace(candidate, nginx_conf(cfg))
    write_private(supervisor_files.supervisord_conf(cfg), render_supervisord(cfg, binary,
                                                     supervisor_files.make_password(cfg)))


def resolved(cfg: Config) -> Config:
    """The config with an absolute run_dir and the worker devices decided: "auto" becomes the
    GPUs found, or cpu (`workers.per_gpu` stays as configured: each GPU listed gets that many
    workers, topology.worker_devices)."""
    devices = cfg.workers.devices
    if devices == "auto":
        devices = topology.visible_gpus() or topology.CPU
    return dataclasses.replace(
        cfg, server=dataclasses.replace(cfg.server, run_dir=str(cfg.run_dir)),
        workers=dataclasses.replace(cfg.workers, devices=devices))


def nginx_binary(cfg: Config) -> str:
    name = cfg.nginx.binary
    found = shutil.which(name)
    if found is None and "/" not in name:
        found = next((str(Path(d) / name) for d in SBIN_DIRS
                      if os.access(Path(d) / name, os.X_OK)), None)
    if found is None:
        raise RenderError(f"nginx.binary: {name!r} is not on PATH nor in {', '.join(SBIN_DIRS)};"
                          " install nginx (scripts/install does) or set nginx.binary")
    return str(Path(found).resolve())


def render_nginx(cfg: Config) -> str:
    n = cfg.nginx
    host = f"[{cfg.server.host}]" if ":" in cfg.server.host else cfg.server.host
    servers = [f'        server "unix:{topology.frontend_socket(cfg, i)}" max_fails=0;'
               for i in range(cfg.frontends.count)]
    admin = ("            allow 127.0.0.1;\n            allow ::1;\n            deny all;"
             if n.admin_loopback_only else
             "            # nginx.admin_loopback_only is false: open to every client")
    binary = nginx_binary(cfg)
    values = {
        "user_directive": _user_directive(),
        "worker_processes": str(n.worker_processes),
        "worker_connections": str(nginx_options.worker_connections(cfg)),
        "nginx_dir": str(nginx_dir(cfg)),
        "client_max_body_size": n.client_max_body_size,
        "client_header_buffer_size": n.client_header_buffer_size,
        "large_client_header_buffers": n.large_client_header_buffers,
        "client_body_timeout": f"{n.client_body_timeout_s}s",
        "client_header_timeout": f"{n.client_header_timeout_s}s",
        "send_timeout": f"{n.send_timeout_s}s",
        "proxy_read_timeout": f"{n.proxy_read_timeout_s}s",
        "probe_timeout": f"{n.probe_timeout_s}s",
        "metrics_timeout": f"{metrics_timeout_s(n)}s",
        **nginx_options.rate_limit(n),
        "upstream_servers": "\n".join(servers),
        "upstream_keepalive": str(n.upstream_keepalive),
        "listen": f"{host}:{cfg.server.port}",
        **tls.nginx_values(cfg, binary),
        "listen_backlog": str(n.listen_backlog),
        "frontend_count": str(cfg.frontends.count),
        "next_upstream_tries": str(min(2, cfg.frontends.count)),  # the first, one other
        "admin_access": admin,
        "access_log_buffer": nginx_options.access_log_buffer(cfg),
        "nginx_answers_log": str(topology.nginx_answers_log(cfg)),
        **nginx_options.cors(n.cors_allow_origins),
        "gzip": nginx_options.gzip(n),
    }
    values["grpc"] = grpc_nginx.block(cfg, binary, values, fill)
    return fill(NGINX_TEMPLATE.read_text(), values)


def interpreter(executable: str | None = None) -> str:
    """This Python as the programs' commands name it: its directory's `python` or `python3`
    where that is the same file. pip writes into the `shmserve` script whichever name ran it
    (scripts/install's `python -m pip`, the README's `.venv/bin/pip`: python3.11), and a program
    whose command changed was replaced by the next `apply`, which its dry run had not said (an
    outside check)."""
    exe = Path(executable or sys.executable)
    for name in ("python", "python3"):
        alias = exe.parent / name
        try:
            if os.path.samefile(alias, exe):
                return str(alias)
        except OSError:  # no such name there
            continue
    return str(exe)


def render_supervisord(cfg: Config, nginx: str, password: str) -> str:
    python = interpreter()
    config_json = str(topology.resolved_config_path(cfg))
    devices = topology.worker_devices(cfg)
    common = {
        "run_dir": str(cfg.run_dir),
        "log_dir": str(topology.log_dir(cfg)),
        "repo_root": str(REPO_ROOT).replace("%", "%%"),
        "supervisor_socket": str(supervisor_files.socket(cfg)),
        "supervisor_password": password,
        "minfds": str(_minfds(cfg)),
        "supervisord_user": "user=root" if os.geteuid() == 0 else "; not root: no user",
        "stopwaitsecs": str(stopwaitsecs(cfg)),
        # supervisord's own activity log stays a file (in the foreground it also echoes it to
        # stdout); with logging.stdout, small, so the run volume's size limit holds (the
        # Kubernetes overlay's 256Mi: 50 MB x 6 could pass it, an outside check)
        "log_max_bytes": "10MB" if cfg.logging.stdout else str(cfg.logging.max_bytes),
        "log_backups": "1" if cfg.logging.stdout else str(cfg.logging.backups),
        # logging.stdout: every program's lines to supervisord's own stdout, unrotated
        "program_log_max_bytes": "0" if cfg.logging.stdout else str(cfg.logging.max_bytes),
        "program_log_backups": "0" if cfg.logging.stdout else str(cfg.logging.backups),
        "nginx_log": program_log(cfg, "nginx"),
        "reaper_log": program_log(cfg, "reaper"),
        "reaper_log_max_bytes": "0" if cfg.logging.stdout else "10MB",
        "common_environment": environment({
            "PROMETHEUS_MULTIPROC_DIR": str(topology.metrics_dir(cfg)),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            # A fatal signal (SIGBUS, SIGSEGV, abort) leaves the Python traceback in the log
            "PYTHONFAULTHANDLER": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "SHMSERVE_RUN_DIR": str(cfg.run_dir),
        }),
        "nginx_command": command(python, "-m", "shmserve.nginxrun", "--binary", nginx,
                                 *(arg for i in range(cfg.frontends.count) for arg in (
                                     "--frontend", str(topology.frontend_socket(cfg, i)))),
                                 str(nginx_conf(cfg))),
        "reaper_command": command(python, "-m", "shmserve.reaper", "--config", config_json),
        "frontend_programs": ",".join(f"frontend-{i}" for i in range(cfg.frontends.count)),
        "worker_programs": ",".join(f"worker-{i}" for i in range(len(devices))),
    }
    frontends = [{"index": str(i), "frontend_command": command(
        python, "-m", "frontend", "--config", config_json, "--index", str(i)),
        "frontend_log": program_log(cfg, f"frontend-{i}"),
        "frontend_stopwaitsecs": str(frontend_stopwaitsecs(cfg))}
        for i in range(cfg.frontends.count)]
    workers = [{"index": str(i), "worker_command": command(
        python, "-m", "gpu_workers", "--config", config_json, "--index", str(i)),
        "worker_environment": environment(worker_environment(cfg, device)),
        "worker_log": program_log(cfg, f"worker-{i}")}
        for i, device in enumerate(devices)]
    return fill_sections(SUPERVISORD_TEMPLATE.read_text(), common,
                         {"frontend": frontends, "worker": workers})


def program_log(cfg: Config, program: str) -> str:
    """Where supervisord writes `program`'s output: its file under the log directory, or
    supervisord's own stdout (logging.stdout)."""
    return "/dev/stdout" if cfg.logging.stdout else str(topology.log_dir(cfg) / f"{program}.log")


def stopwaitsecs(cfg: Config) -> int:
    """How long supervisord waits for a stopping process before SIGKILL: the drain, and some."""
    return math.ceil(cfg.server.drain_timeout_s) + 5


def frontend_stopwaitsecs(cfg: Config) -> int:
    """A frontend's: with gRPC, its calls drain before its HTTP requests (frontend.grpc_api)."""
    return stopwaitsecs(cfg) + (math.ceil(cfg.server.drain_timeout_s)
                                if cfg.server.grpc_port else 0)


def worker_environment(cfg: Config, device: str) -> dict[str, str]:
    threads = str(cfg.workers.torch_threads)
    return {
        "CUDA_VISIBLE_DEVICES": "" if device == topology.CPU else device,
        # workers.devices names GPUs as nvidia-smi numbers them, by PCI bus; CUDA's own default
        # order (fastest first) differs on a machine with mixed cards
        "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
        "PYTORCH_CUDA_ALLOC_CONF": cfg.workers.cuda_alloc_conf,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        # torch makes its inductor cache directory as the model loads (/tmp/torchinductor_USER
        # by default, left behind at `down`): in the run directory, private, unless set
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                  str(cfg.run_dir / "torch")),
    }


def check_nginx(cfg: Config, binary: str, conf: Path | None = None) -> None:
    """Run ``nginx -t`` on a rendered config (`conf`, else the deployment's nginx.conf); its
    complaint becomes a RenderError."""
    conf = conf or nginx_conf(cfg)
    argv = [binary, "-t", "-q", "-e", "stderr", "-p", f"{nginx_dir(cfg)}/", "-c", str(conf)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        problem = (done.stderr or done.stdout).strip()
        what = "the config rendered for" if conf != nginx_conf(cfg) else "the file"
        # A file a TLS key names, quoted by nginx: that key's file to mend, not nginx.conf (a
        # broken CRL was blamed on "the nginx.* keys, or an edit of the file": an outside check)
        named = [f"{key} ({tls.path(value)})" for key, value in tls.files(cfg)
                 if str(tls.path(value)) in problem]
        check = (f"check {', '.join(named)}" if named
                 else "check the nginx.* keys, or an edit of the file")
        raise RenderError(f"nginx rejects {what} {nginx_conf(cfg)} ({check}): {problem}")


def nginx_start_refusal(cfg: Config) -> str | None:
    """Why nginx, which runs on the files it read last, would not start on them as they are
    now (a restart, or supervisord's after a crash), or would serve no client: `nginx -t` of the
    deployment's nginx.conf (a TLS certificate, key or CRL written wrong or part way, a key
    that does not match the certificate: an outside check's nginx, killed, stayed down,
    `status` having said nothing), then a CRL of no CA of the clients (tls.check: nginx -t
    takes it, and refuses every client). None: it would start. `shmserve status` says it; the
    reaper scrapes it (shmserve_nginx_start_refused)."""
    try:
        if not nginx_conf(cfg).exists():  # (gone, nginx's own state says more)
            return None
        check_nginx(cfg, nginx_binary(cfg))
    except (RenderError, OSError, subprocess.SubprocessError) as exc:
        return (f"nginx runs on the files it read last, but would not start on them now (a "
                f"restart, or supervisord's after a crash): {exc}")
    try:
        tls.check(cfg)
    except tls.TlsError as exc:
        return f"{exc} (`restart nginx` refuses it)"
    return None


def fill(template: str, values: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        try:
            return values[match.group(1)]
        except KeyError:
            raise RenderError(f"template placeholder @{match.group(1)}@ has no value") from None
    return _PLACEHOLDER.sub(one, template)


def fill_sections(template: str, common: Mapping[str, str],
                  repeats: Mapping[str, list[dict[str, str]]]) -> str:
    """Fill an ini template, writing each ``[program:KIND-@index@]`` section once per item."""
    out = []
    for section in re.split(r"(?m)^(?=\[)", template):
        kind = _REPEATED.match(section)
        items = repeats[kind.group(1)] if kind else [{}]
        out.extend(fill(section, {**common, **item}) for item in items)
    return "".join(out)


# What supervisord would not read back as written in an environment= value: a double quote
# ends it, a control character (a newline) ends the line, a space then ; or # starts a
# comment, and a ' at either end is stripped. The config's values are checked at load
# (workers.cuda_alloc_conf): this is for those from the environment `up` runs in.
_UNREADABLE = re.compile(r"[\x00-\x1f\x7f\"]|\s[;#]|^'|'$")


def environment(values: Mapping[str, str]) -> str:
    """A supervisord ``environment=`` value: quoted pairs, ``%`` doubled for its expansion."""
    for key, value in values.items():
        if _UNREADABLE.search(value):
            raise RenderError(f"environment {key}: {value!r} cannot be passed through "
                              "supervisord.conf (a double quote, a control character, ' at "
                              "either end, or ; or # after a space)")
    return ",".join(f'{key}="{value.replace("%", "%%")}"' for key, value in values.items())


def command(*argv: str) -> str:
    return " ".join(shlex.quote(arg) for arg in argv).replace("%", "%%")


def _write_error_pages(cfg: Config) -> None:
    errors = nginx_dir(cfg) / "errors"
    for folder, shape in ((errors, nginx_options.error_body),
                          (errors / "v2", nginx_options.kserve_error_body)):
        for status in nginx_options.NGINX_ERRORS:
            body = shape(cfg, status)
            write_private(folder / f"{status}.json", json.dumps(body, separators=(",", ":")) + "\n")
            write_private(folder / f"{status}.msgpack", msgpack.packb(body))


def _user_directive() -> str:
    # A root master would run its workers as `nobody`, who cannot enter the 0700 run directory
    # nor connect to the frontends' sockets; they run as the user who renders instead.
    if os.geteuid() != 0:
        return "# not root: workers run as the master's user"
    return f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};"


def _minfds(cfg: Config) -> int:
    # a descriptor per connection, and as many again for files and the rest; supervisord raises
    # every child's soft limit to this, but never past the hard limit (it refuses to start if
    # asked to; `up` warns when that is under what nginx's connections need: prechecks).
    want = max(4096, 2 * nginx_options.nginx_connections(cfg) + 1024)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return want if hard == resource.RLIM_INFINITY else min(want, hard)


def _check_paths(cfg: Config) -> None:
    # the run directory's characters: config._check_run_dir
    last_worker = len(topology.worker_devices(cfg)) - 1
    last_frontend = (topology.frontend_grpc_socket if cfg.server.grpc_port else
                     topology.frontend_socket)(cfg, cfg.frontends.count - 1)
    sockets = [supervisor_files.socket(cfg), last_frontend,
               Path(topology.worker_endpoint(cfg, last_worker).removeprefix("ipc://"))]
    for path in sockets:
        if len(str(path).encode()) > MAX_SOCKET_PATH:
            raise RenderError(f"server.run_dir: socket path {path} is longer than the "
                              f"{MAX_SOCKET_PATH} bytes a unix socket allows; choose a shorter one")


def _make_dirs(cfg: Config) -> None:
    _check_owner(cfg.run_dir)
    try:
        cfg.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        cfg.run_dir.chmod(0o700)  # mkdir's mode is cut by the umask, ignored for an existing dir
        for path in (topology.socket_dir(cfg), topology.log_dir(cfg), topology.metrics_dir(cfg),
                     nginx_dir(cfg), nginx_dir(cfg) / "temp", nginx_dir(cfg) / "errors",
                     nginx_dir(cfg) / "errors" / "v2"):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only file system
        raise RenderError(f"server.run_dir: cannot make {exc.filename or cfg.run_dir}: "
                          f"{exc.strerror or exc}") from None


def _check_owner(run_dir: Path) -> None:
    """The run directory holds config.json, which every process reads at each start, and
    nginx.conf: whoever can replace it controls the deployment. So it must be this user's (an
    existing one of someone else's cannot be made private, 0700: a volume mounted for it, say;
    a Kubernetes emptyDir is root's, group-writable through fsGroup), and every directory
    above it this user's or root's: the owner of a directory can rename what is in it (an
    outside check, as a second local user, replaced another's run/ with its own and the other
    user's restarted workers served its config). A subdirectory render makes is this user's."""
    me = os.geteuid()
    for path in dict.fromkeys([*run_dir.absolute().parents, *run_dir.resolve().parents]):
        try:
            owner = path.stat().st_uid
        except OSError:
            continue  # not there yet: mkdir makes it ours (or says why it cannot)
        if owner not in (me, 0):
            raise RenderError(f"server.run_dir: {path} belongs to uid {owner}, who could "
                              f"replace {run_dir} and the config every process reads; put the "
                              "run directory where every directory above it is this user's or "
                              f"root's (uid {me}; for example {Path.home() / 'shmserve-run'})")
    try:
        owner = run_dir.stat().st_uid
    except OSError:
        return
    if owner != me:
        where = (f"a subdirectory shmserve makes itself, such as {run_dir / 'run'}"
                 if owner == 0 else f"a directory of this user's ({Path.home() / 'shmserve-run'})")
        raise RenderError(f"server.run_dir: {run_dir} belongs to uid {owner}, not to this user "
                          f"(uid {me}), so it cannot be made private (0700); point "
                          f"server.run_dir at {where}")
