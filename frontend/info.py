"""GET /info: what this deployment serves and its limits.

The body holds shmserve's own keys (models, devices, limits, process counts, version) and, as
top-level keys too, every field of Hugging Face text-embeddings-inference's GET /info, so TEI
clients read it unchanged; those describe the default (first) model.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

import shmserve
from frontend import codec
from frontend.app import CONFIG, MODELS, POOL, SPLITS, Models
from frontend.links import unit_state
from frontend.pool import WorkerPool
from frontend.variants import Splits, revision
from shmserve import topology, yes_no
from shmserve.config import Config
from shmserve.models import hosted

# shmserve's names -> TEI's.
TEI_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
TEI_POOLING = {"mean": "mean", "cls": "cls", "last": "last_token", "splade": "splade"}
EMBEDS = ("embedding", "null")  # the tasks whose rows are pooled embeddings


def _tei_model_type(model: dict[str, Any]) -> dict[str, Any]:
    """TEI's model_type: {"embedding": {"pooling"}}, or a scoring model's labels as
    {"classifier" | "reranker": {"id2label", "label2id"}}."""
    if model["task"] in EMBEDS or model["task"] == "sparse":  # TEI: pooling splade
        # (TEI has no max, weighted or combined pooling: shmserve's name for those)
        return {"embedding": {"pooling": TEI_POOLING.get(model["pooling"], model["pooling"])}}
    labels = model.get("labels") or ["LABEL_0"]  # a cross-encoder's one logit
    return {"classifier" if model["task"] == "classification" else "reranker": {
        "id2label": {str(i): label for i, label in enumerate(labels)},
        "label2id": {label: i for i, label in enumerate(labels)}}}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/info", info)


async def info(request: web.Request) -> web.Response:
    app = request.app
    return codec.render(request, describe(app[CONFIG], app[MODELS], app[POOL], app[SPLITS]))


def describe(cfg: Config, models: Models, pool: WorkerPool,
             splits: Splits | None = None) -> dict[str, Any]:
    served = [_model(cfg, served, pool, splits) for served in models.by_name.values()]
    default = next(m for m in served if m["name"] == models.default)
    devices = topology.worker_devices(cfg)
    return {
        "version": shmserve.__version__,
        "models": served,
        "devices": [_device(i, device, pool) for i, device in enumerate(devices)],
        "limits": {
            "max_batch_tokens": cfg.batching.max_batch_tokens,
            "max_batch_size": cfg.batching.max_batch_size,
            "max_texts_per_request": cfg.limits.max_texts_per_request,
            "max_input_tokens": default["max_input_tokens"],
            "max_text_chars": cfg.limits.max_text_chars,
            "max_inflight_per_frontend": cfg.frontends.max_inflight,
            "truncate": cfg.limits.truncate,
        },
        "frontends": cfg.frontends.count,
        "workers": len(devices),
        # Hugging Face text-embeddings-inference's GET /info fields.
        "model_id": default["name"],
        "model_sha": default["revision"],
        "model_dtype": TEI_DTYPES.get(default["dtype"], default["dtype"]),
        "model_type": _tei_model_type(default),
        "max_concurrent_requests": cfg.frontends.max_inflight * cfg.frontends.count,
        "max_input_length": default["max_input_tokens"],
        "max_batch_tokens": cfg.batching.max_batch_tokens,
        "max_batch_requests": cfg.batching.max_batch_size,
        "max_client_batch_size": cfg.limits.max_texts_per_request,
        "auto_truncate": cfg.limits.truncate,
        "tokenization_workers": cfg.frontends.count,
        "sha": None,
        "docker_label": None,
    }


def _model(cfg: Config, served, pool: WorkerPool, splits: Splits | None) -> dict[str, Any]:
    spec = served.spec
    # Workers name an A/B arm MODEL@VARIANT; the first arm stands for the model here.
    reported = pool.model_info(served.variants[0].unit)
    # The dtype a worker runs (auto resolved there), else the configured one while loading.
    dtype = reported.dtype if reported is not None and reported.dtype else spec.dtype
    model_cfg = next(m for m in cfg.models if m.name == spec.name)
    # The workers hash the weights (the frontend does not read them); a configured revision is
    # known at once.
    info = {"name": spec.name, "aliases": list(model_cfg.aliases),
            "revision": revision(served.variants[0], pool) or None,
            "task": spec.task, "dtype": dtype, "dim": spec.dim,
            # pooling and normalisation make an embedding; a scoring model's head has neither
            "pooling": spec.pooling if spec.task in (*EMBEDS, "sparse") else None,
            "normalize": spec.normalize if spec.task in EMBEDS else None,
            "max_input_tokens": spec.max_tokens,
            # what built the network a worker runs: shmserve (gpu_workers.bert, .modernbert)
            # or transformers; None until a worker has reported it
            "loader": (reported.loader or None) if reported is not None else None,
            # the workers that load it (models.devices) and what each says of it: the devices
            # are in "devices" by worker (an outside check: GET /admin/models alone had them)
            "workers": _hosts(cfg, served.variants[0].unit, pool)}
    if spec.task in EMBEDS:  # by name (prompt_name), and the one applied when none is named
        info["prompts"] = dict(spec.prompts)
        info["default_prompt"] = spec.default_prompt or None
        # False: the pooling leaves a prompt's tokens out (1_Pooling include_prompt: false)
        info["pooling_includes_prompt"] = not spec.skips_prompt
        # the sentence-transformers Dense projections after the pooling, in order
        info["dense"] = [{"in_features": d.in_features, "out_features": d.out_features,
                          "activation": d.activation, "bias": d.bias, "residual": d.residual}
                         for d in spec.dense]
    if spec.task == "classification":
        info["labels"] = list(spec.labels)
        info["activation"] = spec.activation  # softmax, or a multi-label model's sigmoid
    if spec.task == "rerank":
        info["activation"] = spec.activation  # of the logit: sigmoid | identity
        # a reranker answering yes or no (shmserve.yes_no): its prompt's instruction
        info["instruction"] = ((model_cfg.instruction or yes_no.DEFAULT_INSTRUCTION)
                               if spec.pair_format else None)
    if served.variants[0].name:  # an A/B split: each arm's revision ("revision": the first's)
        # and weight in force (the admin API's split, else the configured), and what a request
        # sticks to an arm by: they were in GET /admin/models only, behind the admin token (an
        # outside check)
        weights = (splits.weights(spec.name, served.variants) if splits is not None
                   else [v.weight for v in served.variants])
        info["variants"] = [{"name": v.name, "revision": revision(v, pool) or None,
                             "weight": weight, "workers": _hosts(cfg, v.unit, pool)}
                            for v, weight in zip(served.variants, weights)]
        info["sticky_key"] = served.sticky_key or None
    return info


def _hosts(cfg: Config, unit: str, pool: WorkerPool) -> list[dict[str, Any]]:
    """The workers that load `unit` by the config, each with its state of it: ready, loading,
    staged (a reload awaits its commit), failed (it serves its other models and tries this one
    again) or down."""
    devices = topology.worker_devices(cfg)
    return [{"worker": link.index, "state": unit_state(link, unit)} for link in pool.links
            if any(u.name == unit for u in hosted(cfg, devices, link.index))]


def _device(index: int, device: str, pool: WorkerPool) -> dict[str, Any]:
    """What worker `index` runs on, as its heartbeats say (a worker configured for a GPU falls
    back to the CPU where CUDA sees none); `configured`: what the config asked for. Both
    device and name are null until its first heartbeat after loading."""
    link = pool.links[index] if index < len(pool.links) else None
    name = link.beat.device if link is not None and link.beat is not None else None
    if name is not None and name.startswith("cuda"):
        actual = f"cuda:{device}"  # CUDA_VISIBLE_DEVICES shows the worker this GPU alone
    else:
        actual = name if name == topology.CPU else None  # None: not reported yet ("loading")
    return {"worker": index, "device": actual,
            "name": name if actual is not None else None,
            "configured": topology.device_label(device),
            "ready": bool(link is not None and link.ready)}
