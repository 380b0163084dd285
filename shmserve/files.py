"""A run directory's files written whole: a process reading one never sees half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: str | bytes) -> None:
    """`data` into `path` (mode 0600) by a write and a rename: a reader sees the old file or
    the new one. The temporary name holds the pid, so two writers never share it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    tmp.chmod(0o600)
    os.replace(tmp, path)
