"""The config a frontend or worker starts on: the run directory's config.json, unless an
`shmserve apply` is under way there, or stopped part way (run/apply.json), and has not reached
this program yet. Then the program starts on the config it ran before: the apply's `from`, or,
when an earlier apply this one goes on from had reached it, that apply's config.

An apply writes the new config.json first and restarts the programs one at a time, in an order
that keeps every model served (shmserve.apply_plan): the workers that will serve a model's new
units before the frontends, the frontends before the rest. A program that crashed meanwhile was
started again by supervisord on the new config at once, out of that order: a frontend killed
while the workers still served a model's old A/B units came back asking for the new ones, and
answered that model 503 until a worker of those was ready (an outside check: 40 in ~60 s).

The apply records each program as it reaches it (`reached`: program -> the attempt whose config
it started on); `shmserve restart` does too (restart_record.begin), so a program restarted by
command starts on the config being applied, as the README says. A program the config before
the apply did not have (one the apply adds) starts on config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from shmserve import config, topology
from shmserve.config import Config
from shmserve.files import write_private


def load(path: str | Path, program: str, read_keys: bool = False) -> tuple[Config, str]:
    """The config `program` (frontend-I, worker-I) starts on, and why it is not config.json's
    ("" when it is)."""
    path = Path(path)
    try:
        saved = json.loads((path.parent / topology.APPLY_MARKER).read_text())
        tree, why = _chosen(saved, program)
        if tree is not None:
            return config.from_tree(tree, read_keys), why
    except (OSError, ValueError, LookupError, TypeError, AttributeError, config.ConfigError):
        pass  # no apply's record (the usual case), or one this cannot read or start on (a key
        # file the config before named, gone since): the run directory's config, as before
    return config.load_resolved(path, read_keys), ""


def _chosen(saved: dict[str, Any], program: str) -> tuple[dict | None, str]:
    attempts = saved["attempts"]
    reached = saved.get("reached", {})
    if program in reached:
        index = int(reached[program])
        if index == len(attempts) - 1:
            return None, ""  # the config being applied: config.json
        return attempts[index], "the config of an earlier apply that reached it"
    before = config.from_tree(saved["from"], read_keys=False)
    group, _, index = program.rpartition("-")
    count = (before.frontends.count if group == "frontend"
             else len(topology.worker_devices(before)))
    if int(index) >= count:
        return None, ""  # added by the apply: only the new config has it
    return saved["from"], "the config from before the apply, which has not reached it yet"


def mark_reached(cfg: Config, programs: Iterable[str]) -> None:
    """Record `programs` (NAME or GROUP:NAME) as started on the config an apply under way, or
    stopped part way, is applying (config.json); nothing without an apply's record."""
    marker = topology.apply_marker_path(cfg)
    try:
        saved = json.loads(marker.read_text())
        latest = len(saved["attempts"]) - 1
        reached = saved.setdefault("reached", {})
        for program in programs:
            reached[program.rpartition(":")[2]] = latest
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return
    write_private(marker, json.dumps(saved) + "\n")
