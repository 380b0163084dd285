import dataclasses
import os
import random

import numpy as np
import pytest

from shmserve.arena import (ALIGN, RESERVE_STEP, Arena, ArenaFull, Attachments, ShmFull,
                            arena_name, sweep, sweep_orphans)


@pytest.fixture
def arena(tmp_path):
    a = Arena(arena_name("test", "fe0"), 1 << 16, directory=tmp_path)
    yield a
    a.close()


def test_alloc_is_aligned_and_disjoint(arena):
    spans = []
    for size in (1, 63, 64, 65, 1000, 4096):
        off = arena.alloc(size)
        assert off % ALIGN == 0
        spans.append((off, off + size))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_free_coalesces_so_the_whole_arena_is_reusable(arena):
    offsets = [arena.alloc(1024) for _ in range(64)]  # fills 64 KiB exactly
    with pytest.raises(ArenaFull):
        arena.alloc(1)
    random.Random(0).shuffle(offsets)
    for off in offsets:
        arena.free(off)
    assert arena.bytes_used == 0
    assert arena.alloc(1 << 16) == 0  # one range again: fully coalesced


def test_reuse_after_free(arena):
    a = arena.alloc(128)
    arena.free(a)
    assert arena.alloc(128) == a


def test_double_free_is_an_error(arena):
    a = arena.alloc(10)
    arena.free(a)
    with pytest.raises(KeyError):
        arena.free(a)


def test_full_message_names_the_config_key(arena):
    with pytest.raises(ArenaFull, match="shm.arena_mb"):
        arena.alloc((1 << 16) + 1)


@pytest.mark.parametrize("dtype,shape", [("int32", (0,)), ("float32", (3, 384)),
                                         ("int32", (5000,)), ("float16", (7, 3))])
def test_views_shared_between_owner_and_attacher(arena, tmp_path, dtype, shape):
    off = arena.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)
    handle = arena.handle(off, dtype, shape)
    data = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
    arena.view(handle)[...] = data
    other = Attachments(directory=tmp_path)
    seen = other.view(handle)
    np.testing.assert_array_equal(seen, data)
    seen[...] = 0  # the worker writes outputs into the same slot
    assert not arena.view(handle).any()
    other.close()


def test_handle_outside_the_arena_is_refused(arena, tmp_path):
    bad = arena.handle((1 << 16) - 4, "int32", (2,))
    with pytest.raises(ValueError):
        Attachments(directory=tmp_path).view(bad)


def test_attach_refuses_foreign_names(tmp_path):
    from shmserve.protocol import ShmHandle
    with pytest.raises(ValueError):
        Attachments(directory=tmp_path).view(ShmHandle("../etc/passwd", 0, 4, "int32", (1,)))


def test_close_unlinks_and_sweep_removes_leftovers(tmp_path):
    a = Arena("shmserve-x-fe0-1", 4096, directory=tmp_path)
    a.close()
    assert not (tmp_path / "shmserve-x-fe0-1").exists()
    (tmp_path / "shmserve-x-fe1-99").write_bytes(b"")
    (tmp_path / "shmserve-y-fe1-99").write_bytes(b"")
    assert sweep("shmserve-x-", directory=tmp_path) == ["shmserve-x-fe1-99"]
    assert os.listdir(tmp_path) == ["shmserve-y-fe1-99"]


def test_sweep_orphans_removes_only_arenas_no_live_creator_holds(tmp_path):
    live = Arena(arena_name("0123abcd", "fe0"), 1 << 16, directory=tmp_path)
    orphan = tmp_path / arena_name("89abcdef", "fe1", pid=2**22 + 7)  # its creator was killed
    orphan.write_bytes(b"\0" * 4096)
    other = tmp_path / "shmserve-not-an-arena"  # not ours by name: left alone
    other.write_bytes(b"")
    assert sweep_orphans(tmp_path, min_age_s=0) == [orphan.name]
    assert live.path.exists() and other.exists() and not orphan.exists()
    live.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_sweep_orphans_leaves_other_users_arenas(tmp_path):
    # Another user's deployment on the same machine: not ours to judge or remove (and not
    # removable by a non-root user: /dev/shm is sticky).
    theirs = tmp_path / arena_name("89abcdef", "fe1", pid=2**22 + 7)
    theirs.write_bytes(b"\0" * 4096)
    os.chown(theirs, 10001, 10001)
    assert sweep_orphans(tmp_path, min_age_s=0) == []
    assert theirs.exists()


