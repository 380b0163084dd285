"""What a worker refuses to load, or to load in place of a served model, and what it says:
checkpoints without their task's head, NaN weights, tensors named or shaped otherwise than
config.json describes, reload compatibility. In-process, against tiny random models."""

import numpy as np
import pytest
import torch

from frontend.tokenizer import TextEncoder
from gpu_workers.model import Model
from shmserve.config import REPO_ROOT
from shmserve.models import ModelSourceError, incompatible
from tests.integration.modelkit import TEXTS, run, spec
from tests.tinymodel import build_tiny_bert, build_tiny_classifier, reference_embeddings


def test_scoring_tasks_refuse_a_checkpoint_without_their_head(models, tmp_path):
    with pytest.raises(ModelSourceError, match="sequence-classification checkpoint"):
        spec(models["emb"], "classification")
    with pytest.raises(ModelSourceError, match="one output, this one has 3 labels"):
        spec(models["clf"], "rerank")
    with pytest.raises(ModelSourceError, match="needs >= 2 labels"):
        spec(models["ce"], "classification")


def test_weights_holding_nan_are_refused_at_load(tmp_path):
    """A damaged file whose header reads: it loaded, and every answer was NaN (JSON nulls)."""
    from safetensors.numpy import load_file, save_file

    directory = build_tiny_bert(tmp_path / "nan")
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["encoder.layer.0.output.dense.weight"][0, :4] = np.nan
    save_file(tensors, str(weights))
    with pytest.raises(ModelSourceError, match="weight encoder.layer.0.output.dense.weight holds "
                                               "NaN or infinity"):
        Model(spec(directory, "embedding"), torch.device("cpu"))


@pytest.mark.parametrize("damage, said", [
    ("truncated", "not a readable safetensors file"),
    ("garbled", "not a readable safetensors file"),
    # a wider model's weights: transformers' import and refusal took a hot reload 28 s under
    # load (over 60 s, a CI failure, on a loaded machine)
    ("wider", "does not fit its config.json (bert, hidden_size 32): tensors of other shapes")])
def test_a_damaged_weights_file_is_refused_without_importing_transformers(tmp_path, damage,
                                                                          said):
    """A truncated or garbled weights file of a model the worker builds itself
    went to transformers, which refused it too, after importing itself: 4-16 s of a reload and
    ~145 MB a worker kept (an outside check). Refused before that now, in a fresh interpreter
    as a worker runs."""
    import subprocess
    import sys

    directory = build_tiny_bert(tmp_path / damage)
    weights = directory / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "wider":
        weights.write_bytes((build_tiny_bert(tmp_path / "wide", hidden=48)
                             / "model.safetensors").read_bytes())
    else:
        weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    code = ("import sys, torch\n"
            "from gpu_workers import networks\n"
            "from shmserve.models import ModelSourceError\n"
            "from tests.integration.modelkit import spec\n"
            f"s = spec({str(directory)!r}, 'embedding')\n"
            "try:\n"
            "    networks.load(s, torch.float32)\n"
            "except ModelSourceError as exc:\n"
            "    print('refused:', exc)\n"
            "print('transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(REPO_ROOT)).stdout.splitlines()
    assert out[0].startswith("refused:") and said in out[0], out
    assert out[-1] == "False", out


def test_reload_compatibility(models, tmp_path):
    emb = spec(models["emb"], "embedding")
    other = build_tiny_bert(tmp_path / "other", seed=9)
    assert incompatible(emb, spec(other, "embedding")) == ""
    wider = build_tiny_bert(tmp_path / "wider", seed=9, hidden=48, heads=2)
    assert "output width differs" in incompatible(emb, spec(wider, "embedding"))
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text()
                                          .replace('"[UNK]"', '"[UNKNOWN]"'))
    assert "tokenizer.json differs" in incompatible(emb, spec(other, "embedding"))
    # What the replies mean: a reload keeps pooling, normalization and the kind of checkpoint.
    cls = build_tiny_bert(tmp_path / "cls", seed=9, pooling="cls")
    assert "pooling differs ('mean' now, 'cls'" in incompatible(emb, spec(cls, "embedding"))
    raw = build_tiny_bert(tmp_path / "raw", seed=9, normalize=False)
    assert "normalization differs (True now, False" in incompatible(emb, spec(raw, "embedding"))
    # A classifier's checkpoint loads as an encoder (its head dropped), and must not replace one.
    clf = build_tiny_classifier(tmp_path / "clf", num_labels=3, seed=9, hidden=32)
    assert "architecture differs" in incompatible(emb, spec(clf, "embedding", normalize="true"))
    # ... and is named for that, not for the normalization it also lacks (an outside check).
    assert "architecture differs" in incompatible(emb, spec(clf, "embedding"))


