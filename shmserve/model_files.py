"""A model directory's JSON files as sentence-transformers and transformers read them, without
torch (shmserve.models builds a ModelSpec from them): the Pooling module's mode and config,
whether it normalises, the input limit, and the modules it would run, in either version's
format (sentence-transformers 6 saves `pooling_mode` and the limit in the tokenizer's config;
older versions one flag a mode and sentence_bert_config.json's max_seq_length); and its
tokenizer.json as the tokenizers library loads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ModelSourceError(ValueError):
    """The model source cannot be served; the message says why and what to do."""


def max_seq_length(directory: Path) -> int:
    """sentence-transformers' input limit: sentence_bert_config.json's max_seq_length, else
    (as sentence-transformers 6 saves it, and as older versions fall back to) the tokenizer's
    model_max_length; the model's positions bound it too (`inspect`)."""
    st_cfg = read_json(directory / "sentence_bert_config.json") or {}
    limit = st_cfg.get("max_seq_length")
    if limit is None:
        limit = (read_json(directory / "tokenizer_config.json") or {}).get("model_max_length")
    return int(limit) if isinstance(limit, (int, float)) and limit >= 1 else 10**9


# sentence-transformers' pooling modes (gpu_workers.tasks computes each), by the name
# sentence-transformers 6 saves (`pooling_mode`) -> the name this server gives it
POOLINGS = {"cls": "cls", "max": "max", "mean": "mean",
            "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean": "weightedmean",
            "lasttoken": "last"}
# the flag a mode older versions save, in the order sentence-transformers concatenates the
# vectors of several modes
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean",
                 "pooling_mode_lasttoken": "last"}
# the modules of a sentence-transformers embedding model this server runs, in this order after
# its Transformer: Pooling, any Dense projections, Normalize (Dropout, anywhere, is nothing at
# inference). Another module (LayerNorm, WordWeights, a Router, ...) would change its vectors.
MODULES = ("Transformer", "StaticEmbedding", "Pooling", "Dense", "Normalize", "Dropout")
# A static embedding model's first module (sentence-transformers' StaticEmbedding, model2vec's
# format): an embedding table averaged over a text's tokens, no transformer
STATIC = "StaticEmbedding"
STATIC_ARCHITECTURE = {"model_type": "static", "architectures": [STATIC]}
# its input limit (sentence-transformers reads every token): models[].max_input_tokens lowers it
STATIC_MAX_TOKENS = 8192
# Dense's activation functions this server applies (gpu_workers.tasks), by class name; a
# Dense config without one has sentence-transformers' default, Tanh
ACTIVATIONS = ("Tanh", "Identity", "ReLU", "GELU", "Sigmoid", "SiLU")


@dataclass(frozen=True, slots=True)
class Dense:
    """A sentence-transformers Dense module: activation(x W^T + b), plus x (or x R^T where the
    widths differ) with `residual`; its weights in `directory`/model.safetensors."""

    directory: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # one of ACTIVATIONS
    residual: bool = False

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """The tensors its model.safetensors holds by its config, with their shapes."""
        want = {"linear.weight": (self.out_features, self.in_features)}
        if self.bias:
            want["linear.bias"] = (self.out_features,)
        if self.residual and self.in_features != self.out_features:
            want["residual.weight"] = (self.out_features, self.in_features)
        return want

    @property
    def shape(self) -> str:
        """What it computes, without where its weights lie: "32->16 Tanh", " no bias",
        " residual" (a reload or an A/B arm may change the weights, not this)."""
        return (f"{self.in_features}->{self.out_features} {self.activation}"
                + ("" if self.bias else " no bias") + (" residual" if self.residual else ""))


def _st_modules(directory: Path) -> list[dict]:
    modules = read_json(directory / "modules.json") or []
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def _kind(module: dict) -> str:
    return str(module.get("type", "")).rpartition(".")[2]


