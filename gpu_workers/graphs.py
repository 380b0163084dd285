"""CUDA graphs for a GPU worker's forward (`workers.cuda_graphs`; off by default until measured).

On an H200 a pass of 256 short texts through a BERT-base-sized encoder took 11.4 ms with the GPU
21-45% busy (docs/performance.md): the host launching a few hundred small kernels one by one was
the bound, not the GPU. A CUDA graph records a forward's kernels once and replays them with one
launch. A graph is only valid for the shapes it was recorded with, so each length group runs
padded to one of a few shapes (its texts to `packed.texts_for`, its length to `packed.rows_for`,
within the model's limit), and one graph is recorded per shape, up to `max_graphs`: at warm-up
every shape of groups up to 128 tokens the batching limits allow (`prepare`), longer ones the
first time they are seen; groups past the limit run as they would without graphs.

A group's inputs travel as one int64 [texts, length + 2] buffer: the token ids, then each text's
length and its first segment's length (pairs); one copy to the device per group, from a pinned
host buffer of the graph's own, so the host goes on while it runs. Padding rows have length 1,
so every row attends to something. Each replay's rows are cloned at once: graphs
share one memory pool, so a later replay may reuse an earlier one's output memory.

Recording needs a CUDA device; elsewhere (`capture=False`, as on a CPU in the tests) the same
buffers run through the same function eagerly, which is what the tests check.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from gpu_workers import packed

log = logging.getLogger("shmserve.worker")

# (inputs [texts, length + 2] on the device, length, pairs) -> rows [texts, width] on the device
Rows = Callable[[torch.Tensor, int, bool], torch.Tensor]
# Groups up to this many tokens get their shapes recorded at warm-up (`Graphs.prepare`): the
# corpus's short sentences are 20 tokens at the median and 157 at the 99th percentile.
PREPARED_LENGTH = 128
# One capture at a time in a process (torch.cuda.graph's documented restriction: every capture
# without a stream of its own shares one class-level stream). A hot reload's loader thread
# records the new model's shapes (`prepare`) while the model thread may record a shape it
# sees for the first time (`run`).
_CAPTURING = threading.Lock()


@dataclass(slots=True)
class Entry:
    inputs: torch.Tensor  # the static input buffer on the device
    host: torch.Tensor  # its host side (pinned on a GPU), and a numpy view of it
    staging: np.ndarray
    copied: torch.cuda.Event | None = None  # the last copy from `host` (on a GPU)
    out: torch.Tensor | None = None  # the static output (a graph's), or the last eager one
    graph: torch.cuda.CUDAGraph | None = None


class Graphs:
    def __init__(self, rows: Rows, device: torch.device, pad_id: int, max_tokens: int,
                 max_graphs: int, capture: bool | None = None) -> None:
        self.rows = rows
        self.device = device
        self.pad_id = pad_id
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = device.type == "cuda" if capture is None else capture
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.entries: dict[tuple[int, int, bool], Entry] = {}
        self.overflow = 0  # groups run without a graph: every shape slot was taken

    def prepare(self, max_texts: int, max_tokens: int, pairs: bool,
                up_to_length: int = PREPARED_LENGTH) -> None:
        """Record, before the worker says it is ready, every shape a group of texts up to
        `up_to_length` tokens can take within the batching limits (28 text counts x 8 lengths
        with configs/gpu.yaml's limits), so that recording does not stall the first requests;
        longer groups' shapes are recorded when first seen."""
        lengths = sorted({self.shape(1, n)[1] for n in range(1, min(up_to_length,
                                                                   self.max_tokens) + 1)})
        counts = sorted({packed.texts_for(n) for n in range(1, max_texts + 1)})
        for cols in lengths:
            for rows in counts:
                key = (rows, cols, pairs)
                if rows * cols > max_tokens or key in self.entries:
                    continue
                if len(self.entries) >= self.max_graphs:
                    return
                entry = self.entries[key] = self._entry(rows, cols)
                if self.capture:
                    self._record(entry, cols, pairs)

    def shape(self, texts: int, length: int) -> tuple[int, int]:
        return packed.group_shape(texts, length, self.max_tokens)

    def run(self, ids: np.ndarray, lengths: np.ndarray,
            segments: np.ndarray | None) -> torch.Tensor:
        """One length group (as Model.forward takes it): its rows [texts, width], on the device,
        safe to keep while further groups run."""
        texts, length = ids.shape
        rows, cols = self.shape(texts, length)
        pairs = segments is not None
        key = (rows, cols, pairs)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.max_graphs:
                self.overflow += 1
                entry = self._entry(rows, cols, pinned=False)  # one-off, run eagerly
                self._fill(entry, ids, lengths, segments)
                return self.rows(entry.inputs, cols, pairs)[:texts]
            entry = self.entries[key] = self._entry(rows, cols)
            if self.capture:
                try:
                    self._record(entry, cols, pairs)
                except Exception as exc:  # noqa: BLE001 - this shape runs eagerly from now on
                    entry.out = None
                    log.warning("model.graph_failed: %s: %s", type(exc).__name__, exc,
                                extra={"fields": {"texts": rows, "length": cols}})
        self._fill(entry, ids, lengths, segments)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.out = self.rows(entry.inputs, cols, pairs)
        return entry.out[:texts].clone()

    def _entry(self, rows: int, cols: int, pinned: bool = True) -> Entry:
        pinned = pinned and self.device.type == "cuda"
        host = torch.empty((rows, cols + 2), dtype=torch.int64, pin_memory=pinned)
        inputs = torch.empty((rows, cols + 2), dtype=torch.int64, device=self.device)
        entry = Entry(inputs, host, host.numpy(),
                      torch.cuda.Event() if pinned else None)
        entry.staging[:, :cols] = self.pad_id
        entry.staging[:, cols:] = 1
        inputs.copy_(host)
        return entry

    def _fill(self, entry: Entry, ids: np.ndarray, lengths: np.ndarray,
              segments: np.ndarray | None) -> None:
        texts, length = ids.shape
        if entry.copied is not None:
            entry.copied.synchronize()  # the last copy out of `host` is done (long since, mostly)
        buf = entry.staging
        cols = buf.shape[1] - 2
        buf[:texts, :length] = ids
        buf[:texts, length:cols] = self.pad_id
        buf[texts:, :cols] = self.pad_id
        buf[:texts, cols] = lengths
        buf[texts:, cols] = 1
        buf[:texts, cols + 1] = segments if segments is not None else lengths
        buf[texts:, cols + 1] = 1
        if entry.copied is not None:  # pinned: the host goes on while the copy runs
            entry.inputs.copy_(entry.host, non_blocking=True)
            entry.copied.record()
        else:
            entry.inputs.copy_(entry.host)

    def _record(self, entry: Entry, cols: int, pairs: bool) -> None:
        with _CAPTURING:
            self._record_alone(entry, cols, pairs)

    def _record_alone(self, entry: Entry, cols: int, pairs: bool) -> None:
        started = time.monotonic()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # kernels chosen and workspaces made outside the graph
            for _ in range(2):
                self.rows(entry.inputs, cols, pairs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a hot reload's loader thread may allocate on the device meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            entry.out = self.rows(entry.inputs, cols, pairs)
        entry.graph = graph
        log.info("model.graph_recorded", extra={"fields": {
            "texts": entry.inputs.shape[0], "length": cols, "pairs": pairs,
            "graphs": len(self.entries), "ms": round((time.monotonic() - started) * 1000, 1)}})
