"""A frontend's response cache (frontends.response_cache_mb; 0, the default: none), as Triton's
response cache: a request whose every input was answered before, by the weights its model's arm
serves now, is answered from here without a worker.

Keyed by what decides a row: the arm's unit (MODEL or MODEL@VARIANT) and revision, the input's
token ids (after tokenizing: its prompt and truncation included) and pair split, the tokens its
pooling skips, and whether the row is the model's own or raw. Per-token rows (TEI's /embed_all)
are not cached. A request with any input not here runs whole on a worker, as without a cache
(a request's rows never mix revisions), and its rows are kept. A reload gives the arm a new
revision: its old rows are never read again, and age out. Each frontend keeps its own, least
recently used out first, within its size (rows and keys counted).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from frontend.dispatch import Outcome
from frontend.tokenizer import Encoded
from shmserve.protocol import Result

ENTRY_BYTES = 120  # an entry's own overhead, roughly (the dict's, the key tuple's, the array's)


def _entry_bytes(key: tuple, row: np.ndarray) -> int:
    """What an entry counts against the cache's size: its row, its token ids, its overhead."""
    return row.nbytes + len(key[-1]) + ENTRY_BYTES


class ResponseCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def keys(unit: str, revision: str, enc: Encoded, raw: bool) -> list[tuple]:
        ids = enc.ids.tobytes()
        offsets = (enc.offsets * 4).tolist()
        segments = enc.segments.tolist() if enc.segments is not None else [-1] * enc.count
        return [(unit, revision, raw, enc.skip, segments[i], ids[offsets[i]:offsets[i + 1]])
                for i in range(enc.count)]

    def answer(self, keys: list[tuple], revision: str, width: int) -> Outcome | None:
        """The request's outcome when every key is here (its rows, copied), else None."""
        rows = self._rows
        if not keys or any(key not in rows for key in keys):
            return None
        vectors = np.empty((len(keys), width), dtype=np.float32)
        for i, key in enumerate(keys):
            rows.move_to_end(key)
            vectors[i] = rows[key]
        return Outcome(vectors, Result(0, 0.0, 0.0, 0, 0, revision), worker=-1,
                       received_at=time.perf_counter())

    def keep(self, keys: list[tuple], outcome: Outcome, revision: str) -> None:
        """Keep a computed outcome's rows, where the weights that computed them are the ones
        the keys name (a reload between the lookup and the pass: not kept)."""
        if outcome.revision != revision or outcome.vectors.shape[0] != len(keys):
            return
        rows = self._rows
        for key, row in zip(keys, outcome.vectors):
            size = _entry_bytes(key, row)
            if size > self.max_bytes:
                continue
            old = rows.pop(key, None)
            if old is not None:
                self.bytes -= _entry_bytes(key, old)
            rows[key] = row.copy()
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= _entry_bytes(*rows.popitem(last=False))
