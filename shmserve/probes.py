"""What a frontend's GET /ready says, read over its unix socket, not through nginx: `restart`
and `apply` wait on it for each program they restart."""

from __future__ import annotations

import json

from shmserve import remote


def frontend_ready(socket_path: str) -> str | None:
    """A frontend's GET /ready status where its restart has nothing more to wait for: "ready"
    (a 200: ready or degraded), or "failing: WHAT" (503; WHAT: failing_models) where every
    worker it sees is ready or failed its loads, which no wait mends (an outside check's
    `restart frontends` waited out workers.ready_timeout_s for a model pinned to a worker that
    could not load it); else None."""
    code, answer = ready_answer(socket_path)
    if code == 200:
        return "ready"
    try:
        if code == 503 and answer["status"] == "failing" and all(
                w["ready"] or w["load_error"] or w["unloaded"] for w in answer["workers"]):
            return "failing: " + failing_models(answer)
    except (KeyError, TypeError):
        pass
    return None


def failing_models(answer: dict) -> str:
    """What a failing GET /ready names: each model a worker could not load, with the worker,
    or a worker's load error where it loaded nothing."""
    named = [f"{u['model']} (worker {w['worker']})" for w in answer["workers"]
             for u in w.get("unloaded") or []]
    named += [f"worker {w['worker']}: {w['load_error']}" for w in answer["workers"]
              if w.get("load_error") and not w.get("ready")]
    return "; ".join(named) or "no worker named"


def seen_workers(frontend_socket: str) -> dict[int, dict] | None:
    """The workers as the frontend on `frontend_socket` sees them (its GET /ready's entries,
    by index), or None when it does not answer."""
    _, answer = ready_answer(frontend_socket)
    return workers_of(answer)


def workers_of(answer: dict | None) -> dict[int, dict] | None:
    """A GET /ready answer's worker entries by index (None where it has none)."""
    try:
        return {w["worker"]: w for w in answer["workers"] if isinstance(w, dict)}
    except (KeyError, TypeError):
        return None


def ready_answer(frontend_socket: str) -> tuple[int | None, dict | None]:
    """A frontend's GET /ready: its status code and JSON object (None for either where it did
    not answer, or not with an object)."""
    code, body = remote.get_unix(frontend_socket, "/ready")
    try:
        answer = json.loads(body) if code is not None else None
    except ValueError:
        answer = None
    return code, answer if isinstance(answer, dict) else None


def ready_in(seen: dict[int, dict], index: int, pid: int) -> bool:
    """Whether worker `index` is ready, as process `pid`, in a frontend's `seen_workers`."""
    worker = seen.get(index, {})
    return bool(worker.get("ready")) and worker.get("pid") == pid


def load_failure(seen: dict[int, dict], index: int, pids) -> tuple[int, str] | None:
    """(the process, its error) where a frontend heard that worker `index`'s process, one of
    `pids` (processes a command started), failed to start, else None. Such a process exits
    after a wait and is started again, later each time, with the same error: a command that
    waited for its third start took 25 s for a model that could not load (an outside
    check), 63 s in a loaded CI run."""
    worker = seen.get(index, {})
    if worker.get("load_error") and not worker.get("ready") and worker.get("failed_pid") in pids:
        return worker["failed_pid"], str(worker["load_error"])
    return None
