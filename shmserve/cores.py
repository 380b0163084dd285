"""How many CPU workers and torch threads `auto` means here: the cores this process may use
(its CPU affinity and a cgroup quota), shared out (shmserve.config resolves the layout)."""

from __future__ import annotations

import os
from pathlib import Path


MAX_AUTO_CPU_WORKERS = 8


def cpu_layout(workers: int | str, threads: int | str,
               cores: int | None = None) -> tuple[int, int]:
    """CPU workers and torch threads per worker, `auto` resolved against the usable cores.

    Both auto: one single-thread worker per core up to MAX_AUTO_CPU_WORKERS, then the cores
    shared out as threads (2 cores: 2 x 1, measured 1.07x (fp32) to 1.27x (bf16) the texts/s of
    1 x 2 on the development machine; 16 cores: 8 x 2). One auto: the other fills the cores."""
    cores = usable_cores() if cores is None else cores
    if workers == "auto":
        workers = (min(cores, MAX_AUTO_CPU_WORKERS) if threads == "auto"
                   else max(1, min(cores // threads, MAX_AUTO_CPU_WORKERS)))
    if threads == "auto":
        threads = max(1, cores // workers)
    return workers, threads


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """Cores this process may run on: its CPU affinity, bounded by a cgroup v2 CPU quota (a
    container's `--cpus`, a Kubernetes CPU limit), rounded up."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU counts
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def worker_cores(index: int, workers: int, threads: int,
                 cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> list[int] | None:
    """The cores CPU worker `index` is pinned to (workers.cpu_affinity auto), or None: only
    where the workers' threads fill exactly the cores this process may use, with no cgroup
    quota below them. There, a worker the scheduler moves between cores (to make room for a
    frontend, nginx or the load) loses its caches: pinned workers served about the same on an
    idle machine and 1.45x the texts/s beside a busy process (docs/performance.md, Changes). A
    machine or pod with cores to spare, or a quota over a wider affinity (a shared node, where
    every pod would pin to the same first cores), is left to the scheduler."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return None
    allowed = sorted(affinity(0))
    if workers * threads != len(allowed) or usable_cores(cpu_max) != len(allowed):
        return None
    return allowed[index * threads:(index + 1) * threads]
