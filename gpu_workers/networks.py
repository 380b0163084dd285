"""A served model's network from its directory, in eval mode: the BERT family's (bert, roberta,
xlm-roberta, distilbert, mpnet, electra) through gpu_workers.bert, ModernBERT's through
gpu_workers.modernbert, DeBERTa-v2's through gpu_workers.deberta and a Qwen3 embedder through
gpu_workers.qwen3, which do not import transformers (~3 s of a worker's start); every
other architecture, or a checkpoint those modules do not read exactly as transformers would,
through transformers' Auto classes, which load it or refuse it with a clear
ModelSourceError."""

from __future__ import annotations

from typing import Any

import torch

from gpu_workers import bert, checkpoint, deberta, modernbert, packed, qwen3, static, tasks
from shmserve import logs
from shmserve.models import ModelSourceError, ModelSpec, weights_file


def load(spec: ModelSpec, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """(the network, weights in `dtype`; which loaded it: "shmserve" or "transformers")."""
    for family in (static, bert, modernbert, deberta, qwen3):
        net = family.load(spec.directory, spec.task, dtype)
        if net is not None:
            return net, "shmserve"
    return _transformers(spec, dtype), "transformers"


# Modules whose networks run a packed pass of their own (`Packed`), not gpu_workers.packed's.
OWN_PACKED = (modernbert, qwen3)


def packs(net: torch.nn.Module) -> bool:
    """Whether a packed pass (several length groups in one forward) runs this network."""
    return packed.supports(net) or any(family.supports(net) for family in OWN_PACKED)


def packed_encoder(net: torch.nn.Module, bucket: bool, prepacked: bool):
    """The packed pass for a network `packs` takes: ModernBERT's or Qwen3's own, else the BERT
    family's (gpu_workers.packed)."""
    for family in OWN_PACKED:
        if family.supports(net):
            return family.Packed(net, bucket=bucket)
    return packed.PackedEncoder(net, bucket=bucket, prepacked=prepacked)


def _transformers(spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per load would clutter the JSON log
    logs.adopt()  # its records (a load report) as this worker's lines, not text on stderr
    try:
        config = AutoConfig.from_pretrained(spec.directory, trust_remote_code=False)
    except ValueError as exc:  # a model type this transformers does not have
        raise ModelSourceError(f"{spec.directory}: transformers cannot read its config.json "
                               f"as any model it has: {str(exc).splitlines()[0]}") from exc
    try:
        # Attention: transformers' choice, SDPA where the architecture has it (BERT,
        # RoBERTa, ModernBERT, Qwen, ...), else its eager attention (MPNet, DeBERTa-v2,
        # whose load failed when SDPA was asked of every model).
        net, info = tasks.network_class(spec.task).from_pretrained(
            spec.directory,
            config=config,
            use_safetensors=True,
            trust_remote_code=False,
            dtype=dtype,
            output_loading_info=True,
        )
    except RuntimeError as exc:  # transformers': "look at the above report" (its log's)
        try:
            why = shape_mismatches(spec, config)
        except Exception:  # noqa: BLE001 - the original error says more than this one
            why = None
        if not why:
            raise
        raise ModelSourceError(why) from exc
    missing = info.get("missing_keys") or []
    if spec.task != "embedding" and missing:
        raise ModelSourceError(f"{spec.directory}: weights lack {sorted(missing)[:4]}; a "
                               f"{spec.task} model needs its trained head")
    # An embedding model pools the last hidden state: only BERT's pooler (which many
    # sentence-transformers checkpoints leave out) may be missing. Weights named otherwise
    # than config.json's model expects were loaded as random ones, and served.
    if lost := sorted(k for k in missing if not k.startswith("pooler.")):
        named = sorted(info.get("unexpected_keys") or [])
        # Most of them lost, or tensors under other names: another architecture's checkpoint,
        # or another prefix. A few lost and none named otherwise: a damaged or partial copy.
        why = (f"its tensors are named {named[:3] or 'otherwise'} (a checkpoint of another "
               "architecture, or saved under another prefix?)"
               if named or 2 * len(lost) > len(net.state_dict()) else
               "every other tensor is there (a damaged or partial copy?)")
        raise ModelSourceError(
            f"{spec.directory}: model.safetensors lacks {len(lost)} of the weights its "
            f"config.json's model ({config.model_type}) needs, e.g. {lost[:3]}; {why}")
    return net.eval()


def shape_mismatches(spec: ModelSpec, config: Any) -> str | None:
    """What is wrong with weights whose tensors do not have the shapes config.json gives
    (another size of model under this config, say), said in one line: transformers refuses
    them with a message that points to a table it logged. None when every shape fits."""
    from safetensors import safe_open

    with torch.device("meta"):  # shapes only: nothing allocated
        net = tasks.network_class(spec.task).from_config(config)
    want = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    prefix = getattr(net, "base_model_prefix", "")
    bad = []
    with safe_open(str(weights_file(spec.directory)), framework="pt") as f:
        for key in f.keys():
            have = tuple(f.get_slice(key).get_shape())
            # saved with or without the base model's prefix (bert.), as transformers reads them
            name = next((n for n in (key, f"{prefix}.{key}", key.partition(".")[2])
                         if n in want), None)
            if name is not None and want[name] != have:
                bad.append((key, have, want[name]))
    return checkpoint.misfit(spec.directory, {"model_type": config.model_type,
                                              "hidden_size": getattr(config, "hidden_size", "?")},
                             bad) if bad else None
