"""What each task does with the network's output: one float32 row per text.

    embedding       the pooled last hidden state (cls | mean | last token | max | mean over the
                    square root of the length | position-weighted mean, or several side by
                    side), through the model's Dense projections, L2-normalised when the
                    model says so (unless `normalize` is False: TEI's normalize=false), as
                    sentence-transformers computes them               -> [B, dim]
    classification  the sequence-classification logits, raw             -> [B, num_labels]
    rerank          a cross-encoder's one logit, raw                     -> [B, 1]
    sparse          SPLADE: log(1 + relu(MLM logits)), the largest over a text's tokens
                                                                          -> [B, vocabulary]
                    (gpu_workers.model runs it on the token rows, in chunks of tokens)
                    (the frontend applies the softmax or the model's activation, so it can
                    give the logits back (TEI's raw_scores) and rank by the logit: a sigmoid
                    saturates to 1.0 in float32 past ~17)

Heads run in float32 whatever the network's dtype, so probabilities sum to 1 and pooling does
not lose precision.
"""

from __future__ import annotations

from typing import Callable

import torch

from shmserve.model_files import Dense, dense_shapes_match
from shmserve.models import ModelSourceError, ModelSpec

Head = Callable[..., torch.Tensor]  # (network output, mask, lengths, normalize=True, skip=0)


def network_class(task: str) -> type:
    """transformers' Auto class of the task's network (imported here: gpu_workers.bert loads
    BERT's without it)."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    return {"embedding": AutoModel, "sparse": AutoModelForMaskedLM}.get(
        task, AutoModelForSequenceClassification)


def head(spec: ModelSpec, device: torch.device | None = None) -> Head:
    if spec.task == "embedding":
        dense = [_Projection(layer, device) for layer in spec.dense]
        modes = spec.pooling.split("+")
        return lambda out, mask, lens, normalize=True, skip=0: _embed(
            spec, modes, dense, out.last_hidden_state.float(), mask, lens, normalize, skip)
    return lambda out, mask, lens, normalize=True, skip=0: out.logits.float()


def _embed(spec: ModelSpec, modes: list[str], dense: list[_Projection], hidden: torch.Tensor,
           mask: torch.Tensor, lens: torch.Tensor, normalize: bool,
           skip: int = 0) -> torch.Tensor:
    if skip:
        mask = _without_prompt(mask, skip)
    pooled = _pool(modes[0], hidden, mask, lens, skip) if len(modes) == 1 else torch.cat(
        [_pool(mode, hidden, mask, lens, skip) for mode in modes], dim=1)
    for projection in dense:
        pooled = projection(pooled)
    if spec.normalize and normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return pooled


def _without_prompt(mask: torch.Tensor, skip: int) -> torch.Tensor:
    """`mask` without each text's first `skip` tokens (a prompt's, and the special token
    before it): sentence-transformers' Pooling with include_prompt false."""
    mask = mask.clone()
    mask[:, :skip] = 0
    return mask


def _pool(mode: str, hidden: torch.Tensor, mask: torch.Tensor, lens: torch.Tensor,
          skip: int = 0) -> torch.Tensor:
    """One of sentence-transformers' pooling modes over each text's real tokens (`mask`; the
    padding is on the right). `skip`: `mask` leaves out the first `skip` tokens (a prompt's);
    then cls takes the first token after them and last a zero row where none is left, as
    sentence-transformers 6 does (5.x took the [CLS] token itself)."""
    if mode == "cls":
        if not skip:
            return hidden[:, 0]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device),
                      mask.to(torch.int32).argmax(1)]
    if mode == "last":
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lens - 1]
        return last * (lens > skip).unsqueeze(-1).to(last.dtype) if skip else last
    if mode == "max":
        return hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "weightedmean":  # the first token weighs 1, the next 2, ...
        weights = weights * torch.arange(1, hidden.shape[1] + 1, device=hidden.device,
                                         dtype=hidden.dtype).view(1, -1, 1)
    total = weights.sum(1).clamp(min=1e-9)
    if mode == "mean_sqrt_len_tokens":
        total = total.sqrt()
    return (hidden * weights).sum(1) / total


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Tanh": torch.tanh, "Identity": lambda x: x, "ReLU": torch.relu,
    "GELU": torch.nn.functional.gelu, "Sigmoid": torch.sigmoid,
    "SiLU": torch.nn.functional.silu}


class _Projection:
    """A sentence-transformers Dense module, in float32 on the model's device."""

    def __init__(self, layer: Dense, device: torch.device | None) -> None:
        from safetensors.torch import load_file

        path = layer.directory / "model.safetensors"
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors name no file
            raise ModelSourceError(f"{path} does not load ({exc})") from None
        # (inspect read them from the header; the file may have changed since)
        dense_shapes_match(layer, {n: tuple(t.shape) for n, t in tensors.items()})
        self.weight, self.bias, self.residual = (
            tensors[name].to(device, torch.float32) if name in layer.tensors() else None
            for name in ("linear.weight", "linear.bias", "residual.weight"))
        self.adds = layer.residual
        self.activation = ACTIVATIONS[layer.activation]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(torch.nn.functional.linear(x, self.weight, self.bias))
        if self.adds:
            out = out + (x if self.residual is None else
                         torch.nn.functional.linear(x, self.residual))
        return out
