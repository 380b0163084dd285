"""The check behind `dtype: auto`: reduced precision is kept only where it agrees with fp32.

At load, a model configured `auto` whose device computes bf16 natively runs a fixed probe of
English texts (pairs for a cross-encoder) in fp32 and in bf16; bf16 is kept when every output
agrees with fp32 to `models[].auto_min_cosine` (cosine of each row; for single scores, one
minus the largest error relative to the largest score), else the worker serves fp32 and says
so in its log. A deployment gets the faster dtype where it is safe, per model and per device.
"""

from __future__ import annotations

import numpy as np

from shmserve.model_files import tokenizer
from shmserve.models import ModelSpec

PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "How do I reset my password if I no longer have access to my email account?",
    ("Stock markets fell sharply on Tuesday after the central bank raised interest rates by "
     "half a percentage point, the largest increase in two decades."),
    "I loved this movie!",
    "The service was slow and the food arrived cold; I will not be coming back.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "def add(a, b): return a + b",
    "Ok",
    ("A transformer encoder maps a sequence of tokens to a sequence of contextual vectors, and "
     "a pooling step turns those vectors into one embedding for the whole text; sentence "
     "embedding models are trained so that texts with similar meanings land close together, "
     "which makes them useful for semantic search, clustering, deduplication and retrieval "
     "augmented generation, where a question is matched against passages of a large corpus "
     "before a language model writes its answer from the passages it was given."),
    "Numbers like 3.14159, dates like 2026-11-30 and symbols like #, @ and % appear too.",
)


def probe_batch(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The probe as the worker would batch it: padded int64 ids, lengths, segments (pairs)."""
    tok = tokenizer(spec.directory)
    tok.no_padding()
    tok.enable_truncation(max_length=spec.max_tokens)
    if spec.task == "rerank":
        query = PROBE_TEXTS[1]
        encodings = tok.encode_batch([(query, t) for t in PROBE_TEXTS], add_special_tokens=True)
        segments = np.array([e.type_ids.index(1) if 1 in e.type_ids else len(e.ids)
                             for e in encodings], np.int64)
    else:
        encodings = tok.encode_batch(list(PROBE_TEXTS), add_special_tokens=True)
        segments = None
    lengths = np.array([len(e.ids) for e in encodings], np.int64)
    ids = np.zeros((len(encodings), int(lengths.max())), np.int64)
    for row, encoding in zip(ids, encodings):
        row[:len(encoding.ids)] = encoding.ids
    return ids, lengths, segments


def agreement(want: np.ndarray, got: np.ndarray) -> float:
    """1.0 for identical outputs. Rows of width > 1 (embeddings, class logits): the smallest
    cosine between matching rows. Single scores (rerank): one minus the largest absolute error
    relative to the largest reference score."""
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    if want.shape != got.shape:
        raise ValueError(f"shapes differ: {want.shape} and {got.shape}")
    if not np.isfinite(got).all():
        return float("-inf")
    if want.shape[1] == 1:
        scale = max(float(np.abs(want).max()), 1e-6)
        return 1.0 - float(np.abs(want - got).max()) / scale
    norms = np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1)
    cosine = (want * got).sum(1) / np.maximum(norms, 1e-12)
    return float(cosine.min())
