"""Loading a model into a worker: its weights on the worker's device, warmed up on the largest
pass the batching limits allow (the first request pays no warm-up; out of memory there says
which limits to lower), a worker's models at its start (a reload's recorded source that no
longer loads falls back to the config's), a failed start's wait, and a reload's replacement
checked against the model it replaces."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from gpu_workers.batcher import Limits
from gpu_workers.memory import out_of_memory
from gpu_workers.slots import hosted_configs
from shmserve import state
from shmserve.config import Config, ModelConfig
from shmserve.models import ModelSourceError, ModelSpec, incompatible, inspect

log = logging.getLogger("shmserve.worker")

LOAD_BACKOFF_MAX_S = 30.0  # the longest a worker whose load failed waits before it exits
FAILURE_CHARS = 1000  # of a failed load's error, in heartbeats


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


def load_hosted(cfg: Config, index: int, specs: Mapping[str, ModelSpec],
                configs: Mapping[str, ModelConfig], device: Any, limits: Limits,
                seed: Callable[[int, float], None]
                ) -> Iterator[tuple[ModelConfig, ModelSpec, Any, float]]:
    """Worker `index`'s models at its start, one by one: the config each was loaded from, its
    spec as loaded, the model, and the seconds it took. `seed` takes each warm-up's timed pass
    (real tokens, seconds): the admission estimate's first speed, so a burst that meets a fresh
    worker is judged too (a reload's warm-up runs beside serving and says nothing of it)."""
    configured = hosted_configs(cfg, index, reloaded=False)
    for name, spec in specs.items():
        started = time.monotonic()
        config = configs[name]
        try:
            model, tokens, seconds = load_warm(spec, device, cfg.workers.cuda_graphs, limits)
        except Exception as exc:
            # A reload's source that no longer loads (damaged since): the config's, as for
            # one that is gone (slots.hosted_configs). The worker failed its load in a loop,
            # and a reload that would mend it was refused: a worker not ready (an outside
            # check). It serves apart from the run state, which /admin/models says.
            if config == configured[name]:
                raise
            log.error("worker.reloaded_source_failed", extra={"fields": {
                "model": name, "source": config.source,
                "error": f"{type(exc).__name__}: {exc}"}})
            config = configured[name]
            model, tokens, seconds = load_warm(inspect(config, roots=cfg.model_root_paths),
                                               device, cfg.workers.cuda_graphs, limits)
        seed(tokens, seconds)
        yield config, model.spec, model, time.monotonic() - started


def back_off(cfg: Config, index: int, exc: Exception, status: Any,
             stopping: threading.Event) -> None:
    """A failed start: its error in the heartbeats (`status.failure`: GET /ready names it, and
    says "failing" where no other worker serves the model), for a while before the process
    exits, longer after each failure in a row (1, 2, 4, ... up to LOAD_BACKOFF_MAX_S).
    supervisord starts a worker again at once when it lived past `startsecs`, as a load does:
    a model that cannot load took a core in a loop of imports and loads, beside the workers
    serving, and /ready said "loading" for ever (an outside check). A stop ends the wait."""
    error = " ".join(str(exc).split())
    status.failure = (f"{type(exc).__name__}: {error}" if error
                      else type(exc).__name__)[:FAILURE_CHARS]
    try:
        failures = state.count_load_failure(cfg, index)
    except OSError:
        failures = 1
    wait = max(2 * cfg.workers.heartbeat_interval_s,
               min(2.0 ** (failures - 1), LOAD_BACKOFF_MAX_S))
    log.warning("worker.load_failed", extra={"fields": {
        "worker": index, "failures": failures, "exit_in_s": wait, "error": status.failure}})
    stopping.wait(wait)