def _module_directory(directory: Path, module: dict) -> Path:
    """Where modules.json puts a module's files: its path ("": the model's root, as 6.x saves
    a first module), else its name; never outside the model's directory."""
    path = module.get("path")
    where = directory / str(path if path is not None else module.get("name") or "")
    if not where.resolve().is_relative_to(directory.resolve()):
        raise ModelSourceError(f"{directory}: modules.json puts a {_kind(module)} module at "
                               f"{where}, outside the model's directory")
    return where


def pooling_of(choice: str, task: str, directory: Path) -> str:
    """The configured pooling, or (auto) the model's own: sentence-transformers' Pooling
    module's config, in either version's format; several modes at once are named with "+"
    between them (their vectors side by side, in sentence-transformers' order). Modules this
    server does not run are refused rather than served as other vectors (unless the pooling
    is configured: then the user has chosen how it serves)."""
    if choice != "auto":
        return choice
    if task == "embedding":
        _check_modules(directory)
    pool_cfg = pooling_config(directory)
    if "pooling_mode" in pool_cfg:  # sentence-transformers 6: a name, or a list of them
        modes = pool_cfg["pooling_mode"]
        found = [POOLINGS.get(str(m), str(m))
                 for m in (modes if isinstance(modes, list) else [modes])]
    else:
        found = [mode for flag, mode in POOLING_FLAGS.items() if pool_cfg.get(flag)]
    if not found:
        return "mean"
    if unknown := [m for m in found if m not in POOLINGS.values()]:
        raise ModelSourceError(
            f"{directory}: its sentence-transformers pooling is {' + '.join(found)}: "
            f"{', '.join(unknown)} is not a pooling mode sentence-transformers has "
            f"({', '.join(POOLINGS)}); set models[].pooling to serve it pooled otherwise")
    return "+".join(found)


def _check_modules(directory: Path) -> None:
    """modules.json's modules after the Transformer: Pooling, Dense ..., Normalize, in that
    order (Dropout anywhere), each at most once but Dense; or a StaticEmbedding, which pools
    itself, in the place of the Transformer and its Pooling."""
    order = [k for k in map(_kind, _st_modules(directory)) if k != "Dropout"]
    if STATIC in order[1:] or (order[:1] == [STATIC] and
                               ("Transformer" in order or "Pooling" in order)):
        raise ModelSourceError(
            f"{directory}: modules.json runs {' -> '.join(order)}; a StaticEmbedding module "
            "comes first and pools itself, with no Transformer or Pooling")
    for module in _st_modules(directory):
        if (kind := _kind(module)) not in MODULES:
            raise ModelSourceError(
                f"{directory}: modules.json has a {kind or 'nameless'} module "
                f"({module.get('path') or module.get('name')}), which shmserve does not "
                f"run (it runs {', '.join(MODULES)}): its vectors would not be the model's")
    rank = {"Transformer": 0, STATIC: 1, "Pooling": 1, "Dense": 2, "Normalize": 3}
    ranks = [rank[k] for k in order]
    if ranks != sorted(ranks) or any(order.count(k) > 1 for k in rank if k != "Dense"):
        raise ModelSourceError(
            f"{directory}: modules.json runs {' -> '.join(order)}; shmserve runs a "
            "Transformer, its Pooling, Dense projections, then Normalize, in that order")


def static_directory(directory: Path) -> Path | None:
    """Where a static embedding model (its first module a StaticEmbedding) keeps its table
    and tokenizer, or None for any other model."""
    modules = _st_modules(directory)
    if modules and _kind(modules[0]) == STATIC:
        return _module_directory(directory, modules[0])
    return None


def header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors file's tensors from its header alone: name -> (shape, safetensors' dtype
    name). ModelSourceError when it does not read, or its tensors do not cover the file
    exactly (a truncated copy: safetensors checks it)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise unreadable(path, exc) from None


def unreadable(path: Path, exc: Exception) -> ModelSourceError:
    return ModelSourceError(f"{path} is not a readable safetensors file ({exc})")


