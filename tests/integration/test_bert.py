"""gpu_workers.bert: BERT's networks built without transformers compute what transformers'
compute, load only what they read exactly as transformers would (the rest goes to transformers),
and spare the worker transformers' import."""

import json
import shutil

import pytest
import torch

from gpu_workers import bert, bert_config, networks
from shmserve.models import ModelSourceError
from tests.integration.modelkit import edited, fresh_loads, spec
from tests.tinymodel import build_tiny_bert, build_tiny_classifier, build_tiny_splade


FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra")
TASKS = ("embedding", "classification", "rerank", "sparse")
# what gpu_workers.bert builds: MPNet's and ELECTRA's masked LMs are no sparse models
# shmserve serves (shmserve.models.MASKED_LMS); their checkpoints are still built, served for
# embeddings
BUILT = [(family, task) for family in FAMILIES for task in TASKS
         if (family, task) not in (("mpnet", "sparse"), ("electra", "sparse"))]
MASKED_LM_FAMILIES = [family for family in FAMILIES if (family, "sparse") in BUILT]


@pytest.fixture(scope="module")
def bert_models(tmp_path_factory):
    """A tiny random BERT of each task (tests.tinymodel)."""
    root = tmp_path_factory.mktemp("bert-models")
    return {"embedding": build_tiny_bert(root / "emb", seed=5),
            "classification": build_tiny_classifier(root / "clf", num_labels=3, seed=3),
            "rerank": build_tiny_classifier(root / "ce", num_labels=1, seed=4),
            "sparse": build_tiny_splade(root / "splade", seed=6)}


@pytest.fixture(scope="module")
def family_models(bert_models, tmp_path_factory):
    """{(family, task): directory}: BERT's, and the other families' of the same shape (RoBERTa's,
    XLM-RoBERTa's and MPNet's positions past the padding id, 0 here, or 1 (MPNet's always):
    two more positions), with BERT's tokenizer and pooling files."""
    from transformers import (AutoConfig, AutoModel, AutoModelForMaskedLM,
                              AutoModelForSequenceClassification)

    root = tmp_path_factory.mktemp("family-models")
    out = {("bert", task): directory for task, directory in bert_models.items()}
    for seed, (family, task) in enumerate((f, t) for f in FAMILIES[1:] for t in TASKS):
        torch.manual_seed(seed)
        shape = (dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64) if family == "distilbert"
                 else dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64))
        if family == "electra":  # narrower embeddings, projected to the layers' width
            shape["embedding_size"] = 16
        config = AutoConfig.for_model(
            family, vocab_size=30522, max_position_embeddings=66, pad_token_id=0, **shape,
            num_labels={"classification": 3, "rerank": 1}.get(task, 2),
            initializer_range=0.5 if task in ("classification", "rerank") else 0.02)
        net = {"embedding": AutoModel, "sparse": AutoModelForMaskedLM}.get(
            task, AutoModelForSequenceClassification).from_config(config).eval()
        target = shutil.copytree(bert_models[task], root / f"{family}-{task}")
        net.save_pretrained(target, safe_serialization=True)
        out[family, task] = target
    return out


def transformers_network(directory, task, dtype):
    return networks._transformers(spec(directory, task), dtype)


def batch():
    """Three texts: one of full length, two padded (with the padding id, 0, as the worker pads
    them); a pair's token types on the first."""
    torch.manual_seed(0)
    ids = torch.randint(1000, 30000, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[0, 9:] = 1
    return ids, mask, types


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, task", BUILT)
def test_the_networks_compute_what_transformers_networks_compute(family_models, family, task,
                                                                 dtype):
    ids, mask, types = batch()
    directory = family_models[family, task]
    ours, loader = networks.load(spec(directory, task), dtype)
    theirs = transformers_network(directory, task, dtype)
    assert loader == "shmserve" and type(ours).__name__ == type(theirs).__name__
    assert type(ours.base_model).__name__ == type(theirs.base_model).__name__
    assert all(p.dtype == dtype for p in ours.parameters())
    if family == "mpnet" and dtype == torch.bfloat16:
        # transformers runs MPNet's attention eagerly (bf16 products, then the bias and the
        # softmax), this module through scaled_dot_product_attention: not the same rounding
        return mpnet_nearer_fp32(directory, task, ours, theirs)
    with torch.inference_mode():
        for attention, token_types in ((mask, None if family in ("distilbert", "mpnet")
                                        else types), (torch.ones_like(mask), None)):
            extra = {} if token_types is None else {"token_type_ids": token_types}
            a = ours(input_ids=ids, attention_mask=attention, **extra)
            b = theirs(input_ids=ids, attention_mask=attention, **extra)
            real = attention.bool()
            hidden_b = theirs.base_model(input_ids=ids, attention_mask=attention,
                                         **extra).last_hidden_state
            torch.testing.assert_close(a.last_hidden_state[real], hidden_b[real],
                                       rtol=0, atol=1e-5)
            if task != "embedding":
                torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)


def mpnet_nearer_fp32(directory, task, ours, theirs):
    """MPNet in bf16 against transformers' in fp32: at least as near as transformers' in bf16,
    on padded texts' real tokens and on unpadded ones."""
    reference = transformers_network(directory, task, torch.float32)
    ids, mask, _ = batch()
    for attention in (mask, torch.ones_like(mask)):
        real = attention.bool()
        with torch.inference_mode():
            want, got, theirs_got = (
                net.base_model(input_ids=ids, attention_mask=attention)
                .last_hidden_state[real].float() for net in (reference, ours, theirs))
        ours_off, theirs_off = ((x - want).abs().max().item() for x in (got, theirs_got))
        assert ours_off <= theirs_off * 1.1, (ours_off, theirs_off)
        cosine, theirs_cosine = (torch.nn.functional.cosine_similarity(x, want).min().item()
                                 for x in (got, theirs_got))
        assert cosine >= theirs_cosine - 1e-3, (cosine, theirs_cosine)


@pytest.mark.parametrize("family, task", BUILT)
def test_the_worker_runs_each_family_packed_to_transformers_results(family_models, family,
                                                                    task):
    """Through gpu_workers.model, as a worker serves: several length groups in one packed
    pass (gpu_workers.packed), the task's head, against transformers' network and the same
    head (mean pooling and normalisation, logits, SPLADE's max of log(1 + relu))."""
    import numpy as np

    from gpu_workers.model import Model

    directory = family_models[family, task]
    model = Model(spec(directory, task), torch.device("cpu"))
    assert model.loader == "shmserve" and model.packs
    theirs = transformers_network(directory, task, torch.float32)
    ids, mask, _ = batch()
    lengths = mask.sum(1).numpy()
    groups = [(ids[:1].numpy(), lengths[:1], None), (ids[1:].numpy(), lengths[1:], None)]
    got = model.forward_groups(groups)
    with torch.inference_mode():
        out = theirs(input_ids=ids, attention_mask=mask)
        if task == "embedding":
            weights = mask.unsqueeze(-1).float()
            want = torch.nn.functional.normalize(
                (out.last_hidden_state * weights).sum(1) / weights.sum(1), dim=1)
        elif task == "sparse":
            want = torch.log1p(torch.relu(out.logits.masked_fill(~mask.bool()[..., None],
                                                                 float("-inf")))).amax(1)
        else:
            want = out.logits
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)


@pytest.mark.parametrize("family", MASKED_LM_FAMILIES)
def test_a_masked_lms_decoder_is_the_word_embeddings_and_its_bias_one_tensor(family_models,
                                                                             family):
    net, _ = networks.load(spec(family_models[family, "sparse"], "sparse"), torch.float32)
    ties = bert.MaskedLM.TIES[net.config.prefix]
    assert ties and all(net.get_parameter(name) is net.get_parameter(source)
                        for name, source in ties)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_masked_lm_saved_with_its_decoder_loads_here_only_where_it_is_tied(family_models,
                                                                             family, tmp_path):
    """A checkpoint holding the decoder and its bias: equal to the word embeddings and the
    head's bias, they are one tensor each here; saved with other values (untied), transformers
    keeps them apart (an outside check: served 0.78 off transformers' SPLADE values)."""
    head = "cls.predictions." if family == "bert" else "lm_head."
    words = f"{family.split('-')[0]}.embeddings.word_embeddings.weight"

    def decoder(shift: float, bias_shift: float):
        def edit(t):
            return {**t, head + "decoder.weight": t[words] + shift,
                    head + "decoder.bias": t[head + "bias"] + bias_shift}
        return edit

    source = family_models[family, "sparse"]
    for name, shift, bias_shift, want in (("equal", 0.0, 0.0, "shmserve"),
                                          ("weight", 0.05, 0.0, "transformers"),
                                          ("bias", 0.0, 0.5, "transformers")):
        target = edited(source, tmp_path, name, tensors=decoder(shift, bias_shift))
        net, loader = networks.load(spec(target, "sparse"), torch.float32)
        assert loader == want, name
        theirs = transformers_network(target, "sparse", torch.float32)
        ids, mask, _ = batch()
        with torch.inference_mode():
            torch.testing.assert_close(net(input_ids=ids, attention_mask=mask).logits,
                                       theirs(input_ids=ids, attention_mask=mask).logits,
                                       rtol=0, atol=1e-5)


