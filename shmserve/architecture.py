"""What a checkpoint's config.json says of its architecture, read without importing
transformers (seconds): how many tokens its positions hold, its hidden width under whichever
name it gives it, and whether it needs code of its own (docs/models.md, "Architectures")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Models whose position ids start past the padding id (RoBERTa's): a text of n tokens takes
# positions pad_token_id + 1 .. pad_token_id + n, so max_position_embeddings - pad_token_id - 1
# tokens fit (512 of 514).
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet",
                    "data2vec-text", "roberta-prelayernorm", "xmod", "longformer", "ibert", "luke")
# config.json's name for the hidden width: BERT's and most models' hidden_size, DistilBERT's
# dim, and others' (transformers maps them onto hidden_size; config.json keeps its own).
WIDTH_KEYS = ("hidden_size", "dim", "d_model", "n_embd")


def positions(model_cfg: dict) -> int:
    """The most tokens its position embeddings hold."""
    held = int(model_cfg.get("max_position_embeddings", 512))
    if model_cfg.get("model_type") in OFFSET_POSITIONS:  # 514 positions hold 512 tokens
        # MPNet's padding index is 1 whatever its pad_token_id (transformers' MPNetEmbeddings)
        pad = 1 if model_cfg["model_type"] == "mpnet" else model_cfg.get("pad_token_id", 1)
        held -= int(pad or 0) + 1
    return held


def unpadded(model_cfg: dict) -> str:
    """Why a model whose positions count from its padding id cannot run without one (config.json's
    pad_token_id null: transformers' forward then fails on every input), or ""."""
    kind = model_cfg.get("model_type")
    if kind in OFFSET_POSITIONS and kind != "mpnet" and model_cfg.get("pad_token_id", 1) is None:
        return (f"config.json's pad_token_id is null, and a {kind} model's positions are counted "
                "from its padding id: give the tokenizer's padding token id (RoBERTa's is 1)")
    return ""


def width(model_cfg: dict) -> int | None:
    """Its hidden width (an embedding model's vector width), by whichever name config.json
    gives it (DistilBERT's `dim`: a KeyError's traceback before), or None."""
    for key in WIDTH_KEYS:
        if isinstance(model_cfg.get(key), int) and model_cfg[key] > 0:
            return model_cfg[key]
    return None


def needs_own_code(model_cfg: dict) -> str:
    """Why a checkpoint cannot load without running code from its directory (config.json's
    `auto_map`, for a model type this transformers does not have), or "". Such code never runs
    here (trust_remote_code=False), and the worker's load failed asking for an option shmserve
    does not have. A type transformers has loads as its own class, auto_map or not; the
    installed transformers is looked at on disk, not imported."""
    auto_map = model_cfg.get("auto_map")
    if not auto_map:
        return ""
    model_type = str(model_cfg.get("model_type") or "")
    spec = importlib.util.find_spec("transformers")
    if model_type and spec is not None and spec.origin is not None:
        module = model_type.replace("-", "_")
        if (Path(spec.origin).parent / "models" / module).is_dir():
            return ""
    names = sorted(set(auto_map.values() if isinstance(auto_map, dict) else [str(auto_map)]),
                   key=str)
    return (f"config.json's model_type {model_type or '(none)'!r} is not one transformers has, "
            f"and its auto_map names code shipped with the model ({', '.join(map(str, names))}"
            "), which shmserve never runs (trust_remote_code is off, and not an option): "
            "serve a checkpoint of an architecture transformers has (docs/models.md)")
