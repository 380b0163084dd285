"""gpu_workers.modernbert: ModernBERT's networks built without transformers compute what
transformers' compute (rotary positions, global and windowed layers, cls and mean pooling),
packed as the worker runs them, and load only what they read exactly as transformers would."""

import json
import shutil

import numpy as np
import pytest
import torch

from gpu_workers import modernbert, networks
from shmserve.models import ModelSourceError
from tests.integration.modelkit import edited, fresh_loads, padded_batch, spec
from tests.tinymodel import build_tiny_bert

TASKS = ("embedding", "classification", "rerank")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{(task, pooling): directory}: tiny random ModernBERTs (4 layers: global, windowed,
    windowed, global; a window of 8 positions either way, so the test texts cross it), with
    BERT's tokenizer; and one saved with the older config fields (global_attn_every_n_layers,
    global_rope_theta, local_rope_theta) and the default window, 64."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("modernbert")
    source = build_tiny_bert(root / "bert", seed=5)
    out = {}
    for seed, (task, pooling) in enumerate((t, p) for t in TASKS for p in ("cls", "mean")):
        torch.manual_seed(seed)
        config = AutoConfig.for_model(
            "modernbert", vocab_size=30522, max_position_embeddings=512, pad_token_id=0,
            hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=48,
            local_attention=16, classifier_pooling=pooling, initializer_range=0.2,
            num_labels={"classification": 3, "rerank": 1}.get(task, 2),
            cls_token_id=101, sep_token_id=102, bos_token_id=101, eos_token_id=102)
        net = (AutoModel if task == "embedding" else AutoModelForSequenceClassification
               ).from_config(config).eval()
        target = shutil.copytree(source, root / f"{task}-{pooling}")
        net.save_pretrained(target, safe_serialization=True)
        out[task, pooling] = target
    legacy = shutil.copytree(out["embedding", "mean"], root / "legacy")
    saved = json.loads((legacy / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "local_attention"):
        saved.pop(key)
    saved.update(global_attn_every_n_layers=2, global_rope_theta=50_000.0,
                 local_rope_theta=5_000)
    (legacy / "config.json").write_text(json.dumps(saved))
    out["legacy"] = legacy
    return out


def batch(length=60):
    """Three texts: one of full length, two padded (past the window and within it)."""
    return padded_batch(length, length // 2)


def theirs(directory, task, dtype=torch.float32):
    return networks._transformers(spec(directory, task), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("task", TASKS)
def test_the_networks_compute_what_transformers_networks_compute(models, task, pooling, dtype):
    directory = models[task, pooling]
    ours, loader = networks.load(spec(directory, task), dtype)
    reference = theirs(directory, task, dtype)
    assert loader == "shmserve" and type(ours).__name__ == type(reference).__name__
    assert all(p.dtype == dtype for p in ours.parameters())
    ids, mask = batch()
    with torch.inference_mode():
        for attention in (mask, torch.ones_like(mask)):
            real = attention.bool()
            a = ours(input_ids=ids, attention_mask=attention)
            b = reference(input_ids=ids, attention_mask=attention)
            hidden = reference.base_model(input_ids=ids, attention_mask=attention)
            torch.testing.assert_close(a.last_hidden_state[real],
                                       hidden.last_hidden_state[real], rtol=0, atol=1e-5)
            if task != "embedding":
                torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)


def test_older_config_fields_read_as_transformers_reads_them(models):
    """global_attn_every_n_layers, global_rope_theta and local_rope_theta (configs on the Hub
    from before transformers 5): the layers' kinds, the bases and the default window."""
    from transformers import AutoConfig

    directory = models["legacy"]
    ours, want = modernbert.Config.read(directory), AutoConfig.from_pretrained(directory)
    assert list(ours.layer_types) == want.layer_types == [
        "full_attention", "sliding_attention"] * 2
    assert ours.rope_theta == {kind: want.rope_parameters[kind]["rope_theta"]
                               for kind in ("full_attention", "sliding_attention")}
    assert ours.local_attention == want.local_attention == 128
    net, loader = networks.load(spec(directory, "embedding"), torch.float32)
    ids, mask = batch(length=150)  # past the default window: 64 either way
    with torch.inference_mode():
        torch.testing.assert_close(
            net(ids, mask).last_hidden_state[mask.bool()],
            theirs(directory, "embedding")(input_ids=ids, attention_mask=mask)
            .last_hidden_state[mask.bool()], rtol=0, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("task", TASKS)
def test_the_worker_runs_it_packed_to_transformers_results(models, task, pooling):
    """Through gpu_workers.model, as a worker serves: several length groups in one packed
    pass, the task's head, against transformers' network and the same head."""
    from gpu_workers.model import Model

    directory = models[task, pooling]
    model = Model(spec(directory, task), torch.device("cpu"))
    assert model.loader == "shmserve" and model.packs
    ids, mask = batch()
    lengths = mask.sum(1).numpy()
    groups = [(ids[:1].numpy(), lengths[:1], None), (ids[1:].numpy(), lengths[1:], None)]
    got = model.forward_groups(groups)
    with torch.inference_mode():
        out = theirs(directory, task)(input_ids=ids, attention_mask=mask)
        if task == "embedding":
            weights = mask.unsqueeze(-1).float()
            want = torch.nn.functional.normalize(
                (out.last_hidden_state * weights).sum(1) / weights.sum(1), dim=1)
        else:
            want = out.logits
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
    # int8: the network's own forward through quantized linear layers
    q8 = Model(spec(directory, task, dtype="int8"), torch.device("cpu"))
    assert q8.loader == "shmserve" and not q8.packs
    rows = q8.forward_groups(groups)
    assert rows.shape == got.shape and np.isfinite(rows).all()


@pytest.mark.parametrize("name, config, tensors", [
    ("gelu_new", {"hidden_activation": "gelu_new"}, None),
    ("scaled-rope", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "rope_theta": 160000.0, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, None),
    ("int-eps", {"norm_eps": 1}, None),
    ("odd-kinds", {"layer_types": ["full_attention"] * 3}, None),
    ("missing-tensor", None, lambda t: {k: v for k, v in t.items() if "layers.1.mlp" not in k}),
])
def test_what_only_transformers_reads_goes_to_transformers(models, tmp_path, name, config,
                                                           tensors):
    target = edited(models["embedding", "cls"], tmp_path, name, config, tensors)
    assert modernbert.load(target, "embedding", torch.float32) is None


def test_a_tensor_of_another_shape_is_refused_as_transformers_refuses_it(models, tmp_path):
    """Without importing transformers (which took a hot reload 28 s under load to say so)."""
    target = edited(models["embedding", "cls"], tmp_path, "wider",
                    tensors=lambda t: {**t, "final_norm.weight": torch.ones(33)})
    said = (r"does not fit its config.json \(modernbert, hidden_size 32\): tensors of other "
            r"shapes: 1, e\.g\. final_norm\.weight is \[33\], the config needs \[32\]")
    with pytest.raises(ModelSourceError, match=said):
        modernbert.load(target, "embedding", torch.float32)
    with pytest.raises(ModelSourceError, match=said):  # transformers' refusal, said alike
        networks._transformers(spec(target, "embedding"), torch.float32)


def test_an_embedding_model_loads_the_encoder_of_a_classifiers_checkpoint(models):
    """Its tensors under `model.`, beside the head: the encoder loads here, as transformers'
    AutoModel loads it."""
    directory = models["classification", "mean"]
    ours, loader = networks.load(spec(directory, "embedding"), torch.float32)
    assert loader == "shmserve" and type(ours).__name__ == "ModernBertModel"
    ids, mask = batch()
    with torch.inference_mode():
        torch.testing.assert_close(
            ours(ids, mask).last_hidden_state[mask.bool()],
            theirs(directory, "embedding")(input_ids=ids, attention_mask=mask)
            .last_hidden_state[mask.bool()], rtol=0, atol=1e-5)


def test_loading_a_modernbert_never_imports_transformers(models):
    loaded, transformers, dynamo = fresh_loads([("mb", t, models[t, "mean"]) for t in TASKS])
    assert loaded == [["mb", task, "shmserve"] for task in TASKS]
    assert not transformers and not dynamo


@pytest.mark.parametrize("task", ["embedding", "rerank"])
def test_cuda_graph_shapes_give_the_plain_passes_results(models, task):
    """workers.cuda_graphs runs each group padded to a recorded shape, every position a row
    of the pass (gpu_workers.graphs; eagerly here, without a GPU), padding positions far past
    their texts included: the real rows must not change. (Such a position has no real key
    within the window; PackedModernBert lets it see its text's first token, since a fully
    masked row gives zeros in PyTorch's CPU kernel but need not on a GPU's: not testable
    here.)"""
    from gpu_workers.model import Model

    directory = models[task, "mean"]
    rng = np.random.default_rng(3)
    groups = []
    for rows, width in ((3, 40), (2, 5), (4, 60)):
        lengths = rng.integers(1, 4, rows)  # short texts in wide groups: padding far past them
        lengths[0] = width
        segments = (lengths // 2).astype(np.int64) if task == "rerank" else None
        groups.append((rng.integers(1000, 1100, (rows, width)), lengths, segments))
    plain = Model(spec(directory, task), torch.device("cpu"))
    graphed = Model(spec(directory, task), torch.device("cpu"), graphs=4)
    assert graphed.graphs is not None
    want = plain.forward_groups(groups)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(graphed.forward_groups(groups), want, rtol=1e-4, atol=1e-5)
