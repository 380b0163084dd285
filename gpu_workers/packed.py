"""Several length groups in one forward pass of a BERT-style encoder.

A worker's batch is one group of texts of similar length, so that padding stays small. On a CPU
the linear layers, which are most of an encoder's work, run far faster on many rows at once
than on few (bf16 on this project's development CPU: an 8 x 384 -> 1536 layer runs at
~70 GFLOP/s, a 512-row one at ~800), so several small groups cost much more than their tokens
would together. Here every group's real tokens, without padding, go through the linear layers,
layer norms and activations as one [tokens, hidden] matrix; only self-attention runs group by
group, padded to the group's longest text. The result equals the network's own forward
(tests/integration/test_model.py holds it).

Supported: the encoders whose layers are BERT's (BertModel, RobertaModel, XLMRobertaModel,
DistilBertModel as gpu_workers.bert builds it, ElectraModel) with absolute positions,
MPNetModel (BERT's layers under other names, and a relative position bias added to every
layer's attention scores: `relative_bias`), their sequence classifiers (classification and
rerank models: the classifier runs on each group's hidden states as the network's own forward
would run it) and their masked language models (sparse models, whose head reads the token
rows: `tokens`); anything else runs one ordinary forward per group (`gpu_workers.model`).
ElectraModel's narrower embeddings are projected to its layers' width first. DebertaV2Model
as gpu_workers.deberta builds it: BERT's layers, its attention's position scores computed from
each group's queries and keys (`position_scores`) and added as the mask.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpu_workers import prepack

ENCODERS = ("BertModel", "RobertaModel", "XLMRobertaModel", "DistilBertModel", "MPNetModel",
            "ElectraModel", "DebertaV2Model")
# Sequence classifiers, and how their logits come from the encoder's last hidden state.
CLASSIFIERS = {
    # pooler (first token, dense, tanh), dropout (a no-op in eval), classifier
    "BertForSequenceClassification":
        lambda net, hidden: net.classifier(net.dropout(net.bert.pooler(hidden))),
    # RobertaClassificationHead takes the first token itself
    "RobertaForSequenceClassification": lambda net, hidden: net.classifier(hidden),
    "XLMRobertaForSequenceClassification": lambda net, hidden: net.classifier(hidden),
    # MPNetClassificationHead and ElectraClassificationHead: as RoBERTa's (ELECTRA's: gelu)
    "MPNetForSequenceClassification": lambda net, hidden: net.classifier(hidden),
    "ElectraForSequenceClassification": lambda net, hidden: net.classifier(hidden),
    # ContextPooler (first token, dense, gelu), dropout, classifier
    "DebertaV2ForSequenceClassification":
        lambda net, hidden: net.classifier(net.dropout(net.pooler(hidden))),
    # the first token, pre_classifier, relu, dropout, classifier
    "DistilBertForSequenceClassification": lambda net, hidden: net.classifier(
        net.dropout(torch.relu(net.pre_classifier(hidden[:, 0])))),
}

# Masked language models (sparse, SPLADE: gpu_workers.model), and how their vocabulary logits
# come from the encoder's last hidden state of a token.
MASKED_LMS = {
    "BertForMaskedLM": lambda net, hidden: net.cls(hidden),
    "RobertaForMaskedLM": lambda net, hidden: net.lm_head(hidden),
    "XLMRobertaForMaskedLM": lambda net, hidden: net.lm_head(hidden),
    "DistilBertForMaskedLM": lambda net, hidden: net.vocab_projector(
        net.vocab_layer_norm(net.activation(net.vocab_transform(hidden)))),
}


@dataclass(frozen=True, slots=True)
class Group:
    ids: torch.Tensor  # int64 [b, l], padded with the model's pad id
    mask: torch.Tensor  # bool [b, l]
    token_types: torch.Tensor | None  # int64 [b, l], or None for all zeros
    index: torch.Tensor  # int64 [real tokens]: their rows in the flattened [b * l] (`index_of`)
    # No padding: every text is l tokens long (known on the host: on a GPU, asking the mask
    # would wait for the device). Such a group needs neither gathers nor an attention mask.
    dense: bool = False


def index_of(lengths: np.ndarray, width: int) -> torch.Tensor:
    """The rows of real tokens in a [b, width] batch flattened to [b * width], made on the host
    (on a GPU, nonzero() on the mask would wait for the device)."""
    return torch.from_numpy(np.concatenate(
        [np.arange(n, dtype=np.int64) + i * width for i, n in enumerate(lengths.tolist())]))


def scatter(rows: torch.Tensor, b: int, l: int, index: torch.Tensor | None) -> torch.Tensor:
    """A group's packed rows [real tokens, width] as its padded batch [b * l, width], zeros
    at the padding; the rows themselves where the group has none (`index` None)."""
    return rows if index is None else \
        rows.new_zeros(b * l, rows.shape[1]).index_copy_(0, index, rows)


def gather(padded: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The real tokens' rows of a group's padded [b * l, width] (`scatter`'s inverse)."""
    return padded if index is None else padded.index_select(0, index)


