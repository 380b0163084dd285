"""The machine a benchmark ran on, as its reports name it: the CPU's model and widest matrix
instructions, and the GPUs the workers run on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_description() -> str:
    """The CPU's model name and the widest matrix instructions it has (what decides the speed of
    the dtypes: bf16 is native only with AMX or AVX512-BF16, `dtype: auto` picks by it)."""
    name, flags = platform.processor() or "cpu", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = next((label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"),
                                          ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), "no AVX2")
    return f"{name}, {isa}"


def gpu_description(gpus: list[str]) -> str:
    """The model names of the GPUs `gpus` (indices, as workers.devices lists them) from the
    driver's /proc files, without importing torch; "no GPU" for none (the machine line said
    "no GPU" whatever the workers ran on: an outside check)."""
    if not gpus:
        return "no GPU"
    from shmserve.topology import DRIVER_GPUS

    names = []
    for info in sorted(DRIVER_GPUS.glob("*/information")):
        model = next((line.partition(":")[2].strip() for line in info.read_text().splitlines()
                      if line.startswith("Model:")), "")
        names.append(model or "an NVIDIA GPU")
    picked = [names[int(i)] if int(i) < len(names) else "an NVIDIA GPU" for i in gpus]
    return ", ".join(f"GPU {i}: {name}" for i, name in zip(gpus, picked))
