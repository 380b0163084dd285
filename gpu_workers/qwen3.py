"""Qwen3's decoder as an embedder (Qwen3-Embedding), built and loaded without transformers, and
run packed.

Qwen3-Embedding pools the last token of a causal decoder: pre-norm layers (RMSNorm), query,
key and value products with grouped key-value heads (`num_key_value_heads`) and an RMSNorm of
each head's query and key (`q_norm`, `k_norm`), rotary positions, causal attention, a SwiGLU
MLP (`down(silu(gate(x)) * up(x))`), a final RMSNorm. A worker pads its texts on the right, so
a causal layer's real tokens never see a padded one: no mask beyond the causal one.

Importing transformers' Qwen3 costs a worker ~3 s of its start, and its network runs one
forward per length group. Here the network carries transformers' class and attribute names (the
weights load by name; gpu_workers.prepack and int8 quantization treat its linear layers as
any), and one pass runs several length groups (`PackedQwen3`): the linear layers and norms over
every group's real tokens as one matrix, attention group by group. The network's own forward
is that pass over one group. tests/integration/test_qwen3.py holds them equal to transformers'.

`load` takes an embedding checkpoint, a sequence classifier's (Qwen3ForSequenceClassification:
its linear `score` on the last real token) and a causal LM answering yes or no (a rerank
model: shmserve.yes_no), each only as transformers would read it (default rotary positions,
no sliding window, silu, config values of the types transformers' config accepts, every tensor
the network needs); for anything else (a sliding window, scaled rotary positions) it returns
None, and transformers loads it (gpu_workers.networks) or, a yes/no reranker, refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers import checkpoint
from gpu_workers.bert import embedding
from gpu_workers.bert_config import config_json, default_rope_theta, typed_fields
from gpu_workers.packed import Group, Output, gather, index_of, rows_for, scatter
from shmserve import yes_no
from shmserve.models import ModelSourceError, weights_file


@dataclass
class Config:
    """What the network reads of a qwen3 config.json, with Qwen3Config's defaults."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    use_sliding_window: bool = False
    pad_token_id: int = 0
    num_labels: int = 2  # a sequence classifier's (config_json counts id2label)

    model_type = "qwen3"
    type_vocab_size = 0  # no token types
    position_embedding_type = "rotary"
    is_decoder = True
    _attn_implementation = "sdpa"  # logged as the worker's attention
    # set by `read`
    num_key_value_heads = None
    rope_theta = 10_000.0

    @classmethod
    def read(cls, directory: Path) -> Config | None:
        """config.json as this module runs it, or None (another type; a sliding window,
        scaled rotary positions, another activation, a value of a type transformers' strict
        config refuses)."""
        raw = config_json(directory, ("qwen3",))
        if raw is None or raw.get("rope_scaling") is not None:
            return None
        values = typed_fields(cls, raw, {}, null_pad=True)  # a null padding id reads as 0
        if values is None:
            return None
        config = cls(**values)
        kv = raw.get("num_key_value_heads", config.num_attention_heads)
        kv = config.num_attention_heads if kv is None else kv
        theta = default_rope_theta(raw.get("rope_parameters"), raw.get("rope_theta", 10_000.0))
        if (type(kv) is not int or kv < 1 or config.num_attention_heads % kv
                or type(theta) not in (int, float) or theta <= 0
                or config.use_sliding_window or config.hidden_act != "silu"
                or raw.get("layer_types") not in (None, ["full_attention"]
                                                  * config.num_hidden_layers)
                or min(config.vocab_size, config.hidden_size, config.intermediate_size,
                       config.num_hidden_layers, config.num_attention_heads,
                       config.head_dim) < 1
                or config.head_dim % 2
                or not 0 <= config.pad_token_id < config.vocab_size):
            return None
        config.num_key_value_heads, config.rope_theta = kv, float(theta)
        return config


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In float32, as transformers' Qwen3RMSNorm, then scaled in the input's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3Model(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def base_model(self) -> Qwen3Model:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                whole: nn.Module | None = None, **_) -> Output:
        """Texts padded on the right (a worker's): each real token attends to those before it.
        `whole`: the network this one is the decoder of (a reranker, a classifier)."""
        b, l = input_ids.shape
        mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.bool())
        lengths = mask.sum(1).cpu().numpy()
        group = Group(input_ids, mask, None, index_of(lengths, l).to(input_ids.device),
                      dense=bool((lengths == l).all()))
        return PackedQwen3(whole or self)([group])[0]