def rows_for(tokens: int) -> int:
    """`tokens` rounded up to a multiple of 16, or above 128 to one of 8 sizes per doubling:
    at most 12.5% more rows, and 56 sizes up to 8,192 tokens."""
    step = max(16, 1 << max(0, tokens.bit_length() - 4))
    return -(-tokens // step) * step


def texts_for(texts: int) -> int:
    """A group's padded text count (`group_shape`): exact up to 8, then one of
    4 sizes per doubling (10, 12, 14, 16, 20, 24, ...): at most 25% more rows, ~4 sizes per
    doubling. With `rows_for` on its length, a group's shapes are a few hundred at most."""
    step = max(1, 1 << max(0, texts.bit_length() - 3))
    return -(-texts // step) * step


def group_shape(texts: int, length: int, max_length: int) -> tuple[int, int]:
    """The padded (texts, length) a group of `texts` texts of up to `length` tokens runs as,
    where shapes must be few (oneDNN's compiled kernels, CUDA graphs): `texts_for` and
    `rows_for`, the length never rounded past `max_length` (the model's limit)."""
    return texts_for(texts), max(length, min(rows_for(length), max_length))


def relative_bias(table: torch.Tensor, length: int,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """MPNet's relative position bias for texts of `length` tokens, [1, heads, l, l] (each
    query's row), from its table [buckets, heads] (`encoder.relative_attention_bias`): the
    same for every layer, added to the attention scores. With the keys' `mask` ([b, 1, 1, l],
    bool), padded keys at -inf: [b, heads, l, l], an attention mask for
    scaled_dot_product_attention. Buckets as transformers' MPNetEncoder computes them (32 of
    them whatever the table's size, and 128 positions' distance): exact below 8 positions
    either way, then logarithmic."""
    position = torch.arange(length, device=table.device)
    n = position[:, None] - position[None, :]  # the query's position less the key's
    buckets = (n < 0).to(torch.long) * 16
    n = n.abs()
    large = 8 + (torch.log(n.float() / 8) / math.log(128 / 8) * 8).to(torch.long)
    buckets += torch.where(n < 8, n, large.clamp(max=15))
    bias = F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)
    return bias if mask is None else bias.masked_fill(~mask, float("-inf"))


@dataclass(frozen=True, slots=True)
class Output:
    """What the task heads read of a network's output (gpu_workers.tasks)."""

    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None = None  # a sequence classifier's


def supports(net: torch.nn.Module) -> bool:
    name = type(net).__name__
    if name in MASKED_LMS:
        if type(net.base_model).__name__ not in ENCODERS:
            return False
    elif name in CLASSIFIERS:
        encoder = net.base_model
        if type(encoder).__name__ not in ENCODERS or (
                name.startswith("Bert") and encoder.pooler is None):
            return False
    elif name not in ENCODERS:
        return False
    if not hasattr(net.base_model, "encoder"):
        return False  # transformers' DistilBertModel: its layers under other names
    if name.startswith("DebertaV2") and type(net).__module__ != "gpu_workers.deberta":
        return False  # transformers' own: its position scores are not computed here
    config = net.config
    return (getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not getattr(config, "is_decoder", False))


class PackedEncoder:
    def __init__(self, whole: torch.nn.Module, bucket: bool = False,
                 prepacked: bool = False) -> None:
        """`bucket`: round the token count up (`rows_for`); for CPUs. `prepacked`: the fused
        query-key-value product through gpu_workers.prepack (bf16 on a CPU)."""
        self.whole = whole  # the network as loaded: an encoder, or a classifier around one
        self.bucket = bucket
        self.classify = CLASSIFIERS.get(type(whole).__name__)
        net = self.net = whole if type(whole).__name__ in ENCODERS else whole.base_model
        config = net.config
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        # MPNet's relative position bias table (`relative_bias`); None for the others
        self.relative = getattr(net.encoder, "relative_attention_bias", None)
        # ELECTRA's projection of narrower embeddings to the layers' width; None for the others
        self.project = getattr(net, "embeddings_project", None)
        self.layers = []
        for layer in net.encoder.layer:
            if hasattr(layer.attention, "attn"):  # MPNet's names: attn.q, k, v, o
                attn, names = layer.attention.attn, ("q", "k", "v")
                output = functools.partial(_mpnet_output, attn.o, layer.attention.LayerNorm)
            else:
                attn = layer.attention.self
                names = (("query_proj", "key_proj", "value_proj")  # DeBERTa's
                         if hasattr(attn, "query_proj") else ("query", "key", "value"))
                output = layer.attention.output  # dense, residual, layer norm
            linears = [getattr(attn, name) for name in names]
            # Query, key and value as one matrix: one product instead of three. The network's
            # own three weights become views of it, so the weights are not held twice.
            weight = torch.cat([linear.weight for linear in linears])
            bias = torch.cat([linear.bias for linear in linears])
            for i, linear in enumerate(linears):
                rows = slice(i * self.hidden, (i + 1) * self.hidden)
                linear.weight = torch.nn.Parameter(weight[rows], requires_grad=False)
                linear.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
            scale = getattr(attn, "scaling", None)  # 1/sqrt(head size) unless the model says
            qkv = (prepack.linear(weight, bias) if prepacked
                   else lambda x, weight=weight, bias=bias: F.linear(x, weight, bias))
            if isinstance(qkv, prepack.PrepackedLinear):
                # The plain weights would be held twice (these layers' views of `weight`, and
                # the prepacked copy); nothing runs them once this pass does.
                for name in names:
                    setattr(attn, name, FusedAway(name))
            # DeBERTa's: its position scores from each group's queries and keys, as the mask
            scores = getattr(attn, "position_scores", None)
            self.layers.append((qkv, scale, output, layer, scores))

    def __call__(self, groups: list[Group]) -> list[Output]:
        """Each group's output: its last hidden state [b, l, hidden] (zeros at padded
        positions), and a classifier's logits [b, labels]."""
        h = self.hidden
        x, places = self._encode(groups)
        out = []
        for b, l, index, lo, hi, _ in places:
            hidden = scatter(x[lo:hi], b, l, index).view(b, l, h)
            out.append(Output(hidden, self.classify(self.whole, hidden) if self.classify
                              else None))
        return out

    def tokens(self, groups: list[Group]) -> torch.Tensor:
        """The last hidden state of every real token [tokens, hidden]: the groups' texts in
        order, each text's tokens in order (the packed rows, as they are)."""
        x, places = self._encode(groups)
        return x[:places[-1][4]]

    def _encode(self, groups: list[Group]) -> tuple[torch.Tensor, list[tuple]]:
        """The encoder over the groups' real tokens as one matrix [tokens (and padding rows),
        hidden], and where each group's rows lie in it."""
        h, heads = self.hidden, self.heads
        places, parts, start = [], [], 0
        for g in groups:
            b, l = g.ids.shape
            embedded = self.net.embeddings(input_ids=g.ids, token_type_ids=g.token_types)
            if self.project is not None:
                embedded = self.project(embedded)
            rows = embedded.reshape(b * l, h)
            # A group without padding (one text, or texts of one length) needs neither the
            # gathers nor an attention mask: its rows are its tokens, in order.
            index, mask = (None, None) if g.dense else (g.index, g.mask[:, None, None, :])
            if self.relative is not None:  # MPNet: its position bias, padded keys at -inf
                mask = relative_bias(self.relative.weight, l, mask)
            parts.append(gather(rows, index))
            places.append((b, l, index, start, start + b * l if index is None else
                           start + index.numel(), mask))
            start = places[-1][4]
        padding = rows_for(start) - start if self.bucket else 0
        if padding:
            parts.append(parts[0].new_zeros(padding, h))
        x = torch.cat(parts)  # [tokens (and padding rows), hidden]
        for linear, scale, output, layer, scores in self.layers:
            qkv = linear(x)
            context = []
            for b, l, index, lo, hi, mask in places:
                padded = scatter(qkv[lo:hi], b, l, index)
                q, k, v = padded.view(b, l, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask if scores is None else scores(q, k, mask),
                    scale=scale)
                context.append(gather(out.transpose(1, 2).reshape(b * l, h), index))
            if padding:
                context.append(x.new_zeros(padding, h))
            x = output(torch.cat(context), x)  # dense, residual, layer norm
            x = layer.output(layer.intermediate(x), x)
        return x, places


def _mpnet_output(o: torch.nn.Module, norm: torch.nn.Module, context: torch.Tensor,
                  x: torch.Tensor) -> torch.Tensor:
    """MPNet's attention output: the output product, the residual added, the layer norm
    (MPNetAttention; BERT's is its attention.output module)."""
    return norm(o(context) + x)


class FusedAway(torch.nn.Module):
    """In place of a query, key or value layer whose weight lives on only in a PackedEncoder's
    prepacked product: the network's own forward cannot run without it, and says so."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"the {self.name} layer runs fused in gpu_workers.packed's "
                           "prepacked query-key-value product; the network's own forward is "
                           "not available for this model")
