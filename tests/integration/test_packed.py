"""The packed encoder pass (gpu_workers.packed) and its CPU helpers (rounded row counts,
prepacked bf16 linears, groups without padding), against the network's own forward."""

import numpy as np
import pytest
import torch

from gpu_workers import packed, prepack
from gpu_workers.device import cpu_has_bf16
from gpu_workers.model import Model
from tests.integration.test_model import spec


@pytest.mark.parametrize("dtype,floor", [("fp32", 0.999999), ("bf16", 0.999)])
def test_length_groups_in_one_pass_equal_the_networks_own_forward(models, dtype, floor):
    """An embedding model with BERT's layers runs several groups in one pass (its linear layers
    over every group's real tokens, attention group by group): each row must equal what the
    network computes on that group alone, padded."""
    model = Model(spec(models["emb"], "embedding", dtype), torch.device("cpu"))
    assert model.packs
    rng = np.random.default_rng(7)
    groups = []
    for rows, width in ((3, 5), (1, 40), (4, 64), (2, 1)):
        lengths = rng.integers(1, width + 1, rows)
        lengths[0] = width
        groups.append((rng.integers(1000, 1100, (rows, width)), lengths, None))
    got = model.forward_groups(groups)
    own = Model(spec(models["emb"], "embedding", dtype), torch.device("cpu"), pack=False)
    assert not own.packs  # the network's own forward, group by group
    want = np.concatenate([own.forward(*group) for group in groups])
    assert got.shape == want.shape == (10, model.spec.dim)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= floor


def test_a_cpu_pass_runs_its_linear_layers_on_a_few_row_counts_only(models):
    """oneDNN compiles a kernel per matrix shape: every pass must round its token count up to
    one of a few sizes (packed.rows_for), or a worker compiles without end and slows down."""
    model = Model(spec(models["emb"], "embedding", "fp32"), torch.device("cpu"))
    seen = []
    dense = model.packed.layers[0][3].intermediate.dense
    hook = dense.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        rng = np.random.default_rng(5)
        for texts, width in ((1, 1), (1, 17), (2, 20), (3, 50), (5, 60)):  # 1 to 300 tokens
            model.forward(rng.integers(1000, 1100, (texts, width)), np.full(texts, width))
    finally:
        hook.remove()
    assert seen == [16, 32, 48, 160, 320]


@pytest.mark.parametrize("key,task,pack", [("emb", "embedding", True), ("emb", "embedding", False),
                                           ("clf", "classification", True),
                                           ("ce", "rerank", True)])
def test_bf16_linear_layers_prepacked_for_onednn_give_the_same_rows(models, key, task, pack):
    if not cpu_has_bf16():
        pytest.skip("this CPU has no native bf16: oneDNN's bf16 linear is not what runs here")
    s = spec(models[key], task, "bf16")
    plain = Model(s, torch.device("cpu"), pack=pack, prepacked=False)
    model = Model(s, torch.device("cpu"), pack=pack)
    assert plain.prepacked == 0
    left = [type(m).__name__ for m in model.net.modules() if type(m) is torch.nn.Linear]
    assert left == []
    if pack:  # query, key and value run fused, prepacked in the packed encoder itself, and
        # their plain weights are not kept beside it
        assert all(isinstance(linear, prepack.PrepackedLinear)
                   for linear, *_ in model.packed.layers)
        fused = [m for m in model.net.modules() if isinstance(m, packed.FusedAway)]
        assert len(fused) == 3 * len(model.packed.layers)
        plain_bytes = sum(p.numel() * p.element_size() for p in plain.net.parameters())
        bytes_now = sum(t.numel() * t.element_size()
                        for t in [*model.net.parameters(), *model.net.buffers()]
                        ) + sum(linear.packed.numel() * linear.packed.element_size()
                                for linear, *_ in model.packed.layers)
        assert bytes_now <= plain_bytes * 1.05
    assert model.prepacked > 0
    rng = np.random.default_rng(12)
    groups = []
    for rows, width in ((1, 1), (2, 9), (3, 30), (1, 64)):
        lengths = rng.integers(1, width + 1, rows)
        lengths[0] = width
        segments = (lengths // 2).astype(np.int64) if task == "rerank" else None
        groups.append((rng.integers(1000, 1100, (rows, width)), lengths, segments))
    np.testing.assert_array_equal(model.forward_groups(groups), plain.forward_groups(groups))
    assert Model(spec(models[key], task), torch.device("cpu"), pack=pack).prepacked == 0  # fp32


def test_row_counts_are_few_and_padding_is_bounded():
    sizes = [packed.rows_for(n) for n in range(1, 8193)]
    assert all(size >= n and size % 16 == 0 for n, size in enumerate(sizes, 1))
    assert len(set(sizes)) <= 64  # oneDNN keeps 1,024 kernels; four linears each
    assert max(size / n for n, size in enumerate(sizes, 1) if n > 128) <= 1.125


@pytest.mark.parametrize("key,task", [("clf", "classification"), ("ce", "rerank")])
def test_scoring_models_run_length_groups_in_one_pass_too(models, key, task):
    model = Model(spec(models[key], task), torch.device("cpu"))
    assert model.packs
    rng = np.random.default_rng(11)
    groups = []
    for rows, width in ((2, 6), (3, 30), (1, 64)):
        lengths = rng.integers(2, width + 1, rows)
        lengths[0] = width
        segments = (lengths // 2).astype(np.int64) if task == "rerank" else None
        groups.append((rng.integers(1000, 1100, (rows, width)), lengths, segments))
    got = model.forward_groups(groups)
    own = Model(spec(models[key], task), torch.device("cpu"), pack=False)
    want = np.concatenate([own.forward(*group) for group in groups])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key,task", [("emb", "embedding"), ("clf", "classification"),
                                      ("ce", "rerank")])
def test_groups_without_padding_skip_the_gathers_and_the_mask_with_the_same_rows(models, key,
                                                                               task):
    model = Model(spec(models[key], task), torch.device("cpu"))
    seen = []
    packed_call = type(model.packed).__call__

    def spy(self, groups):
        seen.extend(g.dense for g in groups)
        return packed_call(self, groups)

    rng = np.random.default_rng(13)
    groups = []
    for rows, width, full in ((3, 12, True), (1, 5, True), (2, 20, False)):
        lengths = np.full(rows, width) if full else np.array([width, width - 7])
        segments = (lengths // 2).astype(np.int64) if task == "rerank" else None
        groups.append((rng.integers(1000, 1100, (rows, width)), lengths, segments))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model.packed), "__call__", spy)
        got = model.forward_groups(groups)
    assert seen == [True, True, False]
    own = Model(spec(models[key], task), torch.device("cpu"), pack=False)
    want = np.concatenate([own.forward(*group) for group in groups])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