def test_a_cross_encoder_with_one_token_type_loads_warms_up_and_scores_pairs(family_models,
                                                                             tmp_path):
    """RoBERTa and XLM-R cross-encoders (bge-reranker's) have type_vocab_size 1: the warm-up's
    and the probe's pairs gave token type 1, out of range, and the worker never started (an
    outside check). Their pairs run with type 0 throughout, as transformers runs them."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    from gpu_workers.model import Model, warm_up

    target = edited(family_models["roberta", "rerank"], tmp_path, "one-type",
                    config={"type_vocab_size": 1})
    tensors = load_file(target / "model.safetensors")
    types = "roberta.embeddings.token_type_embeddings.weight"
    save_file({**tensors, types: tensors[types][:1].clone()}, target / "model.safetensors",
              metadata={"format": "pt"})
    model = Model(spec(target, "rerank", dtype="auto"), torch.device("cpu"))
    warm_up(model, 8, 512)
    theirs = transformers_network(target, "rerank", torch.float32)
    ids, mask, _ = batch()
    lengths = mask.sum(1).numpy()
    with torch.inference_mode():
        want = theirs(input_ids=ids, attention_mask=mask).logits.numpy()
    model32 = Model(spec(target, "rerank"), torch.device("cpu"))
    assert model32.loader == "shmserve" and not model32.token_types
    got = model32.forward(ids.numpy(), lengths, lengths // 2)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("saved", ["classification", "sparse", "prefixed", "extra"])
def test_an_embedding_model_loads_the_encoder_of_any_checkpoint_that_holds_one(
        family_models, tmp_path, family, saved):
    """An encoder saved under the family's prefix, inside a classifier's or a masked LM's
    checkpoint (roberta-base is saved with its LM head), or beside a tensor no network has:
    the embedding task loads the encoder here and leaves the rest out, as transformers'
    AutoModel does (they went to transformers, and paid its import on each start: an outside
    check)."""
    from safetensors.torch import load_file

    prefix = bert_config.FAMILIES[family][0] + "."
    if saved in ("classification", "sparse"):
        target = family_models[family, saved]
    else:
        edit = ((lambda t: {prefix + k: v for k, v in t.items()}) if saved == "prefixed"
                else (lambda t: {**t, "extra.weight": torch.zeros(2)}))
        target = edited(family_models[family, "embedding"], tmp_path, saved, tensors=edit)
    ours, loader = networks.load(spec(target, "embedding"), torch.float32)
    assert loader == "shmserve" and ours.pooler is None
    words = load_file(target / "model.safetensors")
    key = "embeddings.word_embeddings.weight"
    torch.testing.assert_close(ours.embeddings.word_embeddings.weight,
                               words.get(prefix + key, words.get(key)), rtol=0, atol=0)
    theirs = transformers_network(target, "embedding", torch.float32)
    ids, mask, _ = batch()
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids, mask).last_hidden_state[mask.bool()],
                                   theirs(input_ids=ids, attention_mask=mask)
                                   .last_hidden_state[mask.bool()], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, config, tensors", [
    ("gelu_new", {"hidden_act": "gelu_new"}, None),
    ("relative", {"position_embedding_type": "relative_key"}, None),
    ("decoder", {"is_decoder": True}, None),
    ("no-padding-id", {"model_type": "roberta", "pad_token_id": None}, None),
    ("string-size", {"hidden_size": "32"}, None),
    ("int-eps", {"layer_norm_eps": 1}, None),  # transformers' strict config refuses it
    ("missing-tensor", None, lambda t: {k: v for k, v in t.items() if ".1.output." not in k}),
    ("int-tensor", None, lambda t: {**t, "encoder.layer.0.output.dense.bias":
                                    torch.zeros(32, dtype=torch.int64)}),
])
def test_what_only_transformers_reads_goes_to_transformers(bert_models, tmp_path, name,
                                                           config, tensors):
    target = edited(bert_models["embedding"], tmp_path, name, config, tensors)
    assert bert.load(target, "embedding", torch.float32) is None


@pytest.mark.parametrize("name, config, tensors, said", [
    ("wider-tensor", None, lambda t: {**t, "encoder.layer.0.output.dense.bias": torch.zeros(33)},
     r"\(bert, hidden_size 32\): tensors of other shapes: 1, e\.g\. "
     r"encoder\.layer\.0\.output\.dense\.bias is \[33\], the config needs \[32\]"),
    # ELECTRA's embeddings are 128 wide unless its config says otherwise: a BERT's are not
    ("electra-typed", {"model_type": "electra"}, None,
     r"\(electra, hidden_size 32\): tensors of other shapes: \d+, e\.g\. \S+ is \[32\], the "
     r"config needs \[128\]"),
])
def test_a_tensor_of_another_shape_is_refused_as_transformers_refuses_it(bert_models, tmp_path,
                                                                         name, config, tensors,
                                                                         said):
    """Without importing transformers (which took a hot reload 28 s under load to say so)."""
    target = edited(bert_models["embedding"], tmp_path, name, config, tensors)
    with pytest.raises(ModelSourceError, match=said):
        bert.load(target, "embedding", torch.float32)
    with pytest.raises(ModelSourceError, match=said):  # transformers' refusal, said alike
        transformers_network(target, "embedding", torch.float32)


def test_the_config_reads_as_transformers_reads_it(family_models, tmp_path):
    """Each field, from the tiny models' configs and from configs that leave every field to
    its family's default."""
    from transformers import AutoConfig

    written = []
    for i, config in enumerate([*({"model_type": family} for family in FAMILIES),
                                {"model_type": "mpnet", "pad_token_id": None,
                                 "relative_attention_num_buckets": 40},
                                {"model_type": "electra", "embedding_size": 256},
                                {"model_type": "distilbert", "dim": 48, "n_heads": 4,
                                 "activation": "relu"},
                                {"model_type": "bert", "id2label": {"0": "a", "1": "b", "2": "c"},
                                 "pad_token_id": None, "layer_norm_eps": 1e-5}]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(config))
        written.append(tmp_path / str(i))
    theirs_of = {ours: theirs for theirs, ours in bert_config.DISTILBERT_FIELDS.items()}
    for directory in [*family_models.values(), *written]:
        ours, theirs = bert_config.Config.read(directory), AutoConfig.from_pretrained(directory)
        for field in ours.__dict__:
            if ours.model_type == "mpnet" and field == "type_vocab_size":
                continue  # none
            if ours.model_type == "distilbert":
                if field in ("type_vocab_size", "layer_norm_eps"):  # none; 1e-12 in its code
                    continue
                field = theirs_of.get(field, field)
            want = getattr(theirs, field)
            got = getattr(ours, bert_config.DISTILBERT_FIELDS.get(field, field))
            assert got == (0 if want is None else want), (directory, field)


