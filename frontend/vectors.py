"""Cheap work on returned vectors in the frontend: Matryoshka shortening and normalisation."""

from __future__ import annotations

import numpy as np

from frontend.errors import ApiError


def check_dimensions(dimensions: int | None, dim: int) -> None:
    """Refuse a `dimensions` the model cannot give, before any inference is spent on it."""
    if dimensions is not None and dimensions > dim:
        raise ApiError("invalid_request", f"'dimensions' is {dimensions}; this model's vectors "
                       f"have {dim}", param="dimensions")


def shorten(vectors: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """The first `dimensions` components of each row; rows the model normalised are normalised
    again (a Matryoshka model's prefix is itself an embedding), others are left raw."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    short = np.ascontiguousarray(vectors[:, :dimensions])
    return normalize(short) if normalized else short


def normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
