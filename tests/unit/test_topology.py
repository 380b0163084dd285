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


def test_auto_devices_refuse_an_index_the_machine_does_not_show(tmp_path, monkeypatch):
    """CUDA_VISIBLE_DEVICES=0,5 on a machine of two GPUs ran one GPU's workers, and 2,3 in a
    container given two GPUs (which CUDA numbers 0 and 1 there) ran CPU workers, without a word
    (an outside check): refused, naming the index. With no GPU at all, CPU workers, noted."""
    driver = tmp_path / "driver"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (driver / bus).mkdir(parents=True)
    monkeypatch.setattr(topology, "DRIVER_GPUS", driver)
    cfg = config.from_tree({"models": [{"name": "m", "source": "/nonexistent/m"}],
                            "workers": {"devices": "auto", "cpu_workers": 2}})
    for visible, missing in (("0,5", "5"), ("2,3", "2, 3")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with pytest.raises(config.ConfigError, match=rf"CUDA_VISIBLE_DEVICES={visible} names "
                           rf"GPU {missing}, which this machine does not show \(it shows 2: "):
            topology.worker_devices(cfg)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert topology.worker_devices(cfg) == ["1", "0"]
    assert topology.unplaced_gpus(cfg) is None
    monkeypatch.setattr(topology, "DRIVER_GPUS", tmp_path / "none")
    monkeypatch.setattr(topology, "DEVICE_NODES", tmp_path / "none")
    assert topology.worker_devices(cfg) == ["cpu", "cpu"]
    assert topology.unplaced_gpus(cfg) == ("CUDA_VISIBLE_DEVICES=1,0 names GPUs, but this "
                                           "machine shows none: workers.devices auto runs 2 "
                                           "CPU worker(s)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert topology.unplaced_gpus(cfg) is None  # GPUs hidden on purpose: nothing to note
    # A container given a GPU its runtime did not expose (a missing runtime class) says so in
    # NVIDIA_VISIBLE_DEVICES alone (an outside check: auto served on CPU without a word)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for given in ("GPU-6f1c2b3a-1d2e-4f5a-9b8c-7d6e5f4a3b2c", "0", "all"):
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", given)
        assert topology.unplaced_gpus(cfg) == (f"NVIDIA_VISIBLE_DEVICES={given} names GPUs, "
                                               "but this machine shows none: workers.devices "
                                               "auto runs 2 CPU worker(s)")
    for none in ("void", "none", ""):
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", none)
        assert topology.unplaced_gpus(cfg) is None
    # GPUs hidden from CUDA on purpose (CUDA base images set NVIDIA_VISIBLE_DEVICES=all)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert topology.unplaced_gpus(cfg) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cpu = config.from_tree({"models": [{"name": "m", "source": "/nonexistent/m"}],
                            "workers": {"devices": "cpu"}})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert topology.unplaced_gpus(cpu) is None
