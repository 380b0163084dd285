"""Where a configuration's tree comes from, before shmserve.config validates it.

Layers, later wins:
  1. ``configs/base.yaml``
  2. ``configs/<env>.yaml`` where env comes from ``--env``, else ``SHMSERVE_ENV`` (default
     ``dev``)
  3. optional extra files (``--config PATH`` or ``SHMSERVE_CONFIG``; several joined by ``:``,
     merged in order)
  4. environment variables ``SHMSERVE__SECTION__KEY=value``: the path is the key's path in
     lower case joined by double underscores, a list index is a number
     (``SHMSERVE__MODELS__0__SOURCE=/models/e5``); the value is parsed as a YAML scalar or
     flow sequence, so ``8``, ``true``, ``[0, 1]`` and ``auto`` all work; a string key takes
     the whole value as written (``01`` stays "01", ``yes`` stays "yes", ``a #b`` stays
     "a #b", ``query: `` stays "query: "; a quoted YAML string is unquoted), a list's string
     item the item as written (``[01234567]``). ``null`` or ``~`` alone is a null.

Mappings are deep-merged (a variable's mapping into its section or list item too); lists and
scalars are replaced. A key set to ``null`` or ``~`` (in a
file or a variable) takes its default once every layer is merged: its value in
``configs/base.yaml``, which lists every key's default (``models: ~`` is the default model),
else the config's own default (a model's keys base.yaml leaves out).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from shmserve.envvalues import WITHOUT_DATES, env_value
from shmserve.typedtree import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
ENV_PREFIX = "SHMSERVE__"
OVERLAYS = ("gpu",)  # files under configs/ given with --config, over an env's


def merged(env: str | None = None, extra: str | Path | None = None,
           environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The four layers above, merged: a plain tree, not yet validated."""
    environ = os.environ if environ is None else environ
    tree = read_yaml(CONFIG_DIR / "base.yaml")
    chosen = env_file(env, environ)
    warn_misspelled(environ)
    base = tree
    tree = deep_merge(tree, read_yaml(chosen))
    return overridden(tree, extra, environ, base)


def env_names() -> list[str]:  # what --env takes: configs/*.yaml but base and overlays
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem not in ("base", *OVERLAYS))


def env_file(env: str | None, environ: Mapping[str, str]) -> Path:
    """The file of the env `env` names, else SHMSERVE_ENV, else dev. base and an overlay are
    files under configs/ too, but no env: `--env gpu` read gpu.yaml in place of an env's file
    (dev's keys dropped) and `--env base` base.yaml twice, without a word (an outside check)."""
    source = "--env" if env else "SHMSERVE_ENV"
    env = env or environ.get("SHMSERVE_ENV", "dev")
    names = ", ".join(env_names())
    if env in OVERLAYS:
        raise ConfigError(f"{source} {env}: configs/{env}.yaml is an overlay, given with --config "
                          f"over an env (--config configs/{env}.yaml); {source} takes one of "
                          f"{names}")
    if env == "base":
        raise ConfigError(f"{source} base: configs/base.yaml is read under every env; {source} "
                          f"takes one of {names}")
    path = CONFIG_DIR / f"{env}.yaml"
    if env not in env_names():
        raise ConfigError(f"{source} {env}: no config file {path}; one of {names} "
                          "(configs/gpu.yaml is an overlay: --config)")
    return path


def overridden(tree: Mapping[str, Any], extra: str | Path | None,
               environ: Mapping[str, str], base: Mapping[str, Any] | None = None
               ) -> dict[str, Any]:
    """`tree` under layers 3 and 4: the extra files (`extra`, else SHMSERVE_CONFIG), then the
    environment's overrides. `base`: configs/base.yaml's tree, if already read (the defaults
    a null takes)."""
    for path in extra_files(extra, environ):  # several files: "a.yaml:b.yaml", in order
        try:
            layer = read_yaml(path)
        except ConfigError as exc:
            if extra or not str(exc).startswith("config file not found"):
                raise
            raise ConfigError(f"{exc} (SHMSERVE_CONFIG)") from None  # where the name came from
        if not layer and str(path) not in _warned:
            # a truncated file left the defaults in place without a word (an outside check)
            _warned.add(str(path))
            print(f"shmserve: warning: config file {path} holds no keys (empty, or comments "
                  "only): nothing in it applies", file=sys.stderr, flush=True)
        tree = deep_merge(tree, layer)
    if base is None:
        base = read_yaml(CONFIG_DIR / "base.yaml")
    # Files' nulls become defaults before the variables apply (`models: ~` then MODELS__0__...)
    return without_nulls(apply_env_overrides(without_nulls(dict(tree), base), environ), base)


