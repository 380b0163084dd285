"""The worker's model in-process, per task and dtype, against the same model run directly in
transformers (and sentence-transformers' CrossEncoder), fed as the frontend tokenizes."""

import dataclasses

import numpy as np
import pytest
import torch

from frontend.tasks import activate, softmax
from frontend.tokenizer import TextEncoder
from gpu_workers.device import cpu_has_bf16
from gpu_workers.model import Model, resolve_dtype
from shmserve.models import ModelSourceError
from tests.integration.modelkit import QUERY, TEXTS, run, spec
from tests.tinymodel import build_tiny_classifier, reference_embeddings, reference_scores

def test_classification_is_softmax_of_the_sequence_classifier(models):
    s = spec(models["clf"], "classification")
    assert s.labels == ("label-0", "label-1", "label-2") and s.dim == 3
    logits = run(Model(s, torch.device("cpu")), TextEncoder(s, truncate=True).encode(TEXTS))
    assert logits.shape == (4, 3)  # the worker gives the logits
    np.testing.assert_allclose(logits, reference_scores(models["clf"], TEXTS, 64, raw=True),
                               atol=1e-5)
    got = softmax(logits)  # the frontend applies the softmax
    np.testing.assert_allclose(got, reference_scores(models["clf"], TEXTS, 64), atol=1e-5)
    np.testing.assert_allclose(got.sum(1), 1, atol=1e-5)


def test_a_classifier_reads_pairs_and_texts_in_one_pass(models):
    """TEI's /predict batch: an NLI model's (premise, hypothesis) pairs with texts alone; a
    pass mixes them (and requests of either kind)."""
    s = spec(models["clf"], "classification")
    items = [TEXTS[0], (TEXTS[1], TEXTS[2]), TEXTS[3], (QUERY, TEXTS[0])]
    model = Model(s, torch.device("cpu"))
    got = run(model, TextEncoder(s, truncate=True).encode_mixed(items))
    np.testing.assert_allclose(got, reference_scores(models["clf"], items, 64, raw=True),
                               atol=1e-5)


def test_rerank_scores_pairs_with_token_types_as_cross_encoder_does(models):
    from sentence_transformers.cross_encoder import CrossEncoder

    s = spec(models["ce"], "rerank")
    assert (s.dim, s.activation) == (1, "sigmoid")
    enc = TextEncoder(s, truncate=True).encode_pairs(QUERY, TEXTS)
    assert enc.segments.tolist()[:2] == [10, 10]  # [CLS] 8 query tokens [SEP]
    logits = run(Model(s, torch.device("cpu")), enc)[:, 0]  # the worker gives the raw logit
    pairs = [(QUERY, t) for t in TEXTS]
    np.testing.assert_allclose(logits, reference_scores(models["ce"], pairs, 64, raw=True),
                               atol=1e-5)
    got = activate(logits, s.activation)  # the frontend applies the activation
    want = reference_scores(models["ce"], pairs, 64)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got.std() > 0.05  # the scores tell the documents apart
    cross = CrossEncoder(str(models["ce"]), device="cpu", max_length=64)
    np.testing.assert_allclose(got, cross.predict([(QUERY, t) for t in TEXTS]), atol=1e-5)
    # Token types matter: without them (all zero) the scores differ.
    assert not np.allclose(run(Model(s, torch.device("cpu")),
                               dataclasses.replace(enc, segments=None))[:, 0], logits, atol=1e-4)


@pytest.mark.parametrize("activation,bias", [("torch.nn.modules.linear.Identity", 0.0),
                                             (None, 20.0)])
