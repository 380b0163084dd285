"""Where every process lives: run-directory layout, worker devices, socket and arena names.

One function per fact, so the CLI, the renderers, the frontends and the workers agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from shmserve import layers
from shmserve.config import Config, ConfigError

CPU = "cpu"


def instance_id(cfg: Config) -> str:
    """A short stable id of this deployment (its run directory), used in shared-memory names."""
    return hashlib.sha1(str(cfg.run_dir.resolve()).encode()).hexdigest()[:8]


def shm_prefix(cfg: Config) -> str:
    return f"shmserve-{instance_id(cfg)}-"


DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # one directory per GPU the driver shows
DEVICE_NODES = Path("/dev")  # /dev/nvidia0, /dev/nvidia1, ...: what a container is given


def visible_gpus() -> list[int]:
    """GPU indices the driver shows, found without importing torch: its /proc directory, else
    the device nodes (a container may be given /dev/nvidiaN without the driver's /proc tree;
    `auto` then ran CPU workers on a GPU pod without a word, an outside check's reading)."""
    count = len(list(DRIVER_GPUS.iterdir())) if DRIVER_GPUS.is_dir() else 0
    if not count:
        count = sum(1 for node in DEVICE_NODES.glob("nvidia*")
                    if node.name[len("nvidia"):].isdigit())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [x.strip() for x in visible.split(",")]
        # GPUs named by UUID (GPU-..., MIG-...) were dropped, and `auto` ran CPU workers on a
        # GPU machine without a word (an outside check, from the code): refused instead.
        if named := [x for x in entries if x.upper().startswith(("GPU-", "MIG-"))]:
            raise ConfigError(
                f"workers.devices: auto cannot place workers on GPUs CUDA_VISIBLE_DEVICES names "
                f"by UUID ({named[0]}...): list their indices (nvidia-smi's) in "
                "workers.devices, or give CUDA_VISIBLE_DEVICES as indices")
        ids = [int(x) for x in entries if x.isdigit()]
        # An index the driver does not show was dropped, and `auto` ran fewer workers, or CPU
        # workers in a container given GPUs that CUDA numbers from 0, without a word (an
        # outside check). None shown at all: CPU workers, which `up` notes.
        if count and (missing := [i for i in ids if i >= count]):
            raise ConfigError(
                f"workers.devices: auto: CUDA_VISIBLE_DEVICES={visible} names GPU "
                f"{', '.join(map(str, missing))}, which this machine does not show (it shows "
                f"{count}: 0-{count - 1}); name GPUs that are here, or list workers.devices")
        return [i for i in ids if i < count]
    return list(range(count))


def unplaced_gpus(cfg: Config) -> str | None:
    """What `up` notes when `workers.devices: auto` found no GPU although CUDA_VISIBLE_DEVICES
    or NVIDIA_VISIBLE_DEVICES (the NVIDIA container runtime's: a container given GPUs that
    its runtime did not expose) names some (CPU workers serve), else None."""
    if cfg.workers.devices != "auto" or visible_gpus():
        return None
    # CUDA_VISIBLE_DEVICES set (empty or -1 hides the GPUs on purpose) is what CUDA obeys
    names = ("CUDA_VISIBLE_DEVICES",) if "CUDA_VISIBLE_DEVICES" in os.environ else (
        "NVIDIA_VISIBLE_DEVICES",)
    for name in names:
        visible = os.environ.get(name, "")
        named = [x.strip() for x in visible.split(",")]
        if any(x.isdigit() or x.startswith(("GPU-", "MIG-")) or x == "all" for x in named):
            return (f"{name}={visible} names GPUs, but this machine shows none: "
                    f"workers.devices auto runs {cfg.workers.cpu_workers} CPU worker(s)")
    return None


def worker_devices(cfg: Config) -> list[str]:
    """One entry per worker process: a GPU index as a string (its CUDA_VISIBLE_DEVICES) or cpu.
    Each GPU gets `workers.per_gpu` workers, numbered one GPU after the other."""
    devices = cfg.workers.devices
    if devices == "auto":
        devices = visible_gpus()
        if not devices:
            return [CPU] * cfg.workers.cpu_workers
    if devices == CPU:
        return [CPU] * cfg.workers.cpu_workers
    return [str(d) for d in devices for _ in range(cfg.workers.per_gpu)]


def device_label(device: str) -> str:
    """A worker_devices entry as torch names it: cpu, or cuda:N (N: the machine's index)."""
    return device if device == CPU else f"cuda:{device}"


def socket_dir(cfg: Config) -> Path:
    return cfg.run_dir / "sockets"


def frontend_socket(cfg: Config, index: int) -> Path:
    return socket_dir(cfg) / f"frontend-{index}.sock"


def frontend_grpc_socket(cfg: Config, index: int) -> Path:
    """Where frontend `index` serves gRPC (server.grpc_port; frontend.grpc_api)."""
    return socket_dir(cfg) / f"frontend-{index}.grpc.sock"


APPLY_MARKER = "apply.json"  # beside config.json (shmserve.program_config reads it there)


def apply_marker_path(cfg: Config) -> Path:
    """The config before an `shmserve apply` that has not finished (shmserve.apply)."""
    return cfg.run_dir / APPLY_MARKER


def restart_marker_path(cfg: Config) -> Path:
    """The programs an `shmserve restart` is restarting, while it does (shmserve.restart_record)."""
    return cfg.run_dir / "restart.json"


def nginx_answers_log(cfg: Config) -> Path:
    """Where nginx appends the statuses it answers itself, and the reaper counts them
    (shmserve.nginx_stats)."""
    return cfg.run_dir / "nginx" / "answers.log"


def worker_endpoint(cfg: Config, index: int) -> str:
    return f"ipc://{socket_dir(cfg) / f'worker-{index}.ipc'}"


def metrics_dir(cfg: Config) -> Path:
    return cfg.run_dir / "metrics"


def log_dir(cfg: Config) -> Path:
    return cfg.run_dir / "logs"


def resolved_config_path(cfg: Config) -> Path:
    return cfg.run_dir / "config.json"


def config_files_path(cfg: Config) -> Path:
    """The config files `up` read, with digests of their content (shmserve.layers.digests)."""
    return cfg.run_dir / "config_files.json"


def config_variables_path(cfg: Config) -> Path:
    """The SHMSERVE__ variables `up` (or the last apply) read: their names, not their values."""
    return cfg.run_dir / "config_variables.json"


def record_sources(cfg: Config, env: str | None, extra: str | Path | None) -> None:
    """What the running config was read from (at `up`, and at each `apply`), for `restart`
    and `apply` to compare with: the files, with digests, and the SHMSERVE__ variables."""
    config_files_path(cfg).write_text(json.dumps(layers.digests(
        layers.file_layers(env, extra, os.environ)), indent=1) + "\n")
    config_variables_path(cfg).write_text(json.dumps(layers.override_names(os.environ)) + "\n")


def config_files(cfg: Config) -> dict[str, str] | None:
    """What config_files_path holds: each file's absolute path and digest; None where `up`
    kept none (an older version's) or the file does not read."""
    try:
        return json.loads(config_files_path(cfg).read_text())
    except (OSError, ValueError):
        return None


def config_variables(cfg: Config) -> list[str]:
    """What config_variables_path holds; none where `up` kept no record (an older one's)."""
    try:
        names = json.loads(config_variables_path(cfg).read_text())
    except (OSError, ValueError):
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []
