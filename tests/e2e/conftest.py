from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY_MAX_TOKENS, tiny_overrides
from tests.e2e.test_api import TEXTS
from tests.stack import Stack
from tests.tinymodel import (build_tiny_bert, build_tiny_classifier, build_tiny_other,
                             build_tiny_splade, build_tiny_static, build_tiny_yes_no_reranker)

# The task stack's (task_stack): its admin token, its classifier's labels, the A/B weight.
TOKEN = "test-admin-token"
LABELS = ["negative", "neutral", "positive"]
AB_WEIGHT_B = 0.3
QWEN3_INSTRUCTION = "Given a question, find the passage that answers it"


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory):
    """A tiny BERT wide and deep enough for a forward of 512 tokens to take ~25 ms on one
    thread: queues that last (tests/e2e/test_reliability.py, test_stopping.py)."""
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "slow", hidden=256, layers=4,
                           heads=4, max_positions=512)


@pytest.fixture(scope="session")
def native(tiny_stack):
    """TEXTS through the native /predict: what every other protocol must return."""
    status, _, body = tiny_stack.post_json("/predict", {"texts": TEXTS})
    assert status == 200
    return np.array(body["results"], dtype=np.float32)


@pytest.fixture(scope="package")
def task_dirs(tmp_path_factory, tiny_model):
    """The tiny models of every task (tests/e2e/test_tasks.py, test_task_protocols.py)."""
    root = tmp_path_factory.mktemp("task-models")
    return {"tiny": tiny_model,
            "other": build_tiny_bert(root / "other", seed=1, max_positions=TINY_MAX_TOKENS),
            "clf": build_tiny_classifier(root / "clf", labels=LABELS, seed=2),
            "clf-multi": build_tiny_classifier(root / "clf-multi", labels=LABELS, seed=12,
                                               problem_type="multi_label_classification"),
            "ce": build_tiny_classifier(root / "ce", num_labels=1, seed=3),
            # A cross-encoder whose score is its logit, and one whose logits (past ~17) make
            # a float32 sigmoid 1.0 for every pair.
            "ce-id": build_tiny_classifier(root / "ce-id", num_labels=1, seed=3,
                                           activation="torch.nn.modules.linear.Identity"),
            "ce-hot": build_tiny_classifier(root / "ce-hot", num_labels=1, seed=3, bias=20.0),
            "sp": build_tiny_splade(root / "sp", seed=9, max_positions=TINY_MAX_TOKENS),
            # Architectures other than BERT's (test_tasks.py): MPNet's and ELECTRA's
            # (gpu_workers.bert), ModernBERT's (gpu_workers.modernbert), DeBERTa-v3's
            # (gpu_workers.deberta), a Qwen3 decoder pooled on its last token (gpu_workers.qwen3);
            # and one transformers loads: a DistilBERT whose config names its width twice
            "mpnet": build_tiny_other(root / "mpnet", "mpnet", seed=4),
            "modernbert": build_tiny_other(root / "modernbert", "modernbert", seed=7),
            "ce-electra": build_tiny_other(root / "ce-electra", "electra", task="rerank",
                                           seed=6),
            "ce-deberta": build_tiny_other(root / "ce-deberta", "deberta-v2", task="rerank",
                                           seed=5),
            "qwen3": build_tiny_other(root / "qwen3", "qwen3", pooling="last", seed=8),
            "distil": build_tiny_other(root / "distil", "distilbert", seed=10),
            # a reranker answering yes or no, as Qwen3-Reranker (shmserve.yes_no)
            "qwen3-ce": build_tiny_yes_no_reranker(root / "qwen3-ce", seed=11),
            "st6-cls": st6_saved(tiny_model, root / "st6-cls"),
            "st6-dense": st6_dense_saved(tiny_model, root / "st6-dense"),
            # sentence-transformers' StaticEmbedding (model2vec's kind): no transformer
            "static": build_tiny_static(root / "static")}


def st6_saved(source, target):
    """`source` saved by this sentence-transformers (6.x: `pooling_mode`, the input limit in
    the tokenizer's config) with CLS pooling and an input limit of 16 tokens."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    SentenceTransformer(modules=[modules.Transformer(str(source), max_seq_length=16),
                                 modules.Pooling(32, "cls"), modules.Normalize()],
                        device="cpu").save(str(target))
    return target


def st6_dense_saved(source, target):
    """`source` saved by this sentence-transformers with two pooling modes side by side (max,
    weighted mean) and two Dense projections (64 -> 16, tanh; 16 -> 8 without bias, GELU), as
    LaBSE, EmbeddingGemma or stella have Dense projections after their pooling."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    SentenceTransformer(modules=[modules.Transformer(str(source)),
                                 modules.Pooling(32, ["max", "weightedmean"]),
                                 modules.Dense(64, 16),
                                 modules.Dense(16, 8, bias=False,
                                               activation_function=torch.nn.GELU()),
                                 modules.Normalize()], device="cpu").save(str(target))
    return target


