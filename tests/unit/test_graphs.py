"""CUDA graph recording without a GPU: torch.cuda's capture calls replaced by fakes that count
how many captures are under way at once."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from gpu_workers.graphs import Graphs  # noqa: E402


class FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class Captures:
    """torch.cuda.graph's stand-in: counts the captures under way, and the most at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.total = 0

    @contextlib.contextmanager
    def graph(self, graph, pool=None, capture_error_mode="global"):
        with self.lock:
            self.now += 1
            self.total += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self.lock:
                self.now -= 1


class FakeGraph:
    def replay(self) -> None:
        pass


def test_two_models_never_record_at_once(monkeypatch):
    """A hot reload: the loader thread records the new model's shapes while the model thread
    records a shape the old model sees for the first time. torch allows one capture at a time
    in a process (and both would share torch.cuda.graph's one capture stream)."""
    captures = Captures()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", captures.graph)

    def rows(inputs, cols, pairs):
        if captures.now:
            time.sleep(0.002)  # a capture takes a while: the other thread gets its turn
        return torch.zeros((inputs.shape[0], 4))

    cpu = torch.device("cpu")
    old = Graphs(rows, cpu, pad_id=0, max_tokens=256, max_graphs=64, capture=True)
    new = Graphs(rows, cpu, pad_id=0, max_tokens=256, max_graphs=64, capture=True)
    failures = []

    def serve_old() -> None:
        try:
            for length in range(130, 256, 16):  # past the prepared lengths: recorded when seen
                ids = torch.ones((2, length), dtype=torch.int64).numpy()
                old.run(ids, torch.full((2,), length).numpy(), None)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    serving = threading.Thread(target=serve_old)
    serving.start()
    new.prepare(max_texts=8, max_tokens=1024, pairs=False)
    serving.join()
    assert failures == []
    assert len(old.entries) >= 4 and len(new.entries) >= 8
    assert captures.total == len(old.entries) + len(new.entries)
    assert captures.most == 1
