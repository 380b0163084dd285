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


def test_gpus_are_counted_from_the_device_nodes_when_the_driver_tree_is_missing(
        tmp_path, monkeypatch):
    """A container may be given /dev/nvidiaN without /proc/driver/nvidia: auto ran CPU
    workers on a GPU pod without a word (an outside check, from the code)."""
    monkeypatch.setattr(topology, "DRIVER_GPUS", tmp_path / "no-such-dir")
    monkeypatch.setattr(topology, "DEVICE_NODES", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).touch()
    assert topology.visible_gpus() == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert topology.visible_gpus() == [1]
    driver = tmp_path / "driver"
    (driver / "0000:01:00.0").mkdir(parents=True)
    monkeypatch.setattr(topology, "DRIVER_GPUS", driver)  # the driver's tree, when there, wins
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert topology.visible_gpus() == [0]
