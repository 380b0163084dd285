"""Where the workers go: the GPUs `workers.devices: auto` finds (shmserve.topology)."""

import pytest

from shmserve import config, topology


def test_auto_devices_refuse_gpus_named_by_uuid(monkeypatch):
    """CUDA_VISIBLE_DEVICES=GPU-<uuid> was dropped entry by entry, so `auto` ran CPU workers on
    a GPU machine without a word (an outside check): refused, saying what to give instead."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3c2a1e-1111-2222-3333-444455556666")
    with pytest.raises(config.ConfigError, match=r"auto cannot place workers on GPUs "
                       r"CUDA_VISIBLE_DEVICES names by UUID \(GPU-8f3c"):
        topology.visible_gpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert topology.visible_gpus() == []  # none visible: CPU workers, as before
