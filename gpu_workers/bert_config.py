"""A BERT-family config.json read as transformers' config reads it, without importing
transformers (gpu_workers.bert builds the networks it describes): `bert`, `roberta`,
`xlm-roberta`, `distilbert`, `mpnet` and `electra`, with each family's defaults, or None for a
setting only transformers runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch.nn.functional as F

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}  # transformers' ACT2FN for these two names
# model_type: (the encoder's attribute and its weights' prefix, the defaults its transformers
# config has where BertConfig's differ)
FAMILIES = {"bert": ("bert", {}),
            "roberta": ("roberta", {"vocab_size": 50265, "pad_token_id": 1}),
            "xlm-roberta": ("roberta", {"pad_token_id": 1}),
            "distilbert": ("distilbert", {"num_hidden_layers": 6}),
            "mpnet": ("mpnet", {"vocab_size": 30527, "pad_token_id": 1}),
            "electra": ("electra", {"hidden_size": 256, "num_attention_heads": 4,
                                    "intermediate_size": 1024})}
# DistilBERT: BERT's layers without token types, under other names: its config.json's names
# for the fields.
DISTILBERT_FIELDS = {"dim": "hidden_size", "n_layers": "num_hidden_layers",
                     "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size",
                     "activation": "hidden_act"}

# DistilBERT's layers' tensors' names for BERT's (the embeddings are named alike).
DISTILBERT_TENSORS = (("transformer.layer.", "encoder.layer."),
                      (".attention.q_lin.", ".attention.self.query."),
                      (".attention.k_lin.", ".attention.self.key."),
                      (".attention.v_lin.", ".attention.self.value."),
                      (".attention.out_lin.", ".attention.output.dense."),
                      (".sa_layer_norm.", ".attention.output.LayerNorm."),
                      (".ffn.lin1.", ".intermediate.dense."), (".ffn.lin2.", ".output.dense."),
                      (".output_layer_norm.", ".output.LayerNorm."))


@dataclass
class Config:
    """What the networks and the worker read of a config.json, with BertConfig's defaults
    (FAMILIES: the others'). Class attributes: what gpu_workers reads of any network's config."""

    model_type: str = "bert"
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

    position_embedding_type = "absolute"
    is_decoder = False
    # MPNet's (an instance attribute there): the rows of its relative attention bias table
    relative_attention_num_buckets = 32
    # ELECTRA's (an instance attribute there): its embeddings' width, projected to hidden_size
    # where they differ
    embedding_size = None
    _attn_implementation = "sdpa"  # logged as the worker's attention

    @property
    def bert(self) -> bool:
        return self.model_type == "bert"

    @property
    def prefix(self) -> str:
        return FAMILIES[self.model_type][0]

    @classmethod
    def read(cls, directory: Path) -> Config | None:
        """config.json as this module can run it, or None (another type, or a setting only
        transformers runs: relative positions, a decoder, another activation)."""
        raw = config_json(directory, FAMILIES)
        if raw is None:
            return None
        if raw["model_type"] == "distilbert":
            if raw.get("sinusoidal_pos_embds", False) or any(
                    name in raw for name in DISTILBERT_FIELDS.values()):
                return None  # fixed positions; or a field under both names
            # no token types; layer norms of eps 1e-12 whatever config.json says
            raw = {**{DISTILBERT_FIELDS.get(k, k): v for k, v in raw.items()
                      if k not in ("position_embedding_type", "is_decoder", "type_vocab_size")},
                   "type_vocab_size": 0, "layer_norm_eps": 1e-12}
        elif raw["model_type"] == "mpnet":
            # no token types; MPNetConfig has none of these fields, and its network reads none
            raw = {**{k: v for k, v in raw.items() if k not in (
                "position_embedding_type", "is_decoder", "add_cross_attention",
                "type_vocab_size")}, "type_vocab_size": 0}
        if (raw.get("position_embedding_type", "absolute") != "absolute"
                or raw.get("is_decoder", False) or raw.get("add_cross_attention", False)
                or raw.get("hidden_act", "gelu") not in ACTIVATIONS):
            return None
        # A null padding id: BERT's positions do not need one; RoBERTa's do, and MPNet's count
        # from 1 whatever it says (transformers' MPNetEmbeddings).
        values = typed_fields(cls, raw, FAMILIES[raw["model_type"]][1],
                              null_pad=raw["model_type"] in ("bert", "mpnet"))
        if values is None:
            return None
        config = cls(**values)
        if config.model_type == "mpnet":
            buckets = raw.get("relative_attention_num_buckets", 32)
            if type(buckets) is not int:
                return None
            config.relative_attention_num_buckets = buckets
        if config.model_type == "electra":
            width = raw.get("embedding_size", 128)
            if type(width) is not int or width < 1:
                return None
            config.embedding_size = width
        sizes = (config.vocab_size, config.hidden_size, config.num_hidden_layers,
                 config.num_attention_heads, config.intermediate_size,
                 config.max_position_embeddings, config.num_labels,
                 config.type_vocab_size + (config.model_type in ("distilbert", "mpnet")),
                 # MPNet's bias reads 32 rows of the table, whatever its size (transformers)
                 config.relative_attention_num_buckets - 31)
        if (min(sizes) < 1 or config.hidden_size % config.num_attention_heads
                or not 0 <= config.pad_token_id < config.vocab_size):
            return None
        return config


def config_json(directory: Path, types) -> dict | None:
    """A model directory's config.json when its model_type is one of `types`, its id2label
    counted into num_labels (as transformers counts them); else None."""
    try:
        raw = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in types:
        return None
    labels = raw.get("id2label")
    if labels is not None:
        if not isinstance(labels, dict) or raw.get("num_labels", len(labels)) != len(labels):
            return None
        raw = {**raw, "num_labels": len(labels)}
    return raw


def typed_fields(cls, raw: dict, defaults: dict, null_pad: bool) -> dict | None:
    """Each of the dataclass `cls`'s fields from `raw`, else its default (`defaults` over the
    field's own), or None when one is of another type than its default, as transformers'
    strict config refuses it (layer_norm_eps 1, an int). `null_pad`: a null pad_token_id
    reads as 0."""
    values = {}
    for field in fields(cls):
        default = defaults.get(field.name, field.default)
        value = raw.get(field.name, default)
        if value is None and field.name == "pad_token_id" and null_pad:
            value = 0
        if type(value) is not type(default):
            return None
        values[field.name] = value
    return values


def default_rope_theta(params, theta: float) -> float | None:
    """The rotary base that rope_parameters (as transformers 5 saves them) give, `theta` where
    they name none; None for parameters only transformers runs (another rope_type: scaled
    positions; other keys). Shared by gpu_workers.modernbert and .qwen3."""
    if params is None:
        return theta
    if not isinstance(params, dict) or params.get("rope_type", "default") != "default" \
            or set(params) - {"rope_type", "rope_theta"}:
        return None
    return params.get("rope_theta", theta)
