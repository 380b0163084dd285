"""gpu_workers.deberta: DeBERTa-v2's and -v3's networks built without transformers compute what
transformers' compute (disentangled attention: content-to-position and position-to-content
scores, bucketed relative distances, shared or own position projections), packed as the worker
runs them, and load only what they read exactly as transformers would."""

import json
import shutil

import numpy as np
import pytest
import torch

from gpu_workers import deberta, networks, packed
from tests.integration.modelkit import edited, fresh_loads, padded_batch, spec
from tests.tinymodel import build_tiny_bert

TASKS = ("embedding", "classification", "rerank")
VARIANTS = {
    # DeBERTa-v3's (mxbai-rerank-v1, the NLI cross-encoders): buckets (16 here, so that the
    # test texts reach the logarithmic ones), shared projections, a layer-normed table, no
    # absolute positions, no token types
    "v3": dict(relative_attention=True, position_buckets=16, max_relative_positions=-1,
               pos_att_type="p2c|c2p", share_att_key=True, norm_rel_ebd="layer_norm",
               position_biased_input=False, type_vocab_size=0),
    # DeBERTa-v2's: no buckets (distances past 12 clamped), own position projections,
    # absolute positions too, token types, narrower embeddings projected
    "v2": dict(relative_attention=True, max_relative_positions=12, pos_att_type=["c2p", "p2c"],
               share_att_key=False, position_biased_input=True, type_vocab_size=2,
               embedding_size=16),
    "c2p": dict(relative_attention=True, position_buckets=32, pos_att_type=["c2p"],
                share_att_key=False, position_biased_input=False),
    # DebertaV2Config's defaults: no relative attention at all
    "absolute": dict(),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{(variant, task): directory}: tiny random DeBERTas with BERT's tokenizer."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("deberta")
    source = build_tiny_bert(root / "bert", seed=5)
    out = {}
    for seed, (variant, task) in enumerate((v, t) for v in VARIANTS for t in TASKS):
        torch.manual_seed(seed)
        config = AutoConfig.for_model(
            "deberta-v2", vocab_size=30522, max_position_embeddings=128, pad_token_id=0,
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
            initializer_range=0.3, num_labels={"classification": 3, "rerank": 1}.get(task, 2),
            **VARIANTS[variant])
        net = (AutoModel if task == "embedding" else AutoModelForSequenceClassification
               ).from_config(config).eval()
        target = shutil.copytree(source, root / f"{variant}-{task}")
        net.save_pretrained(target, safe_serialization=True)
        out[variant, task] = target
    return out


def batch(length=40):
    """Three texts: one of full length, two padded; a pair's token types on the first."""
    ids, mask = padded_batch(length, 25)
    types = torch.zeros_like(ids)
    types[0, 15:] = 1
    return ids, mask, types


def theirs(directory, task, dtype=torch.float32):
    return networks._transformers(spec(directory, task), dtype)


def outputs(net, ids, attention, types):
    """(the encoder's last hidden state at real tokens, the logits or None)."""
    extra = {} if types is None else {"token_type_ids": types}
    with torch.inference_mode():
        hidden = net.base_model(input_ids=ids, attention_mask=attention, **extra)
        out = net(input_ids=ids, attention_mask=attention, **extra)
    real = attention.bool()
    return hidden.last_hidden_state[real].float(), getattr(out, "logits", None)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("task", TASKS)
def test_the_networks_compute_what_transformers_networks_compute(models, task, variant):
    directory = models[variant, task]
    ours, loader = networks.load(spec(directory, task), torch.float32)
    reference = theirs(directory, task)
    assert loader == "shmserve" and type(ours).__name__ == type(reference).__name__
    ids, mask, types = batch()
    for attention, token_types in ((mask, types if variant == "v2" else None),
                                   (torch.ones_like(mask), None)):
        (a, a_logits), (b, b_logits) = (outputs(net, ids, attention, token_types)
                                        for net in (ours, reference))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        if task != "embedding":
            torch.testing.assert_close(a_logits, b_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["v3", "v2"])
@pytest.mark.parametrize("task", TASKS)
def test_in_bf16_they_are_at_least_as_near_fp32_as_transformers_own(models, task, variant):
    """transformers runs DeBERTa's attention eagerly (bf16 products, its root of the scale
    rounded to bf16), this module through scaled_dot_product_attention: not the same rounding.
    Against transformers in fp32, on padded texts' real tokens and on unpadded ones."""
    directory = models[variant, task]
    ours, _ = networks.load(spec(directory, task), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    reference, theirs_bf16 = theirs(directory, task), theirs(directory, task, torch.bfloat16)
    ids, mask, _ = batch()
    for attention in (mask, torch.ones_like(mask)):
        (want, _), (got, _), (theirs_got, _) = (outputs(net, ids, attention, None)
                                                for net in (reference, ours, theirs_bf16))
        # on average at least as near; the largest difference within rounding's noise
        (ours_mean, ours_max), (theirs_mean, theirs_max) = (
            ((x - want).abs().mean().item(), (x - want).abs().max().item())
            for x in (got, theirs_got))
        assert ours_mean <= theirs_mean * 1.05, (ours_mean, theirs_mean)
        assert ours_max <= theirs_max * 1.5, (ours_max, theirs_max)
        cosine, theirs_cosine = (torch.nn.functional.cosine_similarity(x, want).min().item()
                                 for x in (got, theirs_got))
        assert cosine >= theirs_cosine - 1e-3, (cosine, theirs_cosine)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("task", TASKS)
def test_the_worker_runs_them_packed_to_transformers_results(models, task, variant):
    """Through gpu_workers.model, as a worker serves: several length groups in one packed
    pass (gpu_workers.packed, its position scores per group), the task's head, against
    transformers' network and the same head."""
    from gpu_workers.model import Model

    directory = models[variant, task]
    model = Model(spec(directory, task), torch.device("cpu"))
    assert model.loader == "shmserve" and model.packs
    reference = theirs(directory, task)
    ids, mask, _ = batch()
    lengths = mask.sum(1).numpy()
    groups = [(ids[:1].numpy(), lengths[:1], None), (ids[1:].numpy(), lengths[1:], None)]
    got = model.forward_groups(groups)
    with torch.inference_mode():
        out = reference(input_ids=ids, attention_mask=mask)
        if task == "embedding":
            weights = mask.unsqueeze(-1).float()
            want = torch.nn.functional.normalize(
                (out.last_hidden_state * weights).sum(1) / weights.sum(1), dim=1)
        else:
            want = out.logits
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)


@pytest.mark.parametrize("buckets, most", [(256, -1), (256, 512), (16, 128), (64, 1024),
                                           (-1, 12)])
def test_relative_distances_bucket_as_transformers_buckets_them(buckets, most):
    """Every distance to 3,000 either way, through transformers' own function."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    config = deberta.Config(relative_attention=True, position_buckets=buckets,
                            max_relative_positions=most, max_position_embeddings=512)
    relative = deberta.Relative(config)
    length = 3000
    x = torch.zeros(1, length, 1)
    want = build_relative_position(x, x, bucket_size=buckets,
                                   max_position=relative.most)[0, 0]  # query 0, every key
    got = relative.bucket(-torch.arange(length))
    assert torch.equal(got, want)
    want_last = build_relative_position(x, x, bucket_size=buckets,
                                        max_position=relative.most)[0, -1]
    assert torch.equal(relative.bucket(length - 1 - torch.arange(length)), want_last)


def test_what_only_transformers_reads_goes_to_transformers(models, tmp_path):
    """A convolution layer (DeBERTa-v2-xlarge's), a pooler of another width, another
    activation, a position score kind transformers does not compute, a missing tensor: each
    declined here, so transformers loads it (or refuses it with its own message)."""
    source = models["v3", "rerank"]
    for name, change in (("conv", {"conv_kernel_size": 3}), ("act", {"hidden_act": "tanh"}),
                         ("pooler", {"pooler_hidden_act": "silu"}),
                         ("p2p", {"pos_att_type": "p2c|p2p"}),
                         ("eps", {"layer_norm_eps": 1}), ("heads", {"attention_head_size": 8})):
        directory = edited(source, tmp_path, name, config=change)
        assert deberta.Config.read(directory) is None, name
    missing = edited(source, tmp_path, "missing", tensors=lambda t: {
        k: v for k, v in t.items() if "rel_embeddings" not in k})
    assert deberta.load(missing, "rerank", torch.float32) is None
    conv = edited(source, tmp_path, "conv-served", config={"conv_kernel_size": 3})
    from gpu_workers.model import Model
    from shmserve.models import ModelSourceError

    # transformers' message: the convolution's tensors are not in this checkpoint
    with pytest.raises(ModelSourceError, match="conv"):
        Model(spec(conv, "rerank"), torch.device("cpu"))
    # transformers' own network is never run packed: this pass would leave out its
    # position scores
    assert not packed.supports(theirs(source, "rerank"))
    assert packed.supports(networks.load(spec(source, "rerank"), torch.float32)[0])


def test_the_config_reads_as_transformers_reads_it(models):
    """pos_att_type as a string or a list; the bucket span; the table's layer norm."""
    v3 = deberta.Config.read(models["v3", "embedding"])
    assert (v3.pos_att_type, v3.span, v3.rel_layer_norm) == (("c2p", "p2c"), 16, True)
    v2 = deberta.Config.read(models["v2", "embedding"])
    assert (v2.pos_att_type, v2.span, v2.rel_layer_norm, v2.embedding_size) == \
        (("c2p", "p2c"), 12, False, 16)
    absolute = deberta.Config.read(models["absolute", "embedding"])
    assert (absolute.relative_attention, absolute.pos_att_type) == (False, ())
    saved = json.loads((models["v3", "embedding"] / "config.json").read_text())
    assert saved["pos_att_type"] == ["p2c", "c2p"]  # as transformers 5 saves it


def test_loading_a_deberta_never_imports_transformers(models):
    loaded, transformers_imported, _ = fresh_loads(
        [(f"{variant}-{task}", task, models[variant, task])
         for variant in ("v3", "v2") for task in TASKS])
    assert [loader for _, _, loader in loaded] == ["shmserve"] * 6
    assert not transformers_imported


def test_the_position_indices_are_transformers_for_every_length_and_kept_for_none():
    """c2p_pos and p2c_pos as transformers computes them, for lengths within and past the
    model's positions (a relative model may take longer texts), from one row per distance:
    a table kept per length held ~16 l^2 bytes for each length a worker met."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    config = deberta.Config(relative_attention=True, position_buckets=16,
                            max_position_embeddings=64)
    relative = deberta.Relative(config)
    span = config.span
    for length in (1, 2, 9, 40, 64, 100, 37):
        x = torch.zeros(1, length, 1)
        rel = build_relative_position(x, x, bucket_size=16, max_position=64)[0]
        lo, hi, c2p, p2c = relative.index(length, torch.device("cpu"))
        assert torch.equal(c2p + lo, torch.clamp(rel + span, 0, 2 * span - 1)), length
        assert torch.equal(p2c + lo, torch.clamp(-rel + span, 0, 2 * span - 1)), length
        assert 0 <= int(c2p.min()) and int(c2p.max()) < hi - lo <= 2 * span
    assert relative.longest == 100 and list(relative.on) == [torch.device("cpu")]
