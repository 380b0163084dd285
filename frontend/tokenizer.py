"""Texts (or query-document pairs) to one flat int32 token buffer plus offsets, with the model's
fast tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from frontend.errors import ApiError
from shmserve.models import ModelSpec


@dataclass(frozen=True, slots=True)
class Encoded:
    ids: np.ndarray  # int32 [total tokens]
    offsets: np.ndarray  # int32 [n + 1]
    truncated: int  # texts cut to the model's limit
    segments: np.ndarray | None = None  # int32 [n]: first-segment lengths of pairs (token type 0)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])


class TextEncoder:
    def __init__(self, spec: ModelSpec, truncate: bool) -> None:
        self.max_tokens = spec.max_tokens
        self.truncate = truncate
        self._tok = Tokenizer.from_file(str(spec.directory / "tokenizer.json"))
        self._tok.no_padding()
        if truncate:
            self._tok.enable_truncation(max_length=spec.max_tokens)
        else:
            self._tok.no_truncation()

    def encode(self, texts: list[str], param: str = "input") -> Encoded:
        return self._flatten(self._tok.encode_batch(texts, add_special_tokens=True), param)

    def encode_pairs(self, query: str, documents: list[str],
                     param: str = "documents") -> Encoded:
        """(query, document) pairs as a cross-encoder reads them: [CLS] q [SEP] d [SEP], with
        the pair cut longest-first to the model's limit (as transformers' tokenizers do)."""
        encodings = self._tok.encode_batch([(query, d) for d in documents],
                                           add_special_tokens=True)
        # Token types are 0 for the first segment and 1 after it (all 0 for models whose
        # template gives none, such as RoBERTa's); the worker rebuilds them from this length.
        segments = np.fromiter((e.type_ids.index(1) if 1 in e.type_ids else len(e.ids)
                                for e in encodings), np.int32, len(encodings))
        flat = self._flatten(encodings, param)
        return Encoded(flat.ids, flat.offsets, flat.truncated, segments)

    def _flatten(self, encodings: list, param: str) -> Encoded:
        lengths = np.fromiter((len(e.ids) for e in encodings), np.int32, len(encodings))
        if not self.truncate:
            over = np.flatnonzero(lengths > self.max_tokens)
            if over.size:
                i = int(over[0])
                raise ApiError("too_large", f"'{param}[{i}]' has {int(lengths[i])} tokens; the "
                               f"model's limit is {self.max_tokens} (or set limits.truncate)",
                               param=param)
        offsets = np.zeros(len(encodings) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((t for e in encodings for t in e.ids), np.int32, int(offsets[-1]))
        truncated = sum(1 for e in encodings if e.overflowing) if self.truncate else 0
        return Encoded(ids, offsets, truncated)
