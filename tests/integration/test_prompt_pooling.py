"""Models whose pooling leaves the prompt's tokens out (sentence-transformers' Pooling with
include_prompt false, as INSTRUCTOR's checkpoints are saved): the frontend counts the prompt's
tokens as sentence-transformers does (Submit.skip) and the worker's pooling skips them, in every
mode, packed or not. Such a model was served without prompts and refused with one."""

import dataclasses

import numpy as np
import pytest
import torch

from frontend.errors import ApiError
from frontend.tokenizer import TextEncoder
from gpu_workers.model import Model
from shmserve.config import ModelConfig
from shmserve.models import incompatible, inspect
from tests.integration.modelkit import run
from tests.integration.test_st_formats import ALL_MODES, corpus_texts, tiny_saved

PROMPT = "Represent the sentence for retrieving supporting documents: "


@pytest.mark.parametrize("pooling", [*ALL_MODES, ALL_MODES])  # each, and all side by side
@pytest.mark.parametrize("pack", [True, False])
def test_pooling_without_the_prompt_serves_sentence_transformers_vectors(tmp_path, pooling,
                                                                         pack):
    from sentence_transformers import SentenceTransformer

    directory = tiny_saved(tmp_path, "m", pooling, include_prompt=False)
    reference = SentenceTransformer(str(directory), device="cpu")
    spec = inspect(ModelConfig(name="m", source=str(directory), dtype="fp32",
                               prompts={"query": PROMPT}), roots=[tmp_path])
    assert spec.skips_prompt and dict(spec.prompts)["query"] == PROMPT
    model = Model(spec, torch.device("cpu"), pack=pack)
    assert (model.packed is not None) == pack
    texts = corpus_texts()
    encoder = TextEncoder(spec, truncate=True)
    enc = encoder.encode(texts, prompt_name="query")
    # [CLS] and the prompt's tokens, not its [SEP]: what sentence-transformers counts
    assert enc.skip == len(reference.tokenizer(PROMPT)["input_ids"]) - 1 > 5
    want = reference.encode(texts, prompt=PROMPT)
    np.testing.assert_allclose(run(model, enc), want, atol=2e-5)
    if pooling != "lasttoken":  # the comparison can fail: pooling every token differs
        every = run(model, dataclasses.replace(enc, skip=0))
        assert not np.allclose(every, want, atol=1e-3)
    # without a prompt nothing is skipped, as sentence-transformers skips nothing
    plain = encoder.encode(texts)
    assert plain.skip == 0
    np.testing.assert_allclose(run(model, plain), reference.encode(texts), atol=2e-5)


def test_a_cut_from_the_left_is_refused_and_a_reload_keeps_the_prompt_pooling(tmp_path):
    """A text cut from the left (TEI's truncation_direction) would lose the prompt's tokens
    first, and the pooling would skip the text's own: refused, naming it. A reload to weights
    that pool the prompt is refused too (the frontends count what the worker skips)."""
    skipping = tiny_saved(tmp_path, "skips", "mean", include_prompt=False)
    pooling = tiny_saved(tmp_path, "pools", "mean")
    spec = inspect(ModelConfig(name="m", source=str(skipping), prompts={"q": PROMPT}),
                   roots=[tmp_path])
    encoder = TextEncoder(spec, truncate=True)
    assert encoder.encode(["short"], prompt_name="q", direction="left").skip > 0
    with pytest.raises(ApiError, match="cut from the left loses them"):
        encoder.encode(["word " * 100], prompt_name="q", direction="left")
    other = inspect(ModelConfig(name="m", source=str(pooling), prompts={"q": PROMPT}),
                    roots=[tmp_path])
    assert not other.skips_prompt
    assert "prompt pooling" in incompatible(spec, other)
    assert incompatible(spec, spec) == ""
