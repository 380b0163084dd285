"""scripts/install's check that nothing needs installing, run on a copy whose .venv/bin/python
is a stand-in: it imports shmserve (exit 0) and refuses anything else (exit 99, saying what),
so no test here can install anything anywhere."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack import REPO


def copy(tmp_path: Path, stamp: str) -> Path:
    """The install script and its inputs in a directory whose .venv's python is this one."""
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install", tmp_path / "scripts" / "install")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\n[ "$*" = "-c import shmserve" ] && exit 0\n'
                      'echo "would run: $*" >&2\nexit 99\n')
    python.chmod(0o755)
    inputs = hashlib.sha256((REPO / "pyproject.toml").read_bytes() +
                            (REPO / "constraints.txt").read_bytes()).hexdigest()
    (tmp_path / ".venv" / ".shmserve-install").write_text(inputs + stamp + "\n")
    return tmp_path


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="without nginx the script installs it")
@pytest.mark.parametrize("stamp,args,installs", [
    ("", [], False), ("[test]", ["--test"], False),
    ("[test]", [], False),  # `scripts/serve` after `scripts/test` reinstalled (an outside check)
    ("", ["--test"], True), ("-stale", [], True)])
def test_an_install_that_holds_what_is_asked_installs_nothing(tmp_path, stamp, args, installs):
    """An install with the test extra holds the plain one; one without it does not hold the
    test extra, and changed inputs hold nothing."""
    root = copy(tmp_path, stamp)
    done = subprocess.run(["bash", str(root / "scripts" / "install"), *args], cwd=root,
                          capture_output=True, text=True, timeout=60)
    if installs:
        assert done.returncode == 99 and "would run: -m pip" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == "install: python packages up to date", done.stdout