def without_nulls(tree: Any, base: Any) -> Any:
    """`tree` with each mapping key whose value is null, at any depth (list items' mappings
    too), set back to its default: `base`'s value at the same place (configs/base.yaml, which
    holds every key's default: `models: ~` is its default model), else dropped, for the
    config's own default (within a list item always: a model's `aliases: ~` is no aliases,
    not base.yaml's model's)."""
    if isinstance(tree, Mapping):
        base = base if isinstance(base, Mapping) else {}
        out = {}
        for key, value in tree.items():
            if value is None:
                if base.get(key) is not None:
                    out[key] = base[key]
            else:
                out[key] = without_nulls(value, base.get(key))
        return out
    if isinstance(tree, list):  # a list item's keys: the config's own defaults (base.yaml's
        return [without_nulls(v, None) for v in tree]  # items are other models')
    return tree


def digests(files: list[Path]) -> dict[str, str]:
    """Each readable file's absolute path and the SHA-256 of its content: what `up` read, kept
    in the run directory so `restart` can tell a file edited since (by content: a checkout
    that rewrites a file unchanged is no edit)."""
    out = {}
    for path in files:
        try:
            out[str(path.resolve())] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return out


def extra_files(extra: str | Path | None, environ: Mapping[str, str]) -> list[Path]:
    return [Path(p) for p in str(extra or environ.get("SHMSERVE_CONFIG") or "").split(os.pathsep)
            if p]


def file_layers(env: str | None, extra: str | Path | None,
                environ: Mapping[str, str]) -> list[Path]:
    """The files layers 1-3 read, in order."""
    return [CONFIG_DIR / "base.yaml", env_file(env, environ), *extra_files(extra, environ)]


_KEY_PATH = re.compile(r"([A-Za-z0-9_-]+(?:\[[0-9]+\]|\.[A-Za-z0-9_-]+)*): ")


def located(exc: ConfigError, env: str | None, extra: str | Path | None,
            environ: Mapping[str, str]) -> ConfigError:
    """`exc` (a message that starts with a key's path) naming the layer that set that key: the
    environment variable, else the last file that has it (a message named the key only, and
    with several files and variables a user could not tell which one was wrong, an outside
    check). Unchanged when no layer sets it (a rule between keys, a default)."""
    message = str(exc)
    if ConfigError.AND in message:  # several rules broken: each names where its keys were set
        return ConfigError(ConfigError.AND.join(
            str(located(ConfigError(part), env, extra, environ))
            for part in message.split(ConfigError.AND)))
    found = _KEY_PATH.match(message)
    if found is None:
        return exc
    said = []
    if where := _source(found[1], env, extra, environ):
        said.append(f"set in {where}")
    # A rule between keys names the others in its message: where each was set too (the
    # message named only the first key's layer, base.yaml, when a variable had set the other:
    # an outside check).
    rule = re.sub(r"\(did you mean [^)]*\)", "", message[found.end():])  # a suggestion: not set
    for key in dict.fromkeys(_MENTIONED.findall(rule)):
        if key != found[1] and (where := _source(key, env, extra, environ)):
            said.append(f"{key} set in {where}")
    return ConfigError(f"{exc} ({'; '.join(said)})") if said else exc


_MENTIONED = re.compile(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)\b")


def _source(key: str, env: str | None, extra: str | Path | None,
            environ: Mapping[str, str]) -> str | None:
    """The layer that sets `key` (a path such as models[0].name): its environment variable,
    else the last file that has it; None when none does (a default)."""
    parts: list[str | int] = [int(p) if p.isdigit() else p
                              for p in re.split(r"\.|\[|\]\.?", key) if p != ""]
    where = _set_by_variable(parts, environ)
    if where is None:
        for path in reversed(file_layers(env, extra, environ)):
            try:
                if _sets(read_yaml(path), parts):
                    return str(path)
            except ConfigError:
                continue
    return where


