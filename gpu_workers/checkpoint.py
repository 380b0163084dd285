"""A network's weights read from a model directory's model.safetensors by name, for the
networks gpu_workers builds without transformers (gpu_workers.bert, gpu_workers.modernbert):
only a checkpoint read exactly as transformers would read it, else None (transformers then
loads it, or says why). Weights of another size than config.json's are refused here, as
transformers refuses them: it took a hot reload's loader thread 28 s to import it and say so
under load on this machine (and over 60 s on a loaded CI run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from shmserve.model_files import unreadable
from shmserve.models import ModelSourceError, weights_file


def read(directory: Path, net: nn.Module, dtype: torch.dtype, name_of: Callable[[str], str],
         optional: frozenset[str] = frozenset()) -> dict[str, torch.Tensor] | None:
    """The tensors `net` (built on the meta device) has, each under its name in `net`
    (`name_of`: a saved key's), in `dtype`. Saved tensors `net` has no place for (another
    task's head, a pooler never read, a leftover buffer such as embeddings.position_ids) are
    left out, as transformers leaves them. None when a tensor is saved twice (with and
    without a prefix) or not of floats, when one is missing (but those named `optional`).
    A weights file that is missing, pickle-only, damaged or truncated, or whose tensors have
    other shapes than `net`'s, is refused here (ModelSourceError), not handed to
    transformers, which refused it all the same after importing itself: seconds, and ~145 MB
    a worker kept (an outside check)."""
    from safetensors import SafetensorError, safe_open

    path = weights_file(Path(directory))
    shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            names, bad = {}, []
            for key in f.keys():
                name = name_of(key)
                if name not in shapes:
                    continue
                sliced = f.get_slice(key)
                if name in names or sliced.get_dtype() not in ("F32", "F16", "BF16"):
                    return None
                if shapes[name] != (have := tuple(sliced.get_shape())):
                    bad.append((key, have, shapes[name]))
                names[name] = key
            if not bad and shapes.keys() - optional - names.keys():
                return None  # weights missing: transformers says which
            weights = {} if bad else {name: f.get_tensor(key).to(dtype)
                                      for name, key in names.items()}
    except (SafetensorError, OSError) as exc:  # damaged, truncated (safetensors checks it)
        raise unreadable(path, exc) from None
    except Exception:  # noqa: BLE001 - read otherwise than expected: transformers reads
        return None  # it, or says why
    if bad:
        raise ModelSourceError(misfit(Path(directory), _config_json(directory), bad))
    return weights


def misfit(directory: Path, config: dict, bad: list[tuple[str, tuple, tuple]]) -> str:
    """Weights whose tensors do not have the shapes config.json gives (another size of model
    under this config, say), said in one line. `bad`: (saved key, its shape, the shape the
    config needs) of each; `config`: config.json's model_type and width (hidden_size;
    DistilBERT's `dim`, which read "hidden_size ?": an outside check), where given."""
    key, have, need = bad[0]
    width = next((config[k] for k in ("hidden_size", "dim", "d_model") if k in config), "?")
    return (f"{directory}: model.safetensors does not fit its config.json "
            f"({config.get('model_type', '?')}, hidden_size {width}): "
            f"tensors of other shapes: {len(bad)}, e.g. {key} is {list(have)}, the config "
            f"needs {list(need)} (weights of another size of model?)")


def _config_json(directory: Path) -> dict:
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def assign(net: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """`net` with `weights` in place of its meta tensors, frozen, in eval mode."""
    net.load_state_dict(weights, strict=True, assign=True)
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


def build(directory: Path, cls: type, config, dtype: torch.dtype,
          prefix: str | None = None) -> nn.Module | None:
    """`cls(config)` made on the meta device, its weights read from `directory` (`read`) and
    put in place (`assign`); None where the checkpoint is not read exactly as transformers
    would read it. `prefix`: removed from the saved keys (an encoder saved inside a model with
    a head, `model.`), which are taken as they are where it is None."""
    with torch.device("meta"):  # nothing allocated: the weights are assigned
        net = cls(config)
    weights = read(directory, net, dtype,
                   (lambda key: key.removeprefix(prefix)) if prefix else (lambda key: key))
    return None if weights is None else assign(net, weights)