def static_table(directory: Path) -> tuple[str, tuple[int, int]]:
    """A static model's embedding table: (its tensor's name, [vocabulary, width]) from the
    safetensors header: sentence-transformers' `embedding.weight`, or model2vec's
    `embeddings` (without a vocabulary mapping or per-token weights, which are refused)."""
    path = static_directory(directory) / "model.safetensors"
    tensors = header(path)
    names = set(tensors)
    name = next((n for n in ("embedding.weight", "embeddings") if n in names), None)
    if name is None or names - {name}:
        raise ModelSourceError(
            f"{path}: a static embedding table is one tensor, embedding.weight or embeddings; "
            f"it holds {', '.join(sorted(names)) or 'none'} (model2vec's vocabulary mapping "
            "and token weights are not read: save it with sentence-transformers' "
            "StaticEmbedding)")
    shape, kind = tensors[name]
    if len(shape) != 2 or kind not in FLOATS:
        raise ModelSourceError(f"{path}: {name} is {kind} {list(shape)}; a static embedding "
                               "table is a float matrix [vocabulary, width]")
    return name, shape


FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors' names of the float kinds


def static_config(directory: Path) -> dict:
    """A static model's stand-in for config.json, which it has none of: its width, its
    vocabulary and its input limit (its tokenizer's truncation, which StaticEmbedding keeps,
    else STATIC_MAX_TOKENS)."""
    _, (rows, width) = static_table(directory)
    tok = tokenizer(directory)
    words = tok.get_vocab_size(with_added_tokens=True)
    if rows < words:  # sentence-transformers fails on every text with an id past the table
        raise ModelSourceError(
            f"{static_directory(directory)}: its table has {rows} rows, its tokenizer "
            f"{words} tokens: the ids past the table have no row")
    cut = (tok.truncation or {}).get("max_length")
    limit = min(cut, STATIC_MAX_TOKENS) if isinstance(cut, int) and cut >= 1 else \
        STATIC_MAX_TOKENS
    return {**STATIC_ARCHITECTURE, "hidden_size": width, "vocab_size": rows,
            "max_position_embeddings": limit}


def dense_directories(directory: Path) -> list[Path]:
    """Where modules.json puts the model's Dense modules, in order."""
    return [_module_directory(directory, m) for m in _st_modules(directory)
            if _kind(m) == "Dense"]


def dense_of(task: str, directory: Path, width: int) -> tuple[Dense, ...]:
    """The embedding model's Dense modules in order, read from their config.json as
    sentence-transformers reads them; `width`: the pooled vector's, which the first takes."""
    if task != "embedding":
        return ()
    found = []
    for where in dense_directories(directory):
        if not where.is_dir():
            raise ModelSourceError(f"{directory}: modules.json lists a Dense module at "
                                   f"{where.name}, which is not there")
        cfg = read_json(where / "config.json")
        if not isinstance(cfg, dict):
            raise ModelSourceError(f"{where}: a Dense module without its config.json")
        found.append(_dense(where, cfg))
    for layer in found:
        if layer.in_features != width:
            raise ModelSourceError(
                f"{layer.directory}: this Dense module takes vectors of {layer.in_features}, "
                f"but the module before it gives {width}")
        width = layer.out_features
    return tuple(found)


