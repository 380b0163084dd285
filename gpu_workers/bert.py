"""The BERT family's networks, built and loaded without transformers.

Importing transformers' BERT costs a worker ~3 s of its start (of ~5 s with the tiny test
model, on the 2-core development machine: docs/performance.md), and every start pays it:
supervisord's restarts, rolling restarts, reloads, pods. The BERT family (`bert`, `roberta`,
`xlm-roberta`, `distilbert`, `mpnet`, `electra`) is what most embedding, reranking and SPLADE
checkpoints are (the default model is a BERT; all-mpnet-base-v2 an MPNet), and its layers are
few and plain, so the worker builds them itself:

    {Bert,Roberta,XLMRoberta,DistilBert,MPNet,Electra}Model
                                                        embedding (the last hidden state)
    ...ForSequenceClassification                        classification, rerank
    {Bert,Roberta,XLMRoberta,DistilBert}ForMaskedLM     sparse (the vocabulary head, its
                                                        decoder tied to the word embeddings)

The classes, modules and attributes have transformers' names, so the weights load by name and
gpu_workers.packed, gpu_workers.prepack and int8 quantization treat them as transformers' own.
The forward passes compute what transformers' do, in the same order (tests/integration/
test_bert.py holds them equal). RoBERTa differs from BERT in its positions (counted from the
padding id, past it) and its heads; DistilBERT in its names (its tensors are read under
BERT's) and heads; MPNet has no token types, RoBERTa's positions (from a padding id of 1,
whatever its config says) and head, its layers' tensors under other names (attn.q, k, v, o),
and a relative position bias added to every layer's attention scores; ELECTRA (its
discriminator) embeds at its own width, projected to the layers' (`embeddings_project`), and
its classifier's activation is gelu.

`load` takes only a checkpoint it reads exactly as transformers would: an encoder with absolute
positions, gelu or relu, config values of the types transformers' config accepts, and every
tensor the network needs, named and shaped as config.json implies (other tensors, such as
another task's head, are left out, as transformers leaves them). For anything else it returns
None, and transformers loads the model, or refuses it with its own message
(gpu_workers.networks).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers import checkpoint
from gpu_workers.bert_config import ACTIVATIONS, DISTILBERT_TENSORS, Config
from gpu_workers.packed import Output, relative_bias

def embedding(rows: int, width: int) -> nn.Embedding:
    """An embedding table left uninitialised (its weights are loaded): nn.Embedding's own
    normal_ init, on the meta device, imports torch._dynamo, ~1.4 s of a worker's start."""
    return nn.Embedding(rows, width, _weight=torch.empty(rows, width))


class Embeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        width = config.embedding_size or config.hidden_size  # ELECTRA's may be narrower
        self.word_embeddings = embedding(config.vocab_size, width)
        self.position_embeddings = embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = (embedding(config.type_vocab_size, width)
                                      if config.type_vocab_size else None)  # DistilBERT: none
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        # MPNet's padding index is 1, whatever its pad_token_id (transformers' MPNetEmbeddings)
        self.padding_idx = {"roberta": config.pad_token_id, "mpnet": 1}.get(config.prefix)

    def forward(self, input_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[b, l] ids (and token types: None, all zeros) -> [b, l, hidden]. Positions: BERT's
        from 0; RoBERTa's count the tokens that are not the padding id, from past it (a
        padding id's position is the padding id), as fairseq's make_positions."""
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            x = x + (self.token_type_embeddings.weight[0] if token_type_ids is None
                     else self.token_type_embeddings(token_type_ids))
        if self.padding_idx is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        else:
            kept = input_ids.ne(self.padding_idx).int()
            positions = (torch.cumsum(kept, dim=1).type_as(kept) * kept).long() + self.padding_idx
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


class MPNetSelfAttention(nn.Module):
    """BERT's self-attention and its output product under MPNet's names (q, k, v, o)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = (linear(x).view(b, n, self.heads, h // self.heads).transpose(1, 2)
                   for linear in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, n, h))


class MPNetAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`mask`: the relative position bias, padded keys at -inf (packed.relative_bias)."""
        return self.LayerNorm(self.attn(x, mask) + x)


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
        self.attention = (MPNetAttention if config.model_type == "mpnet" else Attention)(config)
        self.intermediate = Intermediate(config)
        self.output = AddNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        if config.model_type == "mpnet":  # its relative position bias (packed.relative_bias)
            self.relative_attention_bias = embedding(config.relative_attention_num_buckets,
                                                     config.num_attention_heads)


class Pooler(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class Model(nn.Module):
    """BertModel, RobertaModel, ... (`network_class`): the encoder."""

    def __init__(self, config: Config, pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        if config.embedding_size not in (None, config.hidden_size):  # ELECTRA's
            self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if pooler else None

    @property
    def base_model(self) -> Model:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        if hasattr(self, "embeddings_project"):
            x = self.embeddings_project(x)
        # As transformers: no mask where no text is padded; else each key position's
        # [b, 1, 1, l] (a padded position's query row attends to the text; it is dropped).
        mask = (None if attention_mask is None or bool(attention_mask.all())
                else attention_mask.bool()[:, None, None, :])
        if self.config.model_type == "mpnet":  # its position bias, padded keys at -inf
            mask = relative_bias(self.encoder.relative_attention_bias.weight,
                                 input_ids.shape[1], mask)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return Output(x)


class WithHead(nn.Module):
    """An encoder under the family's attribute (`bert`, `roberta`) and a head."""

    def __init__(self, config: Config, pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        setattr(self, config.prefix, network_class(config, "embedding")(config, pooler))

    @property
    def base_model(self) -> Model:
        return getattr(self, self.config.prefix)


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        # ElectraClassificationHead's is gelu, whatever hidden_act says
        self.activation = F.gelu if config.model_type == "electra" else torch.tanh

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first token's last hidden state, dense, tanh (ELECTRA's: gelu), out_proj
        (dropouts: identity)."""
        return self.out_proj(self.activation(self.dense(hidden[:, 0])))


class SequenceClassifier(WithHead):
    """BERT's: pooler (first token, dense, tanh), dropout (the identity at inference),
    classifier. RoBERTa's, MPNet's and ELECTRA's: no pooler; the classifier is
    RobertaClassificationHead (MPNetClassificationHead: the same; ElectraClassificationHead:
    gelu for tanh).
    DistilBERT's: the first token, pre_classifier, relu, dropout, classifier."""

    def __init__(self, config: Config) -> None:
        super().__init__(config, pooler=config.bert)
        h = config.hidden_size
        if config.prefix in ("roberta", "mpnet", "electra"):
            self.classifier = RobertaClassificationHead(config)
            return
        self.dropout = nn.Identity()
        if config.prefix == "distilbert":
            self.pre_classifier = nn.Linear(h, h)
        self.classifier = nn.Linear(h, config.num_labels)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, labels] from the encoder's last hidden state [b, l, hidden] (as
        gpu_workers.packed's CLASSIFIERS compute them)."""
        if self.config.prefix in ("roberta", "mpnet", "electra"):
            return self.classifier(hidden)
        if self.config.prefix == "distilbert":
            return self.classifier(self.dropout(torch.relu(self.pre_classifier(hidden[:, 0]))))
        return self.classifier(self.dropout(self.bert.pooler(hidden)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        hidden = self.base_model(input_ids, attention_mask, token_type_ids).last_hidden_state
        return Output(hidden, self.logits(hidden))


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
    """BERT's `cls`."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.predictions = Predictions(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictions(x)


class RobertaLMHead(nn.Module):
    """RoBERTa's `lm_head`: dense, gelu (whatever hidden_act says), layer norm, decoder."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = self.decoder.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(F.gelu(self.dense(x))))


class MaskedLM(WithHead):
    """The vocabulary head: BERT's `cls`, RoBERTa's `lm_head`, DistilBERT's vocab_transform,
    activation, vocab_layer_norm and vocab_projector. Its decoder is tied to the word embeddings
    (`TIES`)."""

    TIES = {  # family's prefix: (tensor, the tensor it is tied to)
        "bert": (("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
                 ("cls.predictions.decoder.bias", "cls.predictions.bias")),
        "roberta": (("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"),
                    ("lm_head.decoder.bias", "lm_head.bias")),
        "distilbert": (("vocab_projector.weight",
                        "distilbert.embeddings.word_embeddings.weight"),)}

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        h = config.hidden_size
        if config.prefix == "bert":
            self.cls = MaskedLMHead(config)
        elif config.prefix == "roberta":
            self.lm_head = RobertaLMHead(config)
        else:
            self.vocab_transform = nn.Linear(h, h)
            self.activation = ACTIVATIONS[config.hidden_act]
            self.vocab_layer_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
            self.vocab_projector = nn.Linear(h, config.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.prefix == "bert":
            return self.cls(hidden)
        if self.config.prefix == "roberta":
            return self.lm_head(hidden)
        return self.vocab_projector(self.vocab_layer_norm(self.activation(
            self.vocab_transform(hidden))))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Output:
        hidden = self.base_model(input_ids, attention_mask, token_type_ids).last_hidden_state
        return Output(hidden, self.logits(hidden))


# Each family's classes, named as transformers names them: gpu_workers.packed knows a network by
# its class's name.
class BertModel(Model): ...
class BertForSequenceClassification(SequenceClassifier): ...
class BertForMaskedLM(MaskedLM): ...
class RobertaModel(Model): ...
class RobertaForSequenceClassification(SequenceClassifier): ...
class RobertaForMaskedLM(MaskedLM): ...
class XLMRobertaModel(Model): ...
class XLMRobertaForSequenceClassification(SequenceClassifier): ...
class XLMRobertaForMaskedLM(MaskedLM): ...
class DistilBertModel(Model): ...
class DistilBertForSequenceClassification(SequenceClassifier): ...
class DistilBertForMaskedLM(MaskedLM): ...
class MPNetModel(Model): ...
class MPNetForSequenceClassification(SequenceClassifier): ...
class ElectraModel(Model): ...
class ElectraForSequenceClassification(SequenceClassifier): ...


CLASSES = {  # (model_type, task) -> class; classification and rerank: the sequence classifier
    (family, task): cls
    for family, classes in (
        ("bert", (BertModel, BertForSequenceClassification, BertForMaskedLM)),
        ("roberta", (RobertaModel, RobertaForSequenceClassification, RobertaForMaskedLM)),
        ("xlm-roberta", (XLMRobertaModel, XLMRobertaForSequenceClassification,
                         XLMRobertaForMaskedLM)),
        ("distilbert", (DistilBertModel, DistilBertForSequenceClassification,
                        DistilBertForMaskedLM)),
        # MPNet's and ELECTRA's masked LMs are no sparse models shmserve serves
        # (shmserve.models.MASKED_LMS)
        ("mpnet", (MPNetModel, MPNetForSequenceClassification)),
        ("electra", (ElectraModel, ElectraForSequenceClassification)))
    for task, cls in zip(("embedding", "classification", "sparse"), classes)}


def network_class(config: Config, task: str) -> type | None:
    """The class of the task's network (classification and rerank: the sequence classifier),
    or None where this module builds none."""
    return CLASSES.get((config.model_type, task if task in ("embedding", "sparse")
                        else "classification"))


def load(directory: Path, task: str, dtype: torch.dtype) -> nn.Module | None:
    """The task's network (eval mode, weights in `dtype`), or None where only transformers
    can say what to do with this checkpoint (the module's docstring)."""
    config = Config.read(directory)
    if config is None or network_class(config, task) is None or (
            task == "sparse" and not config.tie_word_embeddings):
        return None
    with torch.device("meta"):  # nothing allocated: the weights are assigned below
        net = network_class(config, task)(config)
    prefix = config.prefix + "."

    def name_of(key: str) -> str:
        if config.prefix == "distilbert":  # its layers' tensors under BERT's names
            for theirs, ours in DISTILBERT_TENSORS:
                key = key.replace(theirs, ours)
        # an encoder saved alone, or inside a model with a head
        return key.removeprefix(prefix) if task == "embedding" else key

    # A masked LM's decoder is tied to the word embeddings (and its bias to the head's): a
    # checkpoint may leave them out (transformers 5 saves neither), or hold them equal.
    ties = MaskedLM.TIES[config.prefix] if task == "sparse" else ()
    weights = checkpoint.read(directory, net, dtype, name_of,
                              optional=frozenset(name for name, _ in ties))
    if weights is None:
        return None
    for name, source in ties:
        if name in weights and not torch.equal(weights[name], weights[source]):
            return None  # saved untied: transformers then keeps them apart (and says so)
        weights[name] = weights[source]
    net = checkpoint.assign(net, weights)
    for name, source in ties:  # tied as transformers ties them: one tensor each
        module, _, attribute = name.rpartition(".")
        setattr(net.get_submodule(module), attribute, net.get_parameter(source))
    return net
