"""Loading a model into a worker: its weights on the worker's device, warmed up on the largest
pass the batching limits allow (the first request pays no warm-up; out of memory there says
which limits to lower), and a reload's replacement checked against the model it replaces."""

from __future__ import annotations

from typing import Any

from gpu_workers.batcher import Limits
from gpu_workers.memory import out_of_memory
from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, ModelSpec, incompatible, inspect


def load_warm(spec: ModelSpec, device: Any, cuda_graphs: int, limits: Limits
              ) -> tuple[Any, int, float]:
    """The model, and its warm-up's timed pass (real tokens, seconds): the first speed of the
    worker's admission estimate (shmserve.admission)."""
    from gpu_workers.model import load_model, warm_up

    model = load_model(spec, device, cuda_graphs if device.type == "cuda" else 0)
    try:
        tokens, seconds = warm_up(model, limits.max_batch_size, limits.max_batch_tokens)
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        raise MemoryError(
            f"{spec.name}: the largest pass the batching limits allow ran out of device "
            f"memory in warm-up (max_batch_size {limits.max_batch_size}, "
            f"max_batch_tokens {limits.max_batch_tokens}); lower them: {exc}") from exc
    return model, tokens, seconds


def load_replacement(config: ModelConfig, active: ModelSpec, roots: list, device: Any,
                     cuda_graphs: int, limits: Limits) -> Any:
    """A reload's new model, on its loader thread. ModelSourceError: the source cannot be
    served (answered INVALID); anything else (out of memory) is answered FAILED."""
    import torch

    spec = inspect(config, roots=roots)
    why = incompatible(active, spec)
    if why:
        raise ModelSourceError(f"{spec.directory} cannot replace the served {active.name}: "
                               f"{why}; serving a different one needs a config change and "
                               "a restart")
    try:
        model, _, _ = load_warm(spec, device, cuda_graphs, limits)
    except (ModelSourceError, torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as exc:  # corrupt or unreadable weights, a config transformers refuses
        raise ModelSourceError(f"cannot load {spec.directory}: {type(exc).__name__}: "
                               f"{exc}") from exc
    return model
