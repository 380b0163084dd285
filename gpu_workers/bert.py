"""BERT's networks, built and loaded without transformers.

Importing transformers' BERT costs a worker ~3 s of its start (of ~5 s with the tiny test
model, on the 2-core development machine: `python -X importtime` in docs/performance.md), and
every start pays it: supervisord's restarts, rolling restarts, pods. BERT is the family most
embedding, reranking and SPLADE checkpoints are (the default model is one), and its layers are
few and plain, so the worker builds them itself:

    BertModel                       embedding   (the last hidden state; no pooler)
    BertForSequenceClassification   classification, rerank  (pooler, dropout, classifier)
    BertForMaskedLM                 sparse      (the vocabulary head, its decoder tied to the
                                                 word embeddings)

The modules and their attributes have transformers' names, so the weights load by name and
gpu_workers.packed, gpu_workers.prepack and int8 quantization treat them as transformers' own.
The forward passes compute what transformers' do, in the same order (tests hold them equal).

`load` takes only a checkpoint it reads exactly as transformers would: model_type bert, an
encoder with absolute positions, gelu or relu, and every tensor named and shaped as
config.json implies. For anything else it returns None, and transformers loads the model, or
refuses it with its own message, as it did before (gpu_workers.networks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.packed import Output
from shmserve.models import weights_file

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}  # transformers' ACT2FN for these two names
# Tensors old checkpoints saved that hold no weights (transformers drops them too).
IGNORED = ("embeddings.position_ids",)


@dataclass
class Config:
    """What the networks and the worker read of a BERT config.json, with BertConfig's
    defaults. Class attributes: what gpu_workers reads of any network's config."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 2
    tie_word_embeddings: bool = True

    model_type = "bert"
    position_embedding_type = "absolute"
    is_decoder = False
    _attn_implementation = "sdpa"  # logged as the worker's attention

    @classmethod
    def read(cls, directory: Path) -> Config | None:
        """config.json as this module can run it, or None (another type, or a setting only
        transformers runs: relative positions, a decoder, another activation)."""
        try:
            raw = json.loads((Path(directory) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict) or raw.get("model_type") != "bert":
            return None
        if (raw.get("position_embedding_type", "absolute") != "absolute"
                or raw.get("is_decoder", False) or raw.get("add_cross_attention", False)
                or raw.get("hidden_act", "gelu") not in ACTIVATIONS):
            return None
        labels = raw.get("id2label")
        if labels is not None:
            if not isinstance(labels, dict) or raw.get("num_labels", len(labels)) != len(labels):
                return None
            raw = {**raw, "num_labels": len(labels)}
        fields = {}
        for name, default in cls().__dict__.items():
            value = raw.get(name, default)
            if value is None and name == "pad_token_id":
                value = 0
            if type(value) is not type(default):  # as transformers' strict config:
                return None  # layer_norm_eps 1 is refused (an int), and says so
            fields[name] = value
        config = cls(**fields)
        sizes = (config.vocab_size, config.hidden_size, config.num_hidden_layers,
                 config.num_attention_heads, config.intermediate_size,
                 config.max_position_embeddings, config.type_vocab_size, config.num_labels)
        if min(sizes) < 1 or config.hidden_size % config.num_attention_heads:
            return None
        return config


class Embeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[b, l] ids (and token types: None, all zeros) -> [b, l, hidden], positions from 0."""
        types = (self.token_type_embeddings.weight[0] if token_type_ids is None
                 else self.token_type_embeddings(token_type_ids))
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + types
        return self.LayerNorm(x + self.position_embeddings(positions))


class SelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.scaling = (h // self.heads) ** -0.5  # read by gpu_workers.packed
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = (linear(x).view(b, n, self.heads, h // self.heads).transpose(1, 2)
                   for linear in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return out.transpose(1, 2).reshape(b, n, h)


class AddNorm(nn.Module):
    """A dense layer, the residual added, and a layer norm (BertSelfOutput and BertOutput)."""

    def __init__(self, inputs: int, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = AddNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = AddNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))


class Pooler(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    def __init__(self, config: Config, pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if pooler else None

    @property
    def base_model(self) -> BertModel:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        # As transformers: no mask where no text is padded; else each key position's
        # [b, 1, 1, l] (a padded position's query row attends to the text; it is dropped).
        mask = (None if attention_mask is None or bool(attention_mask.all())
                else attention_mask.bool()[:, None, None, :])
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return Output(x)


class BertForSequenceClassification(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, pooler=True)
        self.dropout = nn.Identity()  # inference: dropout is the identity
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def base_model(self) -> BertModel:
        return self.bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        return Output(hidden, self.classifier(self.dropout(self.bert.pooler(hidden))))


class Transform(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class Predictions(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.transform = Transform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = self.decoder.bias  # one tensor, as transformers ties them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class MaskedLMHead(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.predictions = Predictions(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictions(x)


class BertForMaskedLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = MaskedLMHead(config)

    @property
    def base_model(self) -> BertModel:
        return self.bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        return Output(hidden, self.cls(hidden))


NETWORKS = {"embedding": BertModel, "sparse": BertForMaskedLM}  # else the classifier


def expected_shapes(config: Config, task: str) -> tuple[dict[str, tuple], set[str]]:
    """{tensor name: shape} the task's network holds, and the names a checkpoint may leave out
    (the decoder and its bias, tied to the word embeddings and `cls.predictions.bias`)."""
    with torch.device("meta"):  # shapes only: nothing allocated
        net = NETWORKS.get(task, BertForSequenceClassification)(config)
    shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    return shapes, tied & shapes.keys()


def load(directory: Path, task: str, dtype: torch.dtype) -> nn.Module | None:
    """The task's network (eval mode, weights in `dtype`), or None where only transformers
    can say what to do with this checkpoint (the module's docstring)."""
    from safetensors import safe_open

    config = Config.read(directory)
    if config is None or (task == "sparse" and not config.tie_word_embeddings):
        return None
    shapes, optional = expected_shapes(config, task)
    prefixed = task != "embedding"  # a head's checkpoint holds bert.*, as transformers saves
    try:
        with safe_open(str(weights_file(Path(directory))), framework="pt") as f:
            names = {}
            for key in f.keys():
                name = key
                if not prefixed:  # an encoder saved alone, or inside a model with a head
                    name = key.removeprefix("bert.")
                    if name.startswith("pooler."):
                        continue  # the embedding task reads the last hidden state only
                if name in IGNORED:
                    continue
                sliced = f.get_slice(key)
                if (name not in shapes or name in names or shapes[name] != tuple(
                        sliced.get_shape()) or sliced.get_dtype() not in ("F32", "F16", "BF16")):
                    return None  # unknown, twice, of another shape, or not float weights
                names[name] = key
            if shapes.keys() - optional - names.keys():
                return None  # weights missing: transformers says which
            weights = {name: f.get_tensor(key).to(dtype) for name, key in names.items()}
    except Exception:  # noqa: BLE001 - unreadable here (no model.safetensors, a damaged
        return None  # header): transformers reads it, or says why
    if task == "sparse":
        words = weights["bert.embeddings.word_embeddings.weight"]
        weights["cls.predictions.decoder.weight"] = words
        weights["cls.predictions.decoder.bias"] = weights["cls.predictions.bias"]
    with torch.device("meta"):
        net = NETWORKS.get(task, BertForSequenceClassification)(config)
    net.load_state_dict(weights, strict=True, assign=True)
    if task == "sparse":  # tied, as transformers ties them: one tensor each
        head = net.cls.predictions
        head.decoder.weight = net.bert.embeddings.word_embeddings.weight
        head.bias = head.decoder.bias
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()
