"""Tiny random models of each task, built once per test module."""

import pytest

from tests.tinymodel import build_tiny_bert, build_tiny_classifier


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("task-models")
    return {"clf": build_tiny_classifier(root / "clf", num_labels=3, seed=3),
            "ce": build_tiny_classifier(root / "ce", num_labels=1, seed=4),
            "emb": build_tiny_bert(root / "emb", seed=5)}
