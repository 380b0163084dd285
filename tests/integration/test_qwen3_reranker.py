"""A reranker that is a Qwen3 causal LM answering yes or no (Qwen3-Reranker: shmserve.yes_no):
served as a cross-encoder whose score is the model card's, P(yes) over "yes" and "no" at the
last token of the pair's prompt, built and run packed without transformers."""

import json
import shutil

import numpy as np
import pytest
import torch

from frontend.errors import ApiError
from frontend.tokenizer import TextEncoder
from gpu_workers.model import Model
from shmserve.models import ModelSourceError, incompatible
from tests.integration.modelkit import edited, fresh_loads, run, spec
from tests.tinymodel import (build_tiny_bert, build_tiny_yes_no_reranker,
                              reference_yes_no_scores)

QUERY = "what moves token ids between processes?"
DOCUMENTS = ["Shared memory moves token ids between processes without copies.", "hello",
             "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-reranker")
    return {"tied": build_tiny_yes_no_reranker(root / "tied", tied=True, seed=1),
            "untied": build_tiny_yes_no_reranker(root / "untied", tied=False, seed=2)}


def served_scores(served, query, documents, truncate=True):
    encoder = TextEncoder(served, truncate=truncate)
    enc = encoder.encode_pairs(query, documents)
    logits = run(Model(served, torch.device("cpu")), enc)[:, 0]
    return 1 / (1 + np.exp(-logits)), enc


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_scores_are_the_model_cards(models, name):
    """Its packed pass, its prompt and its score against the model card's code run on
    transformers' Qwen3ForCausalLM: the same P(yes) in fp32, whether the head is tied to the
    token embeddings (0.6B, 4B) or saved (8B)."""
    served = spec(models[name], "rerank")
    assert served.activation == "sigmoid" and served.dim == 1 and len(served.answers) == 2
    scores, _ = served_scores(served, QUERY, DOCUMENTS)
    want = reference_yes_no_scores(models[name], QUERY, DOCUMENTS, 512)
    np.testing.assert_allclose(scores, want, rtol=0, atol=1e-5)
    assert Model(served, torch.device("cpu")).packs


def test_the_instruction_is_configured_and_goes_in_the_prompt(models):
    directory = models["tied"]
    asked = "Given a question, find the passage that answers it"
    served = spec(directory, "rerank", instruction=asked)
    scores, _ = served_scores(served, QUERY, DOCUMENTS)
    np.testing.assert_allclose(
        scores, reference_yes_no_scores(directory, QUERY, DOCUMENTS, 512, asked), rtol=0, atol=1e-5)
    default, _ = served_scores(spec(directory, "rerank"), QUERY, DOCUMENTS)
    assert not np.allclose(scores, default, atol=1e-4)
    # a reload must not change how the running frontends build the prompt
    assert "pair prompt" in incompatible(spec(directory, "rerank"), served)


def test_a_long_pair_is_cut_in_its_middle_or_refused(models):
    """The middle (instruction, query, document) is cut to what the prompt's head and tail
    leave of the limit, as the model card cuts it, so the prompt's end (where the answer is
    read) stays; without truncation, a 413 naming the limit."""
    directory = models["tied"]
    served = spec(directory, "rerank", max_input_tokens=120)
    long = ["word " * 300, "a short one"]
    scores, enc = served_scores(served, QUERY, long)
    assert enc.truncated == 1 and int(np.diff(enc.offsets).max()) == 120
    np.testing.assert_allclose(scores, reference_yes_no_scores(directory, QUERY, long, 120),
                               rtol=0, atol=1e-5)
    with pytest.raises(ApiError, match=r"the query with 'documents\[0\]' has at least \d+ "
                                       r"tokens in the model's prompt; the model's limit is 120"):
        TextEncoder(served, truncate=False).encode_pairs(QUERY, long)
    with pytest.raises(ModelSourceError, match="fixed head and tail take"):
        TextEncoder(spec(directory, "rerank", max_input_tokens=40), truncate=True)