def test_loading_a_bert_family_model_never_imports_transformers(family_models):
    """The worker's import and its load of each family's and task's model, warmed up, in a
    fresh interpreter: transformers' import (and torch._dynamo's, which nn.Embedding's own
    init imported on the meta device) is what gpu_workers.bert spares a worker's start."""
    loaded, transformers, dynamo = fresh_loads([(f, t, family_models[f, t]) for f, t in BUILT])
    assert loaded == [[family, task, "shmserve"] for family, task in BUILT]
    assert not transformers and not dynamo


def test_mpnets_position_bias_is_transformers_at_every_distance():
    """packed.relative_bias, which both MPNet paths use (the network's own forward and the
    packed pass), against transformers' MPNetEncoder: buckets exact up to 8 positions, then
    logarithmic, then one bucket past 128 (texts of up to 514 positions), either way."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    from gpu_workers.packed import relative_bias

    torch.manual_seed(0)
    table = torch.randn(32, 3)
    encoder = MPNetEncoder.__new__(MPNetEncoder)
    torch.nn.Module.__init__(encoder)
    encoder.relative_attention_bias = torch.nn.Embedding.from_pretrained(table)
    length = 300
    want = encoder.compute_position_bias(torch.zeros(1, length, 3))
    got = relative_bias(table, length)
    assert got.shape == (1, 3, length, length)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # every bucket met but 16 (a key 0 positions after its query, counted as after)
    assert len(torch.unique(got[0, 0])) == 31
    mask = torch.ones(2, 1, 1, length, dtype=torch.bool)
    mask[1, ..., 10:] = False
    masked = relative_bias(table, length, mask)
    assert masked.shape == (2, 3, length, length)
    assert torch.equal(masked[0], want[0]) and torch.equal(masked[1, ..., :10], want[0, ..., :10])
    assert bool((masked[1, ..., 10:] == float("-inf")).all())


def test_a_distilbert_misfit_names_its_width(family_models, tmp_path):
    """DistilBERT's config.json has its width as `dim`: the refusal read "hidden_size ?" (an
    outside check)."""
    wide = edited(family_models["distilbert", "embedding"], tmp_path, "wide", tensors=lambda t: {
        k: torch.zeros(48) if k == "embeddings.LayerNorm.bias" else v for k, v in t.items()})
    with pytest.raises(ModelSourceError, match=r"\(distilbert, hidden_size 32\): tensors of "
                       r"other shapes: 1, e\.g\. embeddings\.LayerNorm\.bias is \[48\]"):
        bert.load(wide, "embedding", torch.float32)
