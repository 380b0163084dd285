"""What the in-process model tests share: corpus-like texts and a spec read as the worker
reads one (test_model, test_model_loading)."""

import numpy as np

from gpu_workers.model import Model
from shmserve.config import ModelConfig
from shmserve.models import inspect

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Shared memory moves token ids between processes without copies.",
         "word " * 80]  # over the 64-token limit: truncated
QUERY = "what moves token ids between processes?"


def spec(directory, task, dtype="fp32", **extra):
    return inspect(ModelConfig(name=task, source=str(directory), task=task, dtype=dtype,
                               **extra))


def run(model: Model, enc) -> np.ndarray:
    lengths = np.diff(enc.offsets)
    ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
    for i, (a, b) in enumerate(zip(enc.offsets[:-1], enc.offsets[1:])):
        ids[i, :b - a] = enc.ids[a:b]
    return model.forward(ids, lengths, enc.segments)
