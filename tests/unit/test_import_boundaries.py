"""The design's import rules: shmserve/ imports neither torch nor aiohttp; frontend/ never
imports torch (it would cost every frontend process a second of start-up and ~300 MB)."""

import pkgutil
import subprocess
import sys

import frontend
import shmserve


def loaded_after_importing(package) -> set[str]:
    names = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    code = ("import sys, importlib\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "print(' '.join(sorted(m for m in ('torch', 'transformers', 'aiohttp') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return set(out.split())


def test_shmserve_imports_neither_torch_nor_aiohttp():
    assert loaded_after_importing(shmserve) == set()


def test_frontend_never_imports_torch():
    assert loaded_after_importing(frontend) == {"aiohttp"}