def _set_by_variable(parts: list[str | int], environ: Mapping[str, str]) -> str | None:
    """The variable that sets `parts`: its own, one that sets a key under it (an unknown
    section: SHMSERVE___ADMIN__TOKEN's `_admin`), or a section's above it whose mapping holds
    the rest of the path (the longest first; a later layer than any file)."""
    names = {name[len(ENV_PREFIX):].lower(): name for name in environ
             if name.startswith(ENV_PREFIX)}
    path = "__".join(str(p) for p in parts).lower()
    for key in sorted(names):
        if key == path or key.startswith(path + "__"):
            return names[key]
    for end in range(len(parts) - 1, 0, -1):
        name = names.get("__".join(str(p) for p in parts[:end]).lower())
        if name is not None:
            value = env_value(environ[name])
            parsed = getattr(value, "parsed", value)
            if _sets(parsed, parts[end:]) and isinstance(parsed, (Mapping, list)):
                return name
    return None


def _sets(tree: Any, parts: list[str | int]) -> bool:
    """Whether a file's tree gives `parts` (or a list above it, which a file replaces whole)."""
    node = tree
    for part in parts:
        if isinstance(node, list):
            return True
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


_warned: set[str] = set()


# The single-underscore names something in this project reads: the layers above, the client's
# key, what supervisord gives its programs, the install script's, the tests' and benchmarks'.
KNOWN_VARIABLES = frozenset({
    "SHMSERVE_ENV", "SHMSERVE_CONFIG", "SHMSERVE_API_KEY", "SHMSERVE_RUN_DIR",
    "SHMSERVE_TORCH_INDEX", "SHMSERVE_TEST_PROCESSES", "SHMSERVE_PORTS", "SHMSERVE_BENCH_TEXTS",
    "SHMSERVE_BENCH_TEXTS_OUT", "SHMSERVE_BENCH_MODEL", "SHMSERVE_BENCH_CORPUS",
    "SHMSERVE_BENCH_API"})


def variable_key(name: str) -> str:
    """The dotted key a SHMSERVE__ variable sets, a list's item as the list (as
    shmserve.configview.flat has it): SHMSERVE__MODELS__0__SOURCE sets `models`."""
    parts = name[len(ENV_PREFIX):].lower().split("__")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
    return ".".join(parts[:index])


def override_names(environ: Mapping[str, str]) -> list[str]:
    """The SHMSERVE__ variables in `environ` (each overrides a key), sorted."""
    return sorted(name for name in environ if name.startswith(ENV_PREFIX))


def warn_misspelled(environ: Mapping[str, str]) -> None:
    """Say once (on stderr) which variables look like shmserve's but are not read: a key path
    with `__` after a single-underscore prefix (SHMSERVE_FRONTENDS__COUNT), a prefix in lower
    case (shmserve__frontends__count: names are case-sensitive, an outside check's was
    ignored without a word), or a single-underscore name nothing reads (SHMSERVE_CONFG: the
    server started without the user's file, SHMSERVE_FRONTENDS_COUNT; an outside check)."""
    for name in sorted(environ):
        if (not name.upper().startswith("SHMSERVE") or name.startswith(ENV_PREFIX)
                or name in KNOWN_VARIABLES or name in _warned):
            continue
        _warned.add(name)
        if "__" in name:
            fixed = ENV_PREFIX + name[len("SHMSERVE"):].lstrip("_").upper()
            print(f"shmserve: warning: {name} is not read; environment overrides start with "
                  f"{ENV_PREFIX} (two underscores): {fixed}?", file=sys.stderr, flush=True)
            continue
        print(f"shmserve: warning: {name} is not read; {_meant(name)}", file=sys.stderr,
              flush=True)


# The single-underscore names a user sets (the others are the tests', benchmarks' and what
# supervisord gives its programs: no suggestion points there)
USER_VARIABLES = ("SHMSERVE_ENV", "SHMSERVE_CONFIG", "SHMSERVE_API_KEY")


