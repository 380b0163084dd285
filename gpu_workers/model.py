"""A served model: safetensors weights in eval mode, one forward per batch, one row per text.

Loading (gpu_workers.networks: the BERT family through gpu_workers.bert, the rest through
transformers) refuses pickle checkpoints, remote code, and a scoring checkpoint whose head
would be initialised at random. The forward pass takes a padded int64 batch built by the worker and
returns float32 rows (gpu_workers.tasks) ready to be copied into shared memory.

dtypes: fp32 | bf16 | fp16 as loaded; auto is bf16 where the device computes it natively and a
probe agrees with fp32 (gpu_workers.parity), else fp32; int8 is dynamic quantization of every
nn.Linear (weights int8 ahead of time, activations quantized per batch), for CPU workers only.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from gpu_workers import networks, packed, parity, prepack, tasks
from gpu_workers.device import cpu_has_bf16, release, trim_heap
from gpu_workers.graphs import Graphs
from shmserve.models import ModelSourceError, ModelSpec, weights_file

log = logging.getLogger("shmserve.worker")

# A sparse model's vocabulary logits are computed this many floats at a time (64 MiB in fp32).
SPLADE_CHUNK_FLOATS = 1 << 24

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int8": torch.float32}  # int8 loads fp32 weights, then quantizes them


class Model:
    def __init__(self, spec: ModelSpec, device: torch.device, pack: bool = True,
                 bucket: bool | None = None, graphs: int = 0, prepacked: bool = True) -> None:
        """`pack=False` keeps the network's own forward, one length group at a time (for
        measuring what the packed pass gains: scripts/packed_ab.py). `bucket` (default: on a
        CPU) rounds the shapes the linear layers see to a few sizes, as oneDNN compiles a
        kernel for every new one: the packed pass's token count (packed.rows_for) always, and
        a group's texts and length in the network's own forward (`_bucketed`) in bf16 and fp16
        only, where oneDNN's compiled kernels run (in fp32 and int8 the padding cost 8% and 6%
        in-process: docs/performance.md). `graphs` > 0: run each length group through a CUDA
        graph of its padded shape, up to that many shapes (gpu_workers.graphs; a model that
        packs only; without a GPU the same path runs eagerly, for the tests). `prepacked`:
        bf16 linear layers on a CPU with their weights reordered for oneDNN once, at load
        (gpu_workers.prepack); False keeps `F.linear` (for scripts/packed_ab.py)."""
        weights_file(spec.directory)  # refuses a pickle-only directory with a clear message
        dtype = resolve_dtype(spec.dtype, device)
        guarded = spec.dtype == "auto" and dtype != "fp32"  # kept only if it agrees with fp32
        self.device = device
        self.bucket = device.type == "cpu" if bucket is None else bucket
        self.prepack = prepacked and device.type == "cpu"
        self.prepacked = 0  # linear layers running through gpu_workers.prepack
        self.max_tokens = spec.max_tokens  # a group's length is never rounded past it
        net, self.loader = networks.load(spec, DTYPES["fp32" if guarded else dtype])
        config = net.config
        self.attention = str(getattr(config, "_attn_implementation", "") or "")  # logged
        _refuse_non_finite(net, spec)
        if dtype == "int8":
            net = quantize_int8(net)
        self.head = tasks.head(spec, device)
        self.pad_id = int(getattr(config, "pad_token_id", 0) or 0)
        # Token types for pairs where the network has a second one: a RoBERTa cross-encoder's
        # one (type_vocab_size 1) is all zeros, and a 1 was out of range (warm-up's pairs).
        self.token_types = ("token_type_ids" in inspect.signature(net.forward).parameters
                            and getattr(config, "type_vocab_size", 2) > 1)
        # A model with BERT's layers runs several length groups in one pass
        # (gpu_workers.packed); int8's quantized linears keep the network's own forward.
        self._packs = pack and dtype != "int8" and networks.packs(net)
        # sparse (SPLADE): the vocabulary logits of a token's last hidden state
        self.splade = packed.MASKED_LMS.get(type(net).__name__) if spec.task == "sparse" else None
        if spec.task == "sparse" and self.splade is None:  # config.json named one, not so
            raise ModelSourceError(f"{spec.directory}: loads as {type(net).__name__}; a sparse "
                                   f"model must be one of {', '.join(packed.MASKED_LMS)}")
        self.vocab = spec.dim  # a sparse model's row width
        self.max_graphs = graphs if self._packs and self.splade is None else 0
        self._use(net.to(device))
        self.agreement: float | None = None  # with fp32 on the probe, when dtype auto chose
        if guarded:
            dtype = self._choose(spec, dtype)
        self.spec = dataclasses.replace(spec, dtype=dtype)  # with the dtype it runs in

    def _use(self, net: torch.nn.Module) -> None:
        self.net = net
        half = next(net.parameters()).dtype in (torch.bfloat16, torch.float16)
        self.round_groups = self.bucket and half
        bf16 = self.prepack and next(net.parameters()).dtype == torch.bfloat16
        self.packed = (networks.packed_encoder(net, self.bucket, prepacked=bf16)
                       if self._packs else None)
        # after the packed encoder has fused query, key and value from their layers (not the
        # fused product: FusedAway); 0 for a network of another dtype (auto's fp32 fallback
        # logged the bf16 candidate's count)
        self.prepacked = prepack.swap(net) if bf16 else 0
        self.graphs = (Graphs(self._graph_rows, self.device, self.pad_id, self.max_tokens,
                              self.max_graphs) if self.max_graphs else None)

    def _choose(self, spec: ModelSpec, dtype: str) -> str:
        """dtype auto: run the probe in fp32 and in `dtype`; keep whichever the agreement
        allows. The fp32 weights are dropped once `dtype` is kept."""
        fp32 = self.net
        try:
            probe = parity.probe_batch(spec)
            want = self.forward(*probe)
            self._use(copy.deepcopy(fp32).to(DTYPES[dtype]))
            self.agreement = parity.agreement(want, self.forward(*probe))
        except Exception as exc:  # noqa: BLE001 - the check, not the model, is what failed here
            # The model may still serve (a probe text may hit what real inputs never do); the
            # unchecked dtype is not kept. Its own errors show on the requests that cause them.
            log.warning("model.dtype_auto", extra={"fields": {
                "model": spec.name, "candidate": dtype, "dtype": "fp32",
                "probe_error": f"{type(exc).__name__}: {exc}"}})
            self._use(fp32)
            return "fp32"
        keep = self.agreement >= spec.auto_min_cosine
        fields = {"model": spec.name, "candidate": dtype, "agreement": round(self.agreement, 6),
                  "auto_min_cosine": spec.auto_min_cosine, "dtype": dtype if keep else "fp32"}
        if keep:
            log.info("model.dtype_auto", extra={"fields": fields})
            del fp32
            release(self.device)  # the fp32 copy's memory back (on a GPU, to the driver)
            return dtype
        log.warning("model.dtype_auto", extra={"fields": fields})  # level warning: not kept
        self._use(fp32)
        return "fp32"

    @property
    def packs(self) -> bool:
        """True when `forward_groups` runs several groups in one pass (worth merging them)."""
        return self.packed is not None

    def forward(self, ids: np.ndarray, lengths: np.ndarray,
                segments: np.ndarray | None = None) -> np.ndarray:
        """ids: int64 [B, L] padded with anything; lengths: int [B]; segments: int [B], the
        length of each text's first segment (None: one segment). Returns float32 [B, width]."""
        return self.forward_groups([(ids, lengths, segments)])

    @torch.inference_mode()
    def forward_groups(self, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
                       tokens: bool = False, normalize: bool = True,
                       skip: int = 0) -> np.ndarray:
        """Several (ids, lengths, segments) groups, as `forward` takes one; their rows, in
        order. One pass where the network packs (gpu_workers.packed), else one per group.
        `tokens` (an embedding model): the last hidden state of every real token instead,
        float32 [tokens, hidden], the texts in order (TEI's /embed_all). A sparse model's rows
        are its SPLADE vectors, float32 [B, vocabulary] (`_splade`). `normalize` False: an
        embedding model's pooled rows without its L2 normalisation (eager: the CUDA graphs
        record the head as the model serves it). `skip`: leading tokens of every text its
        pooling leaves out (Submit.skip; eager too)."""
        if tokens:
            return self._token_rows(groups).float().cpu().numpy()
        if self.splade is not None:
            return self._splade(self._token_rows(groups), groups).cpu().numpy()
        if self.graphs is not None and normalize and not skip:
            return torch.cat([self.graphs.run(*group) for group in groups]).cpu().numpy()
        inputs = [self._inputs(*group) for group in groups]
        if self.packed is not None:
            outputs = self.packed([
                packed.Group(ids, mask, types, packed.index_of(group[1], group[0].shape[1])
                             .to(self.device, non_blocking=True),
                             dense=bool((group[1] == group[0].shape[1]).all()))
                for (ids, mask, _, types), group in zip(inputs, groups)])
            rows = [self.head(out, mask, lens, normalize, skip)
                    for out, (_, mask, lens, _) in zip(outputs, inputs)]
        else:
            rows = []
            for ids, mask, lens, types in inputs:
                texts = ids.shape[0]
                if self.round_groups:
                    ids, mask, lens, types = self._bucketed(ids, mask, lens, types)
                extra = {} if types is None else {"token_type_ids": types}
                out = self.net(input_ids=ids, attention_mask=mask.long(), **extra)
                rows.append(self.head(out, mask, lens, normalize, skip)[:texts])
        return torch.cat(rows).cpu().numpy()

    def _token_rows(self, groups) -> torch.Tensor:
        """The last hidden state of every real token [tokens, hidden], in the network's dtype
        and on its device: the texts in order, each text's tokens in order."""
        inputs = [self._inputs(*group) for group in groups]
        if self.packed is not None:  # its rows are the real tokens, in order
            return self.packed.tokens([
                packed.Group(ids, mask, types, packed.index_of(group[1], group[0].shape[1])
                             .to(self.device, non_blocking=True),
                             dense=bool((group[1] == group[0].shape[1]).all()))
                for (ids, mask, _, types), group in zip(inputs, groups)])
        rows = []
        encoder = self.net.base_model  # the network itself, or a masked LM's encoder
        for ids, mask, lens, types in inputs:
            texts, width = ids.shape
            if self.round_groups:
                ids, mask, lens, types = self._bucketed(ids, mask, lens, types)
            extra = {} if types is None else {"token_type_ids": types}
            out = encoder(input_ids=ids, attention_mask=mask.long(), **extra)
            # The mask, row-major: text by text, each text's tokens in order.
            rows.append(out.last_hidden_state[:texts, :width][mask[:texts, :width]])
        return torch.cat(rows)

    def _splade(self, hidden: torch.Tensor, groups) -> torch.Tensor:
        """SPLADE vectors [texts, vocabulary] from the token rows, as sentence-transformers'
        SpladePooling and TEI compute them: log(1 + relu(logit)), the largest over each text's
        tokens (special tokens included). log1p and relu rise with the logit, so the largest
        logit is taken first. The vocabulary head runs on SPLADE_CHUNK_FLOATS of logits at a
        time: a pass's [tokens, vocabulary] at once would be ~1 GB for 8,192 tokens of a
        30,522-word vocabulary."""
        lengths = torch.from_numpy(np.concatenate([g[1] for g in groups]).astype(np.int64))
        text_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(
            self.device, non_blocking=True)
        out = torch.full((lengths.numel(), self.vocab), float("-inf"), device=self.device)
        step = max(1, SPLADE_CHUNK_FLOATS // self.vocab)
        for lo in range(0, hidden.shape[0], step):
            logits = self.splade(self.net, hidden[lo:lo + step]).float()
            rows = text_of[lo:lo + step, None].expand(-1, self.vocab)  # a view: no copy
            out.scatter_reduce_(0, rows, logits, "amax")
        return torch.log1p(torch.relu(out))

    def _bucketed(self, ids, mask, lens, types):
        """A group padded to one of a few shapes (packed.group_shape); the rows added hold one
        padding token each (a row with nothing to attend to could give NaN), and are dropped
        after."""
        texts, width = ids.shape
        rows, cols = packed.group_shape(texts, width, self.max_tokens)
        if (rows, cols) == (texts, width):
            return ids, mask, lens, types

        def grow(t: torch.Tensor, fill) -> torch.Tensor:
            return F.pad(t, (0, cols - width, 0, rows - texts), value=fill)

        ids, mask = grow(ids, self.pad_id), grow(mask, False)
        mask[texts:, 0] = True
        lens = F.pad(lens, (0, rows - texts), value=1)
        return ids, mask, lens, None if types is None else grow(types, 0)

    def _inputs(self, ids: np.ndarray, lengths: np.ndarray, segments: np.ndarray | None):
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=True)
        lens = torch.from_numpy(lengths.astype(np.int64)).to(self.device, non_blocking=True)
        first = (None if segments is None else
                 torch.from_numpy(segments.astype(np.int64)).to(self.device))
        return self._masked(input_ids, lens, first)

    def _masked(self, ids: torch.Tensor, lens: torch.Tensor, first: torch.Tensor | None):
        """On the device: ids with padding set to the pad id, the mask, the lengths, and the
        token types of pairs (None: one segment)."""
        positions = torch.arange(ids.shape[1], device=self.device)
        mask = positions[None, :] < lens[:, None]
        ids = ids.masked_fill(~mask, self.pad_id)
        types = None
        if first is not None and self.token_types:
            types = ((positions[None, :] >= first[:, None]) & mask).long()
        return ids, mask, lens, types

    def _graph_rows(self, inputs: torch.Tensor, cols: int, pairs: bool) -> torch.Tensor:
        """What one CUDA graph records (gpu_workers.graphs): a padded group through the packed
        encoder, every position taken as a row (a static shape), and the head."""
        ids, mask, lens, types = self._masked(inputs[:, :cols], inputs[:, cols],
                                              inputs[:, cols + 1] if pairs else None)
        index = torch.arange(ids.numel(), device=self.device)
        out, = self.packed([packed.Group(ids, mask, types, index)])
        return self.head(out, mask, lens)


