"""What a model directory says about itself, read without torch.

Both sides need it: the frontend for the tokenizer and the input limit, the worker for pooling,
normalisation and the weights. A source is a directory, or ``package:NAME`` for an installed
Python package that ships one (``NAME.get_model_path()`` or a ``model/`` folder beside it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from shmserve.config import ModelConfig


class ModelSourceError(ValueError):
    """The model source cannot be served; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    directory: Path
    task: str
    pooling: str  # mean | cls | last
    normalize: bool
    max_tokens: int
    dim: int
    dtype: str
    revision: str


def resolve_source(source: str, roots: list[Path] | None = None) -> Path:
    """The model directory of `source`; a directory must lie under one of `roots` (None: no
    confinement, for tools that read a model the user points them at)."""
    if source.startswith("package:"):
        package = source.removeprefix("package:")
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModelSourceError(f"model package {package!r} is not installed "
                                   f"(pip install {package.replace('_', '-')})")
        path = Path(spec.origin).parent / "model"
        roots = None  # installed packages are trusted code already
    else:
        path = Path(source).expanduser()
    if roots is not None:
        real = path.resolve()
        if not any(real.is_relative_to(root.resolve()) for root in roots):
            raise ModelSourceError(f"model directory {real} is outside the model roots "
                                   f"({', '.join(map(str, roots))}); add its parent to "
                                   "model_roots")
    if not path.is_dir():
        raise ModelSourceError(f"model directory not found: {path}")
    return path.resolve()


def weights_file(directory: Path) -> Path:
    path = directory / "model.safetensors"
    if path.is_file():
        return path
    pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
    if pickles:
        raise ModelSourceError(f"{directory} holds only pickle checkpoints ({', '.join(pickles)}); "
                               "shmserve loads safetensors only: convert with "
                               "safetensors.torch.save_file")
    raise ModelSourceError(f"{directory}: no model.safetensors")


def inspect(cfg: ModelConfig, with_revision: bool = True,
            roots: list[Path] | None = None) -> ModelSpec:
    directory = resolve_source(cfg.source, roots)
    model_cfg = _read_json(directory / "config.json")
    if model_cfg is None:
        raise ModelSourceError(f"{directory}: no config.json")
    if not (directory / "tokenizer.json").is_file():
        raise ModelSourceError(f"{directory}: no tokenizer.json (a fast tokenizer is required)")
    st_cfg = _read_json(directory / "sentence_bert_config.json") or {}
    limit = min(int(model_cfg.get("max_position_embeddings", 512)),
                int(st_cfg.get("max_seq_length", 10**9)))
    if cfg.max_input_tokens:
        limit = min(limit, cfg.max_input_tokens)
    revision = cfg.revision
    if not revision and with_revision:
        revision = weights_digest(weights_file(directory))
    return ModelSpec(
        name=cfg.name,
        directory=directory,
        task=cfg.task,
        pooling=_pooling(cfg.pooling, directory),
        normalize=_normalize(cfg.normalize, directory),
        max_tokens=limit,
        dim=int(model_cfg["hidden_size"]),
        dtype=cfg.dtype,
        revision=revision,
    )


def weights_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def _pooling(choice: str, directory: Path) -> str:
    if choice != "auto":
        return choice
    pool_cfg = _read_json(directory / "1_Pooling" / "config.json") or {}
    if pool_cfg.get("pooling_mode_cls_token"):
        return "cls"
    if pool_cfg.get("pooling_mode_lasttoken"):
        return "last"
    return "mean"


def _normalize(choice: str, directory: Path) -> bool:
    if choice != "auto":
        return choice == "true"
    modules = _read_json(directory / "modules.json") or []
    return any(str(m.get("type", "")).endswith("Normalize") for m in modules)


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{path}: invalid JSON ({exc})") from None