def _dense(where: Path, cfg: dict) -> Dense:
    for key in ("module_input_name", "module_output_name"):  # (None: the default)
        if cfg.get(key) not in (None, "sentence_embedding"):
            raise ModelSourceError(
                f"{where}/config.json: {key} {cfg[key]!r}: shmserve runs a Dense module on "
                "the pooled vector (sentence_embedding) only")
    sizes = [cfg.get(k) for k in ("in_features", "out_features")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise ModelSourceError(f"{where}/config.json: in_features and out_features must be "
                               f"whole numbers >= 1, not {sizes[0]!r} and {sizes[1]!r}")
    # sentence-transformers' default is Tanh when the config names none; a name outside
    # torch it does not import without trust_remote_code (it falls back to Tanh, warning)
    name = str(cfg.get("activation_function") or "torch.nn.modules.activation.Tanh")
    activation = name.rpartition(".")[2]
    if not name.startswith("torch.") or activation not in ACTIVATIONS:
        raise ModelSourceError(
            f"{where}/config.json: activation_function {name!r}, which shmserve does not "
            f"apply (it applies torch.nn's {', '.join(ACTIVATIONS)})")
    weights = where / "model.safetensors"
    if not weights.is_file():
        pickles = sorted(p.name for p in where.glob("*.bin"))
        held = f"only {', '.join(pickles)} (pickle)" if pickles else "no model.safetensors"
        raise ModelSourceError(f"{where}: {held}; shmserve loads safetensors only: convert "
                               "with safetensors.torch.save_file")
    layer = Dense(where, sizes[0], sizes[1], bool(cfg.get("bias", True)), activation,
                  bool(cfg.get("use_residual", False)))
    _check_dense_weights(layer)
    return layer


def _check_dense_weights(layer: Dense) -> None:
    """The tensors a Dense module's config says it has, of the shapes it says, from the
    safetensors header (the worker loads them; a mismatch found there cost three restarts)."""
    dense_shapes_match(layer, {name: shape for name, (shape, _) in
                               header(layer.directory / "model.safetensors").items()})


def dense_shapes_match(layer: Dense, have: dict) -> None:
    """Refuse tensors (name -> shape) that are not the ones `layer`'s config says it has."""
    for name, shape in layer.tensors().items():
        if have.get(name) != shape:
            raise ModelSourceError(f"{layer.directory / 'model.safetensors'}: {name} should be "
                                   f"{shape} by its config.json, is {have.get(name) or 'missing'}")


def pooling_config(directory: Path) -> dict:
    """The Pooling module's config.json (its directory as modules.json names it)."""
    path = next((m.get("path") for m in _st_modules(directory)
                 if str(m.get("type", "")).endswith("Pooling")), None) or "1_Pooling"
    found = read_json(directory / path / "config.json")
    return found if isinstance(found, dict) else {}


def normalize_of(choice: str, directory: Path) -> bool:
    if choice != "auto":
        return choice == "true"
    return any(str(m.get("type", "")).endswith("Normalize") for m in _st_modules(directory))


def read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{path}: invalid JSON ({exc})") from None


def tokenizer(directory: Path):
    """The model's fast tokenizer (a tokenizers.Tokenizer) from its tokenizer.json, lowercasing
    first where sentence-transformers' config asks it to (`lowercases`). One that does not load
    (a truncated copy: `EOF while parsing a string at line 1 column 1000`) is a
    ModelSourceError naming the file, where tokenizers' own error names none."""
    from tokenizers import Tokenizer
    from tokenizers.normalizers import Lowercase, Sequence

    static = static_directory(directory)
    path = tokenizer_path(directory)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises Exception itself
        raise ModelSourceError(f"{path} does not load as a tokenizer ({exc})") from None
    if static is not None:  # a static model's texts have no special tokens added
        tok.post_processor = None
    if lowercases(directory):
        # as sentence-transformers' Transformer module does: Lowercase before the tokenizer's
        # own normalizer, unless that is Lowercase or a sequence holding one (a
        # BertNormalizer that lowercases gets one too there: lowercasing twice changes nothing)
        normalizer = tok.normalizer
        if isinstance(normalizer, Sequence):
            steps = [step for step in normalizer]
        else:
            steps = [normalizer] if normalizer is not None else []
        if not any(isinstance(step, Lowercase) for step in steps):
            tok.normalizer = Sequence([Lowercase(), *steps])
    return tok


def tokenizer_path(directory: Path) -> Path:
    """The model's tokenizer.json: a static model's beside its table."""
    return (static_directory(directory) or directory) / "tokenizer.json"


def lowercases(directory: Path) -> bool:
    """sentence_bert_config.json's do_lower_case: sentence-transformers lowercases every text
    before its tokenizer sees it (BGE's configs say so, over a tokenizer that lowercases
    anyway; over a cased one the ids differ)."""
    st_cfg = read_json(directory / "sentence_bert_config.json")
    return isinstance(st_cfg, dict) and st_cfg.get("do_lower_case") is True
