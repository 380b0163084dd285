"""What each task does with the network's output: one float32 row per text.

    embedding       the pooled last hidden state (cls | mean | last token), L2-normalised when
                    the model says so (unless `normalize` is False: TEI's normalize=false)
                                                                          -> [B, hidden]
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

from shmserve.models import ModelSpec

Head = Callable[..., torch.Tensor]  # (network output, mask, lengths, normalize=True)


def network_class(task: str) -> type:
    """transformers' Auto class of the task's network (imported here: gpu_workers.bert loads
    BERT's without it)."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    return {"embedding": AutoModel, "sparse": AutoModelForMaskedLM}.get(
        task, AutoModelForSequenceClassification)


def head(spec: ModelSpec) -> Head:
    if spec.task == "embedding":
        return lambda out, mask, lens, normalize=True: _embed(
            spec, out.last_hidden_state.float(), mask, lens, normalize)
    return lambda out, mask, lens, normalize=True: out.logits.float()


def _embed(spec: ModelSpec, hidden: torch.Tensor, mask: torch.Tensor, lens: torch.Tensor,
           normalize: bool) -> torch.Tensor:
    if spec.pooling == "cls":
        pooled = hidden[:, 0]
    elif spec.pooling == "last":
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), lens - 1]
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    if spec.normalize and normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return pooled
