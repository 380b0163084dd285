"""Static embedding models (sentence-transformers' StaticEmbedding, model2vec's kind: a token
table averaged, no transformer, no special tokens) as sentence-transformers saves them, in
either layout: served to its vectors; what they cannot be is refused, naming why."""

import json
import shutil

import numpy as np
import pytest
import torch

from frontend.errors import ApiError
from frontend.tokenizer import TextEncoder
from gpu_workers.model import Model
from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, inspect, resolve_source
from tests.integration.modelkit import run
from tests.integration.test_st_formats import DEFAULT, corpus_texts
from tests.tinymodel import build_tiny_static


@pytest.mark.parametrize("dense, normalize", [([], True), ([(32, 16, {})], False)])
def test_a_static_embedding_model_serves_its_vectors(tmp_path, dense, normalize):
    """sentence-transformers' StaticEmbedding (model2vec's kind: a table averaged over a text's
    tokens, no transformer, no special tokens, its tokenizer's own truncation): served as
    sentence-transformers encodes, with a projection after it too. It was refused (no
    config.json)."""
    from sentence_transformers import SentenceTransformer

    directory = build_tiny_static(tmp_path / "static", *dense, normalize=normalize)
    reference = SentenceTransformer(str(directory), device="cpu")
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32"),
                   roots=[tmp_path])
    # 128: the truncation its tokenizer.json was saved with, which StaticEmbedding applies
    assert (spec.pooling, spec.dim, spec.max_tokens) == ("mean", 16 if dense else 32, 128)
    model = Model(spec, torch.device("cpu"))
    assert model.loader == "shmserve" and model.packed is None
    encoder = TextEncoder(model.spec, truncate=True)
    texts = corpus_texts()
    got = run(model, encoder.encode(texts))
    np.testing.assert_allclose(got, reference.encode(texts), atol=2e-5)
    # no special tokens: the ids are the text's own, as StaticEmbedding tokenizes
    assert encoder.encode(["hello world"]).ids.tolist() == reference[0].tokenizer.encode(
        "hello world", add_special_tokens=False).ids
    # so a client's ids need no frame either (a BERT's need [CLS] ... [SEP])
    assert encoder.from_ids([[7592, 2088]]).ids.tolist() == [7592, 2088]
    # every token's row (/embed_all): the table's rows
    rows = model.forward_groups([(np.array([[7592, 2088]]), np.array([2]), None)],
                                tokens=True)
    np.testing.assert_allclose(rows, reference[0].embedding.weight[[7592, 2088]].detach(),
                               atol=1e-6)
    # a text of whitespace has no tokens to average: said so (422), not sent to a worker
    with pytest.raises(ApiError, match=r"'input\[1\]' has no tokens for model 'm'"):
        encoder.encode(["fine", "   "])


def test_a_model2vec_table_is_read_and_what_it_cannot_be_is_refused(tmp_path):
    """model2vec saves its table as `embeddings`: read as sentence-transformers reads it. A
    vocabulary mapping or token weights (quantized model2vec models), a static model for
    another task, or a StaticEmbedding after a Transformer, are refused, naming why."""
    from safetensors.torch import load_file, save_file
    from sentence_transformers import SentenceTransformer

    directory = build_tiny_static(tmp_path / "m2v", normalize=False)
    want = SentenceTransformer(str(directory), device="cpu").encode(["a b c"])
    table = load_file(str(directory / "model.safetensors"))["embedding.weight"]
    save_file({"embeddings": table}, str(directory / "model.safetensors"))
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32"),
                   roots=[tmp_path])
    model = Model(spec, torch.device("cpu"))
    np.testing.assert_allclose(
        run(model, TextEncoder(model.spec, truncate=True).encode(["a b c"])), want, atol=1e-6)
    with pytest.raises(ModelSourceError, match="serves task embedding, not classification"):
        inspect(ModelConfig(name="m", source=str(directory), task="classification"),
                roots=[tmp_path])
    save_file({"embeddings": table, "mapping": torch.arange(table.shape[0])},
              str(directory / "model.safetensors"))
    with pytest.raises(ModelSourceError, match="it holds embeddings, mapping .*model2vec's "
                                               "vocabulary mapping and token weights are not"):
        inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])
    # a table of fewer rows than the tokenizer has tokens (sentence-transformers fails on every
    # text with an id past it; it was served, and every such text was a 500), of integers, or
    # of one dimension
    for bad, why in ((table[:1000].clone(), "its table has 1000 rows, its tokenizer 30522 "
                                            "tokens"),
                     ((table * 100).to(torch.int8), r"embeddings is I8 \[30522, 32\]; a static "
                                                     "embedding table is a float matrix"),
                     (table[:, 0].contiguous(), r"embeddings is F32 \[30522\]")):
        save_file({"embeddings": bad}, str(directory / "model.safetensors"))
        with pytest.raises(ModelSourceError, match=why):
            inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])
    modules = json.loads((directory / "modules.json").read_text())
    shutil.copy(resolve_source(DEFAULT) / "config.json", directory / "config.json")
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {**modules[0], "idx": 1, "name": "1"}]))
    with pytest.raises(ModelSourceError, match="a StaticEmbedding module comes first"):
        inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])


def test_a_static_model_saved_in_its_own_folder_serves_and_reloads(tmp_path):
    """sentence-transformers before 6 saved StaticEmbedding's table and tokenizer in
    0_StaticEmbedding/ (as the static models on the Hub have them), not at the model's root;
    a reload compares that tokenizer.json, and a static model does not replace an encoder."""
    from sentence_transformers import SentenceTransformer

    from shmserve.models import incompatible

    directory = build_tiny_static(tmp_path / "old")
    want = SentenceTransformer(str(directory), device="cpu").encode(["old layout"])
    (directory / "0_StaticEmbedding").mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (directory / name).rename(directory / "0_StaticEmbedding" / name)
    modules = json.loads((directory / "modules.json").read_text())
    modules[0]["path"] = "0_StaticEmbedding"
    (directory / "modules.json").write_text(json.dumps(modules))
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32"),
                   roots=[tmp_path])
    model = Model(spec, torch.device("cpu"))
    np.testing.assert_allclose(
        run(model, TextEncoder(model.spec, truncate=True).encode(["old layout"])), want,
        atol=1e-6)
    new = build_tiny_static(tmp_path / "new")  # at the root, the same tokenizer
    new_spec = inspect(ModelConfig(name="m", source=str(new)), roots=[tmp_path])
    assert incompatible(spec, new_spec) == ""
    encoder = inspect(ModelConfig(name="m", source=DEFAULT))
    assert incompatible(spec, encoder).startswith("its architecture differs")
    # a table of other rows: the frontends check a client's token ids against the old one
    from safetensors.torch import load_file, save_file

    table = load_file(str(new / "model.safetensors"))["embedding.weight"]
    save_file({"embedding.weight": torch.cat([table, table[:10]])},
              str(new / "model.safetensors"))
    assert incompatible(spec, inspect(ModelConfig(name="m", source=str(new)),
                                      roots=[tmp_path])).startswith(
        "its embedding table's rows (config.json vocab_size) differs (30522 now, 30532")
