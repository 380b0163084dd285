"""What the in-process model tests share: corpus-like texts and a spec read as the worker
reads one (test_model, test_model_loading)."""

import json
import shutil
import subprocess
import sys

import numpy as np

from gpu_workers.model import Model
from shmserve.config import ModelConfig
from shmserve.models import inspect

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Shared memory moves token ids between processes without copies.",
         "word " * 80]  # over the 64-token limit: truncated
QUERY = "what moves token ids between processes?"


def padded_batch(length: int, second: int):
    """Three random texts padded as a worker pads them (with the padding id, 0, on the right):
    one of `length` tokens, one of `second`, one of 3; ids [3, length] and their mask."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(1000, 30000, (3, length))
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, second:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return ids, mask


def spec(directory, task, dtype="fp32", **extra):
    return inspect(ModelConfig(name=task, source=str(directory), task=task, dtype=dtype,
                               **extra))


def run(model: Model, enc) -> np.ndarray:
    lengths = np.diff(enc.offsets)
    ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
    for i, (a, b) in enumerate(zip(enc.offsets[:-1], enc.offsets[1:])):
        ids[i, :b - a] = enc.ids[a:b]
    return model.forward_groups([(ids, lengths, enc.segments)], skip=enc.skip)


def edited(source, tmp_path, name, config=None, tensors=None):
    """A copy of the model directory `source` under tmp_path/name, its config.json updated
    with `config` and its tensors replaced by `tensors(the saved ones)`."""
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(source, tmp_path / name)
    if config:
        saved = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**saved, **config}))
    if tensors:
        weights = tensors(load_file(target / "model.safetensors"))
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def fresh_loads(models: list[tuple[str, str, str]]) -> tuple[list[list[str]], bool, bool]:
    """Each (label, task, directory) imported, loaded and warmed up under dtype auto as a
    worker does, in a fresh interpreter: [label, task, loader] each, and whether transformers
    and torch._dynamo were imported by then (what gpu_workers.bert and .modernbert spare a
    worker's start: ~3 s and ~1.4 s)."""
    code = (
        "import sys, torch\n"
        "import gpu_workers.worker\n"
        "from gpu_workers.batcher import Limits\n"
        "from gpu_workers.loading import load_warm\n"
        "from tests.integration.modelkit import spec\n"
        f"for label, task, directory in {[(a, b, str(c)) for a, b, c in models]!r}:\n"
        "    model, _, _ = load_warm(spec(directory, task, dtype='auto'), torch.device('cpu'),\n"
        "                            0, Limits(8, 512, 0.0))\n"
        "    print(label, task, model.loader)\n"
        "print('transformers' in sys.modules, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    return [line.split() for line in out[:-2]], out[-2].split()[0] == "True", \
        out[-2].split()[1] == "True"
