"""The CPU layout the config resolves (workers and threads over the usable cores, a cgroup
quota counted) and the GPU overlay."""

from pathlib import Path

import pytest

from shmserve import config
from shmserve.cores import cpu_layout, usable_cores
from shmserve.config import ConfigError


@pytest.mark.parametrize("workers,threads,cores,want", [
    ("auto", "auto", 1, (1, 1)),
    ("auto", "auto", 2, (2, 1)),   # the development machine: measured best (docs/performance.md)
    ("auto", "auto", 16, (8, 2)),  # at most 8 workers; the cores shared out as threads
    ("auto", "auto", 64, (8, 8)),
    ("auto", 2, 1, (1, 2)),        # a fixed thread count: workers fill the cores
    ("auto", 2, 6, (3, 2)),
    (3, "auto", 12, (3, 4)),       # a fixed worker count: threads fill the cores
    (4, "auto", 2, (4, 1)),
    (1, 2, 16, (1, 2)),            # both given: as given
])
def test_cpu_layout(workers, threads, cores, want):
    assert cpu_layout(workers, threads, cores) == want


def test_the_default_layout_is_resolved_at_load(tmp_path):
    cfg = config.load(environ={})
    want = cpu_layout("auto", "auto")
    assert (cfg.workers.cpu_workers, cfg.workers.torch_threads) == want
    cfg = config.load(environ={"SHMSERVE__WORKERS__CPU_WORKERS": "1",
                               "SHMSERVE__WORKERS__TORCH_THREADS": "auto"})
    assert (cfg.workers.cpu_workers, cfg.workers.torch_threads) == (1, usable_cores())


def test_usable_cores_respects_a_cgroup_quota(tmp_path):
    import os

    cpu_max = tmp_path / "cpu.max"
    affinity = len(os.sched_getaffinity(0))
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == affinity
    cpu_max.write_text("50000 100000\n")  # half a core: still one
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text(f"{affinity * 300000} 100000\n")  # a quota above the affinity
    assert usable_cores(cpu_max) == affinity
    assert usable_cores(tmp_path / "missing") == affinity


@pytest.mark.parametrize("key,value", [("cpu_workers", 0), ("cpu_workers", "four"),
                                       ("torch_threads", 0), ("torch_threads", "many")])
def test_bad_layouts_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"workers.{key}"):
        config.from_tree({"models": [{"name": "m", "source": "x"}],
                          "workers": {key: value}})


def test_usable_cores_without_an_affinity_call(monkeypatch, tmp_path):
    """macOS has no os.sched_getaffinity: every CPU counts."""
    import os

    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cores(tmp_path / "missing") == 6


def test_the_gpu_overlay_loads_with_gpu_sized_passes():
    cfg = config.load(extra=Path(__file__).resolve().parents[2] / "configs" / "gpu.yaml",
                      environ={})
    assert (cfg.batching.max_batch_size, cfg.batching.max_batch_tokens) == (256, 32768)
    assert cfg.workers.devices == "auto" and cfg.frontends.count == 8
