"""frontend.respcache: the response cache's keys, its answers and its bound."""

from __future__ import annotations

import numpy as np

from frontend.dispatch import Outcome
from frontend.respcache import ENTRY_BYTES, ResponseCache
from frontend.tokenizer import Encoded
from shmserve.protocol import Result


def encoded(*rows: list[int], segments=None) -> Encoded:
    offsets = np.cumsum([0, *map(len, rows)]).astype(np.int32)
    ids = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows])
    return Encoded(ids, offsets, 0, None if segments is None else np.asarray(segments, np.int32))


def outcome(vectors: np.ndarray, revision: str = "r1") -> Outcome:
    return Outcome(vectors.astype(np.float32), Result(1, 1.0, 2.0, 3, 4, revision), 0, 0.0)


def test_a_request_is_answered_only_when_every_input_is_held_under_its_revision():
    cache = ResponseCache(1 << 20)
    enc = encoded([101, 7, 102], [101, 8, 9, 102])
    keys = cache.keys("m", "r1", enc, raw=False)
    assert cache.answer(keys, "r1", 4) is None
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    cache.keep(keys, outcome(rows), "r1")
    got = cache.answer(keys, "r1", 4)
    np.testing.assert_array_equal(got.vectors, rows)
    assert (got.revision, got.worker, got.result.inference_ms) == ("r1", -1, 0.0)
    got.vectors[0, 0] = 99  # the answer's rows are its own
    np.testing.assert_array_equal(cache.answer(keys, "r1", 4).vectors, rows)
    # one input of them, in another request: held; one more input: not
    one = cache.keys("m", "r1", encoded([101, 8, 9, 102]), raw=False)
    np.testing.assert_array_equal(cache.answer(one, "r1", 4).vectors, rows[1:])
    more = cache.keys("m", "r1", encoded([101, 7, 102], [101, 5, 102]), raw=False)
    assert cache.answer(more, "r1", 4) is None
    # what else decides a row: the revision, the arm, raw rows, a pair's split, skipped tokens
    for other in (cache.keys("m", "r2", enc, raw=False), cache.keys("m@b", "r1", enc, False),
                  cache.keys("m", "r1", enc, raw=True),
                  cache.keys("m", "r1", encoded([101, 7, 102], [101, 8, 9, 102],
                                                segments=[2, 2]), raw=False)):
        assert cache.answer(other, "r1", 4) is None
    # rows a reload's weights computed, for keys of the old revision: not kept
    cache.keep(more, outcome(rows, revision="r2"), "r1")
    assert cache.answer(more, "r1", 4) is None and len(cache) == 2


def test_the_least_recently_used_go_first_within_the_bound():
    row_bytes = 4 * 4 + 3 * 4 + ENTRY_BYTES  # a row of 4 floats, a key of 3 ids
    cache = ResponseCache(3 * row_bytes)
    keys = [cache.keys("m", "r1", encoded([101, i, 102]), raw=False) for i in range(5)]
    for i in range(3):
        cache.keep(keys[i], outcome(np.full((1, 4), i)), "r1")
    assert cache.bytes == 3 * row_bytes and len(cache) == 3
    cache.answer(keys[0], "r1", 4)  # used: the oldest is now 1
    cache.keep(keys[3], outcome(np.full((1, 4), 3)), "r1")
    assert [cache.answer(k, "r1", 4) is not None for k in keys[:4]] == [True, False, True, True]
    assert cache.bytes <= cache.max_bytes
    # a row larger than the whole cache is not kept (nor does it empty the cache)
    small = ResponseCache(row_bytes - 1)
    small.keep(keys[4], outcome(np.zeros((1, 4))), "r1")
    assert len(small) == 0 and small.bytes == 0
