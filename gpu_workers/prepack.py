"""Linear layers with their weights laid out once for oneDNN, for bf16 on a CPU.

`F.linear` in bf16 on a CPU hands its weight to oneDNN in PyTorch's plain layout, and oneDNN
reorders it into its blocked one on every call: for the small row counts a served batch has,
that reorder is most of the product (on this project's development CPU, an 8 x 384 -> 1536
bf16 layer takes ~105 us through `F.linear` and ~45 us with the weight reordered ahead, 37 rows
~147 against ~90; docs/performance.md). `PrepackedLinear` holds the reordered weight and calls
oneDNN's linear directly: the same kernel, so the same results to the bit (a load-time check
compares them; a layer that does not match keeps `F.linear`).

Only for bf16 on a CPU: fp32 runs through MKL's own GEMM, where the gain was 0-20%, and
oneDNN's fp16 needs an AMX-FP16 CPU. The op is PyTorch's own (what torch.compile's weight
freezing emits); where this PyTorch lacks it, nothing is swapped.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("shmserve.worker")


def available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


class PrepackedLinear(torch.nn.Module):
    """y = x W^T + b for x of any leading shape, W reordered for oneDNN ahead of time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), None))
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(),
                                                 self.packed, self.bias, "none", [], "")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """A prepacked layer for `weight` and `bias` when it reproduces `F.linear` on a probe, else
    `F.linear` bound to them."""
    if available() and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        try:
            layer = PrepackedLinear(weight, bias)
            probe = torch.randn(5, weight.shape[1], dtype=weight.dtype,
                                generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                if torch.equal(layer(probe), F.linear(probe, weight, bias)):
                    return layer
        except RuntimeError as exc:  # an op this CPU or build cannot run
            log.debug("prepack.unavailable: %s", exc)
    return lambda x: F.linear(x, weight, bias)


def swap(net: torch.nn.Module) -> int:
    """Every bf16 nn.Linear of `net` on a CPU replaced in place by a PrepackedLinear; the count
    replaced."""
    swapped = 0
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            layer = linear(child.weight, child.bias)
            if isinstance(layer, PrepackedLinear):
                setattr(parent, name, layer)
                swapped += 1
    return swapped
