"""The benchmark's own counting: a locust window's texts/s must be its requests/s times the
texts each request carried (an earlier version counted the ramp-up's and the last second's
texts against a request count that had neither, and overstated texts/s by up to a fifth)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.stack import REPO, corpus_path

sys.path.insert(0, str(REPO / "scripts"))

benchkit = pytest.importorskip("benchkit")


@pytest.fixture(scope="module")
def short_corpus(tmp_path_factory):
    """Corpus sentences that fit the tiny model's 64 tokens (it does not truncate)."""
    path = tmp_path_factory.mktemp("corpus") / "short.json"
    path.write_text(json.dumps([t for t in json.loads(corpus_path().read_text())
                                if len(t) <= 80]))
    return path


@pytest.mark.parametrize("texts,api", [("1", "openai"), ("4", "msgpack")])
def test_locust_window_counts_texts_per_request_exactly(tiny_stack, short_corpus, texts, api):
    window = benchkit.locust_window(tiny_stack.url, benchkit.Scenario("w", 8, texts, api=api),
                                    3, short_corpus)
    assert window["failures"] == 0 and window["requests"] > 50
    assert window["texts_per_s"] == pytest.approx(window["requests_per_s"] * int(texts),
                                                  rel=1e-9)


@pytest.mark.parametrize("api", ["openai", "msgpack"])
def test_error_answers_count_as_failures_in_either_api(tiny_stack, short_corpus, monkeypatch,
                                                       api):
    # A model the stack does not serve: every answer is a 404. In msgpack, locust's HTTP
    # client decoded the error body as UTF-8 to describe it and raised, so nothing was counted.
    monkeypatch.setenv("SHMSERVE_BENCH_MODEL", "no-such-model")
    # 3 s: at 2, three test processes on two cores once left locust no request inside the
    # window its stats count (they restart once every user is spawned).
    window = benchkit.locust_window(tiny_stack.url, benchkit.Scenario("w", 4, "1", api=api),
                                    3, short_corpus)
    assert window["requests"] > 20 and window["failures"] == window["requests"]


def test_parity_compares_the_served_model_with_its_own_weights(tiny_stack, tiny_model,
                                                                short_corpus):
    """bench.py's parity check took all-MiniLM-L6-v2 as the reference whatever was served:
    another model's rows (32 wide here) failed it with a shape error (an outside check)."""
    import benchparity
    from shmserve import config

    cfg = config.load(env="test", extra=tiny_stack.config_file)
    reference = benchparity.parity_reference(cfg, cfg.models[0].name)
    assert reference == tiny_model
    texts = json.loads(short_corpus.read_text())[:40]
    assert benchparity.min_cosine_to_fp32(tiny_stack.url, texts, reference) > 0.999
    with pytest.raises(ValueError, match="not the local config's first model"):
        benchparity.parity_reference(cfg, "some-other-model")
    assert benchparity.parity_reference(cfg, "all-MiniLM-L6-v2") is None  # the default's package
    with pytest.raises(ValueError, match="no modules.json"):
        benchparity.min_cosine_to_fp32(tiny_stack.url, texts, tiny_model.parent)