@pytest.fixture(scope="package")
def task_stack(tmp_path_factory, task_dirs):
    """One stack serving them, shared by the task modules (a stack takes ~15 s to start)."""
    dirs = task_dirs
    tiny, other = str(dirs["tiny"]), str(dirs["other"])
    overrides = tiny_overrides(dirs["tiny"], workers={"cpu_workers": 2},
                               admin={"token": TOKEN})
    overrides["model_roots"] = sorted({str(d.parent) for d in dirs.values()})
    overrides["limits"]["truncate"] = True  # over-long pairs are cut, as CrossEncoder does
    overrides["models"] += [
        {"name": "clf", "source": str(dirs["clf"]), "task": "classification",
         "revision": "clf-r1", "devices": [1], "dtype": "fp32"},
        {"name": "ce", "source": str(dirs["ce"]), "task": "rerank", "revision": "ce-r1",
         "dtype": "fp32"},
        {"name": "clf-multi", "source": str(dirs["clf-multi"]), "task": "classification",
         "dtype": "fp32", "devices": [0]},
        {"name": "ce-id", "source": str(dirs["ce-id"]), "task": "rerank", "dtype": "fp32",
         "devices": [0]},
        {"name": "ce-hot", "source": str(dirs["ce-hot"]), "task": "rerank", "dtype": "fp32",
         "devices": [1]},
        {"name": "ab", "sticky_key": "header:X-User", "dtype": "fp32", "variants": [
            {"name": "a", "source": tiny, "revision": "ab-r1", "weight": 1 - AB_WEIGHT_B},
            {"name": "b", "source": other, "revision": "ab-r2", "weight": AB_WEIGHT_B}]},
        {"name": "ab-user", "sticky_key": "user", "dtype": "fp32", "variants": [
            {"name": "a", "source": tiny, "revision": "u-r1"},
            {"name": "b", "source": other, "revision": "u-r2"}]},
        {"name": "q8", "source": tiny, "dtype": "int8", "devices": [0]},
        {"name": "sp", "source": str(dirs["sp"]), "task": "sparse", "revision": "sp-r1",
         "dtype": "fp32"},
        {"name": "mpnet", "source": str(dirs["mpnet"]), "dtype": "fp32"},
        {"name": "modernbert", "source": str(dirs["modernbert"]), "dtype": "fp32"},
        {"name": "qwen3", "source": str(dirs["qwen3"]), "dtype": "fp32", "devices": [1]},
        {"name": "distil", "source": str(dirs["distil"]), "dtype": "fp32", "devices": [1]},
        {"name": "st6-cls", "source": str(dirs["st6-cls"]), "dtype": "fp32"},
        {"name": "st6-dense", "source": str(dirs["st6-dense"]), "dtype": "fp32"},
        {"name": "static", "source": str(dirs["static"]), "dtype": "fp32"},
        {"name": "ce-deberta", "source": str(dirs["ce-deberta"]), "task": "rerank",
         "dtype": "fp32"},
        {"name": "ce-electra", "source": str(dirs["ce-electra"]), "task": "rerank",
         "dtype": "fp32"},
        {"name": "qwen3-ce", "source": str(dirs["qwen3-ce"]), "task": "rerank", "dtype": "fp32",
         "instruction": QWEN3_INSTRUCTION, "devices": [0]},
        # auto keeps bf16 where the CPU has it natively and the probe agrees to 0.99 (random
        # tiny weights agree less closely than trained ones); "strict" asks for more than
        # bf16 can give, so it serves fp32.
        {"name": "auto", "source": tiny, "dtype": "auto", "auto_min_cosine": 0.99},
        {"name": "strict", "source": tiny, "dtype": "auto", "auto_min_cosine": 1.0,
         "devices": [0]}]
    s = Stack(tmp_path_factory.mktemp("tasks-stack"), overrides)
    s.up()
    yield s
    s.down()


def two_of_each_stack(root: Path, tiny_model: Path) -> Stack:
    """A stack (not started) of two frontends and two single-thread CPU workers: what rolling
    restarts and `apply` need to serve throughout (tests/e2e/test_operations.py, whose module
    shares one, and test_apply.py)."""
    return Stack(root, tiny_overrides(tiny_model, frontends={"count": 2}, workers={
        "devices": "cpu", "cpu_workers": 2, "torch_threads": 1}))


@pytest.fixture
def two_of_each(tmp_path, tiny_model):
    """two_of_each_stack, started for one test."""
    s = two_of_each_stack(tmp_path / "stack", tiny_model)
    s.up()
    yield s
    s.down()
