"""The inference routes' API keys: auth.api_keys inline, then auth.api_keys_file's (read when a
frontend starts and again when the file changes: frontend.auth)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from shmserve.layers import REPO_ROOT
from shmserve.typedtree import ConfigError

if TYPE_CHECKING:
    from shmserve.config import Config

_KEY = re.compile(r"[\x21-\x7e]{8,512}")  # printable, no spaces: it travels in a header


def api_keys_file(cfg: Config) -> Path | None:
    """auth.api_keys_file's path (relative: to the repository root), or None."""
    if not cfg.auth.api_keys_file:
        return None
    path = Path(cfg.auth.api_keys_file)
    return path if path.is_absolute() else REPO_ROOT / path


def api_keys(cfg: Config) -> tuple[str, ...]:
    """The inference routes' keys: auth.api_keys, then one a line of auth.api_keys_file (blank
    lines and lines starting with # skipped). Empty: no key is asked for."""
    keys = list(cfg.auth.api_keys)
    source = "auth.api_keys"
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ConfigError(f"{source}[{i}]: expected 8 to 512 printable characters without "
                              "spaces")
    if (path := api_keys_file(cfg)) is not None:
        try:
            raw = path.read_bytes()
            lines = raw.removeprefix(b"\xef\xbb\xbf").decode().splitlines()
        except OSError as exc:
            raise ConfigError(f"auth.api_keys_file: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:  # PowerShell's `>` writes UTF-16: a traceback, before
            utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw[:64]
            raise ConfigError(f"auth.api_keys_file: {path} is not UTF-8 text"
                              + (" (UTF-16, as PowerShell writes?)" if utf16 else "")
                              + "; save it as UTF-8") from None
        found = [line.strip() for line in lines
                 if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise ConfigError(f"auth.api_keys_file: {path} holds no key")
        for n, key in enumerate(found, 1):
            if not _KEY.fullmatch(key):
                raise ConfigError(f"auth.api_keys_file: key {n} of {path}: expected 8 to 512 "
                                  "printable characters without spaces")
        keys += found
    return tuple(keys)
