"""The programs an `shmserve restart` (or an apply's replacement of one) is stopping and
starting, kept in the run directory while it does (run/restart.json), so that a command killed
part way (Ctrl-C, a lost terminal, kill -9) does not leave programs stopped for good.

supervisorctl's restart is a stop, then a start. Killed between the two, its program was left
STOPPED, which the next group restart and `apply` take for an operator's stop (`shmserve ctl
stop`) and leave so: a worker, or every worker of an all-at-once restart, out of service until
someone noticed. A program named here that is STOPPED and has not started since the record was
written was stopped by that restart: the next restart or apply starts it, and says so.
"""

from __future__ import annotations

import json
import time
from typing import Sequence

from shmserve import program_config, topology
from shmserve.config import Config
from shmserve.files import write_private


def begin(cfg: Config, programs: Sequence[str], command: str = "restart") -> None:
    """Record `programs` (GROUP:NAME) as a restart of them begins. `end` removes the record once
    the restart has started them; a restart that fails or is interrupted before leaves it for
    the next restart or apply to read. Where an apply is under way or stopped part way, they
    start on the config it applies (shmserve.program_config)."""
    program_config.mark_reached(cfg, programs)
    write_private(topology.restart_marker_path(cfg),
                  json.dumps({"programs": list(programs), "at": time.time(),
                              "command": command}) + "\n")


def end(cfg: Config) -> None:
    topology.restart_marker_path(cfg).unlink(missing_ok=True)


def stopped_by_restart(cfg: Config, infos: list[dict]) -> list[str]:
    """The programs of `infos` (supervisord's getAllProcessInfo) that a restart killed part way
    left stopped: named in its record, STOPPED, and not started since it began."""
    try:
        record = json.loads(topology.restart_marker_path(cfg).read_text())
        named, at = set(record["programs"]), float(record["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted(p["name"] for p in infos if p.get("statename") == "STOPPED"
                  and f"{p.get('group')}:{p.get('name')}" in named and p.get("start", 0) < at)


def said(cfg: Config, names: list[str]) -> str:
    """What a command that starts them again says of `names` (stopped_by_restart)."""
    try:
        command = json.loads(topology.restart_marker_path(cfg).read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        command = None
    verb = "was" if len(names) == 1 else "were"
    return (f"{', '.join(names)} {verb} stopped by {'an' if command == 'apply' else 'a'} "
            f"{command or 'restart'} that did not finish "
            f"({topology.restart_marker_path(cfg)}): started again")