def test_sweep_orphans_skips_an_arena_it_may_not_open(tmp_path, monkeypatch):
    # What a non-root user meets for another user's segment (mode 0600): EACCES, not a crash.
    unreadable = tmp_path / arena_name("89abcdef", "fe1", pid=2**22 + 7)
    unreadable.write_bytes(b"")
    real_open = os.open

    def refusing_open(path, *args, **kwargs):
        if str(path) == str(unreadable):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", refusing_open)
    assert sweep_orphans(tmp_path, min_age_s=0) == []
    assert unreadable.exists()


def test_sweep_orphans_leaves_a_segment_too_young_to_be_locked_yet(tmp_path):
    young = tmp_path / arena_name("89abcdef", "fe1", pid=2**22 + 7)
    young.write_bytes(b"")
    assert sweep_orphans(tmp_path, min_age_s=60) == []
    assert young.exists()


def test_an_arena_whose_creator_was_killed_is_an_orphan(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time; from pathlib import Path; from shmserve.arena import Arena; "
            f"a = Arena(sys.argv[1], 1 << 16, directory=Path({str(tmp_path)!r})); "
            "print('ready', flush=True); time.sleep(60)")
    name = arena_name("0123abcd", "fe0", pid=4242)
    child = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE,
                             text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                 os.path.abspath(__file__)))))
    try:
        assert child.stdout.readline().strip() == "ready"
        assert sweep_orphans(tmp_path, min_age_s=0) == []  # held by a live process
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 5
        while not sweep_orphans(tmp_path, min_age_s=0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (tmp_path / name).exists()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_an_arena_is_made_under_a_name_no_one_can_foresee_and_never_through_a_link(tmp_path):
    """A security review: the name was the deployment's prefix and the pid, and the file was
    opened O_CREAT|O_TRUNC, so another local user could create it first (and read or write the
    requests in it) or place a symlink there, through which a root frontend truncated and grew
    any file."""
    a, b = arena_name("0123abcd", "fe0"), arena_name("0123abcd", "fe0")
    assert a != b and a.startswith(f"shmserve-0123abcd-fe0-{os.getpid()}-")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / a).symlink_to(victim)
    with pytest.raises(FileExistsError):
        Arena(a, 1 << 12, directory=tmp_path)
    assert victim.read_text() == "precious"
    (tmp_path / b).write_bytes(b"\0" * 4096)  # created first by someone else
    with pytest.raises(FileExistsError):
        Arena(b, 1 << 12, directory=tmp_path)


def test_a_worker_maps_only_a_regular_file_of_its_own_user(tmp_path):
    arena = Arena(arena_name("0123abcd", "fe0"), 1 << 12, directory=tmp_path)
    handle = arena.handle(arena.alloc(64), "float32", (16,))
    assert Attachments(tmp_path).view(handle).shape == (16,)
    link = tmp_path / arena_name("0123abcd", "fe1")
    link.symlink_to(arena.path)
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        Attachments(tmp_path).view(dataclasses.replace(handle, arena=link.name))
    if os.geteuid() == 0:  # another user's file (root can make one)
        theirs = tmp_path / arena_name("0123abcd", "fe2")
        theirs.write_bytes(b"\0" * 4096)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="not a regular file of this user"):
            Attachments(tmp_path).view(dataclasses.replace(handle, arena=theirs.name))
    arena.close()


async def test_a_frontends_arena_use_is_reported_every_second(tmp_path):
    import asyncio

    from frontend import metrics, own_files

    arena = Arena(arena_name("0123abcd", "fe7"), 1 << 16, directory=tmp_path)
    reporter = asyncio.create_task(own_files.watch(arena, 7, tmp_path / "no.sock"))
    try:
        await asyncio.sleep(0.05)
        gauge = metrics.ARENA_USED.labels("7")
        assert gauge._value.get() == 0
        offset = arena.alloc(1000)
        await asyncio.sleep(1.1)
        assert gauge._value.get() == 1024  # aligned to 64
        arena.free(offset)
        await asyncio.sleep(1.1)
        assert gauge._value.get() == 0
    finally:
        reporter.cancel()
        arena.close()


