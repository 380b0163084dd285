"""gpu_workers.qwen3: a Qwen3 embedder (Qwen3-Embedding's architecture) built without
transformers computes what transformers' computes (grouped key-value heads, per-head query and
key norms, rotary positions, causal attention), packed as the worker runs it, and loads only
what it reads exactly as transformers would."""

import shutil

import numpy as np
import pytest
import torch

from gpu_workers import networks, qwen3
from tests.integration.modelkit import edited, fresh_loads, padded_batch, spec
from tests.tinymodel import build_tiny_bert

SHAPES = {
    # Qwen3-Embedding-0.6B's proportions: grouped key-value heads, a head size of its own
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                attention_bias=True),
    "mha": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{shape: directory}: tiny random Qwen3 decoders with BERT's tokenizer, saved as
    transformers saves Qwen3Model; and one saved inside a causal LM (`model.`, an lm_head)."""
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)

    root = tmp_path_factory.mktemp("qwen3")
    source = build_tiny_bert(root / "bert", seed=5)
    out = {}
    for seed, (name, shape) in enumerate(SHAPES.items()):
        torch.manual_seed(seed)
        config = AutoConfig.for_model(
            "qwen3", vocab_size=30522, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0,
            initializer_range=0.2, **shape)
        target = shutil.copytree(source, root / name)
        AutoModel.from_config(config).eval().save_pretrained(target, safe_serialization=True)
        out[name] = target
    torch.manual_seed(9)
    config = AutoConfig.for_model("qwen3", vocab_size=30522, hidden_size=32,
                                  intermediate_size=48, num_hidden_layers=2, pad_token_id=0,
                                  initializer_range=0.2, **SHAPES["gqa"])
    target = shutil.copytree(source, root / "causal-lm")
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(target,
                                                                    safe_serialization=True)
    out["causal-lm"] = target
    for labels, name in ((3, "classifier"), (1, "cross-encoder")):  # as transformers saves them
        torch.manual_seed(10 + labels)
        config = AutoConfig.for_model("qwen3", vocab_size=30522, hidden_size=32,
                                      intermediate_size=48, num_hidden_layers=2, pad_token_id=0,
                                      initializer_range=0.2, num_labels=labels,
                                      **SHAPES["gqa"])
        target = shutil.copytree(source, root / name)
        AutoModelForSequenceClassification.from_config(config).eval().save_pretrained(
            target, safe_serialization=True)
        out[name] = target
    return out


def batch(length=40):
    """Three texts padded on the right as a worker pads them: one of full length, two not."""
    return padded_batch(length, 25)


def hidden(net, ids, mask):
    with torch.inference_mode():
        return net(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [*SHAPES, "causal-lm"])
def test_the_network_computes_what_transformers_network_computes(models, name, dtype):
    directory = models[name]
    ours, loader = networks.load(spec(directory, "embedding"), dtype)
    theirs = networks._transformers(spec(directory, "embedding"), dtype)
    assert loader == "shmserve" and type(ours).__name__ == type(theirs).__name__
    assert all(p.dtype == dtype for p in ours.parameters())
    ids, mask = batch()
    for attention in (mask, torch.ones_like(mask)):
        torch.testing.assert_close(hidden(ours, ids, attention), hidden(theirs, ids, attention),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", SHAPES)
def test_the_worker_runs_it_packed_to_transformers_results(models, name):
    """Through gpu_workers.model, as a worker serves: several length groups in one packed
    pass, pooled on each text's last token and normalised, against transformers' network."""
    from gpu_workers.model import Model

    directory = models[name]
    served = spec(directory, "embedding", pooling="last")
    model = Model(served, torch.device("cpu"))
    assert model.loader == "shmserve" and model.packs
    theirs = networks._transformers(served, torch.float32)
    ids, mask = batch()
    lengths = mask.sum(1).numpy()
    groups = [(ids[:1].numpy(), lengths[:1], None), (ids[1:].numpy(), lengths[1:], None)]
    got = model.forward_groups(groups)
    with torch.inference_mode():
        last = theirs(input_ids=ids, attention_mask=mask).last_hidden_state[
            torch.arange(3), torch.as_tensor(lengths) - 1]
    np.testing.assert_allclose(got, torch.nn.functional.normalize(last, dim=1).numpy(),
                               atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("name,task", [("classifier", "classification"),
                                       ("cross-encoder", "rerank")])
def test_a_sequence_classifier_runs_packed_to_transformers_logits(models, name, task, dtype):
    """Qwen3ForSequenceClassification (a classifier, a converted reranker such as
    Qwen3-Reranker-seq-cls) built here: its linear `score` on each text's last real token,
    several length groups a pass, against transformers' network (it ran transformers' own,
    one forward per group); int8 runs the network's own forward, quantized."""
    from gpu_workers.model import Model

    served = spec(models[name], task, dtype=dtype)
    model = Model(served, torch.device("cpu"))
    assert model.loader == "shmserve" and model.packs == (dtype != "int8")
    theirs = networks._transformers(spec(models[name], task), torch.float32)
    ids, mask = batch()
    lengths = mask.sum(1).numpy()
    groups = [(ids[:1].numpy(), lengths[:1], None), (ids[1:].numpy(), lengths[1:], None)]
    got = model.forward_groups(groups)
    with torch.inference_mode():
        want = theirs(input_ids=ids, attention_mask=mask).logits.numpy()
    assert got.shape == want.shape == (3, 3 if name == "classifier" else 1)
    if dtype == "int8":  # quantized weights and activations (per batch): near, not equal
        assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95, (got, want)
    else:
        np.testing.assert_allclose(got, want, atol={"fp32": 1e-5, "bf16": 0.05}[dtype])


def test_what_only_transformers_reads_goes_to_transformers(models, tmp_path):
    """A sliding window, scaled rotary positions, another activation, a classifier's task, a
    missing tensor: each declined here, so transformers loads it (or refuses it)."""
    source = models["gqa"]
    for name, change in (("window", {"use_sliding_window": True, "sliding_window": 8}),
                         ("scaled", {"rope_parameters": {"rope_type": "linear",
                                                         "rope_theta": 1e4, "factor": 2.0}}),
                         ("act", {"hidden_act": "gelu"}),
                         ("eps", {"rms_norm_eps": 1}),
                         ("heads", {"num_key_value_heads": 3})):
        directory = edited(source, tmp_path, name, config=change)
        assert qwen3.Config.read(directory) is None, name
    assert qwen3.load(source, "classification", torch.float32) is None  # no score weights
    missing = edited(source, tmp_path, "missing", tensors=lambda t: {
        k: v for k, v in t.items() if "q_norm" not in k})
    assert qwen3.load(missing, "embedding", torch.float32) is None
    # transformers' own network is never run packed: this module's pass is for its own
    assert not networks.packs(networks._transformers(spec(source, "embedding"), torch.float32))


def test_loading_a_qwen3_embedder_never_imports_transformers(models):
    loaded, transformers_imported, _ = fresh_loads(
        [(name, "embedding", models[name]) for name in ("gqa", "causal-lm")])
    assert [loader for _, _, loader in loaded] == ["shmserve"] * 2
    assert not transformers_imported
