"""Loading a model into a worker: its weights on the worker's device, warmed up on the largest
pass the batching limits allow (the first request pays no warm-up; out of memory there says
which limits to lower), a worker's models at its start (a reload's recorded source that no
longer loads falls back to the config's), a failed start's wait, the models that failed while
others loaded tried again, and a reload's replacement checked against the model it replaces."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

from gpu_workers.batcher import Limits
from gpu_workers.memory import out_of_memory
from gpu_workers.slots import hosted_configs
from shmserve import state
from shmserve.config import Config, ModelConfig
from shmserve.models import ModelSourceError, ModelSpec, inspect, replacement
from shmserve.protocol import Unloaded

log = logging.getLogger("shmserve.worker")

LOAD_BACKOFF_MAX_S = 30.0  # the longest wait after failed loads: to exit, or to try one again
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

    spec = replacement(config, active, roots)
    try:
        model, _, _ = load_warm(spec, device, cuda_graphs, limits)
    except (ModelSourceError, torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as exc:  # corrupt or unreadable weights, a config transformers refuses
        raise ModelSourceError(f"cannot load {spec.directory}: {type(exc).__name__}: "
                               f"{exc}") from exc
    return model


def load_unit(cfg: Config, name: str, spec: ModelSpec, config: ModelConfig,
              configured: ModelConfig, device: Any, limits: Limits
              ) -> tuple[ModelConfig, Any, int, float]:
    """One of a worker's models: the config it was loaded from, the model, and its warm-up's
    timed pass (real tokens, seconds). A reload's source that no longer loads (damaged since)
    falls back to the config's (`configured`), as one that is gone does (slots.hosted_configs):
    the worker failed its load in a loop, and a reload that would mend it was refused (an
    outside check). It serves apart from the run state then, which /admin/models says."""
    try:
        model, tokens, seconds = load_warm(spec, device, cfg.workers.cuda_graphs, limits)
    except Exception as exc:
        if config == configured:
            raise
        # (a ModelSourceError names its directory already)
        first = " ".join(str(exc).split()) if isinstance(exc, ModelSourceError) else \
            f"{config.source}: {describe(exc)}"
        log.error("worker.reloaded_source_failed", extra={"fields": {
            "model": name, "source": config.source, "error": describe(exc)}})
        config = configured
        try:
            model, tokens, seconds = load_warm(inspect(config, roots=cfg.model_root_paths),
                                               device, cfg.workers.cuda_graphs, limits)
        except Exception as second:  # both said: a reload's error is the one the caller needs
            raise ModelSourceError(f"{first}; the config's {config.source} did not load either: "
                                   f"{describe(second)}") from None
    return config, model, tokens, seconds


def load_hosted(cfg: Config, index: int, specs: Mapping[str, ModelSpec],
                configs: Mapping[str, ModelConfig], device: Any, limits: Limits,
                seed: Callable[[int, float], None]
                ) -> Iterator[tuple[str, tuple[ModelConfig, Any, float] | Exception]]:
    """Worker `index`'s models at its start, one by one: each name with the config it was
    loaded from, the model and the seconds it took, or with the error that stopped it (the
    worker serves the others: Retries). `seed` takes each warm-up's timed pass (real tokens,
    seconds): the admission estimate's first speed, so a burst that meets a fresh worker is
    judged too (a reload's warm-up runs beside serving and says nothing of it)."""
    configured = hosted_configs(cfg, index, reloaded=False)
    for name, spec in specs.items():
        started = time.monotonic()
        try:
            config, model, tokens, seconds = load_unit(cfg, name, spec, configs[name],
                                                       configured[name], device, limits)
        except Exception as exc:  # noqa: BLE001 - the worker serves its other models
            yield name, exc
            continue
        seed(tokens, seconds)
        yield name, (config, model, time.monotonic() - started)


def load_again(cfg: Config, index: int, name: str, device: Any, limits: Limits
               ) -> tuple[ModelConfig, Any, float]:
    """A model that failed to load, tried again (Retries), on its loader thread at the
    priority a reload's has: from its files as they are now, at the source the run state
    records for it (a reload the other workers took meanwhile) or else the config's. The
    config it loaded from, the model, the seconds it took."""
    from gpu_workers.device import yield_cores

    log.info("worker.loading", extra={"fields": {
        "model": name, "nice": yield_cores(cfg.workers.reload_nice)}})
    started = time.monotonic()
    config = hosted_configs(cfg, index)[name]
    configured = hosted_configs(cfg, index, reloaded=False)[name]
    spec = inspect(config, roots=cfg.model_root_paths)
    config, model, _, _ = load_unit(cfg, name, spec, config, configured, device, limits)
    return config, model, time.monotonic() - started


def log_loaded(name: str, model: Any, device: Any, seconds: float) -> None:
    import torch

    spec = model.spec
    log.info("worker.loaded", extra={"fields": {
        "model": name, "revision": spec.revision, "dtype": spec.dtype, "device": str(device),
        "seconds": round(seconds, 2), "torch_threads": torch.get_num_threads(),
        "prepacked_linears": getattr(model, "prepacked", 0),
        "attention": getattr(model, "attention", ""), "loader": getattr(model, "loader", ""),
        "switch_interval_ms": round(sys.getswitchinterval() * 1000, 3)}})


def on_a_nicer_thread(load: Callable[[], None], nice: int) -> None:
    """A worker's load at its start (torch's import, the weights, the warm-up: seconds of CPU)
    on a thread of lower priority (workers.reload_nice), as a reload's is: in a rolling restart
    or an apply, the workers serving meanwhile share the cores with it. The model thread
    serves afterwards at its own priority, which a thread cannot get back once lowered. It
    waits in short joins, so a stop while loading still reaches it (its signal handler)."""
    from gpu_workers.device import yield_cores

    failure: list[BaseException] = []

    def run() -> None:
        log.info("worker.loading", extra={"fields": {"nice": yield_cores(nice)}})
        try:
            load()
        except BaseException as exc:  # noqa: BLE001 - raised again on the model thread
            failure.append(exc)

    loader = threading.Thread(target=run, name="loader", daemon=True)
    loader.start()
    while loader.is_alive():
        loader.join(0.1)
    if failure:
        raise failure[0]


def describe(exc: BaseException) -> str:
    """An error on one line, for heartbeats (GET /ready) and logs."""
    error = " ".join(str(exc).split())
    return (f"{type(exc).__name__}: {error}" if error else type(exc).__name__)[:FAILURE_CHARS]


@dataclass(frozen=True, slots=True)
class Retried:
    """A retry's outcome, posted to the model thread: the config it loaded, the model and its
    seconds, or the error."""

    name: str
    loaded: tuple[ModelConfig, Any, float] | None
    error: str  # (describe's: not the exception, whose traceback holds what the load built)


@dataclass
class _Missing:
    error: str
    failures: int
    retry_at: float  # monotonic
    trying: bool = False
    tried: Any = None  # the run state's entry for it when last tried (a reload changes it)


class Retries:
    """The models a serving worker failed to load (at its start: the others loaded, so it
    serves them; before, one model that did not load took down every worker hosting it with
    the models beside it). Each is tried again on a loader thread of its own, 1 s after a
    failure and twice as long after each failure in a row, at most LOAD_BACKOFF_MAX_S: weights
    copied into place, or memory freed, are picked up without an operator. The model thread
    calls every method; `load` runs on the loader thread and its outcome comes back through
    `post` (the worker's inbox) as a Retried."""

    def __init__(self, load: Callable[[str], tuple[ModelConfig, Any, float]],
                 post: Callable[[Retried], None],
                 counted: Callable[[str], None] = lambda model: None) -> None:
        """`counted(model)`: each failure (its metric)."""
        self._load = load
        self._post = post
        self._counted = counted
        self._missing: dict[str, _Missing] = {}

    def __bool__(self) -> bool:
        return bool(self._missing)

    def failed(self, name: str, error: str) -> _Missing:
        """`error`: describe()'s."""
        old = self._missing.get(name)
        failures = old.failures + 1 if old else 1
        wait = min(2.0 ** (failures - 1), LOAD_BACKOFF_MAX_S)
        missing = self._missing[name] = _Missing(error, failures,
                                                 time.monotonic() + wait,
                                                 tried=old.tried if old else None)
        log.warning("worker.load_failed", extra={"fields": {
            "model": name, "failures": failures, "retry_in_s": wait, "error": missing.error}})
        self._counted(name)
        return missing

    def start_due(self, sources: Mapping[str, Any]) -> None:
        """Try those whose wait is over, or whose source in the run state (`sources`) changed
        since they were last tried: a reload's, which they load without waiting."""
        now = time.monotonic()
        for name, missing in self._missing.items():
            if not missing.trying and (now >= missing.retry_at
                                       or sources.get(name) != missing.tried):
                missing.trying, missing.tried = True, sources.get(name)
                threading.Thread(target=self._try, args=(name,), name=f"retry-{name}",
                                 daemon=True).start()

    def _try(self, name: str) -> None:
        try:
            loaded = self._load(name)
        except Exception as exc:  # noqa: BLE001 - counted, and tried again later
            self._post(Retried(name, None, describe(exc)))
            return
        self._post(Retried(name, loaded, ""))

    def done(self, item: Retried) -> None:
        if item.loaded is None:
            self.failed(item.name, item.error)
        else:
            del self._missing[item.name]

    def unloaded(self) -> tuple[Unloaded, ...]:
        now = time.monotonic()
        return tuple(Unloaded(name, m.error, m.failures,
                              0.0 if m.trying else round(max(0.0, m.retry_at - now), 1),
                              (m.tried or {}).get("source", ""))
                     for name, m in self._missing.items())


def back_off(cfg: Config, index: int, exc: Exception, status: Any,
             stopping: threading.Event) -> None:
    """A failed start: its error in the heartbeats (`status.failure`: GET /ready names it, and
    says "failing" where no other worker serves the model), for a while before the process
    exits, longer after each failure in a row (1, 2, 4, ... up to LOAD_BACKOFF_MAX_S): where none
    of its models loaded (where some did, it serves them: Retries).
    supervisord starts a worker again at once when it lived past `startsecs`, as a load does:
    a model that cannot load took a core in a loop of imports and loads, beside the workers
    serving, and /ready said "loading" for ever (an outside check). A stop ends the wait."""
    try:  # (counted before a heartbeat says it: the frontends read the count)
        failures = state.count_load_failure(cfg, index)
    except OSError:
        failures = 1
    status.failure = describe(exc)
    wait = max(2 * cfg.workers.heartbeat_interval_s,
               min(2.0 ** (failures - 1), LOAD_BACKOFF_MAX_S))
    status.unloaded = tuple(dataclasses.replace(u, failures=failures, retry_in_s=wait)
                            for u in status.unloaded)
    log.warning("worker.load_failed", extra={"fields": {
        "worker": index, "failures": failures, "exit_in_s": wait, "error": status.failure}})
    # A reload recorded meanwhile (frontend.reload, where every host failed the model) ends
    # the wait: the next start loads its source.
    tried, ends = _recorded(cfg, status.unloaded), time.monotonic() + wait
    while not stopping.wait(min(0.5, max(0.0, ends - time.monotonic()))):
        if time.monotonic() >= ends or _recorded(cfg, status.unloaded) != tried:
            return


def unloaded_at_start(cfg: Config, index: int, configs: Mapping[str, ModelConfig],
                      failures: list[tuple[str, Exception]]) -> tuple[Unloaded, ...]:
    """A worker none of whose models loaded: each with its error and the source it tried (the
    run state's as `configs` took it at the start, "" for the config's), for its heartbeats
    while it backs off (back_off): the frontends answer requests for them at once,
    /admin/models names them, and a reload of them is recorded for the next start."""
    configured = hosted_configs(cfg, index, reloaded=False)
    return tuple(Unloaded(name, describe(exc), 1, 0.0,
                          "" if configs[name].source == configured[name].source
                          else configs[name].source) for name, exc in failures)


def _recorded(cfg: Config, unloaded: tuple[Unloaded, ...]) -> dict:
    """The run state's sources of the models in `unloaded`."""
    try:
        sources = state.read(cfg).sources
    except (OSError, ValueError):
        return {}
    return {u.model: sources.get(u.model) for u in unloaded}