class Scored(nn.Module):
    """The decoder (`model`) and a `score` on each text's last real token: PackedQwen3 runs
    both in one pass."""

    @property
    def base_model(self) -> Qwen3Model:
        return self.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **_) -> Output:
        return self.model(input_ids, attention_mask, whole=self)


class Qwen3Reranker(Scored):
    """A Qwen3 causal LM that answers "yes" or "no" (Qwen3-Reranker: shmserve.yes_no) as a
    cross-encoder of one logit, yes - no: the decoder, and of its vocabulary head only the
    difference of those two rows (`score`), applied to the last token's hidden state."""

    def __init__(self, model: Qwen3Model, score: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.register_buffer("score", score.float(), persistent=False)

    def _apply(self, fn, recurse=True):
        """The weights follow a cast to another dtype; the score row stays float32 (a task's
        head runs in float32: gpu_workers.tasks) and follows only a move to another device."""
        score = self._buffers.pop("score")
        super()._apply(fn, recurse)
        self.register_buffer("score", score.to(fn(score[:1]).device), persistent=False)
        return self


class Qwen3ForSequenceClassification(Scored):
    """transformers' Qwen3ForSequenceClassification: the decoder and a linear `score` (no bias)
    on the last real token's hidden state."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on query or key [b, heads, l, d], in their dtype as transformers'
    apply_rotary_pos_emb (cos and sin already in it)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class PackedQwen3:
    """Several length groups in one pass (gpu_workers.packed's interface: `__call__` gives
    each group's Output, `tokens` the real tokens' last hidden states in order)."""

    def __init__(self, whole: nn.Module, bucket: bool = False) -> None:
        net = self.net = whole.base_model
        # a scoring network's head, on each text's last token: a reranker's yes - no row (in
        # float32), a classifier's linear layer (in the network's dtype, as transformers')
        self.score = whole.score if isinstance(whole, Scored) else None
        self.bucket = bucket
        config = net.config
        self.heads, self.kv, self.d = (config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim)
        # rotary inverse frequencies, made once on the network's device (a host-to-device
        # copy would break a CUDA graph's capture)
        d, device = self.d, net.embed_tokens.weight.device
        self.inverse = (1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float)
                                                     / d))).to(device)

    def __call__(self, groups: list[Group]) -> list[Output]:
        h = self.net.config.hidden_size
        x, places = self._encode(groups)
        out = []
        for g, (b, l, index, lo, hi) in zip(groups, places):
            hidden = scatter(x[lo:hi], b, l, index).view(b, l, h)
            logits = None
            if self.score is not None:  # padded on the right: the last real token's row
                last = hidden[torch.arange(b, device=hidden.device), g.mask.sum(1) - 1]
                logits = (last.float() @ self.score)[:, None] \
                    if isinstance(self.score, torch.Tensor) else self.score(last)
            out.append(Output(hidden, logits))
        return out

    def tokens(self, groups: list[Group]) -> torch.Tensor:
        x, places = self._encode(groups)
        return x[:places[-1][4]]

    def _positions(self, l: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..l-1 [l, head size], in float32 then the dtype, as
        transformers' Qwen3RotaryEmbedding."""
        freqs = torch.arange(l, device=device).float()[:, None] * self.inverse[None]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _encode(self, groups: list[Group]) -> tuple[torch.Tensor, list[tuple]]:
        net, heads, kv, d = self.net, self.heads, self.kv, self.d
        h = net.config.hidden_size
        places, parts, rotary, start = [], [], [], 0
        for g in groups:
            b, l = g.ids.shape
            rows = net.embed_tokens(g.ids).reshape(b * l, h)
            index = None if g.dense else g.index
            parts.append(gather(rows, index))
            end = start + (b * l if index is None else index.numel())
            places.append((b, l, index, start, end))
            rotary.append(self._positions(l, rows.device, rows.dtype))
            start = end
        padding = rows_for(start) - start if self.bucket else 0
        if padding:
            parts.append(parts[0].new_zeros(padding, h))
        x = torch.cat(parts)
        n = x.shape[0]
        for layer in net.layers:
            attn = layer.self_attn
            normed = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(normed).view(n, heads, d))
            k = attn.k_norm(attn.k_proj(normed).view(n, kv, d))
            v = attn.v_proj(normed).view(n, kv, d)
            context = []
            for (b, l, index, lo, hi), (cos, sin) in zip(places, rotary):
                def padded(t: torch.Tensor) -> torch.Tensor:  # [b, heads, l, d]
                    return scatter(t[lo:hi].reshape(hi - lo, -1), b, l, index) \
                        .view(b, l, -1, d).transpose(1, 2)

                out = F.scaled_dot_product_attention(
                    _rotate(padded(q), cos, sin), _rotate(padded(k), cos, sin), padded(v),
                    is_causal=True, enable_gqa=kv != heads, scale=d ** -0.5)
                context.append(gather(out.transpose(1, 2).reshape(b * l, heads * d), index))
            if padding:
                context.append(x.new_zeros(padding, heads * d))
            x = x + attn.o_proj(torch.cat(context))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return net.norm(x), places


