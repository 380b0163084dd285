"""Tiny random models of each task, built once per test module; the config of a run directory
for a worker started by hand (test_pool, test_news)."""

import pytest
import yaml

from shmserve import config
from tests.conftest import tiny_overrides
from tests.tinymodel import build_tiny_bert, build_tiny_classifier


def run_config(tmp_path, overrides: dict) -> config.Config:
    """The test env's config with `overrides`, its run directory in `tmp_path`, written there
    as `shmserve up` would (config.json, sockets/) for processes started by hand."""
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump(overrides))
    cfg = config.load(env="test", extra=extra,
                      environ={"SHMSERVE__SERVER__RUN_DIR": str(tmp_path / "run")})
    (cfg.run_dir / "sockets").mkdir(parents=True)
    (cfg.run_dir / "config.json").write_text(cfg.to_json())
    return cfg


@pytest.fixture
def cfg(tmp_path, tiny_model):
    return run_config(tmp_path, tiny_overrides(tiny_model))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("task-models")
    return {"clf": build_tiny_classifier(root / "clf", num_labels=3, seed=3),
            "ce": build_tiny_classifier(root / "ce", num_labels=1, seed=4),
            "emb": build_tiny_bert(root / "emb", seed=5)}
