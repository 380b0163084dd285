"""A model directory's JSON files as sentence-transformers and transformers read them, without
torch (shmserve.models builds a ModelSpec from them): the Pooling module's mode and config,
whether it normalises, the input limit, and the modules it would run, in either version's
format (sentence-transformers 6 saves `pooling_mode` and the limit in the tokenizer's config;
older versions one flag a mode and sentence_bert_config.json's max_seq_length); and its
tokenizer.json as the tokenizers library loads it."""

from __future__ import annotations

import json
from pathlib import Path


class ModelSourceError(ValueError):
    """The model source cannot be served; the message says why and what to do."""


def max_seq_length(directory: Path) -> int:
    """sentence-transformers' input limit: sentence_bert_config.json's max_seq_length, else
    (as sentence-transformers 6 saves it, and as older versions fall back to) the tokenizer's
    model_max_length; the model's positions bound it too (`inspect`)."""
    st_cfg = read_json(directory / "sentence_bert_config.json") or {}
    limit = st_cfg.get("max_seq_length")
    if limit is None:
        limit = (read_json(directory / "tokenizer_config.json") or {}).get("model_max_length")
    return int(limit) if isinstance(limit, (int, float)) and limit >= 1 else 10**9


# sentence-transformers' pooling modes this server computes (gpu_workers.tasks), by the name
# sentence-transformers 6 saves (`pooling_mode`) and the flag older versions save
POOLINGS = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}
# the modules a sentence-transformers embedding model may have for this server to serve it as
# sentence-transformers does: another (Dense, a projection) would change its vectors
MODULES = ("Transformer", "Pooling", "Normalize", "Dropout")  # (Dropout: none at inference)


def _st_modules(directory: Path) -> list[dict]:
    modules = read_json(directory / "modules.json") or []
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def pooling_of(choice: str, task: str, directory: Path) -> str:
    """The configured pooling, or (auto) the model's own: sentence-transformers' Pooling
    module's config, in either version's format. One this server does not compute (max,
    weighted mean, several at once), and modules it does not run (a Dense projection), are
    refused rather than served as another pooling's vectors."""
    if choice != "auto":
        return choice
    modules = _st_modules(directory)
    if task == "embedding":
        for module in modules:
            kind = str(module.get("type", "")).rpartition(".")[2]
            if kind not in MODULES:
                raise ModelSourceError(
                    f"{directory}: modules.json has a {kind or 'nameless'} module "
                    f"({module.get('path') or module.get('name')}), which shmserve does not "
                    f"run (it runs {', '.join(MODULES)}): its vectors would not be the "
                    "model's")
    pool_cfg = pooling_config(directory)
    if "pooling_mode" in pool_cfg:  # sentence-transformers 6: a name, or a list of them
        modes = pool_cfg["pooling_mode"]
        found = [POOLINGS.get(str(m), str(m))
                 for m in (modes if isinstance(modes, list) else [modes])]
    else:
        found = [mode for flag, mode in POOLING_FLAGS.items() if pool_cfg.get(flag)]
    if not found:
        return "mean"
    if len(found) > 1 or found[0] not in POOLINGS.values():
        raise ModelSourceError(
            f"{directory}: its sentence-transformers pooling is {' + '.join(found)}, which "
            "shmserve does not compute (it pools cls, mean or lasttoken); set "
            "models[].pooling to serve it pooled otherwise")
    return found[0]


def pooling_config(directory: Path) -> dict:
    """The Pooling module's config.json (its directory as modules.json names it)."""
    path = next((m.get("path") for m in _st_modules(directory)
                 if str(m.get("type", "")).endswith("Pooling")), None) or "1_Pooling"
    found = read_json(directory / path / "config.json")
    return found if isinstance(found, dict) else {}


def normalize_of(choice: str, directory: Path) -> bool:
    if choice != "auto":
        return choice == "true"
    return any(str(m.get("type", "")).endswith("Normalize") for m in _st_modules(directory))


def read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{path}: invalid JSON ({exc})") from None


def tokenizer(directory: Path):
    """The model's fast tokenizer (a tokenizers.Tokenizer) from its tokenizer.json. One that
    does not load (a truncated copy: `EOF while parsing a string at line 1 column 1000`) is
    a ModelSourceError naming the file, where tokenizers' own error names none."""
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises Exception itself
        raise ModelSourceError(f"{path} does not load as a tokenizer ({exc})") from None
