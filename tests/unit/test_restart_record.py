"""run/restart.json (shmserve.restart_record): which stopped programs a restart killed part way
left stopped, apart from those an operator stopped."""

from __future__ import annotations

import time

from shmserve import restart_record, topology


def info(name: str, state: str, start: float) -> dict:
    group = "workers" if name.startswith("worker") else "frontends"
    return {"group": group, "name": name, "statename": state, "start": int(start)}


def test_only_a_recorded_program_stopped_and_not_started_since_counts(base):
    base.run_dir.mkdir(parents=True, exist_ok=True)
    before = time.time() - 60
    infos = [info("worker-0", "STOPPED", before), info("worker-1", "STOPPED", before),
             info("frontend-0", "STOPPED", before)]
    assert restart_record.stopped_by_restart(base, infos) == []  # no record: an operator's
    restart_record.begin(base, ["workers:worker-0", "frontends:frontend-0"])
    assert topology.restart_marker_path(base).stat().st_mode & 0o777 == 0o600
    assert restart_record.stopped_by_restart(base, infos) == ["frontend-0", "worker-0"]
    # started since (by hand, then stopped again: an operator's stop), or running
    later = [info("worker-0", "STOPPED", time.time() + 1), info("frontend-0", "RUNNING", before)]
    assert restart_record.stopped_by_restart(base, later) == []
    restart_record.end(base)
    assert not topology.restart_marker_path(base).exists()
    assert restart_record.stopped_by_restart(base, infos) == []
    topology.restart_marker_path(base).write_text('{"programs": "workers:worker-0"')  # torn
    assert restart_record.stopped_by_restart(base, infos) == []
    assert restart_record.said(base, ["worker-0"]).startswith(
        "worker-0 was stopped by a restart that did not finish (")
