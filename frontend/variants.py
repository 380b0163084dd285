"""A/B traffic split: which variant of a model serves a request.

A model configured with `variants` is served as one unit per variant (shmserve.models), each with
its own weights and revision. Each request goes to one variant, by weight:

* with no sticky key, each frontend walks the golden-ratio sequence u_n = frac(u_0 + n / phi),
  whose points spread evenly over [0, 1): a frontend's split stays within a few requests of the
  weights at any count (independent random draws would drift by sqrt(n));
* with a sticky key (`sticky_key`: a request header, or the body's `user`), u is read from
  sha256(model, key): the same key lands on the same variant on every frontend and across
  restarts, for as long as the weights stay.

The variant is the one whose share of [0, 1), in configured order, holds u. Weights come from the
config until the admin API sets others (``PUT /admin/models/{name}/split``), which it writes to
the run state (shmserve.state); every frontend re-reads that file when it changed, at its next
split request, so all frontends route by the same weights.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from shmserve.models import ModelSpec
from shmserve.state import Watch

_STEP = 0.6180339887498949  # 1 / phi


@dataclass(frozen=True, slots=True)
class Variant:
    name: str  # "" for a model without variants
    unit: str  # what the workers call it: MODEL or MODEL@VARIANT
    spec: ModelSpec
    encoder: object  # frontend.tokenizer.TextEncoder
    weight: float  # as configured


def revision(variant: Variant, pool) -> str:
    """The revision a variant serves: what its workers report (a frontend.pool.WorkerPool's
    heartbeats), else the configured one; "" until either is known."""
    info = pool.model_info(variant.unit)
    return info.revision if info is not None and info.revision else variant.spec.revision


def bucket(weights: list[float], u: float) -> int:
    """The index whose share of [0, 1) holds u; weights are relative (sum > 0)."""
    total = sum(weights)
    edge = 0.0
    last = max(i for i, w in enumerate(weights) if w > 0)
    for i, weight in enumerate(weights):
        edge += weight / total
        if u < edge and weight > 0:
            return i
    return last  # u within rounding of 1.0


def sticky_point(model: str, key: str) -> float:
    digest = hashlib.sha256(f"{model}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class Splits:
    """This frontend's router over the variants of every split model."""

    def __init__(self, watch: Watch) -> None:
        self._watch = watch
        self._points: dict[str, float] = {}

    def weights(self, model: str, variants: tuple[Variant, ...]) -> list[float]:
        """The weights in force: the admin API's, else the configured ones."""
        chosen = self._watch.current().splits.get(model)
        if chosen is not None and set(chosen) == {v.name for v in variants} and \
                sum(chosen.values()) > 0:
            return [chosen[v.name] for v in variants]
        return [v.weight for v in variants]

    def choose(self, model: str, variants: tuple[Variant, ...], key: str | None,
               serving: Callable[[str], object] = lambda unit: True) -> Variant:
        """The arm a request goes to: by the weights, sticky on `key` where one is given. An
        arm no worker serves now (`serving(unit)` falsy: its workers restarting, or its model
        not loaded) gives its share to the arms that are served, so its requests are answered
        by another arm (X-Model-Variant names it) rather than refused 503."""
        if len(variants) == 1:
            return variants[0]
        if key is not None:
            u = sticky_point(model, key)
        else:
            u = self._points.get(model)
            u = random.random() if u is None else (u + _STEP) % 1.0
            self._points[model] = u
        weights = self.weights(model, variants)
        chosen = variants[bucket(weights, u)]
        if serving(chosen.unit):
            return chosen
        served = [w if w > 0 and serving(v.unit) else 0.0 for v, w in zip(variants, weights)]
        return variants[bucket(served, u)] if any(served) else chosen
