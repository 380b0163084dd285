"""What a model directory says about itself, read without torch.

Both sides need it: the frontend for the tokenizer, the input limit and the labels, the worker
for pooling, normalisation, the scoring head and the weights. A source is a directory, or
``package:NAME`` for an installed Python package that ships one (a ``model/`` folder beside it).

A configured model is served as one or more *units*, what a worker loads and what a Submit
names: a model without variants is one unit of its own name; a model with A/B variants is one
unit per variant, named ``MODEL@VARIANT``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from shmserve import architecture as arch
from shmserve import yes_no
from shmserve.config import Config, ModelConfig
from shmserve.model_files import (Dense, ModelSourceError, dense_directories, dense_of,
                                  lowercases, max_seq_length, normalize_of, pooling_of,
                                  pooling_config, read_json, STATIC_ARCHITECTURE, static_config,
                                  static_directory, header, tokenizer, tokenizer_path)
from shmserve.sources import resolve_source  # noqa: F401 - imported from here too

# A cross-encoder's score, as sentence-transformers' CrossEncoder computes it: the activation it
# saved with the model, else Sigmoid for one label.
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
               "torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    directory: Path
    task: str
    # mean | cls | last | max | mean_sqrt_len_tokens | weightedmean, or several joined by "+"
    # (their vectors side by side); splade (sparse)
    pooling: str
    normalize: bool
    max_tokens: int
    # the width of one output row: hidden size, number of labels, 1 (rerank), or the vocabulary
    # size (sparse)
    dim: int
    dtype: str
    revision: str
    labels: tuple[str, ...] = ()  # classification: label names by class index
    activation: str = ""  # classification: softmax | sigmoid; rerank: sigmoid | identity
    auto_min_cosine: float = 0.999  # dtype auto: the agreement with fp32 bf16 / fp16 must reach
    # Embedding models: texts prepended before tokenizing, by name (sentence-transformers'
    # prompts), and the one for requests that name none ("" for none).
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt: str = ""
    # The rows of the model's embedding table (config.json's vocab_size; 0: not given): a
    # client's token ids must be under it as well as under the tokenizer's vocabulary size
    # (a tokenizer with added tokens the table never grew for).
    vocab_size: int = 0
    # A reranker that is a causal LM answering yes or no (shmserve.yes_no): how a pair is put
    # in its prompt (prefix, before the query, between query and document, suffix), and the
    # ids of its answers "yes" and "no". Empty for any other model.
    pair_format: tuple[str, ...] = ()
    answers: tuple[int, ...] = ()
    # An embedding model's sentence-transformers Dense projections after its pooling, in order
    dense: tuple[Dense, ...] = ()
    # An embedding model's token rows' width (its hidden size), where its pooled vector's
    # differs (several pooling modes, Dense projections); 0: `dim`
    hidden: int = 0
    # An embedding model whose pooling leaves the prompt's tokens out (sentence-transformers'
    # 1_Pooling include_prompt: false, INSTRUCTOR-style): the frontends count them
    # (Submit.skip) and the worker's pooling skips them
    skips_prompt: bool = False
    # What `incompatible` compares from the directory's files (architecture, lowercasing, the
    # tokenizer's digest), read when the spec was: a reload compares with the served model as
    # it was loaded, whose directory may be gone since (it read "architecture differs (('',)
    # now ...)", and refused every reload, once a reloaded source was deleted: an outside check)
    files: tuple = ()

    def width(self, per_token: bool = False) -> int:
        """A row's width: every token's (TEI's /embed_all) or the text's."""
        return (self.hidden or self.dim) if per_token else self.dim


@dataclass(frozen=True, slots=True)
class Unit:
    """What a worker loads: one model, or one A/B variant of it."""

    name: str  # MODEL, or MODEL@VARIANT
    model: str  # the configured model's name
    variant: str  # "" for a model without variants
    weight: float
    config: ModelConfig  # the model's config with this unit's name, source and revision


def units(model: ModelConfig) -> list[Unit]:
    if not model.variants:
        return [Unit(model.name, model.name, "", 1.0, model)]
    return [Unit(f"{model.name}@{v.name}", model.name, v.name, v.weight,
                 dataclasses.replace(model, name=f"{model.name}@{v.name}", source=v.source,
                                     revision=v.revision, variants=[], sticky_key=""))
            for v in model.variants]


def hosted(cfg: Config, devices: list[str], index: int) -> list[Unit]:
    """The units worker `index` loads; `devices` is topology.worker_devices(cfg)."""
    return [u for m in cfg.models if _hosts(m, devices, index) for u in units(m)]


def check(cfg: Config, devices: list[str]) -> None:
    """Refuse, with ModelSourceError, a configured model that cannot be served: before any
    process starts (`shmserve up`). `devices` is topology.worker_devices(cfg)."""
    cpu = "cpu" in devices
    for index, model in enumerate(cfg.models):
        missing = [d for d in model.devices if not any(
            _hosts(dataclasses.replace(model, devices=[d]), devices, i)
            for i in range(len(devices)))]
        if missing:
            raise ModelSourceError(
                f"models[{index}].devices: {missing} name no worker; the workers are "
                + (f"worker indexes {list(range(len(devices)))}" if cpu else f"GPUs {devices}"))
        first = None
        unlabelled: dict[Path, str] = {}  # variants without a revision, by weights file
        for unit in units(model):
            try:
                spec = inspect(unit.config, with_revision=False, roots=cfg.model_root_paths)
                weights = weights_file(resolve_source(unit.config.source, cfg.model_root_paths))
                check_weights(weights)  # (the Dense modules' headers: read by inspect)
                tokenizer(spec.directory)  # what every frontend loads as it starts
            except ModelSourceError as exc:
                raise ModelSourceError(f"{unit.name}: {exc}") from None
            if unit.variant and not unit.config.revision:
                # Both would be labelled with the weights' digest: one revision for two arms,
                # which metrics and KServe's versions could not tell apart.
                if weights in unlabelled:
                    raise ModelSourceError(
                        f"{unit.name}: variants {unlabelled[weights]!r} and {unit.variant!r} "
                        "load the same weights with no revision, so both would be labelled "
                        "with its digest; give each a revision")
                unlabelled[weights] = unit.variant
            # Variants are revisions behind one name: the frontends tokenize for all of them
            # with one tokenizer and describe one output, so they are held to a reload's rules.
            if first is None:
                first = unit, spec
            elif why := incompatible(first[1], spec, (f"in {first[0].variant}",
                                                      f"in {unit.variant}:")):
                raise ModelSourceError(f"{unit.name} cannot be a variant beside "
                                       f"{first[0].name}: {why}")
        on_gpu = [d for i, d in enumerate(devices)
                  if d != "cpu" and _hosts(model, devices, i)]
        if model.dtype == "int8" and on_gpu:
            raise ModelSourceError(
                f"models[{index}].dtype: int8 (dynamic quantization) runs on CPU workers only, "
                f"and {model.name} would load on GPUs {on_gpu}; use bf16 or fp16, or "
                "workers.devices: cpu")


def _hosts(model: ModelConfig, devices: list[str], index: int) -> bool:
    if not model.devices:
        return True
    if devices[index] == "cpu":
        return index in model.devices
    return int(devices[index]) in model.devices


def weights_file(directory: Path) -> Path:
    directory = static_directory(directory) or directory  # a static model's table
    path = directory / "model.safetensors"
    if path.is_file():
        return path
    pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
    if pickles:
        raise ModelSourceError(f"{directory} holds only pickle checkpoints ({', '.join(pickles)}); "
                               "shmserve loads safetensors only: convert with "
                               "safetensors.torch.save_file")
    raise ModelSourceError(f"{directory}: no model.safetensors")


def check_weights(path: Path) -> None:
    """Refuse a weights file whose safetensors header does not read, or whose tensors do not
    cover the file exactly (a truncated copy): the header alone is read, not the weights."""
    if not header(path):
        raise ModelSourceError(f"{path} holds no tensors")


def inspect(cfg: ModelConfig, with_revision: bool = True,
            roots: list[Path] | None = None) -> ModelSpec:
    directory = resolve_source(cfg.source, roots)
    static = static_directory(directory)
    if static is not None and cfg.task != "embedding":
        raise ModelSourceError(f"{directory}: a static embedding model (StaticEmbedding) serves "
                               f"task embedding, not {cfg.task}")
    model_cfg = static_config(directory) if static else read_json(directory / "config.json")
    if model_cfg is None:
        raise ModelSourceError(f"{directory}: no config.json")
    if not tokenizer_path(directory).is_file():
        raise ModelSourceError(f"{tokenizer_path(directory).parent}: no tokenizer.json (a fast "
                               "tokenizer is required)")
    if why := arch.needs_own_code(model_cfg) or arch.unpadded(model_cfg):
        raise ModelSourceError(f"{directory}: {why}")
    limit = min(arch.positions(model_cfg), max_seq_length(directory))
    if cfg.max_input_tokens:
        limit = min(limit, cfg.max_input_tokens)
    labels, activation = _head(cfg.task, model_cfg, directory)
    answering = yes_no.applies(cfg.task, model_cfg)
    if cfg.instruction and not answering:
        raise ModelSourceError(f"model {cfg.name!r}: an instruction is read by a reranker that "
                               f"answers yes or no ({', '.join(yes_no.ARCHITECTURES)}, task "
                               f"rerank), not by this {cfg.task} model")
    prompts, default_prompt = _prompts(cfg, directory)
    sparse = cfg.task == "sparse" and _masked_lm(model_cfg, directory)
    pooling = "splade" if sparse else pooling_of(cfg.pooling, cfg.task, directory)
    hidden = _width(model_cfg, directory) if cfg.task in ("embedding", "null") else 0
    dim = sparse or {"classification": len(labels), "rerank": 1}.get(cfg.task) or (
        hidden * len(pooling.split("+")))
    dense = () if sparse else dense_of(cfg.task, directory, dim)
    if dense:
        dim = dense[-1].out_features
    revision = cfg.revision
    if not revision and cfg.task == "null":
        revision = "null"
    if not revision and with_revision:
        revision = weights_revision(directory)
    return ModelSpec(
        name=cfg.name,
        directory=directory,
        task=cfg.task,
        pooling=pooling,
        normalize=False if sparse else normalize_of(cfg.normalize, directory),
        max_tokens=limit,
        dim=dim,
        dtype=cfg.dtype,
        revision=revision,
        labels=labels,
        activation=activation,
        auto_min_cosine=cfg.auto_min_cosine,
        prompts=prompts,
        default_prompt=default_prompt,
        vocab_size=int(model_cfg.get("vocab_size") or 0),
        pair_format=yes_no.pair_format(cfg.instruction) if answering else (),
        answers=yes_no.answer_tokens(directory) if answering else (),
        dense=dense,
        hidden=hidden if hidden != dim else 0,
        skips_prompt=cfg.task == "embedding" and pooling_config(directory).get(
            "include_prompt") is False,
        files=files_compared(directory),
    )


def files_compared(directory: Path) -> tuple:
    """The facts of a model's files a reload must keep (`incompatible`): its architecture, its
    lowercasing, its tokenizer.json's digest."""
    return (architecture(directory), lowercases(directory),
            file_digest(tokenizer_path(directory)))


def replacement(config: ModelConfig, active: ModelSpec, roots: list[Path] | None,
                with_revision: bool = True) -> ModelSpec:
    """The spec of `config`'s source as a reload's new weights for the served `active`, or a
    ModelSourceError saying why it cannot replace it (a worker's Reload; a frontend's check for
    workers that take a reload's source at their next load)."""
    spec = inspect(config, with_revision=with_revision, roots=roots)
    why = incompatible(active, spec)
    if why:
        raise ModelSourceError(f"{spec.directory} cannot replace the served {active.name}: "
                               f"{why}; serving a different one needs a config change and "
                               "a restart")
    return spec


def incompatible(active: ModelSpec, new: ModelSpec, sides: tuple[str, str] = ("now", "in")
                 ) -> str:
    """Why `new` cannot replace `active` under a running frontend ("" when it can): frontends
    tokenize with the active model's tokenizer and shape replies by its outputs. `sides`
    words each value of a difference: (the served one's, `new`'s before its directory)."""
    # The kind of checkpoint first: a classifier's offered for an encoder differs in its
    # normalization too, and that would be named instead of what the user got wrong.
    served = active.files or files_compared(active.directory)
    offered = new.files or files_compared(new.directory)
    for what, old, now in (("task", active.task, new.task),
                           ("architecture", served[0], offered[0]),
                           ("output width", active.dim, new.dim),
                           ("label set", active.labels, new.labels),
                           # the frontends score the logits by the served model's (a softmax,
                           # a multi-label model's or a cross-encoder's sigmoid, identity)
                           ("scoring", active.activation, new.activation),
                           ("input limit", active.max_tokens, new.max_tokens),
                           # the frontends refuse token ids past the table they were told of
                           ("embedding table's rows (config.json vocab_size)",
                            active.vocab_size, new.vocab_size),
                           ("pooling", active.pooling, new.pooling),
                           ("normalization", active.normalize, new.normalize),
                           # the frontends count the prompt's tokens for the worker to skip
                           ("prompt pooling (1_Pooling include_prompt)",
                            not active.skips_prompt, not new.skips_prompt),
                           ("Dense projections", [d.shape for d in active.dense],
                            [d.shape for d in new.dense]),
                           ("lowercasing (sentence_bert_config.json do_lower_case)",
                            served[1], offered[1]),
                           ("prompts", dict(active.prompts), dict(new.prompts)),
                           ("default prompt", active.default_prompt, new.default_prompt),
                           ("pair prompt", active.pair_format, new.pair_format)):
        if old != now:
            verb = "differ" if what in ("prompts", "Dense projections") else "differs"
            return f"its {what} {verb} ({old!r} {sides[0]}, {now!r} {sides[1]} {new.directory})"
    if served[2] != offered[2]:
        return f"its tokenizer.json differs from the served one ({active.directory})"
    return ""


def architecture(directory: Path) -> tuple[str, ...]:
    """config.json's model type and architectures: a classifier's checkpoint is not an
    encoder's, even where the encoder's weights would load from it."""
    model_cfg = (STATIC_ARCHITECTURE if static_directory(directory)
                 else read_json(directory / "config.json") or {})
    return (str(model_cfg.get("model_type", "")), *map(str, model_cfg.get("architectures") or ()))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _width(model_cfg: dict, directory: Path) -> int:
    if (found := arch.width(model_cfg)) is None:
        raise ModelSourceError(f"{directory}: config.json gives no hidden width (one of "
                               f"{', '.join(arch.WIDTH_KEYS)})")
    return found


def _head(task: str, model_cfg: dict, directory: Path) -> tuple[tuple[str, ...], str]:
    """(labels, activation) of a scoring model; refuses a checkpoint without a trained head."""
    if task not in ("classification", "rerank"):
        return (), ""
    if yes_no.applies(task, model_cfg):  # its score: P(yes) = sigmoid(yes - no)
        return (), "sigmoid"
    architectures = model_cfg.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ModelSourceError(f"{directory}: task {task} needs a sequence-classification "
                               f"checkpoint (config.json architectures: {architectures or 'none'})"
                               "; a bare encoder would get an untrained head")
    id2label = model_cfg.get("id2label") or {"0": "LABEL_0", "1": "LABEL_1"}
    try:
        labels = tuple(str(id2label[str(i)]) for i in range(len(id2label)))
    except KeyError:
        raise ModelSourceError(f"{directory}/config.json: id2label must map 0..N-1") from None
    if task == "classification":
        if len(labels) < 2:
            raise ModelSourceError(f"{directory}: a classification model needs >= 2 labels; "
                                   "one label is a cross-encoder (task rerank)")
        # A multi-label model (toxicity's kind: labels that hold together) is scored label by
        # label, as transformers' pipeline does; others, a softmax over the labels
        multi = model_cfg.get("problem_type") == "multi_label_classification"
        return labels, "sigmoid" if multi else "softmax"
    if len(labels) != 1:
        raise ModelSourceError(f"{directory}: a rerank model (cross-encoder) has one output, "
                               f"this one has {len(labels)} labels (task classification?)")
    st = model_cfg.get("sentence_transformers") or {}
    st_file = read_json(directory / "config_sentence_transformers.json") or {}
    path = (st.get("activation_fn") or model_cfg.get("sbert_ce_default_activation_function")
            or st_file.get("activation_fn") or "torch.nn.modules.activation.Sigmoid")
    if path not in ACTIVATIONS:
        raise ModelSourceError(f"{directory}: cross-encoder activation {path!r} is not one of "
                               f"{', '.join(sorted(ACTIVATIONS))}")
    return (), ACTIVATIONS[path]


# The masked-language-model checkpoints a sparse (SPLADE) model may be: those whose encoder
# runs packed and whose vocabulary head gpu_workers.packed knows.
MASKED_LMS = ("BertForMaskedLM", "RobertaForMaskedLM", "XLMRobertaForMaskedLM",
              "DistilBertForMaskedLM")


def _masked_lm(model_cfg: dict, directory: Path) -> int:
    """A sparse model's output width, its vocabulary size; refuses a checkpoint without the
    masked-language-model head SPLADE reads (a bare encoder's would be missing)."""
    architectures = [str(a) for a in model_cfg.get("architectures") or []]
    if not any(a in MASKED_LMS for a in architectures):
        raise ModelSourceError(f"{directory}: task sparse (SPLADE) needs a masked-language-model "
                               f"checkpoint, one of {', '.join(MASKED_LMS)} (config.json "
                               f"architectures: {', '.join(architectures) or 'none'})")
    return int(model_cfg["vocab_size"])


def _prompts(cfg: ModelConfig, directory: Path) -> tuple[tuple[tuple[str, str], ...], str]:
    """(prompts by name, the default prompt's text) as sentence-transformers applies them: the
    model's config_sentence_transformers.json `prompts` and `default_prompt_name`, with the
    configured ones over them."""
    if cfg.task != "embedding":
        if cfg.prompts or cfg.default_prompt_name not in ("auto", "none"):
            raise ModelSourceError(f"model {cfg.name!r}: prompts apply to embedding models, "
                                   f"not task {cfg.task}")
        return (), ""
    st_file = read_json(directory / "config_sentence_transformers.json") or {}
    own = st_file.get("prompts") or {}
    if not isinstance(own, dict) or not all(isinstance(v, str) for v in own.values()):
        raise ModelSourceError(f"{directory}/config_sentence_transformers.json: prompts must "
                               "map names to strings")
    prompts = {**{str(k): v for k, v in own.items()}, **cfg.prompts}
    name = (st_file.get("default_prompt_name") or "" if cfg.default_prompt_name == "auto"
            else "" if cfg.default_prompt_name == "none" else cfg.default_prompt_name)
    if name and name not in prompts:
        raise ModelSourceError(f"model {cfg.name!r}: default prompt {name!r} is not one of its "
                               f"prompts ({', '.join(sorted(prompts)) or 'none'})")
    return tuple(sorted(prompts.items())), prompts.get(name, "")


def weights_revision(directory: Path) -> str:
    """The revision a model's weights get where none is configured: the digest of its
    model.safetensors, and of its Dense projections' after it where it has them."""
    dense = [d / "model.safetensors" for d in dense_directories(directory)]
    return weights_digest(weights_file(directory), *(d for d in dense if d.is_file()))


def weights_digest(path: Path, *more: Path) -> str:
    """The weights' revision: the file's digest; with `more` (a model's Dense projections),
    the digest of every file's in order."""
    if not more:
        return file_digest(path)[:12]
    return hashlib.sha256("".join(map(file_digest, (path, *more))).encode()).hexdigest()[:12]