def warm_up(model: Model, max_batch_size: int, max_batch_tokens: int) -> tuple[int, float]:
    """Run the largest batch shape the limits allow (on a CPU, one text of the longest input),
    so the first request pays no warm-up; then time a full pass of short texts (32 tokens),
    twice, and return the faster as (real tokens, seconds): the worker's first estimate of the
    speed it drains a backlog at (shmserve.admission), before it has drained one.

    On a GPU the largest pass reserves its memory (the caching allocator keeps it) and records
    its kernels' plans. A CPU has neither to prepare: the whole batch only cost the start its
    compute, which grows with the model (a BERT-base-sized model in fp32: ~36 s of a worker's
    ~56 s to ready on the 2-core development machine, an outside check), at every restart and
    hot reload. One longest text still checks the longest input's outputs for overflow."""
    longest = model.spec.max_tokens
    batch = max(1, min(max_batch_size, max_batch_tokens // longest))
    if model.device.type == "cpu":
        batch = 1
    pairs = model.spec.task == "rerank"  # warm the token-type path a cross-encoder takes
    if model.graphs is not None:
        with torch.inference_mode():
            model.graphs.prepare(max_batch_size, max_batch_tokens, pairs)
    short = min(32, longest)
    typical = (max(1, min(max_batch_size, max_batch_tokens // short)), short)
    timed = []
    for shape in ((1, 8), (batch, longest), typical, typical):
        started = time.perf_counter()
        out = model.forward(np.ones(shape, np.int64), np.full(shape[0], shape[1], np.int64),
                            np.full(shape[0], shape[1] // 2, np.int64) if pairs else None)
        timed.append(time.perf_counter() - started)
        if not np.isfinite(out).all():  # would be answered as nulls, or NaN in msgpack
            raise ModelSourceError(
                f"{model.spec.directory}: the model's outputs hold NaN or infinity in "
                f"{model.spec.dtype} on a warm-up batch of {shape[0]} x {shape[1]} tokens "
                "(fp16 overflow? then bf16 or fp32)")
    trim_heap()  # the largest batch's buffers, freed, back to the system
    return typical[0] * typical[1], min(timed[2:])


def _refuse_non_finite(net: torch.nn.Module, spec: ModelSpec) -> None:
    """Refuse weights holding NaN or infinity (a damaged file whose header reads): every output
    would be NaN, which JSON answers as null."""
    for name, tensor in net.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelSourceError(f"{spec.directory}: weight {name} holds NaN or infinity "
                                   "(a damaged model.safetensors?)")


def resolve_dtype(name: str, device: torch.device) -> str:
    """The dtype a model of configured dtype `name` runs in on `device`."""
    if name == "int8" and device.type != "cpu":
        raise ModelSourceError("dtype int8 (dynamic quantization) runs on CPU workers only; use "
                               "bf16 or fp16 on a GPU")
    if name != "auto":
        return name
    if device.type == "cuda":
        # Native bf16 from Ampere on; before it (T4, V100) bf16 is emulated and slow
        # (is_bf16_supported counts emulation unless told not to), while fp16 runs on the
        # tensor cores. The load-time probe guards either against fp32.
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return "bf16" if cpu_has_bf16() else "fp32"


def quantize_int8(net: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of every nn.Linear, with per-output-channel weight scales
    (closer to fp32 than one scale per tensor: min cosine 0.96 against 0.90 on all-MiniLM-L6-v2,
    see docs/models.md)."""
    # torch.ao.quantization is deprecated in favour of torchao, but is what this torch ships and
    # runs on its CPU kernels (fbgemm/onednn); its deprecation notices are silenced here only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions")
        from torch.ao import quantization

        return quantization.quantize_dynamic(
            net, {torch.nn.Linear: quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8)


class NullModel:
    """The `null` task: zeros of the right shape, no computation. It measures everything around
    the model (nginx, frontends, shared memory, ZeroMQ, batching) on its own."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    packs = False
    graphs = None

    def forward(self, ids: np.ndarray, lengths: np.ndarray,
                segments: np.ndarray | None = None) -> np.ndarray:
        return np.zeros((ids.shape[0], self.spec.dim), np.float32)

    def forward_groups(self, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
                       tokens: bool = False, normalize: bool = True,
                       skip: int = 0) -> np.ndarray:
        rows = sum(int(g[1].sum()) if tokens else g[0].shape[0] for g in groups)
        return np.zeros((rows, self.spec.width(tokens)), np.float32)


def load_model(spec: ModelSpec, device: torch.device, graphs: int = 0) -> Model | NullModel:
    """`graphs`: the most CUDA graph shapes a model records (0: none; Model)."""
    return NullModel(spec, device) if spec.task == "null" else Model(spec, device, graphs=graphs)
