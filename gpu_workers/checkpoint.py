"""A network's weights read from a model directory's model.safetensors by name, for the
networks gpu_workers builds without transformers (gpu_workers.bert, gpu_workers.modernbert):
only a checkpoint read exactly as transformers would read it, else None (transformers then
loads it, or says why)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from shmserve.model_files import unreadable
from shmserve.models import weights_file


def read(directory: Path, net: nn.Module, dtype: torch.dtype, name_of: Callable[[str], str],
         optional: frozenset[str] = frozenset()) -> dict[str, torch.Tensor] | None:
    """The tensors `net` (built on the meta device) has, each under its name in `net`
    (`name_of`: a saved key's), in `dtype`. Saved tensors `net` has no place for (another
    task's head, a pooler never read, a leftover buffer such as embeddings.position_ids) are
    left out, as transformers leaves them. None when a tensor is saved twice (with and
    without a prefix), of another shape, or not of floats, when one is missing (but those
    named `optional`). A weights file that is missing, pickle-only, damaged or truncated is
    refused here (ModelSourceError), not handed to transformers, which refused it all the
    same after importing itself: seconds, and ~145 MB a worker kept (an outside check)."""
    from safetensors import SafetensorError, safe_open

    path = weights_file(Path(directory))
    shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = {}
            for key in f.keys():
                name = name_of(key)
                if name not in shapes:
                    continue
                sliced = f.get_slice(key)
                if (name in names or shapes[name] != tuple(sliced.get_shape())
                        or sliced.get_dtype() not in ("F32", "F16", "BF16")):
                    return None
                names[name] = key
            if shapes.keys() - optional - names.keys():
                return None  # weights missing: transformers says which
            return {name: f.get_tensor(key).to(dtype) for name, key in names.items()}
    except (SafetensorError, OSError) as exc:  # damaged, truncated (safetensors checks it)
        raise unreadable(path, exc) from None
    except Exception:  # noqa: BLE001 - read otherwise than expected: transformers reads
        return None  # it, or says why


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