def test_pages_are_reserved_before_an_allocation_hands_them_out(tmp_path, monkeypatch):
    """The arena file is sparse: a page that /dev/shm cannot allocate when first written kills
    the writer with SIGBUS (every frontend and worker crash-looped once others had filled
    /dev/shm, an outside check). Pages are reserved first, and a full mount is an error."""
    import errno

    from shmserve import arena as arena_module

    a = Arena(arena_name("test", "fe1"), 4 * RESERVE_STEP, directory=tmp_path)
    try:
        assert os.stat(a.path).st_blocks == 0  # nothing reserved until used
        calls = []
        real = os.posix_fallocate
        monkeypatch.setattr(arena_module.os, "posix_fallocate",
                            lambda fd, off, n: calls.append((off, n)) or real(fd, off, n))
        first = a.alloc(1000)
        assert calls == [(0, RESERVE_STEP)] and os.stat(a.path).st_blocks * 512 >= RESERVE_STEP
        a.free(first)
        a.alloc(RESERVE_STEP // 2)  # within what is reserved: no system call
        assert len(calls) == 1
        second = a.alloc(RESERVE_STEP)  # past it: the next step, up to its end
        assert calls[1] == (RESERVE_STEP, RESERVE_STEP) and second == RESERVE_STEP // 2

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(arena_module.os, "posix_fallocate", full)
        used = a.bytes_used
        with pytest.raises(ShmFull, match=r"is full: no room for 1,048,576 more bytes"):
            a.alloc(RESERVE_STEP)
        assert a.bytes_used == used  # nothing handed out
        a.alloc(100)  # what is reserved still serves
    finally:
        a.close()


def test_unlinked_says_when_the_arena_file_was_deleted_under_its_owner(tmp_path):
    a = Arena("shmserve-t-fe0-1", 1 << 20, directory=tmp_path)
    try:
        assert not a.unlinked()
        (tmp_path / a.name).unlink()
        assert a.unlinked()
    finally:
        a.close()
    assert not a.unlinked()  # closed: nothing to say


async def test_a_frontends_grpc_socket_deleted_stops_it_but_not_once_its_stop_began(
        tmp_path, monkeypatch):
    """The gRPC socket's file deleted left every gRPC call UNAVAILABLE for good, /ready 200
    (an outside check); the stop's own placeholder in its place is no loss."""
    import asyncio
    import signal
    import socket

    from frontend import own_files

    killed = []
    monkeypatch.setattr(own_files.os, "kill", lambda pid, sig: killed.append(sig))
    arena = Arena(arena_name("0123abcd", "fe7"), 1 << 16, directory=tmp_path)
    http, grpc_path = tmp_path / "fe.sock", tmp_path / "fe.grpc.sock"
    listeners = []
    for path in (http, grpc_path):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listeners.append(listener)
    serving = [grpc_path]
    try:
        watcher = asyncio.create_task(own_files.watch(arena, 7, http, lambda: serving[0]))
        await asyncio.sleep(1.2)
        serving[0] = None  # its stop began: the file is replaced
        grpc_path.unlink()
        await asyncio.sleep(1.2)
        assert killed == [] and not watcher.done()
        watcher.cancel()
        serving[0] = grpc_path  # a new server's, deleted under it
        listeners[1].close()
        listeners[1] = socket.socket(socket.AF_UNIX)
        listeners[1].bind(str(grpc_path))
        watcher = asyncio.create_task(own_files.watch(arena, 7, http, lambda: serving[0]))
        await asyncio.sleep(0.1)
        grpc_path.unlink()
        await asyncio.wait_for(watcher, 3)
        assert killed == [signal.SIGTERM]
    finally:
        for listener in listeners:
            listener.close()
        arena.close()


def test_a_live_frontends_arena_stays_mapped_after_its_file_is_deleted(tmp_path):
    """A /dev/shm cleaner deletes a running frontend's arena file: the frontend drains its
    requests, whose slots the workers must still read and write (drop_vanished forgot them,
    and each was answered 503); a dead creator's mapping goes, so its pages are freed."""
    live = Arena(arena_name("0123abcd", "fe0"), 1 << 16, directory=tmp_path)  # this process
    dead = Arena(arena_name("0123abcd", "fe1", pid=999999999), 1 << 16, directory=tmp_path)
    try:
        attached = Attachments(directory=tmp_path)
        handles = []
        for a in (live, dead):
            h = a.handle(a.alloc(64), "int32", (16,))
            a.view(h)[...] = 7
            assert (attached.view(h) == 7).all()
            handles.append(h)
        for a in (live, dead):
            (tmp_path / a.name).unlink()
        attached.drop_vanished()
        assert (attached.view(handles[0]) == 7).all()  # still mapped: no open by name
        with pytest.raises(FileNotFoundError):
            attached.view(handles[1])
        attached.close()
    finally:
        live.close()
        dead.close()