def test_texts_alone_are_refused(models):
    encoder = TextEncoder(spec(models["tied"], "rerank"), truncate=True)
    with pytest.raises(ApiError, match=r"'inputs\[1\]' is a text alone"):
        encoder.encode_mixed([(QUERY, "a document"), "a text"])
    pairs = encoder.encode_mixed([(QUERY, "a document")])
    assert np.array_equal(pairs.ids, encoder.encode_pairs(QUERY, ["a document"]).ids)


def test_what_it_cannot_read_is_refused_with_a_reason(models, tmp_path):
    directory = models["untied"]
    with pytest.raises(ModelSourceError, match="an instruction is read by a reranker"):
        spec(build_tiny_bert(tmp_path / "bert"), "embedding", instruction="find it")
    no_head = edited(directory, tmp_path, "no-head",
                     tensors=lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    with pytest.raises(ModelSourceError, match="no lm_head.weight"):
        Model(spec(no_head, "rerank"), torch.device("cpu"))
    window = edited(directory, tmp_path, "window",
                    config={"use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(ModelSourceError, match="served only as plain Qwen3"):
        Model(spec(window, "rerank"), torch.device("cpu"))
    answerless = shutil.copytree(directory, tmp_path / "answerless")
    tokenizer = json.loads((answerless / "tokenizer.json").read_text())
    del tokenizer["model"]["vocab"]["yes"]
    (answerless / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelSourceError, match="lacks 'yes'"):
        spec(answerless, "rerank")


def test_its_score_row_stays_float32_in_bf16(models):
    """The network's weights in bf16 and its one-row head in float32 (as every task's head):
    the scores stay within what bf16 weights make of them."""
    served = spec(models["tied"], "rerank", dtype="bf16")
    model = Model(served, torch.device("cpu"))
    assert next(model.net.parameters()).dtype == torch.bfloat16
    assert model.net.score.dtype == torch.float32
    scores, _ = served_scores(served, QUERY, DOCUMENTS)
    fp32, _ = served_scores(spec(models["tied"], "rerank"), QUERY, DOCUMENTS)
    np.testing.assert_allclose(scores, fp32, atol=0.02)


def test_loading_it_never_imports_transformers(models):
    loaded, transformers_imported, _ = fresh_loads([("tied", "rerank", models["tied"])])
    assert [loader for _, _, loader in loaded] == ["shmserve"]
    assert not transformers_imported


def test_a_left_cut_takes_the_documents_start_and_keeps_the_query(models):
    """TEI's truncation_direction Left on a yes/no reranker: the document loses its start, the
    instruction and the query stay (the middle's tail was kept, and every query scored the
    same: an outside check)."""
    served = spec(models["tied"], "rerank", max_input_tokens=120)
    encoder = TextEncoder(served, truncate=True)
    model = Model(served, torch.device("cpu"))
    document = "alpha " * 300 + "omega " * 300
    scores = {}
    for query in ("fruit", "vegetable"):
        enc = encoder.encode_pairs(query, [document], direction="left")
        assert enc.truncated == 1 and enc.tokens == 120
        text = encoder.decode([enc.ids.tolist()])[0]
        assert f"query > : {query}" in text and "omega" in text and "alpha" not in text, text
        assert text.endswith("< / think >"), text  # the tail, where the answer is read
        scores[query] = run(model, enc)[0, 0]
    assert scores["fruit"] != scores["vegetable"]


def test_a_query_that_leaves_no_room_for_a_document_is_refused(models):
    """Cut to the limit, a query that fills the prompt's room alone left every document out:
    all scored the same (an outside check). Refused, whatever the truncation."""
    encoder = TextEncoder(spec(models["tied"], "rerank", max_input_tokens=120), truncate=True)
    for query in ("river " * 1000, "river " * 60):  # past a piece's length, and within it
        for direction in ("right", "left"):
            with pytest.raises(ApiError, match="no document would be read"):
                encoder.encode_pairs(query, ["doc one", "another document"],
                                     direction=direction)
    assert encoder.encode_pairs("river " * 5, ["doc one"]).count == 1
