"""gpu_workers.bert: BERT's networks built without transformers compute what transformers'
compute, load only what they read exactly as transformers would (the rest goes to transformers),
and spare the worker transformers' import."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from gpu_workers import bert, networks
from tests.integration.modelkit import spec
from tests.tinymodel import build_tiny_bert, build_tiny_classifier, build_tiny_splade


@pytest.fixture(scope="module")
def bert_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-models")
    return {"embedding": build_tiny_bert(root / "emb", seed=5),
            "classification": build_tiny_classifier(root / "clf", num_labels=3, seed=3),
            "rerank": build_tiny_classifier(root / "ce", num_labels=1, seed=4),
            "sparse": build_tiny_splade(root / "splade", seed=6)}


def transformers_network(directory, task, dtype):
    return networks._transformers(spec(directory, task), dtype)


def batch():
    """Three texts: one of full length, two padded; a pair's token types on the first."""
    torch.manual_seed(0)
    ids = torch.randint(1000, 30000, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 3:] = 0
    types = torch.zeros_like(ids)
    types[0, 9:] = 1
    return ids, mask, types


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("task", ["embedding", "classification", "rerank", "sparse"])
def test_the_networks_compute_what_transformers_networks_compute(bert_models, task, dtype):
    ids, mask, types = batch()
    ours, loader = networks.load(spec(bert_models[task], task), dtype)
    theirs = transformers_network(bert_models[task], task, dtype)
    assert loader == "shmserve" and type(ours).__name__ == type(theirs).__name__
    assert next(ours.parameters()).dtype == dtype
    with torch.inference_mode():
        for attention, token_types in ((mask, types), (torch.ones_like(mask), None)):
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


def test_a_masked_lms_decoder_is_the_word_embeddings_and_its_bias_one_tensor(bert_models):
    net, _ = networks.load(spec(bert_models["sparse"], "sparse"), torch.float32)
    head = net.cls.predictions
    assert head.decoder.weight is net.bert.embeddings.word_embeddings.weight
    assert head.decoder.bias is head.bias


def test_an_embedding_checkpoint_saved_with_a_head_or_prefix_loads_its_encoder(bert_models,
                                                                                tmp_path):
    """A classifier's checkpoint (bert.* with a pooler) served as an embedding model loads its
    encoder, as transformers' AutoModel does; a head's tensors are not the encoder's."""
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(bert_models["embedding"], tmp_path / "prefixed")
    tensors = load_file(target / "model.safetensors")
    save_file({f"bert.{k}": v for k, v in tensors.items()}, target / "model.safetensors",
              metadata={"format": "pt"})
    net, loader = networks.load(spec(target, "embedding"), torch.float32)
    assert loader == "shmserve" and net.pooler is None
    torch.testing.assert_close(net.embeddings.word_embeddings.weight,
                               tensors["embeddings.word_embeddings.weight"], rtol=0, atol=0)
    _, loader = networks.load(spec(bert_models["classification"], "embedding"), torch.float32)
    assert loader == "transformers"  # its classifier.* tensors are not the encoder's


def edited(source, tmp_path, name, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(source, tmp_path / name)
    if config:
        saved = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**saved, **config}))
    if tensors:
        weights = tensors(load_file(target / "model.safetensors"))
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("name, config, tensors", [
    ("gelu_new", {"hidden_act": "gelu_new"}, None),
    ("relative", {"position_embedding_type": "relative_key"}, None),
    ("decoder", {"is_decoder": True}, None),
    ("roberta-typed", {"model_type": "roberta"}, None),
    ("string-size", {"hidden_size": "32"}, None),
    ("int-eps", {"layer_norm_eps": 1}, None),  # transformers' strict config refuses it
    ("extra-tensor", None, lambda t: {**t, "extra.weight": torch.zeros(2)}),
    ("int-tensor", None, lambda t: {**t, "encoder.layer.0.output.dense.bias":
                                    torch.zeros(32, dtype=torch.int64)}),
])
def test_what_only_transformers_reads_goes_to_transformers(bert_models, tmp_path, name,
                                                           config, tensors):
    target = edited(bert_models["embedding"], tmp_path, name, config, tensors)
    assert bert.load(target, "embedding", torch.float32) is None


def test_the_config_reads_as_transformers_reads_it(bert_models, tmp_path):
    from transformers import AutoConfig

    sparse = json.loads((bert_models["sparse"] / "config.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "bert"}))  # every default
    labelled = tmp_path / "labelled"
    labelled.mkdir()
    (labelled / "config.json").write_text(json.dumps(
        {"model_type": "bert", "id2label": {"0": "a", "1": "b", "2": "c", "3": "d"},
         "pad_token_id": None, "layer_norm_eps": 1e-5}))
    assert sparse.get("tie_word_embeddings", True)
    for directory in [*bert_models.values(), bare, labelled]:
        ours, theirs = bert.Config.read(directory), AutoConfig.from_pretrained(directory)
        for field in ours.__dict__:
            assert getattr(ours, field) == (getattr(theirs, field) or 0), (directory, field)


def test_loading_a_bert_model_never_imports_transformers(bert_models):
    """The worker's import and its load of each task's BERT model, warmed up, in a fresh
    interpreter: transformers' import is what gpu_workers.bert spares a worker's start."""
    code = (
        "import sys, torch\n"
        "import gpu_workers.worker\n"
        "from gpu_workers.batcher import Limits\n"
        "from gpu_workers.loading import load_warm\n"
        "from tests.integration.modelkit import spec\n"
        f"for task, directory in {[(t, str(d)) for t, d in bert_models.items()]!r}:\n"
        "    model, _, _ = load_warm(spec(directory, task, dtype='auto'), torch.device('cpu'),\n"
        "                            0, Limits(8, 512, 0.0))\n"
        "    print(task, model.loader, model.spec.dtype)\n"
        "print('transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    assert [line.split()[:2] for line in out[:4]] == [
        [task, "shmserve"] for task in bert_models]
    assert out[4] == "False"
