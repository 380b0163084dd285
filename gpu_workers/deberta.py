"""DeBERTa-v2's and -v3's networks, built and loaded without transformers.

DeBERTa-v3 (`model_type: deberta-v2`) is what many cross-encoders and classifiers are built on:
mxbai-rerank-v1, the ms-marco and NLI DeBERTa cross-encoders, the zero-shot NLI classifiers and
prompt-injection detectors. Its layers are BERT's (post-norm attention output, intermediate,
output), so gpu_workers.packed runs them packed, but its attention is disentangled: besides the
content-to-content scores q.k, each query attends to the keys' relative positions (c2p: the
query against a position key, `pos_key`) and each key to the query's (p2c: the key against a
position query, `pos_query`), where a position's vectors are the layer's key and query
projections (its own `pos_key_proj` and `pos_query_proj` where `share_att_key` is false) of the
encoder's relative position embeddings (`rel_embeddings`, layer-normed where `norm_rel_ebd`
says). Relative distances go into `position_buckets` buckets: exact below half of them either
way, logarithmic further. All three scores are scaled by 1/sqrt(head size x 3).

The position vectors do not depend on the input: they are computed once when the weights are
loaded (`prepare`), in the network's dtype as transformers computes them on every forward; a
pass then adds both position scores to the attention mask
(`DisentangledSelfAttention.position_scores`, which gpu_workers.packed calls too), and the
attention itself runs in scaled_dot_product_attention (transformers runs DeBERTa's eagerly).

Classes and attributes have transformers' names, so the weights load by name. `load` takes only
a checkpoint it reads exactly as transformers would (relative attention of the c2p and p2c
kinds, no convolution layer, gelu or relu, config values of the types transformers' config
accepts, every tensor the network needs); else it returns None and transformers loads it
(gpu_workers.networks). tests/integration/test_deberta.py holds them equal to transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers import checkpoint
from gpu_workers.bert import AddNorm, Intermediate, embedding
from gpu_workers.bert_config import ACTIVATIONS, config_json, typed_fields
from gpu_workers.packed import Output

RECENT_LENGTHS = 8  # Relative's indices kept: a pass's groups are of a few lengths
KINDS = ("c2p", "p2c")  # the position scores transformers computes (its `pos_att_type`)


@dataclass
class Config:
    """What the networks read of a deberta-v2 config.json, with DebertaV2Config's defaults,
    and the fields its modules read with getattr (`position_buckets`, ...) at theirs."""

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-7
    relative_attention: bool = False
    max_relative_positions: int = -1
    pad_token_id: int = 0
    position_biased_input: bool = True
    pooler_hidden_act: str = "gelu"
    num_labels: int = 2
    position_buckets: int = -1
    share_att_key: bool = False
    norm_rel_ebd: str = "none"
    conv_kernel_size: int = 0

    model_type = "deberta-v2"
    position_embedding_type = "absolute"  # relative attention besides; read by packed.supports
    is_decoder = False
    _attn_implementation = "sdpa"  # logged as the worker's attention
    # set by `read`
    embedding_size = None  # the embeddings' width, projected to hidden_size where it differs
    pos_att_type = ()  # the position scores' kinds (KINDS)

    @property
    def span(self) -> int:
        """The relative positions' reach either way: rel_embeddings has twice as many rows."""
        if self.position_buckets > 0:
            return self.position_buckets
        return (self.max_relative_positions if self.max_relative_positions >= 1
                else self.max_position_embeddings)

    @property
    def rel_layer_norm(self) -> bool:
        return "layer_norm" in [x.strip() for x in self.norm_rel_ebd.lower().split("|")]

    @classmethod
    def read(cls, directory: Path) -> Config | None:
        """config.json as this module runs it, or None (another type; a convolution layer,
        another activation, a pooler of its own width, a value of a type transformers' strict
        config refuses)."""
        raw = config_json(directory, ("deberta-v2",))
        if raw is None or raw.get("is_decoder", False):
            return None
        values = typed_fields(cls, raw, {}, null_pad=True)
        if values is None:
            return None
        config = cls(**values)
        kinds = raw.get("pos_att_type")
        if isinstance(kinds, str):  # "p2c|c2p", as DebertaV2Config splits it
            kinds = [x.strip() for x in kinds.lower().split("|")]
        kinds = [] if kinds is None else kinds
        if not isinstance(kinds, list) or not set(kinds) <= set(KINDS):
            return None
        config.pos_att_type = tuple(kind for kind in KINDS if kind in kinds)
        width = raw.get("embedding_size", config.hidden_size)
        heads = config.num_attention_heads
        if (type(width) is not int or width < 1
                or raw.get("pooler_hidden_size", config.hidden_size) != config.hidden_size
                or raw.get("attention_head_size", config.hidden_size // max(heads, 1))
                != config.hidden_size // max(heads, 1)
                or config.conv_kernel_size > 0
                or config.hidden_act not in ACTIVATIONS
                or config.pooler_hidden_act not in ACTIVATIONS
                or min(config.vocab_size, config.hidden_size, config.num_hidden_layers, heads,
                       config.intermediate_size, config.max_position_embeddings,
                       config.num_labels) < 1
                or config.hidden_size % heads
                or not 0 <= config.pad_token_id < config.vocab_size
                or (config.relative_attention and config.span < 1)):
            return None
        config.embedding_size = width
        return config


class Relative:
    """A network's relative positions: each distance's bucket, as the rows of the position
    vectors c2p and p2c read (transformers' c2p_pos and p2c_pos), shared by its layers."""

    def __init__(self, config: Config) -> None:
        self.span = config.span
        self.buckets, self.most = config.position_buckets, config.max_relative_positions
        if self.most < 1:
            self.most = config.max_position_embeddings
        self.longest = 0  # the distances the vectors below cover: -(longest-1)..longest-1
        self.c2p = self.p2c = torch.empty(0, dtype=torch.long)  # on the host
        self.on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # their copies
        # The last few lengths' indices: every layer of a pass asks for its groups' lengths,
        # which were made anew 12-24 times a group (bounded: a table kept per length held
        # ~16 l^2 bytes for every length a worker met)
        self.recent: dict[tuple, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        self.cover(config.max_position_embeddings)

    def bucket(self, distance: torch.Tensor) -> torch.Tensor:
        """Each query-less-key distance's bucket, as transformers' make_log_bucket_position
        computes it (in float32, its log of the same values); the distance itself where there
        are no buckets."""
        if self.buckets <= 0 or self.most <= 0:
            return distance
        mid = self.buckets // 2
        sign = torch.sign(distance)
        near = (distance < mid) & (distance > -mid)
        absolute = torch.where(near, torch.full_like(distance, mid - 1), distance.abs())
        scale = float(torch.log(torch.tensor((self.most - 1) / mid)))
        log = torch.ceil(torch.log(absolute / mid) / scale * (mid - 1)) + mid
        return torch.where(absolute <= mid, distance.to(log.dtype), log * sign).long()

    def cover(self, length: int) -> None:
        """The rows for every distance within texts of `length` tokens, on the host (a
        longer text than the model's positions, which a relative model may take, widens
        them; the copies on devices are made again)."""
        if length <= self.longest:
            return
        self.longest = length
        relative = self.bucket(torch.arange(-(length - 1), length))
        self.c2p = torch.clamp(relative + self.span, 0, 2 * self.span - 1)
        self.p2c = torch.clamp(-relative + self.span, 0, 2 * self.span - 1)
        self.on, self.recent = {}, {}

    def index(self, length: int, device: torch.device
              ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        key = (length, device)
        if key not in self.recent:
            if len(self.recent) >= RECENT_LENGTHS:
                del self.recent[next(iter(self.recent))]  # the oldest
            self.recent[key] = self._index(length, device)
        return self.recent[key]

    def _index(self, length: int, device: torch.device
               ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """For texts of `length` tokens: the rows of the position vectors their distances
        reach (lo, hi), and the c2p and p2c indices into those rows [l, l], made on the device
        from the rows of each distance (`index` keeps the last RECENT_LENGTHS); the rows are
        copied to a device once, before a CUDA graph's capture (its warm-up pass ran the
        shape)."""
        self.cover(length)
        middle = self.longest - 1  # distance 0
        # c2p rises with the distance and p2c falls: their ends bound the rows
        ends = (self.c2p[middle - length + 1], self.c2p[middle + length - 1],
                self.p2c[middle - length + 1], self.p2c[middle + length - 1])
        lo, hi = int(min(ends)), int(max(ends)) + 1
        if device not in self.on:
            self.on[device] = (self.c2p.to(device), self.p2c.to(device))
        c2p, p2c = self.on[device]
        position = torch.arange(length, device=device)
        distance = position[:, None] - position[None, :] + middle
        return lo, hi, c2p[distance] - lo, p2c[distance] - lo


class DisentangledSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.query_proj, self.key_proj, self.value_proj = (nn.Linear(h, h) for _ in range(3))
        self.kinds = config.pos_att_type if config.relative_attention else ()
        if config.relative_attention and not config.share_att_key:
            if "c2p" in self.kinds:
                self.pos_key_proj = nn.Linear(h, h)
            if "p2c" in self.kinds:
                self.pos_query_proj = nn.Linear(h, h)
        # 1/sqrt(head size x (1 + the position scores' kinds)); read by gpu_workers.packed.
        # (transformers rounds the root to the network's dtype first: in bf16 13.875 for
        # sqrt(192) = 13.856; exact here.)
        self.scaling = (h // self.heads * (1 + len(config.pos_att_type))) ** -0.5
        self.relative: Relative | None = None
        # [heads, 2 x span, head size] (`prepare`): buffers, so they move with the weights
        self.register_buffer("pos_key", None, persistent=False)
        self.register_buffer("pos_query", None, persistent=False)

    def prepare(self, rel: torch.Tensor | None, relative: Relative | None,
                share: bool) -> None:
        """The position vectors, once the weights are in place: this layer's key and query
        projections (or its own position ones) of the relative position embeddings `rel`
        [2 x span, hidden], in the network's dtype as transformers computes them."""
        if rel is None or not self.kinds:
            return
        self.relative = relative
        d = rel.shape[1] // self.heads
        with torch.no_grad():
            for kind, name, own in (("c2p", "pos_key", "pos_key_proj"),
                                    ("p2c", "pos_query", "pos_query_proj")):
                if kind in self.kinds:
                    linear = getattr(self, ("key_proj" if kind == "c2p" else "query_proj")
                                     if share else own)
                    vectors = linear(rel).view(-1, self.heads, d).transpose(0, 1)
                    setattr(self, name, vectors.contiguous())

    def position_scores(self, q: torch.Tensor, k: torch.Tensor,
                        mask: torch.Tensor | None) -> torch.Tensor | None:
        """The position scores for a group's queries and keys [b, heads, l, d], scaled as the
        content scores are, with the keys' `mask` ([b, 1, 1, l], bool; None: none padded):
        an attention mask for scaled_dot_product_attention, padded keys at -inf. Without
        position scores, `mask` itself."""
        if self.relative is None:
            return mask
        lo, hi, c2p, p2c = self.relative.index(q.shape[2], q.device)
        b, heads, l, _ = q.shape
        score = None
        if self.pos_key is not None:  # content to position: each query, its keys' distances
            att = torch.matmul(q, self.pos_key[:, lo:hi].transpose(-1, -2))
            score = torch.gather(att, -1, c2p.expand(b, heads, l, l)).float()
        if self.pos_query is not None:  # position to content: each key, its queries'
            att = torch.matmul(k, self.pos_query[:, lo:hi].transpose(-1, -2))
            att = torch.gather(att, -1, p2c.expand(b, heads, l, l)).transpose(-1, -2).float()
            score = att if score is None else score + att
        # summed and scaled in float32, rounded once to the queries' dtype (the mask's)
        score = (score * self.scaling).to(q.dtype)
        return score if mask is None else score.masked_fill(~mask, float("-inf"))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = (linear(x).view(b, n, self.heads, h // self.heads).transpose(1, 2)
                   for linear in (self.query_proj, self.key_proj, self.value_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.position_scores(q, k, mask),
                                             scale=self.scaling)
        return out.transpose(1, 2).reshape(b, n, h)


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self = DisentangledSelfAttention(config)
        self.output = AddNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Layer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = AddNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Embeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        width = config.embedding_size or config.hidden_size
        self.word_embeddings = embedding(config.vocab_size, width)
        self.position_embeddings = (embedding(config.max_position_embeddings, width)
                                    if config.position_biased_input else None)
        self.token_type_embeddings = (embedding(config.type_vocab_size, width)
                                      if config.type_vocab_size > 0 else None)
        self.embed_proj = (nn.Linear(width, config.hidden_size, bias=False)
                           if width != config.hidden_size else None)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[b, l] ids (and token types: None, all zeros) -> [b, l, hidden]. Padded positions
        are not zeroed as transformers zeroes them: no real token attends to them."""
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings.weight[:input_ids.shape[1]]
        if self.token_type_embeddings is not None:
            x = x + (self.token_type_embeddings.weight[0] if token_type_ids is None
                     else self.token_type_embeddings(token_type_ids))
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        return self.LayerNorm(x)


class Encoder(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        if config.relative_attention:
            self.rel_embeddings = embedding(2 * config.span, config.hidden_size)
            if config.rel_layer_norm:
                self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class DebertaV2Model(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    @property
    def base_model(self) -> DebertaV2Model:
        return self

    def prepare(self) -> None:
        """Each layer's scale and position vectors (DisentangledSelfAttention.prepare)."""
        config, rel = self.config, None
        if config.relative_attention:
            rel = self.encoder.rel_embeddings.weight
            if config.rel_layer_norm:
                rel = self.encoder.LayerNorm(rel)
        relative = Relative(config) if rel is not None else None
        for layer in self.encoder.layer:
            layer.attention.self.prepare(rel, relative, config.share_att_key)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        mask = (None if attention_mask is None or bool(attention_mask.all())
                else attention_mask.bool()[:, None, None, :])
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return Output(x)


class ContextPooler(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.pooler_hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first token, dense, activation (dropouts: identity)."""
        return self.act(self.dense(hidden[:, 0]))


class DebertaV2ForSequenceClassification(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.deberta = DebertaV2Model(config)
        self.pooler = ContextPooler(config)
        self.dropout = nn.Identity()
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def base_model(self) -> DebertaV2Model:
        return self.deberta

    def prepare(self) -> None:
        self.deberta.prepare()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, labels] from the encoder's last hidden state (as gpu_workers.packed's
        CLASSIFIERS compute them)."""
        return self.classifier(self.dropout(self.pooler(hidden)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        hidden = self.deberta(input_ids, attention_mask, token_type_ids).last_hidden_state
        return Output(hidden, self.logits(hidden))


CLASSES = {"embedding": DebertaV2Model, "classification": DebertaV2ForSequenceClassification,
           "rerank": DebertaV2ForSequenceClassification}


def supports(net: nn.Module) -> bool:
    """Whether `net` is one this module built (transformers' DeBERTa has no `prepare`d
    position vectors, and gpu_workers.packed must not run it)."""
    return isinstance(net, (DebertaV2Model, DebertaV2ForSequenceClassification))


def load(directory: Path, task: str, dtype: torch.dtype) -> nn.Module | None:
    """The task's network (eval mode, weights in `dtype`), or None where only transformers
    can say what to do with this checkpoint."""
    config = Config.read(directory)
    if config is None or task not in CLASSES:
        return None
    # an encoder saved alone, or inside a model with a head (`deberta.`)
    net = checkpoint.build(directory, CLASSES[task], config, dtype,
                           "deberta." if task == "embedding" else None)
    if net is not None:
        net.prepare()
    return net

