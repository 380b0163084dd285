"""ModernBERT's networks, built and loaded without transformers, and run packed.

ModernBERT (gte-modernbert, modernbert-embed, ModernBERT cross-encoders) differs from BERT in
its layers: pre-norm (the first layer's attention without one), no biases by default, query,
key and value as one product (`Wqkv`), a gated MLP (`Wi` gives the input and the gate, `act(input)
* gate`, `Wo`), rotary positions in place of position embeddings, and every third layer
attending to the whole text while the others attend within a window of `local_attention`
positions (64 either way by default), each kind with its own rotary base. A final layer norm
closes the encoder; its sequence classifier pools the first token (`classifier_pooling: cls`)
or the mean of the real ones, then dense, activation, layer norm, and the classifier.

Importing transformers' ModernBERT costs a worker ~3 s of its start, as BERT's did
(gpu_workers/bert.py), and its network runs one forward per length group. Here the networks
carry transformers' class and attribute names (the weights load by name; gpu_workers.prepack
and int8 quantization treat their linear layers as any), and one pass runs several length
groups (`PackedModernBert`): the linear layers and norms over every group's real tokens as one
matrix, attention group by group. The network's own forward is that pass over one group.
tests/integration/test_modernbert.py holds them equal to transformers'.

`load` takes only a checkpoint it reads exactly as transformers would (default rotary
positions, gelu or relu, config values of the types transformers' config accepts, every tensor
the network needs); for anything else it returns None, and transformers loads it
(gpu_workers.networks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers import checkpoint
from gpu_workers.bert import embedding
from gpu_workers.bert_config import ACTIVATIONS, config_json, default_rope_theta, typed_fields
from gpu_workers.packed import Group, Output, gather, index_of, rows_for, scatter

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class Config:
    """What the networks read of a ModernBERT config.json, with ModernBertConfig's defaults."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int = 50283
    attention_bias: bool = False
    mlp_bias: bool = False
    local_attention: int = 128
    classifier_pooling: str = "cls"
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    num_labels: int = 2

    model_type = "modernbert"
    type_vocab_size = 0  # no token types
    position_embedding_type = "absolute"
    is_decoder = False
    _attn_implementation = "sdpa"  # logged as the worker's attention
    # set by `read`: each layer's kind (FULL, SLIDING) and each kind's rotary base
    layer_types = ()
    rope_theta = None

    @classmethod
    def read(cls, directory: Path) -> Config | None:
        """config.json as this module runs it, or None (another type, or a setting only
        transformers runs: scaled rotary positions, another activation, a value of a type
        transformers' strict config refuses)."""
        raw = config_json(directory, ("modernbert",))
        if raw is None or raw.get("rope_scaling") is not None or raw.get("is_decoder", False):
            return None
        # a null padding id reads as 0: positions are rotary, padding is masked
        values = typed_fields(cls, raw, {}, null_pad=True)
        if values is None:
            return None
        config = cls(**values)
        if (config.hidden_activation not in ACTIVATIONS
                or config.classifier_activation not in ACTIVATIONS
                or config.classifier_pooling not in ("cls", "mean")
                or min(config.vocab_size, config.hidden_size, config.intermediate_size,
                       config.num_hidden_layers, config.num_attention_heads,
                       config.num_labels, config.local_attention) < 1
                or config.hidden_size % config.num_attention_heads
                or (config.hidden_size // config.num_attention_heads) % 2
                or not 0 <= config.pad_token_id < config.vocab_size):
            return None
        # Each layer's kind: config.json's list, or every n-th layer global (older configs)
        every = raw.get("global_attn_every_n_layers", 3)
        kinds = raw.get("layer_types")
        if kinds is None:
            if type(every) is not int or every < 1:
                return None
            kinds = [SLIDING if i % every else FULL for i in range(config.num_hidden_layers)]
        if (not isinstance(kinds, list) or len(kinds) != config.num_hidden_layers
                or not set(kinds) <= {FULL, SLIDING}):
            return None
        config.layer_types = tuple(kinds)
        # Each kind's rotary base: rope_parameters (as transformers 5 saves them), or the
        # older global_rope_theta and local_rope_theta
        theta = {FULL: raw.get("global_rope_theta", 160_000.0),
                 SLIDING: raw.get("local_rope_theta", 10_000.0)}
        given = raw.get("rope_parameters")
        if given is not None:
            if not isinstance(given, dict):
                return None
            for kind in (FULL, SLIDING):
                theta[kind] = default_rope_theta(given.get(kind) or {}, theta[kind])
        if not all(type(t) in (int, float) and t > 0 for t in theta.values()):
            return None
        config.rope_theta = {kind: float(t) for kind, t in theta.items()}
        return config


def norm(config: Config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class Embeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.tok_embeddings = embedding(config.vocab_size, config.hidden_size)
        self.norm = norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.Wqkv = nn.Linear(h, 3 * h, bias=config.attention_bias)
        self.Wo = nn.Linear(h, h, bias=config.attention_bias)


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                            bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_activation]
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class Layer(nn.Module):
    def __init__(self, config: Config, index: int) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else norm(config)
        self.attn = Attention(config)
        self.mlp_norm = norm(config)
        self.mlp = MLP(config)
        self.attention_type = config.layer_types[index]


class ModernBertModel(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = norm(config)

    @property
    def base_model(self) -> ModernBertModel:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **_) -> Output:
        return PackedModernBert(self)([_group(input_ids, attention_mask)])[0]


class PredictionHead(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size,
                               bias=config.classifier_bias)
        self.act = ACTIVATIONS[config.classifier_activation]
        self.norm = norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config)
        self.head = PredictionHead(config)
        self.drop = nn.Identity()  # dropout, at inference
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def base_model(self) -> ModernBertModel:
        return self.model

    def logits(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[b, labels] from the last hidden state [b, l, hidden] and the real tokens [b, l]:
        the first token, or the mean of the real ones (`classifier_pooling`)."""
        if self.config.classifier_pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1)
        return self.classifier(self.drop(self.head(pooled)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **_) -> Output:
        return PackedModernBert(self)([_group(input_ids, attention_mask)])[0]


CLASSES = {"embedding": ModernBertModel, "classification": ModernBertForSequenceClassification,
           "rerank": ModernBertForSequenceClassification}


def _group(ids: torch.Tensor, mask: torch.Tensor | None) -> Group:
    """One padded batch as a packed pass's only group."""
    b, l = ids.shape
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    lengths = mask.sum(1).cpu().numpy()
    return Group(ids, mask, None, index_of(lengths, l).to(ids.device),
                 dense=bool((lengths == l).all()))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on query or key [b, heads, l, d], in float32 as transformers does."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class PackedModernBert:
    """Several length groups in one pass (gpu_workers.packed's interface: `__call__` gives
    each group's Output, `tokens` the real tokens' last hidden states in order)."""

    def __init__(self, whole: nn.Module, bucket: bool = False) -> None:
        self.whole = whole
        self.net = whole.base_model
        self.bucket = bucket
        config = self.net.config
        self.hidden, self.heads = config.hidden_size, config.num_attention_heads
        self.window = config.local_attention // 2  # keys within this distance either way
        # each layer kind's rotary inverse frequencies, made once on the network's device (a
        # host-to-device copy would break a CUDA graph's capture)
        d, device = self.hidden // self.heads, next(self.net.parameters()).device
        self.inverse = {kind: (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)))
                        .to(device) for kind, theta in config.rope_theta.items()}

    def __call__(self, groups: list[Group]) -> list[Output]:
        h = self.hidden
        x, places = self._encode(groups)
        out = []
        for g, (b, l, index, lo, hi) in zip(groups, places):
            hidden = scatter(x[lo:hi], b, l, index).view(b, l, h)
            logits = (self.whole.logits(hidden, g.mask) if hasattr(self.whole, "logits")
                      else None)
            out.append(Output(hidden, logits))
        return out

    def tokens(self, groups: list[Group]) -> torch.Tensor:
        x, places = self._encode(groups)
        return x[:places[-1][4]]

    def _positions(self, l: int, device, dtype) -> dict:
        """Each layer kind's rotary cos and sin for positions 0..l-1 [l, head size], rounded
        to the network's dtype first as transformers rounds them."""
        out = {}
        for kind, inverse in self.inverse.items():
            freqs = torch.arange(l, device=device).float()[:, None] * inverse[None]
            angles = torch.cat((freqs, freqs), dim=-1)
            out[kind] = (angles.cos().to(dtype).float(), angles.sin().to(dtype).float())
        return out

    def _masks(self, g: Group, l: int) -> dict:
        """Each layer kind's attention mask for a group (None: attend everywhere). The window:
        keys within `window` positions. A padding position's query, dropped after, may attend
        to its text's first token, so that no row of the window's mask is empty: PyTorch's CPU
        kernel gives such a row zeros, but a GPU kernel may give NaN, which would reach the
        real rows through the next layer's values where a CUDA graph's shape runs every
        position as a row (not run on a GPU yet)."""
        keys = None if g.dense else g.mask[:, None, None, :]
        masks = {FULL: keys}
        if l - 1 <= self.window:
            masks[SLIDING] = keys
            return masks
        position = torch.arange(l, device=g.ids.device)
        band = (position[:, None] - position[None, :]).abs() <= self.window  # [l, l]
        if keys is None:
            masks[SLIDING] = band[None, None]
        else:
            padded = ~g.mask[:, None, :, None]  # padding positions' queries [b, 1, l, 1]
            first = position[None, None, None, :] == 0
            masks[SLIDING] = (band[None, None] & keys) | (padded & first)
        return masks

    def _encode(self, groups: list[Group]) -> tuple[torch.Tensor, list[tuple]]:
        h, heads = self.hidden, self.heads
        places, parts, extras, start = [], [], [], 0
        for g in groups:
            b, l = g.ids.shape
            rows = self.net.embeddings(g.ids).reshape(b * l, h)
            index = None if g.dense else g.index
            parts.append(gather(rows, index))
            end = start + (b * l if index is None else index.numel())
            places.append((b, l, index, start, end))
            extras.append((self._positions(l, rows.device, rows.dtype), self._masks(g, l)))
            start = end
        padding = rows_for(start) - start if self.bucket else 0
        if padding:
            parts.append(parts[0].new_zeros(padding, h))
        x = torch.cat(parts)
        for layer in self.net.layers:
            kind = layer.attention_type
            qkv = layer.attn.Wqkv(layer.attn_norm(x))
            context = []
            for (b, l, index, lo, hi), (rotary, masks) in zip(places, extras):
                padded = scatter(qkv[lo:hi], b, l, index)
                q, k, v = padded.view(b, l, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
                cos, sin = rotary[kind]
                out = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin),
                                                     v, attn_mask=masks[kind])
                context.append(gather(out.transpose(1, 2).reshape(b * l, h), index))
            if padding:
                context.append(x.new_zeros(padding, h))
            x = x + layer.attn.Wo(torch.cat(context))
            x = x + layer.mlp(layer.mlp_norm(x))
        return self.net.final_norm(x), places


Packed = PackedModernBert  # gpu_workers.networks' name for a module's packed pass


def supports(net: nn.Module) -> bool:
    """Whether the packed pass runs this network: ModernBERT's as this module builds it."""
    return isinstance(net, (ModernBertModel, ModernBertForSequenceClassification))


def load(directory: Path, task: str, dtype: torch.dtype) -> nn.Module | None:
    """The task's network (eval mode, weights in `dtype`), or None where only transformers
    can say what to do with this checkpoint."""
    config = Config.read(directory)
    if config is None or task not in CLASSES:
        return None
    # an encoder saved alone, or inside a model with a head (`model.`)
    return checkpoint.build(directory, CLASSES[task], config, dtype,
                            "model." if task == "embedding" else None)
