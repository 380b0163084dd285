import os
import random

import numpy as np
import pytest

from shmserve.arena import ALIGN, Arena, ArenaFull, Attachments, arena_name, sweep


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
