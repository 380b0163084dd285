"""What a worker's socket thread knows of the frontends' processes (gpu_workers.intake)."""

import os
import subprocess
import sys
import time

from gpu_workers.intake import running


def test_a_killed_process_is_not_running_even_before_it_is_reaped():
    """A frontend killed is a zombie until supervisord reaps it: its queued requests are let
    go from then, not from the reaping."""
    assert running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert running(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while running(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not running(child.pid)
        assert child.poll() is not None  # reaped only now: it was a zombie above
    finally:
        child.kill()
        child.wait()
    assert not running(child.pid)  # gone


def test_a_process_this_worker_cannot_see_is_not_taken_for_running():
    # (another pid namespace, or no /proc): then judged by pings alone (Intake.heartbeat)
    assert not running(2**22 + 12345)


def _intake():
    import threading
    from types import SimpleNamespace

    from gpu_workers.intake import Intake, Status
    from shmserve import config

    cfg = config.load(environ={"SHMSERVE__FRONTENDS__HUNG_KILL_S": "0"})
    metrics = SimpleNamespace(watching=lambda frontend: None, refused=lambda why: None,
                              set_queue_depth=lambda n: None)
    return Intake(cfg, 0, {}, metrics, threading.Event(), Status(infos=()))


def _queued(intake, peer: bytes, seq: int, tokens: int = 6):
    """A request of two texts of `tokens` // 2 tokens, admitted (as on_submit counts it)."""
    from types import SimpleNamespace

    import numpy as np

    from gpu_workers.requests import Request

    request = Request.__new__(Request)
    for name, value in dict(msg=SimpleNamespace(priority=0, seq=seq), peer=peer,
                            offsets=np.array([0, tokens // 2, tokens]), tokens_left=tokens,
                            aborted=False, orphaned=False, released_tokens=0).items():
        object.__setattr__(request, name, value)
    intake._requests[(peer, seq)] = request
    intake.backlog.add(0, tokens)
    intake.queued_texts += 2
    return request


def test_a_gone_frontends_requests_leave_the_queue_bound_and_backlog_once():
    """However the model thread's pass and the release interleave, every token leaves the
    backlog once and every text the queue once."""
    intake = _intake()
    # Released before any of it ran; another frontend's request stays counted.
    first, kept = _queued(intake, b"A", 1), _queued(intake, b"B", 2)
    intake.orphan(b"A", 0)
    assert first.aborted and first.orphaned and not kept.aborted
    assert intake.backlog.queued() == 6 and intake.orphaned_texts == 2
    intake.orphan(b"A", 0)  # again (a ping and a look): nothing more
    assert intake.backlog.queued() == 6 and intake.orphaned_texts == 2
    intake.finished(first)
    assert (intake.queued_texts, intake.orphaned_texts, intake.backlog.queued()) == (2, 0, 6)
    # Released while its pass ran: the pass takes what it computed off afterwards.
    running = _queued(intake, b"A", 3)
    intake.orphan(b"A", 0)
    running.tokens_left -= 6
    intake.backlog.done(0, 6)  # as the model thread does for a pass
    intake.finished(running)
    # Computed in part before it was released.
    partly = _queued(intake, b"A", 4)
    partly.tokens_left -= 3
    intake.backlog.done(0, 3)
    intake.orphan(b"A", 0)
    intake.finished(partly)
    intake.finished(kept)
    assert (intake.queued_texts, intake.orphaned_texts, intake.backlog.queued()) == (0, 0, 0)


def test_a_killed_frontends_arena_is_unmapped_once_unlinked(tmp_path):
    """Its pages stayed allocated in /dev/shm while the workers kept it mapped: a replacement
    frontend met a full /dev/shm (503s) until a new arena was first seen (a second outside
    check). The worker's look for frontends gone drops unlinked arenas too."""
    from shmserve.arena import Arena, Attachments, arena_name

    intake = _intake()
    intake.attachments = Attachments(directory=tmp_path)
    dead = Arena(arena_name("test", "fe0", pid=999999999), 1 << 16,  # its creator gone
                 directory=tmp_path)
    intake.attachments.view(dead.handle(dead.alloc(64), "float32", (16,)))
    intake._look()
    assert dead.name in intake.attachments._maps  # still there: kept
    dead.close()  # unlinked, as the sweep after a kill does
    intake._looked = intake._dropped = 0.0
    intake._look()
    assert dead.name not in intake.attachments._maps


def test_an_arena_the_worker_cannot_map_hands_the_request_to_another_worker(monkeypatch,
                                                                            caplog):
    """A worker out of file descriptors (or memory) to map a request's arena with answered
    INVALID, a 500 "bad buffers" that no other worker was asked to take and no line logged
    (an outside check): its own trouble is UNAVAILABLE, which the frontend sends elsewhere.
    Handles that do not fit their arena stay the frontend's fault (INVALID)."""
    import errno
    from types import SimpleNamespace

    from gpu_workers import intake as module
    from shmserve.protocol import ErrorCode

    intake = _intake()
    intake.status.ready = True
    intake.specs = {"m": SimpleNamespace(task="embedding", width=lambda per_token: 4)}
    msg = SimpleNamespace(seq=7, model="m", per_token=False, raw=False, priority=0)
    for raised, code in ((OSError(errno.EMFILE, "Too many open files"), ErrorCode.UNAVAILABLE),
                         (ValueError("handle outside arena"), ErrorCode.INVALID)):
        def read_request(*args, raised=raised):
            raise raised
        monkeypatch.setattr(module, "read_request", read_request)
        error = intake.on_submit(b"fe0", msg)
        assert (error.seq, error.code) == (7, code), error
        assert str(raised) in error.message
    # Logged naming the frontend by its index (not its ZeroMQ identity), a line a second at
    # most: one a request (and attempt) flooded the log (a re-check)
    intake._frontends, intake._unreadable_logged = {1: (b"fe0", 0)}, 0.0
    caplog.clear()
    monkeypatch.setattr(module, "read_request", lambda *args: (_ for _ in ()).throw(
        OSError(errno.EMFILE, "Too many open files")))
    with caplog.at_level("WARNING", logger="shmserve.worker"):
        for _ in range(3):
            assert intake.on_submit(b"fe0", msg).code is ErrorCode.UNAVAILABLE
    lines = [r for r in caplog.records if r.getMessage() == "worker.arena_unreadable"]
    assert len(lines) == 1 and lines[0].fields["frontend"] == 1, lines


def test_a_worker_that_maps_no_request_of_a_frontend_for_a_while_is_unwell(monkeypatch,
                                                                           caplog):
    """Descriptors gone after one frontend's arena was mapped and before the other's: the
    other's every request was 503 for good while the first's served. Failures of one
    frontend's requests for UNMAPPABLE_EXIT_S, whatever another's do, make the worker unwell
    (the model thread exits on it): heartbeats say not ready from then on. Only failures a
    fresh process may not meet (descriptors, memory), not a file gone."""
    import errno
    import time
    from types import SimpleNamespace

    from gpu_workers import intake as module
    from shmserve.protocol import ErrorCode

    intake = _intake()
    intake.status.ready = True
    intake.specs = {"m": SimpleNamespace(task="embedding", width=lambda per_token: 4)}
    monkeypatch.setattr(module, "UNMAPPABLE_EXIT_S", 0.05)

    def read_request(attachments, peer, msg, *args):
        if peer == b"fe0":
            raise OSError(errno.EMFILE, "Too many open files")
        if peer == b"fe2":  # its arena deleted: a fresh worker would not map it either
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        # mapped; too many texts for the queue (refused after the reading, which is all here)
        return SimpleNamespace(remaining=10 ** 9, offsets=[0, 3], arrived=time.time())

    monkeypatch.setattr(module, "read_request", read_request)
    msg = SimpleNamespace(seq=7, model="m", per_token=False, raw=False, priority=0,
                          deadline=time.time() + 60)
    assert intake.on_submit(b"fe0", msg).code is ErrorCode.UNAVAILABLE
    assert intake.on_submit(b"fe2", msg).code is ErrorCode.UNAVAILABLE
    time.sleep(0.06)
    assert intake.on_submit(b"fe2", msg).code is ErrorCode.UNAVAILABLE and not intake.unwell
    assert intake.on_submit(b"fe1", msg).code is ErrorCode.OVERLOADED  # fe1's map works
    assert not intake.unwell and intake._beat(0.0).ready
    with caplog.at_level("ERROR", logger="shmserve.worker"):
        assert intake.on_submit(b"fe0", msg).code is ErrorCode.UNAVAILABLE
    assert "0.05 s: [Errno 24] Too many open files" in intake.unwell
    assert not intake._beat(0.0).ready
    assert [r.getMessage() for r in caplog.records].count("worker.unwell") == 1
    # A frontend gone takes its failures with it: its replacement's count from its own
    intake.unwell = ""
    intake.orphan(b"fe0", 0)
    assert intake.on_submit(b"fe0", msg).code is ErrorCode.UNAVAILABLE and not intake.unwell


def test_a_request_under_spread_part_texts_is_told_to_every_frontend(monkeypatch):
    """Heartbeat.small_at: when the worker was last sent a request of fewer than
    frontends.spread_part_texts (16) texts, from any frontend; no frontend spreads a large
    request within frontends.spread_quiet_s of one (frontend.dispatch)."""
    from types import SimpleNamespace

    import numpy as np

    from gpu_workers import intake as module

    intake = _intake()
    intake.status.ready = True
    intake.specs = {"m": SimpleNamespace(task="embedding", width=lambda per_token: 4)}

    def read_request(attachments, peer, msg, now, width):
        texts = msg.seq  # (the test's requests have as many texts as their seq)
        return SimpleNamespace(remaining=texts, offsets=np.arange(texts + 1) * 3, arrived=now)
    monkeypatch.setattr(module, "read_request", read_request)
    monkeypatch.setattr(intake.arrivals, "arrived", lambda *args, **kwargs: None)
    def submit(peer: bytes, texts: int):
        return intake.on_submit(peer, SimpleNamespace(seq=texts, model="m", per_token=False,
                                                      raw=False, priority=0,
                                                      deadline=time.time() + 30))

    for texts in (16, 40):  # a spread request's part has at least 16
        assert submit(b"fe0", texts) is None
    assert intake._beat(0.0).small_at == 0.0
    before = time.time()
    assert submit(b"fe1", 15) is None
    assert before <= intake._beat(0.0).small_at <= time.time()
