import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.stack import Stack, raise_open_files  # noqa: E402
from tests.tinymodel import build_tiny_bert  # noqa: E402

TINY_MAX_TOKENS = 64

raise_open_files()  # the flood tests' clients hold ~1,500 sockets


# Test files that share a package-scoped stack (tests/e2e/conftest.py's task_stack, ~40 s to
# build its models and start) run in one xdist process, so it is built once, not in each.
SHARED_STACK_FILES = {f"tests/e2e/{name}.py": "tests/e2e/task_stack"
                      for name in ("test_tasks", "test_task_protocols", "test_task_variants")}


# Seconds each unit of work took in a whole run (scripts/test_durations.py writes it). A unit it
# does not name (a new file) counts as UNKNOWN_S.
DURATIONS = Path(__file__).parent / "durations.json"
UNKNOWN_S = 10


def pytest_xdist_make_scheduler(config, log):
    """scripts/test's --dist loadfile, with SHARED_STACK_FILES one unit of work, and the longest
    units handed out first (xdist's own order is by test count: the e2e files of a few slow
    tests came last, and one process ran the last of them alone for minutes)."""
    import json

    from xdist.scheduler import LoadFileScheduling

    try:
        durations = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        durations = {}

    class Scheduling(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_STACK_FILES.get(scope, scope)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is whole at the first hand-out
                self.ordered = True
                units = sorted(self.workqueue.items(),
                               key=lambda unit: -durations.get(unit[0], UNKNOWN_S))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return Scheduling(config, log) if config.getoption("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "tiny", max_positions=TINY_MAX_TOKENS)


def tiny_overrides(tiny_model, **extra):
    tree = {
        "model_roots": [str(tiny_model.parent)],
        "models": [{"name": "tiny", "aliases": ["tiny-alias", "test-org/tiny"],
                    "source": str(tiny_model),
                    # fp32: tests compare vectors with fp32 references (dtype auto could pick
                    # bf16 on a CPU with AMX); tests/e2e/test_tasks.py serves auto on purpose.
                    "dtype": "fp32",
                    "revision": "tiny-r1",
                    # Named by requests only (no default): unnamed, texts go as sent.
                    "prompts": {"query": "query: "}}],
        "frontends": {"count": 2},
        "workers": {"devices": "cpu", "cpu_workers": 1, "torch_threads": 1},
        "limits": {"max_texts_per_request": 64, "truncate": False},
        "batching": {"max_batch_size": 16, "max_wait_ms": 2},
    }
    for section, values in extra.items():
        tree[section] = {**tree.get(section, {}), **values} if isinstance(values, dict) else values
    return tree


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory, tiny_model):
    stack = Stack(tmp_path_factory.mktemp("tiny-stack"), tiny_overrides(tiny_model))
    stack.up()
    yield stack
    stack.down()