def _meant(name: str) -> str:
    """What a single-underscore name nothing reads may have meant."""
    rest = name[len("SHMSERVE"):].lstrip("_").upper()
    tree = _base_tree()
    section = next((k for k in tree if rest.startswith(k.upper() + "_")), None)
    if section:  # SHMSERVE_FRONTENDS_COUNT: a key's path with single underscores
        return f"{ENV_PREFIX}{section.upper()}__{rest[len(section) + 1:]}?"
    # SHMSERVE_PORT, SHMSERVE_RUNDIR: a key of one section, named alone
    squeezed = rest.replace("_", "").lower()
    keys = [(sec, key) for sec, keys in tree.items() if isinstance(keys, Mapping)
            for key in keys if key.replace("_", "") == squeezed]
    if len(keys) == 1:
        return f"{ENV_PREFIX}{keys[0][0].upper()}__{keys[0][1].upper()}?"
    own = {known[len("SHMSERVE_"):]: known for known in USER_VARIABLES}
    near = [own[k] for k in own if rest.startswith(k) or k.startswith(rest)] or \
        [own[k] for k in difflib.get_close_matches(rest, own, n=1, cutoff=0.75)]
    return f"{near[0]}?" if near else f"an override is {ENV_PREFIX}SECTION__KEY (two underscores)"


def _base_tree() -> dict[str, Any]:
    """configs/base.yaml's tree (every section and key), for suggestions."""
    try:
        return read_yaml(CONFIG_DIR / "base.yaml")
    except ConfigError:
        return {}


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_env_overrides(tree: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    tree = json.loads(json.dumps(tree))  # a private deep copy we may mutate
    # Names differing in case name one key: which one won was their sort order's
    # (SHMSERVE__frontends__count=4 over SHMSERVE__FRONTENDS__COUNT=3, silently: an outside
    # check)
    by_key: dict[str, list[str]] = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX):
            by_key.setdefault(name[len(ENV_PREFIX):].lower(), []).append(name)
    for key, names in by_key.items():
        if len(names) > 1:
            raise ConfigError(f"{' and '.join(names)}: {len(names)} variables set one key "
                              f"({key.replace('__', '.')}); keep one")
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        if "" in parts:
            raise ConfigError(f"{name}: no key between the prefix and '__', or between two "
                              "'__': SHMSERVE__SECTION__KEY")
        value = env_value(environ[name])
        node: Any = tree
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            key: Any = int(part) if isinstance(node, list) and part.isdigit() else part
            if isinstance(node, list):
                if not isinstance(key, int) or key >= len(node):
                    raise ConfigError(f"{name}: no list item {part!r} at {'.'.join(parts[:i])}")
            elif not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(parts[:i])} is not a section")
            if last:
                parsed = getattr(value, "parsed", None)
                here = node[key] if isinstance(node, list) else node.get(key)
                if isinstance(parsed, dict) and isinstance(here, dict):
                    # a section's mapping merges into it, as a file's does (it replaced the
                    # section whole, and prod's frontends.count went back to base's, an
                    # outside check); a list item's too (SHMSERVE__MODELS__0='{dtype: fp32}'
                    # dropped the model's name: an outside check)
                    node[key] = deep_merge(here, parsed)
                else:
                    node[key] = value
            else:
                if isinstance(node, dict) and key not in node:
                    node[key] = {}
                node = node[key]
    return tree


class _FileLoader(yaml.SafeLoader):
    """safe_load's YAML, except that a key given twice in one mapping is an error (the second
    `frontends:` section replaced the first whole, silently), and a date stays the text it
    was written as (`revision: 2024-01-01`; YAML's date objects are no config value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            # `<<: *defaults`, YAML's merge key (the mapping's own keys override its keys:
            # SafeLoader's flatten), is a key too: a second one is refused as any key given
            # twice (`<<: [*a, *b]` merges several)
            key = ("<<" if key_node.tag == "tag:yaml.org,2002:merge" else
                   self.construct_object(key_node, deep=deep))
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_FileLoader.yaml_implicit_resolvers = WITHOUT_DATES


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), _FileLoader) or {}
        json.dumps(data)  # only what JSON holds (run/config.json): no !!binary, no !!set
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.MarkedYAMLError as exc:  # one line: the file, line and column, the problem
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = "; ".join(filter(None, (exc.context, exc.problem)))
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: holds a value no config key takes ({exc}; a YAML tag such "
                          "as !!binary or !!set?)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data
