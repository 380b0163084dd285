"""Inputs through a fast tokenizer in chunks, as flat token ids: each chunk's Encoding objects
(~100 bytes a token) live only until its ids are copied out, and a tokenization whose request
was answered without it stops between two chunks (frontend.tokenizer's TextEncoder calls
`tokenized`; frontend.tasks.off_loop, `abandonable`)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
from tokenizers import Encoding, Tokenizer

# Inputs a tokenizer call takes at once. Its Encoding objects hold ~100 bytes a token (each
# token's string, offsets, masks, and a truncated text's cut-off part too) where the ids kept
# are 4: a request of 2,040 long texts made ~1 GB of them at once, which glibc kept after the
# answer (a frontend at 1.6 GB after a few such requests: an outside check). A chunk's are
# dropped once its ids are copied out: ~120 MB at the peak for 4 such requests at once, and
# no slower (in-process, 2,040 texts of 2,048 characters, 4 threads: 3.1-3.6 s a round
# against 3.2-4.1 s whole).
TOKENIZE_CHUNK = 128


class Abandoned(Exception):
    """A tokenization stopped between two chunks: the request it was for was answered without
    it (its deadline passed, or its client went away)."""


_abandon = threading.local()  # .event: the thread's tokenization stops once it is set


@contextlib.contextmanager
def abandonable(event: threading.Event) -> Iterator[None]:
    """Tokenizations on this thread stop (Abandoned) at their next chunk once `event` is set:
    one left running after its request's 504 held a frontend's executor threads, and the
    next requests waited behind it, 15-25 s past their own deadlines (an outside check)."""
    _abandon.event = event
    try:
        yield
    finally:
        _abandon.event = None


@dataclasses.dataclass(frozen=True, slots=True)
class Tokenized:
    ids: np.ndarray  # int32 [total tokens], every input's after the other
    lengths: np.ndarray  # int32 [n]
    truncated: int  # inputs the tokenizer's truncation cut
    segments: np.ndarray | None  # int32 [n]: pairs' first-segment lengths (token type 0)


def tokenized(tok: Tokenizer, items: list, special: bool = True,
               pairs: bool = False) -> Tokenized:
    """`items` (texts, or (first, second) pairs where `pairs`: their segments too) through
    `tok`, TOKENIZE_CHUNK at a time; `special`: with the special tokens. encode_batch_fast
    leaves out the character offsets, which nothing here reads (pairs too: the same ids,
    token types and cuts as encode_batch on 64 query-document pairs, 4% faster)."""
    encode = tok.encode_batch_fast
    if len(items) == 1:  # the common case, without the generators (~2x faster)
        e = encode(items, add_special_tokens=special)[0]
        ids = np.array(e.ids, np.int32)
        return Tokenized(ids, np.array([ids.shape[0]], np.int32), 1 if e.overflowing else 0,
                         _segments([e]) if pairs else None)
    ids, lengths, segments, truncated = [np.zeros(0, np.int32)], [np.zeros(0, np.int32)], \
        [np.zeros(0, np.int32)], 0  # (none: empty arrays)
    stop = getattr(_abandon, "event", None)
    for start in range(0, len(items), TOKENIZE_CHUNK):
        if stop is not None and stop.is_set():
            raise Abandoned
        chunk = encode(items[start:start + TOKENIZE_CHUNK], add_special_tokens=special)
        rows = [e.ids for e in chunk]
        counts = np.fromiter(map(len, rows), np.int32, len(rows))
        ids.append(np.fromiter((t for row in rows for t in row), np.int32, int(counts.sum())))
        lengths.append(counts)
        truncated += sum(1 for e in chunk if e.overflowing)
        if pairs:
            segments.append(_segments(chunk))
        del chunk, rows
    return Tokenized(np.concatenate(ids), np.concatenate(lengths), truncated,
                     np.concatenate(segments) if pairs else None)


def _segments(encodings: list[Encoding]) -> np.ndarray:
    """Token types are 0 for the first segment and 1 after it (all 0 for models whose
    template gives none, such as RoBERTa's); the worker rebuilds them from this length."""
    return np.fromiter((e.type_ids.index(1) if 1 in e.type_ids else len(e.ids)
                        for e in encodings), np.int32, len(encodings))
