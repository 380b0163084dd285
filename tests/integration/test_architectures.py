"""Architectures other than BERT's, as a worker serves them (in-process, tiny random models
with BERT's tokenizer), against sentence-transformers and transformers on the same inputs:
MPNet and ELECTRA (built by gpu_workers.bert, packed), ModernBERT (gpu_workers.modernbert,
packed), DeBERTa-v3 (gpu_workers.deberta, packed), a Qwen3 decoder pooled on its last token
(gpu_workers.qwen3, packed), and DistilBERT loaded by transformers (its own forward).
An outside check found MPNet and DeBERTa-v2 refused at load (SDPA asked of every model) and
DistilBERT a KeyError in `shmserve config` (its width is `dim`)."""

import inspect

import numpy as np
import pytest
import torch

from frontend.tokenizer import TextEncoder
from gpu_workers.model import Model
from shmserve.models import ModelSourceError
from tests.integration.modelkit import QUERY, TEXTS, run, spec
from tests.tinymodel import OTHER_ARCHITECTURES, build_tiny_other

@pytest.mark.parametrize("model_type,pooling", [(t, "last" if t == "qwen3" else "mean")
                                                for t in OTHER_ARCHITECTURES])
def test_embeddings_equal_sentence_transformers(tmp_path, model_type, pooling):
    from sentence_transformers import SentenceTransformer

    directory = build_tiny_other(tmp_path / model_type, model_type, pooling=pooling)
    served = spec(directory, "embedding")
    assert served.dim == 32 and served.max_tokens == 64
    model = Model(served, torch.device("cpu"))
    got = run(model, TextEncoder(model.spec, truncate=True).encode(TEXTS))
    want = SentenceTransformer(str(directory), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert model.attention == "sdpa"
    # (this DistilBERT's config.json names its width twice, `dim` and `hidden_size`: to
    # transformers, as gpu_workers.bert_config declines it)
    ours = model_type in ("mpnet", "electra", "modernbert", "deberta-v2", "qwen3")
    assert (model.loader, model.packs) == (("shmserve", True) if ours else ("transformers", False))


@pytest.mark.parametrize("model_type", ["distilbert", "deberta-v2", "mpnet", "electra"])
@pytest.mark.parametrize("task", ["classification", "rerank"])
def test_logits_equal_transformers(tmp_path, model_type, task):
    from transformers import AutoModelForSequenceClassification

    labels = 3 if task == "classification" else 1
    directory = build_tiny_other(tmp_path / model_type, model_type, task=task,
                                 num_labels=labels)
    served = spec(directory, task)
    # 66 positions; MPNet's start past its padding index, 1 (it served 65 and failed at 65)
    assert served.max_tokens == (64 if model_type == "mpnet" else 66)
    model = Model(served, torch.device("cpu"))
    encoder = TextEncoder(model.spec, truncate=True)
    enc = encoder.encode(TEXTS) if task == "classification" else \
        encoder.encode_pairs(QUERY, TEXTS)
    got = run(model, enc)  # the logits: the frontend applies the softmax or the activation
    net = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    want = []
    with torch.inference_mode():
        for i, (a, b) in enumerate(zip(enc.offsets[:-1], enc.offsets[1:])):
            extra = {}
            if enc.segments is not None and "token_type_ids" in inspect.signature(
                    net.forward).parameters:  # (its __code__ is a decorator's: no names)
                # a pair's first segment (its length: `segments`) type 0, the second type 1
                extra["token_type_ids"] = (torch.arange(b - a) >= int(enc.segments[i]))[None].long()
            ids = torch.as_tensor(np.asarray(enc.ids[a:b], dtype=np.int64))[None]
            logits = net(input_ids=ids, **extra).logits[0]
            want.append(logits.numpy())
    np.testing.assert_allclose(got.reshape(len(want), -1), np.stack(want), atol=2e-5)


def test_a_model_that_needs_its_own_code_is_refused_before_any_worker(tmp_path):
    """nomic-bert's kind: a model type transformers does not have, and code in the model
    directory (auto_map). The worker's load said to pass trust_remote_code=True, an option
    shmserve does not have; `shmserve up` now refuses it, naming the code."""
    import json

    directory = build_tiny_other(tmp_path / "custom", "distilbert")
    saved = json.loads((directory / "config.json").read_text())
    saved.update(model_type="tinycustom", auto_map={"AutoConfig": "custom.TinyConfig",
                                                    "AutoModel": "custom.TinyModel"})
    (directory / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ModelSourceError, match=r"model_type 'tinycustom' is not one "
                       r"transformers has.*custom\.TinyModel.*never runs"):
        spec(directory, "embedding")
    # A type transformers has loads as its own class, auto_map or not.
    saved["model_type"] = "distilbert"
    (directory / "config.json").write_text(json.dumps(saved))
    assert spec(directory, "embedding").dim == 32


def test_a_model_type_transformers_lacks_is_refused_by_the_worker_saying_so(tmp_path):
    """Without auto_map nothing tells `up` (transformers' list of types costs seconds to
    import): the worker's load refuses it as a model source, which `up --wait` shows."""
    import json

    directory = build_tiny_other(tmp_path / "unknown", "distilbert")
    saved = json.loads((directory / "config.json").read_text())
    saved["model_type"] = "tinycustom"
    (directory / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ModelSourceError, match="transformers cannot read its config.json as "
                                               "any model it has: .*tinycustom"):
        Model(spec(directory, "embedding"), torch.device("cpu"))
