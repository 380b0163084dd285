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


@pytest.mark.parametrize("affinity,quota,workers,threads,want", [
    ({0, 1}, "max", 2, 1, [[0], [1]]),                 # this machine: one core each
    ({0, 1, 2, 3}, "max", 2, 2, [[0, 1], [2, 3]]),
    ({4, 5}, "max", 2, 1, [[4], [5]]),                 # a cpuset (Kubernetes' static policy)
    ({0, 1, 2, 3}, "max", 2, 1, [None, None]),         # cores to spare: the scheduler's
    ({0, 1}, "max", 4, 1, [None] * 4),                 # more threads than cores
    ({0, 1, 2, 3}, "200000 100000", 2, 1, [None, None]),  # a quota over a wider affinity
])
def test_worker_cores_only_where_the_workers_fill_the_cores(monkeypatch, tmp_path, affinity,
                                                            quota, workers, threads, want):
    from shmserve.cores import worker_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(affinity))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(f"{quota}\n")
    assert [worker_cores(i, workers, threads, cpu_max) for i in range(workers)] == want


@pytest.mark.parametrize("affinity,devices,pinned", [
    ("auto", "cpu", [[0]]), ("off", "cpu", []), (False, "cpu", []),  # YAML's bare off
    ("auto", [0], [])])                                              # a GPU worker: never
def test_a_worker_pins_itself_only_as_configured(monkeypatch, affinity, devices, pinned):
    import gpu_workers.__main__ as worker_main
    from shmserve import cores

    calls = []
    monkeypatch.setattr(cores, "worker_cores", lambda i, w, t: [i])
    monkeypatch.setattr("os.sched_setaffinity", lambda pid, mine: calls.append(mine))
    cfg = config.from_tree({"models": [{"name": "m", "source": "x"}], "workers": {
        "devices": devices, "cpu_affinity": affinity, "cpu_workers": 2, "torch_threads": 1}})
    worker_main.pin(cfg, 0)
    assert calls == pinned


def test_a_cpu_affinity_other_than_auto_or_off_is_refused():
    with pytest.raises(ConfigError, match="workers.cpu_affinity: expected auto or off"):
        config.from_tree({"models": [{"name": "m", "source": "x"}],
                          "workers": {"cpu_affinity": "cores"}})
