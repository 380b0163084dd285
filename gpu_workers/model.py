"""A served model: safetensors weights in eval mode, one forward per batch, pooled outputs.

Loading refuses pickle checkpoints and remote code. The forward pass takes a padded int64 batch
built by the worker and returns float32 rows ready to be copied into shared memory.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from transformers import AutoConfig, AutoModel
from transformers.utils import logging as hf_logging

from shmserve.models import ModelSpec, weights_file

log = logging.getLogger("shmserve.worker")

hf_logging.disable_progress_bar()  # a progress bar per load would clutter the JSON log

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class EmbeddingModel:
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        weights_file(spec.directory)  # refuses a pickle-only directory with a clear message
        self.spec = spec
        self.device = device
        config = AutoConfig.from_pretrained(spec.directory, trust_remote_code=False)
        self.model = AutoModel.from_pretrained(
            spec.directory,
            config=config,
            use_safetensors=True,
            trust_remote_code=False,
            dtype=DTYPES[spec.dtype],
            attn_implementation="sdpa",
        ).to(device).eval()
        self.pad_id = int(getattr(config, "pad_token_id", 0) or 0)

    @torch.inference_mode()
    def forward(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """ids: int64 [B, L] padded with anything; lengths: int [B]. Returns float32 [B, D]."""
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=True)
        lens = torch.from_numpy(lengths.astype(np.int64)).to(self.device, non_blocking=True)
        positions = torch.arange(input_ids.shape[1], device=self.device)
        mask = positions[None, :] < lens[:, None]
        input_ids = input_ids.masked_fill(~mask, self.pad_id)
        hidden = self.model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        pooled = self._pool(hidden.float(), mask, lens)
        if self.spec.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy()

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        if self.spec.pooling == "cls":
            return hidden[:, 0]
        if self.spec.pooling == "last":
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), lens - 1]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class NullModel:
    """The `null` task: zeros of the right shape, no computation. It measures everything around
    the model (nginx, frontends, shared memory, ZeroMQ, batching) on its own."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    def forward(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return np.zeros((ids.shape[0], self.spec.dim), np.float32)


def load_model(spec: ModelSpec, device: torch.device):
    return NullModel(spec, device) if spec.task == "null" else EmbeddingModel(spec, device)


def pick_device(threads: int) -> torch.device:
    """The worker's device: the one GPU CUDA_VISIBLE_DEVICES shows it, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"
