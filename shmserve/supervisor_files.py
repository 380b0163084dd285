"""Where a run directory's supervisord files are, and the password of supervisord's control
socket: made at the directory's first render (shmserve.render) and read by every client of
the socket (the CLI's XML-RPC, shmserve.processes; supervisorctl reads it from
supervisord.conf's [supervisorctl])."""

from __future__ import annotations

import configparser
import secrets
from pathlib import Path

from shmserve.config import Config
from shmserve.files import write_private

USER = "shmserve"


def supervisord_conf(cfg: Config) -> Path:
    return cfg.run_dir / "supervisord.conf"


def supervisord_pidfile(cfg: Config) -> Path:
    return cfg.run_dir / "supervisord.pid"


def socket(cfg: Config) -> Path:
    return cfg.run_dir / "supervisor.sock"


def secret(cfg: Config) -> Path:
    return cfg.run_dir / "supervisor.secret"


def password(cfg: Config) -> str | None:
    """The password of supervisord's socket: its file's, else the rendered supervisord.conf's
    (the file removed, the CLI's calls were refused and `status` listed supervisord alone:
    an outside check); None where no render made one (a deployment started before it had
    one, whose supervisord asks for none)."""
    try:
        return secret(cfg).read_text().strip() or None
    except OSError:
        pass
    parser = configparser.RawConfigParser()
    try:
        parser.read(supervisord_conf(cfg))
    except configparser.Error:
        return None
    return parser.get("supervisorctl", "password", fallback=None) or None


def make_password(cfg: Config) -> str:
    """The run directory's password, made at its first render and kept: an apply's new
    supervisord.conf does not change the running supervisord's socket, so a new password
    there would lock supervisorctl out."""
    made = password(cfg) or secrets.token_urlsafe(24)
    if not secret(cfg).exists():
        write_private(secret(cfg), made + "\n")
    return made