def test_weights_named_otherwise_than_the_config_expects_are_refused(models, tmp_path):
    """Tensors renamed (saved under another prefix, or another architecture's): transformers
    initialised the model at random and it served random vectors, ready and 200 (an outside
    check). A checkpoint without BERT's pooler, which embeddings never use, still loads; one
    that lacks a single tensor is called damaged, not another architecture's."""
    import shutil

    from safetensors.numpy import load_file, save_file

    lost = "encoder.layer.1.output.dense.bias"
    for name, rename in (("renamed", lambda k: "0.auto_model." + k),
                         ("no-pooler", lambda k: None if k.startswith("pooler.") else k),
                         ("one-lost", lambda k: None if k == lost else k)):
        target = tmp_path / name
        shutil.copytree(models["emb"], target)
        tensors = load_file(target / "model.safetensors")
        save_file({rename(k): v for k, v in tensors.items() if rename(k)},
                  target / "model.safetensors", metadata={"format": "pt"})
        if name == "renamed":
            with pytest.raises(ModelSourceError, match=r"lacks \d+ of the weights.*0\.auto_model"):
                Model(spec(target, "embedding"), torch.device("cpu"))
        elif name == "one-lost":  # not another architecture's: said so (an outside check)
            with pytest.raises(ModelSourceError, match=rf"lacks 1 of the weights .*{lost}.*; "
                               r"every other tensor is there \(a damaged or partial copy\?\)"):
                Model(spec(target, "embedding"), torch.device("cpu"))
        else:
            model = Model(spec(target, "embedding"), torch.device("cpu"))
            enc = TextEncoder(model.spec, truncate=True).encode(TEXTS)
            np.testing.assert_allclose(run(model, enc),
                                       reference_embeddings(models["emb"], TEXTS, 64), atol=1e-5)


@pytest.mark.parametrize("task", ["embedding", "classification"])
def test_weights_of_another_size_say_which_tensor_and_shapes(tmp_path, task):
    """A config.json with the weights of a wider model: transformers refused them with "look at
    the above report", a table only in the worker's log, which a reload's caller never sees
    (an outside check). The message names a tensor and both shapes: shmserve's own loader's,
    and networks.shape_mismatches' for the architectures transformers loads."""
    import shutil

    from transformers import AutoConfig

    from gpu_workers import networks

    build = build_tiny_bert if task == "embedding" else build_tiny_classifier
    target, wide = build(tmp_path / "narrow"), build(tmp_path / "wide", hidden=48)
    shutil.copy(wide / "model.safetensors", target / "model.safetensors")
    said = (r"model.safetensors does not fit its config.json \(bert, hidden_size 32\): tensors "
            r"of other shapes: \d+, e\.g\. \S+ is \[.*48.*\], the config needs \[.*32.*\]")
    with pytest.raises(ModelSourceError, match=said):
        Model(spec(target, task), torch.device("cpu"))
    import re
    assert re.search(said, networks.shape_mismatches(spec(target, task),
                                                     AutoConfig.from_pretrained(target)))
