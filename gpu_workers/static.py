"""A static embedding model's network (sentence-transformers' StaticEmbedding, model2vec's
format): its embedding table looked up for every token. The embedding task's mean pooling over
a text's tokens then gives what StaticEmbedding's EmbeddingBag gives (the mean of its tokens'
rows); its Dense projections and Normalize run after it as after any pooling. No transformer,
no attention, nothing packed: a text's cost is its lookups."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shmserve.model_files import static_directory, static_table
from shmserve.models import weights_file


@dataclass
class StaticConfig:
    """What gpu_workers.model reads of a network's config."""

    pad_token_id: int = 0
    type_vocab_size: int = 1
    _attn_implementation: str = ""


@dataclass
class StaticOutput:
    last_hidden_state: torch.Tensor


class StaticNet(torch.nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding.from_pretrained(table, freeze=True)
        self.config = StaticConfig()

    @property
    def base_model(self) -> StaticNet:  # (/embed_all reads the token rows from it)
        return self

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> StaticOutput:
        return StaticOutput(self.embedding(input_ids))


def load(directory: Path, task: str, dtype: torch.dtype) -> StaticNet | None:
    """The network of a static model in `directory`, or None for any other model."""
    if static_directory(directory) is None:
        return None
    from safetensors import safe_open

    name, _ = static_table(directory)
    with safe_open(str(weights_file(directory)), framework="pt") as f:
        table = f.get_tensor(name)
    return StaticNet(table.to(dtype)).eval()


def supports(net: torch.nn.Module) -> bool:
    return False