def test_rerank_scores_as_cross_encoder_for_identity_and_saturated_sigmoid(
        models, tmp_path, activation, bias):
    """An Identity cross-encoder's score is its logit; a sigmoid one with logits past ~17
    scores 1.0 for every pair in float32, as CrossEncoder.predict does, while the logits
    (what TEI's raw_scores gives and what ranks) still tell the pairs apart."""
    from sentence_transformers.cross_encoder import CrossEncoder

    directory = build_tiny_classifier(tmp_path / "ce", num_labels=1, seed=4,
                                      activation=activation, bias=bias)
    s = spec(directory, "rerank")
    assert s.activation == ("identity" if activation else "sigmoid")
    pairs = [(QUERY, t) for t in TEXTS]
    logits = run(Model(s, torch.device("cpu")),
                 TextEncoder(s, truncate=True).encode_pairs(QUERY, TEXTS))[:, 0]
    cross = CrossEncoder(str(directory), device="cpu", max_length=64)
    raw = cross.predict(pairs, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(logits, raw, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(activate(logits, s.activation), cross.predict(pairs),
                               rtol=1e-5, atol=1e-5)
    if bias:
        assert logits.min() > 17 and (activate(logits, s.activation) == 1.0).all()
        assert len(set(logits.tolist())) == len(TEXTS)


@pytest.mark.parametrize("dtype,floor", [("bf16", 0.99), ("fp16", 0.999), ("int8", 0.99)])
def test_reduced_dtypes_stay_close_to_fp32(models, dtype, floor):
    s = spec(models["emb"], "embedding", dtype)
    model = Model(s, torch.device("cpu"))
    assert model.spec.dtype == dtype
    got = run(model, TextEncoder(s, truncate=True).encode(TEXTS))
    want = reference_embeddings(models["emb"], TEXTS, 64)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= floor, cosine


def test_auto_and_int8_dtype_rules(tmp_path):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", cpu) == ("bf16" if cpu_has_bf16() else "fp32")
    assert resolve_dtype("int8", cpu) == "int8"
    with pytest.raises(ModelSourceError, match="int8.*CPU workers only"):
        resolve_dtype("int8", gpu)
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor: 0\nflags\t\t: fpu sse avx512f amx_bf16 avx512_vnni\n")
    assert cpu_has_bf16(flags)
    flags.write_text("processor: 0\nflags\t\t: fpu sse avx2\n")
    assert not cpu_has_bf16(flags)
    assert not cpu_has_bf16(tmp_path / "missing")


@pytest.fixture
def native_bf16(monkeypatch):
    """As on a CPU with AVX512-BF16 or AMX, whatever this one has (bf16 runs everywhere, only
    slower without them), so the auto rule's probe runs on any machine."""
    monkeypatch.setattr("gpu_workers.model.cpu_has_bf16", lambda: True)


@pytest.mark.parametrize("task", ["embedding", "classification", "rerank"])
def test_auto_keeps_bf16_where_the_probe_agrees(models, native_bf16, task):
    directory = {"embedding": "emb", "classification": "clf", "rerank": "ce"}[task]
    model = Model(spec(models[directory], task, "auto", auto_min_cosine=0.9),
                  torch.device("cpu"))
    assert model.spec.dtype == "bf16"
    assert 0.9 <= model.agreement <= 1.0 + 1e-9
    assert {p.dtype for p in model.net.parameters()} == {torch.bfloat16}


def test_auto_serves_fp32_where_the_probe_disagrees(models, native_bf16, caplog):
    s = spec(models["emb"], "embedding", "auto", auto_min_cosine=1.0)  # more than bf16 gives
    model = Model(s, torch.device("cpu"))
    assert model.spec.dtype == "fp32" and model.agreement < 1.0
    assert {p.dtype for p in model.net.parameters()} == {torch.float32}
    assert model.prepacked == 0  # (it logged the bf16 candidate's count: an outside check)
    # The very fp32 weights it loaded, not a round trip through bf16.
    got = run(model, TextEncoder(s, truncate=True).encode(TEXTS))
    np.testing.assert_allclose(got, reference_embeddings(models["emb"], TEXTS, 64), atol=1e-5)
    # one message, its fields saying what was kept (a warning: the candidate was not)
    (said,) = [r for r in caplog.records if r.getMessage() == "model.dtype_auto"]
    assert said.levelname == "WARNING" and said.fields["dtype"] == "fp32", said.fields
    assert said.fields["candidate"] == "bf16" and said.fields["agreement"] < 1.0


def test_auto_without_native_bf16_is_fp32_without_a_probe(models, monkeypatch):
    monkeypatch.setattr("gpu_workers.model.cpu_has_bf16", lambda: False)
    model = Model(spec(models["emb"], "embedding", "auto"), torch.device("cpu"))
    assert model.spec.dtype == "fp32" and model.agreement is None


def test_the_agreement_measure():
    from gpu_workers.parity import agreement

    a = np.array([[1.0, 0.0], [0.6, 0.8]])
    assert agreement(a, a) == pytest.approx(1.0)
    assert agreement(a, np.array([[1.0, 0.0], [0.8, 0.6]])) == pytest.approx(0.96)
    scores = np.array([[2.0], [-4.0]])  # rerank: one score per row
    assert agreement(scores, scores + [[0.0], [0.4]]) == pytest.approx(0.9)
    assert agreement(a, np.array([[np.nan, 0.0], [0.6, 0.8]])) == float("-inf")
    with pytest.raises(ValueError, match="shapes differ"):
        agreement(a, scores)


def test_a_failing_probe_leaves_the_model_serving_fp32(models, native_bf16, monkeypatch):
    def broken(spec):
        raise RuntimeError("no tokenizer")
    monkeypatch.setattr("gpu_workers.parity.probe_batch", broken)
    s = spec(models["emb"], "embedding", "auto")
    model = Model(s, torch.device("cpu"))
    assert model.spec.dtype == "fp32" and model.agreement is None
    assert {p.dtype for p in model.net.parameters()} == {torch.float32}


def test_int8_keeps_the_networks_own_forward(models):
    assert not Model(spec(models["emb"], "embedding", "int8"), torch.device("cpu")).packs


@pytest.mark.parametrize("allowed", [False, True])
def test_a_gpu_worker_sets_cudnn_attention_as_configured(monkeypatch, allowed):
    # No GPU here: pretend one is visible, and check what pick_device leaves set for the
    # attention kernels (workers.cudnn_attention; on a GPU, cuDNN's per-shape plans cost
    # ~50 ms each: docs/performance.md).
    from gpu_workers.device import pick_device

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        torch.backends.cuda.enable_cudnn_sdp(not allowed)
        assert pick_device(1, allowed) == torch.device("cuda", 0)
        assert torch.backends.cuda.cudnn_sdp_enabled() is allowed
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_worker_given_a_gpu_it_cannot_see_refuses_instead_of_using_the_cpu(monkeypatch):
    from gpu_workers.device import DeviceError, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)  # once a process
    with pytest.raises(DeviceError, match=r"workers.devices: this worker was given GPU 3"):
        pick_device(1, gpu="3")
    assert pick_device(1) == torch.device("cpu")  # a CPU worker (cpu, or auto without a GPU)
    assert pick_device(1, gpu="3", fallback=True) == torch.device("cpu")  # cpu_fallback


@pytest.mark.parametrize("key,task", [("emb", "embedding"), ("ce", "rerank")])
def test_the_networks_own_forward_on_a_cpu_sees_few_shapes_and_the_same_results(models, key,
                                                                                task):
    """Models that do not pack run their own forward group by group; on a CPU in bf16 each group
    is padded to one of a few (texts, length) shapes (oneDNN compiles a kernel per shape), and
    the padding changes nothing. In fp32 (MKL's kernels) groups run as they come."""
    rounded = Model(spec(models[key], task, "bf16"), torch.device("cpu"), pack=False)
    exact = Model(spec(models[key], task, "bf16"), torch.device("cpu"), pack=False,
                  bucket=False)
    assert rounded.round_groups and not exact.round_groups
    assert not Model(spec(models[key], task, "fp32"), torch.device("cpu"),
                     pack=False).round_groups
    seen = []
    dense = rounded.net.base_model.encoder.layer[0].intermediate.dense
    hook = dense.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[:2]))
    rng = np.random.default_rng(13)
    try:
        for texts, width in ((1, 1), (3, 17), (9, 20), (13, 50), (2, 64)):
            lengths = rng.integers(1, width + 1, texts)
            lengths[0] = width
            group = (rng.integers(1000, 1100, (texts, width)), lengths,
                     (lengths // 2).astype(np.int64) if task == "rerank" else None)
            got, want = rounded.forward(*group), exact.forward(*group)
            assert got.shape == want.shape == (texts, rounded.spec.dim)
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    finally:
        hook.remove()
    # (texts, length): texts exact to 8 then 10, 12, 14, 16, ...; lengths to a multiple of 16
    # within the model's 64-token limit
    assert seen == [(1, 16), (3, 32), (10, 32), (14, 64), (2, 64)]


@pytest.mark.parametrize("key,task", [("emb", "embedding"), ("clf", "classification"),
                                      ("ce", "rerank")])
def test_the_graph_path_pads_each_group_to_a_few_shapes_and_changes_no_result(models, key,
                                                                              task):
    """workers.cuda_graphs: each group runs padded to a recorded shape through static buffers
    (gpu_workers.graphs). No GPU here, so no graph is recorded: the same buffers and padding
    run eagerly, which is what must give the plain pass's results. Two groups of one shape in
    one pass must not share rows, and shapes past the limit run without a buffer of their own."""
    rng = np.random.default_rng(17)
    groups = []
    for rows, width in ((3, 5), (3, 6), (1, 40), (9, 64), (2, 1), (5, 33)):  # (3,5), (3,6): one
        lengths = rng.integers(1, width + 1, rows)                           # shape (3, 16)
        lengths[0] = width
        segments = (lengths // 2).astype(np.int64) if task == "rerank" else None
        groups.append((rng.integers(1000, 1100, (rows, width)), lengths, segments))
    plain = Model(spec(models[key], task), torch.device("cpu"))
    graphed = Model(spec(models[key], task), torch.device("cpu"), graphs=4)
    assert graphed.graphs is not None and not graphed.graphs.capture
    want = plain.forward_groups(groups)
    for _ in range(2):  # the second time every kept shape is reused
        np.testing.assert_allclose(graphed.forward_groups(groups), want, rtol=1e-4, atol=1e-5)
    shapes = graphed.graphs.entries
    assert len(shapes) == 4 and (3, 16, task == "rerank") in shapes
    assert all(key[1] <= 64 and key[1] % 16 == 0 for key in shapes)  # within the model's limit
    assert graphed.graphs.overflow == 2 * (5 - 4)  # five shapes, four kept


def test_graphs_only_for_models_that_pack(models):
    assert Model(spec(models["emb"], "embedding"), torch.device("cpu"), pack=False,
                 graphs=8).graphs is None
    assert Model(spec(models["emb"], "embedding", "int8"), torch.device("cpu"),
                 graphs=8).graphs is None


def test_warm_up_prepares_the_short_groups_shapes_within_the_limits(models):
    """Recording a graph stalls the worker; warm-up records every shape a group of up to 128
    tokens can take (here the model's limit, 64: lengths 16-64 x 16 text counts up to 32)."""
    from gpu_workers.model import warm_up

    model = Model(spec(models["emb"], "embedding"), torch.device("cpu"), graphs=100)
    warm_up(model, max_batch_size=32, max_batch_tokens=1024)
    shapes = set(model.graphs.entries)
    assert {cols for _, cols, _ in shapes} == {16, 32, 48, 64}
    assert all(rows * cols <= 1024 for rows, cols, _ in shapes)
    assert (32, 32, False) in shapes and (32, 48, False) not in shapes  # 1,536 tokens: too many
    before = len(shapes)
    rng = np.random.default_rng(3)
    model.forward(rng.integers(1000, 1100, (5, 20)), np.full(5, 20))  # (6, 32): prepared
    assert len(model.graphs.entries) == before
    capped = Model(spec(models["emb"], "embedding"), torch.device("cpu"), graphs=10)
    warm_up(capped, max_batch_size=32, max_batch_tokens=1024)
    assert len(capped.graphs.entries) == 10


@pytest.mark.parametrize("pack,dtype", [(True, "fp32"), (False, "fp32"), (True, "bf16"),
                                        (False, "bf16")])
def test_token_rows_are_the_networks_last_hidden_state(models, pack, dtype):
    """TEI's /embed_all: every real token's row, texts in order, from the packed pass or the
    network's own forward (bf16: its groups padded to a few shapes), several groups in one
    call; what transformers' AutoModel gives for each text alone."""
    from transformers import AutoModel

    model = Model(spec(models["emb"], "embedding", dtype), torch.device("cpu"), pack=pack)
    assert model.packs == pack
    enc = TextEncoder(model.spec, truncate=True).encode(TEXTS)
    lengths = np.diff(enc.offsets)
    groups = []
    for members in ([0, 2, 3], [1]):  # two length groups, as a pass may hold
        ids = np.zeros((len(members), int(lengths[members].max())), np.int64)
        for j, i in enumerate(members):
            ids[j, :lengths[i]] = enc.ids[enc.offsets[i]:enc.offsets[i + 1]]
        groups.append((ids, lengths[members], None))
    got = model.forward_groups(groups, tokens=True)
    order = [0, 2, 3, 1]
    assert got.dtype == np.float32 and got.shape == (int(lengths.sum()), model.spec.dim)
    net = AutoModel.from_pretrained(models["emb"]).eval()
    at = 0
    for i in order:
        ids = torch.from_numpy(enc.ids[enc.offsets[i]:enc.offsets[i + 1]].astype(np.int64))
        with torch.inference_mode():
            want = net(input_ids=ids[None]).last_hidden_state[0].numpy()
        tolerance = 1e-5 if dtype == "fp32" else 0.06  # bf16's 8 bits of mantissa
        np.testing.assert_allclose(got[at:at + lengths[i]], want, rtol=0, atol=tolerance)
        at += lengths[i]


@pytest.mark.parametrize("pack", [True, False])
def test_rows_without_the_models_own_normalisation_are_its_pooled_vectors(models, pack):
    """TEI's normalize=false for a model that normalises itself: the pooled vectors as they
    are, from the packed pass or the network's own forward; the default pass still normalises."""
    model = Model(spec(models["emb"], "embedding"), torch.device("cpu"), pack=pack)
    assert model.spec.normalize and model.packs == pack
    enc = TextEncoder(model.spec, truncate=True).encode(TEXTS)
    lengths = np.diff(enc.offsets)
    ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
    for i, (a, b) in enumerate(zip(enc.offsets[:-1], enc.offsets[1:])):
        ids[i, :b - a] = enc.ids[a:b]
    raw = model.forward_groups([(ids, lengths, None)], normalize=False)
    want = reference_embeddings(models["emb"], TEXTS, 64, normalize=False)
    np.testing.assert_allclose(raw, want, rtol=0, atol=1e-5)
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 0.1  # not unit vectors
    np.testing.assert_allclose(model.forward_groups([(ids, lengths, None)]),
                               reference_embeddings(models["emb"], TEXTS, 64), atol=1e-5)


def test_freed_heap_goes_back_to_the_system_after_warm_up_and_a_replaced_model(models,
                                                                                monkeypatch):
    """glibc kept a replaced model's and the warm-up's freed memory: a worker held ~100 MB
    more from its start and ~200 MB more after a hot reload (a soak test; docs/observability.md
    has the figures with and without)."""
    from gpu_workers import device
    from gpu_workers import model as model_module

    calls = []
    monkeypatch.setattr(model_module, "trim_heap", lambda: calls.append(1))
    monkeypatch.setattr(device, "trim_heap", lambda: calls.append(1))
    model = Model(spec(models["emb"], "embedding"), torch.device("cpu"))
    model_module.warm_up(model, max_batch_size=4, max_batch_tokens=256)
    assert calls == [1]
    assert device.release(torch.device("cpu")) is False and calls == [1, 1]


def test_a_cpu_warm_up_runs_one_longest_text_not_the_largest_batch(models, monkeypatch):
    """The largest batch the limits allow prepares a GPU (its allocator's memory, its kernels'
    plans); on a CPU it only cost the start its compute: ~36 s of a BERT-base-sized worker's
    ~56 s to ready in fp32 (an outside check), at every restart and reload. One text of the
    longest input still checks its outputs; the short batch is timed as before."""
    from gpu_workers import model as model_module

    model = Model(spec(models["emb"], "embedding"), torch.device("cpu"))
    shapes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *rest: (shapes.append(ids.shape),
                                                               forward(ids, *rest))[1])
    tokens, seconds = model_module.warm_up(model, max_batch_size=32, max_batch_tokens=1024)
    longest = model.spec.max_tokens
    assert shapes == [(1, 8), (1, longest), (32, 32), (32, 32)]
    assert tokens == 32 * 32 and seconds > 0


@pytest.mark.parametrize("native, emulated, want", [
    (True, True, "bf16"),    # Ampere and later
    (False, True, "fp16"),   # T4, V100: bf16 only emulated; fp16 on the tensor cores
    (False, False, "fp16"),
])
def test_auto_on_a_gpu_takes_bf16_only_where_it_is_native(monkeypatch, native, emulated, want):
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native or (including_emulation and emulated)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == want
    assert resolve_dtype("fp32", torch.device("cuda", 0)) == "fp32"