Packed = PackedQwen3  # gpu_workers.networks' name for a module's packed pass


def supports(net: nn.Module) -> bool:
    """Whether the packed pass runs this network: Qwen3's as this module builds it."""
    return isinstance(net, (Qwen3Model, Scored))


def load(directory: Path, task: str, dtype: torch.dtype) -> nn.Module | None:
    """The embedding network, or a reranker answering yes or no (eval mode, weights in
    `dtype`); None where only transformers can say what to do with this checkpoint."""
    raw = config_json(directory, ("qwen3",))
    if raw is not None and yes_no.applies(task, raw):
        return _reranker(directory, raw, dtype)
    config = Config.read(directory)
    if config is None:
        return None
    if task in ("classification", "rerank"):  # a sequence classifier's checkpoint
        return checkpoint.build(directory, Qwen3ForSequenceClassification, config, dtype)
    # a decoder saved alone (sentence-transformers' Qwen3-Embedding), or inside a causal LM
    # (`model.`, its head left out)
    return checkpoint.build(directory, Qwen3Model, config, dtype, "model.") \
        if task == "embedding" else None


def _reranker(directory: Path, raw: dict, dtype: torch.dtype) -> Qwen3Reranker:
    """A causal LM's decoder and the yes - no row of its vocabulary head (`lm_head`, or the
    token embeddings where config.json ties them), as transformers would load them; refused
    with a reason otherwise: transformers has no sequence classifier for such a checkpoint."""
    from safetensors import safe_open

    config = Config.read(directory)
    model = None if config is None else checkpoint.build(directory, Qwen3Model, config, dtype,
                                                         "model.")
    if model is None:
        raise ModelSourceError(f"{directory}: a yes/no reranker is served only as plain Qwen3 "
                               "(no sliding window or scaled rotary positions, silu, every "
                               "decoder weight under model.), which this checkpoint is not")
    yes, no = yes_no.answer_tokens(directory)
    if raw.get("tie_word_embeddings", False):
        rows = model.embed_tokens.weight[[yes, no]].float()
    else:
        with safe_open(str(weights_file(directory)), framework="pt") as f:
            if "lm_head.weight" not in f.keys():
                raise ModelSourceError(f"{directory}: model.safetensors has no lm_head.weight, "
                                       "whose 'yes' and 'no' rows score a pair (config.json "
                                       "does not tie it to the token embeddings)")
            head = f.get_slice("lm_head.weight")
            rows = torch.stack([head[i:i + 1][0] for i in (yes, no)]).float()
    if rows.shape[-1] != config.hidden_size or not torch.isfinite(rows).all():
        raise ModelSourceError(f"{directory}: lm_head.weight's 'yes' and 'no' rows are not "
                               f"{config.hidden_size} finite floats")
    return Qwen3Reranker(model, rows[0] - rows[1]).eval()
