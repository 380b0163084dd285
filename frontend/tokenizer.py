"""Texts (or query-document pairs) to one flat int32 token buffer plus offsets, with the model's
fast tokenizer."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding, Tokenizer

from frontend.chunked import Tokenized, tokenized
from frontend.errors import ApiError
from frontend.pieces import CHARS_PER_TOKEN, LONG_MARGIN, counted, cut_piece, head_tokens
from shmserve.model_files import tokenizer
from shmserve.models import ModelSourceError, ModelSpec


@dataclass(frozen=True, slots=True)
class Encoded:
    ids: np.ndarray  # int32 [total tokens]
    offsets: np.ndarray  # int32 [n + 1]
    truncated: int  # texts cut to the model's limit
    segments: np.ndarray | None = None  # int32 [n]: first-segment lengths of pairs (token type 0)
    skip: int = 0  # leading tokens of every text its pooling leaves out (Submit.skip)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def count(self) -> int:
        return int(self.offsets.shape[0]) - 1


class TextEncoder:
    def __init__(self, spec: ModelSpec, truncate: bool) -> None:
        self.max_tokens = spec.max_tokens
        self.truncate = truncate
        self.name = spec.name
        self._directory = spec.directory
        self._tok = self._load(truncate, "right")
        # Ids a client sends must index the model's embedding table too: an id past it failed
        # the forward (500; on a GPU a device-side assert, fatal to the worker).
        self.vocab_size = min(filter(None, (self._tok.get_vocab_size(), spec.vocab_size)))
        self.prompts = dict(spec.prompts)
        self.default_prompt = spec.default_prompt
        # A model whose pooling leaves the prompt out: each prompt's tokens, counted once
        self._skips: dict[str, int] | None = {} if spec.skips_prompt else None
        # A reranker answering yes or no reads a pair inside its prompt (shmserve.yes_no): the
        # prompt's fixed head and tail, tokenized once, and what goes around the query.
        self._asks = spec.pair_format
        if self._asks:
            head, tail = self._tok.encode_batch([self._asks[0], self._asks[3]],
                                                add_special_tokens=False)
            self._around = (head.ids, tail.ids)
            if len(head.ids) + len(tail.ids) >= self.max_tokens:
                raise ModelSourceError(f"model {self.name!r}: its prompt's fixed head and tail "
                                       f"take {len(head.ids) + len(tail.ids)} tokens of its "
                                       f"limit of {self.max_tokens}")
        # Per-request truncation settings (TEI's truncate, truncation_direction), made on first
        # use: a tokenizer's truncation is its state, and requests run concurrently.
        self._variants: dict[tuple[bool, str], Tokenizer] = {(truncate, "right"): self._tok}

    def _variant(self, truncate: bool, direction: str) -> Tokenizer:
        key = (truncate, direction if truncate else "right")
        tok = self._variants.get(key)
        if tok is None:
            tok = self._variants[key] = self._load(*key)
        return tok

    def _load(self, truncate: bool, direction: str) -> Tokenizer:
        try:
            tok = tokenizer(self._directory)
        except ModelSourceError as exc:
            raise ModelSourceError(f"model {self.name!r}: {exc}") from None
        tok.no_padding()
        if truncate:
            tok.enable_truncation(max_length=self.max_tokens, direction=direction)
        else:
            tok.no_truncation()
        return tok

    def encode(self, texts: list[str], param: str = "input", truncate: bool | None = None,
               direction: str = "right", prompt_name: str | None = None) -> Encoded:
        """`prompt_name`: the prompt put before every text (None: the model's default prompt,
        if it has one); the cut to the model's limit comes after, as in sentence-transformers."""
        hint = _hint(truncate)
        truncate = self.truncate if truncate is None else truncate
        tok = self._variant(truncate, direction)
        prompt = self.prompt(prompt_name)
        texts, long = self._pieces(_after(prompt, texts), direction)
        enc = self._flatten(tokenized(tok, texts), param, truncate, hint=hint, long=long)
        if prompt and self._skips is not None:
            if enc.truncated and truncate and direction == "left":
                # named as TEI names it (frontend.cohere renames it on Cohere's routes, the
                # other one that cuts from the left)
                raise ApiError("invalid_request", f"model {self.name!r} pools without its "
                               "prompt's tokens, and a text cut from the left loses them "
                               "first: send it shorter, or truncation_direction right",
                               param="truncation_direction")
            enc = dataclasses.replace(enc, skip=self._prompt_tokens(prompt))
        return enc

    def _prompt_tokens(self, prompt: str) -> int:
        """The leading tokens a model whose pooling leaves the prompt out skips, counted as
        sentence-transformers counts them: the prompt tokenized alone, with the special tokens,
        less a special token at its end (a [CLS] before it is skipped too)."""
        skip = self._skips.get(prompt)
        if skip is None:
            alone = self._tok.encode(prompt, add_special_tokens=True)
            ends_special = bool(alone.special_tokens_mask and alone.special_tokens_mask[-1])
            skip = self._skips[prompt] = len(alone.ids) - ends_special
        return skip

    def prompted(self, texts: list[str], name: str | None) -> list[str]:
        """`texts` as the model reads them: after prompt `name` (see `prompt`)."""
        return _after(self.prompt(name), texts)

    def prompt(self, name: str | None) -> str:
        """The text of prompt `name` (None: the default prompt, "" when there is none; "": no
        prompt, as sentence-transformers' prompt="")."""
        if name is None:
            return self.default_prompt
        if name == "":
            return ""
        text = self.prompts.get(name)
        if text is None:
            have = ", ".join(map(repr, sorted(self.prompts)))
            raise ApiError("invalid_request", f"'prompt_name' {name!r} is not one of model "
                           f"{self.name!r}'s prompts " + (f"({have})" if have else
                                                          "(it has none: models[].prompts)"),
                           param="prompt_name")
        return text

    def encode_pairs(self, query: str, documents: list[str], param: str = "documents",
                     truncate: bool | None = None, direction: str = "right",
                     doc_tokens: int | None = None) -> Encoded:
        """(query, document) pairs as a cross-encoder reads them: [CLS] q [SEP] d [SEP], with
        the pair cut longest-first to the model's limit (as transformers' tokenizers do).
        `truncate` None: limits.truncate. `doc_tokens`: each document cut to as many tokens
        first (Cohere's max_tokens_per_doc)."""
        hint = _hint(truncate)
        truncate = self.truncate if truncate is None else truncate
        if doc_tokens is not None and doc_tokens < self.max_tokens:  # (else the pair's cut is)
            documents = self.cut_documents(documents, doc_tokens)
        if self._asks:
            return self._asked([(query, d) for d in documents], param, truncate, direction,
                               hint)
        query, documents, long = self._pair_pieces(query, documents, direction)
        return self._flatten(tokenized(self._variant(truncate, direction),
                                        [(query, d) for d in documents], pairs=True),
                             param, truncate, pairs=True, hint=hint, long=long)

    def cut_documents(self, documents: list[str], tokens: int) -> list[str]:
        """Each document cut after its first `tokens` tokens (frontend.pieces.head_tokens)."""
        return [head_tokens(self._variant(False, "right"), d, tokens) for d in documents]

    def encode_mixed(self, items: list[str | tuple[str, str]], param: str = "inputs",
                     truncate: bool | None = None, direction: str = "right") -> Encoded:
        """Texts and (first, second) pairs in one request, as TEI's /predict takes them for a
        classifier: a pair as `encode_pairs` reads a query and a document, a text alone as one
        segment (no prompt: prompts are an embedding model's)."""
        if self._asks:
            return self._asked(items, param, self.truncate if truncate is None else truncate,
                               direction, _hint(truncate))
        if not any(isinstance(item, tuple) for item in items):
            return self.encode(items, param, truncate, direction, prompt_name="")
        hint = _hint(truncate)
        truncate = self.truncate if truncate is None else truncate
        cap = self.max_tokens * CHARS_PER_TOKEN
        pieces, long = list(items), set()
        for i, item in enumerate(items):  # only a text far past the limit is replaced
            if isinstance(item, tuple) and max(len(item[0]), len(item[1])) > cap:
                first, (second,), cut = self._pair_pieces(item[0], [item[1]], direction)
                pieces[i] = (first, second)
            elif isinstance(item, str) and len(item) > cap:
                (pieces[i],), cut = self._pieces([item], direction)
            else:
                continue
            if cut:
                long.add(i)
        return self._flatten(tokenized(self._variant(truncate, direction), pieces, pairs=True),
                             param, truncate, hint=hint, long=long)

    def _asked(self, pairs: list, param: str, truncate: bool, direction: str,
               hint: str) -> Encoded:
        """(query, document) pairs as a reranker answering yes or no reads them: each in its
        prompt (the head, the instruction, the query and the document, the tail), the middle
        tokenized alone and cut to what the limit leaves it, as the model card's code does."""
        before, between = self._asks[1], self._asks[2]
        lone = next((i for i, p in enumerate(pairs) if not isinstance(p, tuple)), None)
        if lone is not None:
            raise ApiError("invalid_request", f"'{param}[{lone}]' is a text alone; model "
                           f"{self.name!r} scores (query, document) pairs", param=param)
        head, tail = self._around
        room = self.max_tokens - len(head) - len(tail)
        # A query that fills the prompt's room alone leaves no token of any document: every
        # document scored the same (an outside check). Refused, whatever the truncation.
        counter = self._variant(False, "right")
        cap = max(room, 1) * CHARS_PER_TOKEN  # (a longer query counted from a piece of it)
        for query in dict.fromkeys(q for q, _ in pairs):
            piece = query if len(query) <= cap else cut_piece(query, cap, "right")
            asked = len(counter.encode(before + piece + between, add_special_tokens=False).ids)
            if asked >= room:
                raise ApiError("too_large", f"the instruction and the query take "
                               f"{counted(asked, piece is not query)} of the {room} tokens "
                               f"model {self.name!r}'s prompt leaves them and a document: no "
                               "document would be read; send a shorter query", param=param)
        left = direction == "left"
        if left:  # only the documents are cut from their start: pieces of them alone
            documents, long = self._pieces([d for _, d in pairs], direction)
            middles = [before + q + between + d for (q, _), d in zip(pairs, documents)]
            encodings = self._variant(False, "right").encode_batch(middles,
                                                                   add_special_tokens=False)
        else:
            middles, long = self._pieces([before + q + between + d for q, d in pairs],
                                         direction)
            encodings = self._variant(False, "right").encode_batch_fast(
                middles, add_special_tokens=False)
        rows, truncated = [], 0
        for i, e in enumerate(encodings):
            ids = e.ids
            if len(ids) > room:
                if not truncate:
                    total = counted(len(ids) + len(head) + len(tail), i in long)
                    raise ApiError("too_large", f"{_which(param, i, True)} has {total} tokens "
                                   f"in the model's prompt; the model's limit is "
                                   f"{self.max_tokens} (or {hint})", param=param)
                ids = ids[:room] if not left else _cut_document(e, room, len(middles[i])
                                                                - len(documents[i]))
                truncated += 1
            rows.append(head + ids + tail)
        return _flat(rows, truncated)

    def _pair_pieces(self, query: str, documents: list[str], direction: str
                     ) -> tuple[str, list[str], set[int]]:
        """_pieces for query-document pairs, and the pairs holding a piece. When both sides of
        a pair are past the limit, the longest-first cut gives the shorter side (the query, on
        a tie) half the limit and the longer side the rest, so a piece must keep its side's
        order against the other side where that side is whole: a document's piece stays longer
        than a whole query, a query's piece longer than every whole document. Then the pair is
        cut as the tokenizer cuts the whole texts. Where both sides are pieces (a query and a
        document both past CHARS_PER_TOKEN x the limit), their order is not known without
        tokenizing both whole, and the split between them may be one token off (one token of
        the limit moves from one side to the other)."""
        cap = self.max_tokens * CHARS_PER_TOKEN
        if len(query) <= cap:
            if all(len(d) <= cap for d in documents):
                return query, documents, set()
            documents, long = self._pieces(documents, direction, self._count([query])[0] + 1)
            return query, documents, long
        documents, long = self._pieces(documents, direction)
        whole = [d for i, d in enumerate(documents) if i not in long]
        (query,), cut = self._pieces([query], direction, max(self._count(whole), default=0) + 1)
        return query, documents, set(range(len(documents))) if cut else long

    def _count(self, texts: list[str]) -> list[int]:
        """Tokens in each text, without special tokens, uncut."""
        return tokenized(self._variant(False, "right"), texts, special=False).lengths.tolist()

    def _pieces(self, texts: list[str], direction: str, at_least: int = 0
                ) -> tuple[list[str], set[int]]:
        """`texts` with each one far past the model's limit replaced by a piece of it that
        still holds LONG_MARGIN tokens more than the limit (CHARS_PER_TOKEN), and `at_least`
        tokens, and the indexes so replaced. A text without such a piece is kept whole."""
        cap = self.max_tokens * CHARS_PER_TOKEN
        if max(map(len, texts), default=0) <= cap:  # every ordinary request: no copies
            return texts, set()
        need = max(self.max_tokens + LONG_MARGIN, at_least)
        out, long = list(texts), set()
        pending = [i for i, t in enumerate(texts) if len(t) > cap]
        while pending:
            pieces = [cut_piece(texts[i], cap, direction) for i in pending]
            retry = []
            for i, piece, n in zip(pending, pieces, self._count(pieces)):
                if n >= need:
                    out[i] = piece
                    long.add(i)
                elif len(texts[i]) > cap * 4:
                    retry.append(i)
            pending, cap = retry, cap * 4
        return out, long

    def _flatten(self, got: Tokenized, param: str, truncate: bool, pairs: bool = False,
                 hint: str = "set limits.truncate", long: set[int] = frozenset()) -> Encoded:
        """`got` checked (no text without tokens; none past the limit unless truncated) as the
        worker takes it. `long`: inputs tokenized from a piece (_pieces): their counts are lower
        bounds."""
        lengths = got.lengths
        if lengths.shape[0] == 1:  # the common case, in plain ints (~6 us a request less)
            n = got.ids.shape[0]
            if not n:
                self._no_tokens(param, 0, pairs)
            if not truncate and n > self.max_tokens:
                self._too_long(param, 0, n, pairs, long, hint)
            return Encoded(got.ids, np.array([0, n], np.int32), got.truncated if truncate else 0,
                           got.segments)
        if not lengths.all():
            self._no_tokens(param, int(np.flatnonzero(lengths == 0)[0]), pairs)
        if not truncate:
            over = np.flatnonzero(lengths > self.max_tokens)
            if over.size:
                i = int(over[0])
                self._too_long(param, i, int(lengths[i]), pairs, long, hint)
        offsets = np.zeros(lengths.shape[0] + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return Encoded(got.ids, offsets, got.truncated if truncate else 0, got.segments)

    def _too_long(self, param: str, i: int, n: int, pairs: bool, long: set[int],
                  hint: str) -> None:
        raise ApiError("too_large", f"{_which(param, i, pairs)} has {counted(n, i in long)} "
                       f"tokens; the model's limit is {self.max_tokens} (or {hint})",
                       param=param)

    def _no_tokens(self, param: str, i: int, pairs: bool) -> None:
        """A text that tokenizes to nothing (whitespace, control or zero-width characters, for a
        static model, which adds no special tokens): there is nothing to average."""
        raise ApiError("invalid_request", f"{_which(param, i, pairs)} has no tokens for model "
                       f"{self.name!r}: its tokenizer keeps none of its characters (whitespace, "
                       "control or zero-width characters alone)", param=param)

    def check_ids(self, rows: list[list[int]], param: str, hint: str = "") -> None:
        """422 naming the first row holding an id outside [0, vocab size); `hint`: the
        likeliest cause on the route asking."""
        for i, row in enumerate(rows):
            low, high = min(row), max(row)  # Python ints: no overflow before the check
            if low < 0 or high >= self.vocab_size:
                raise ApiError("invalid_request", f"'{param}[{i}]' holds token id "
                               f"{low if low < 0 else high}; ids must be in [0, "
                               f"{self.vocab_size}) for this model's vocabulary{hint}",
                               param=param)

    def decode(self, rows: list[list[int]], skip_special_tokens: bool = True,
               param: str = "ids") -> list[str]:
        """The text of each row of token ids (TEI's /decode), special tokens skipped or kept."""
        self.check_ids(rows, param)
        return self._tok.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def from_ids(self, rows: list[list[int]], param: str = "input",
                 truncate: bool | None = None, direction: str = "right",
                 hint: str = "") -> Encoded:
        """Token ids a client tokenized itself, as the model's tokenizer gives them for a text:
        framed by the special tokens it puts around every text ([CLS] ... [SEP]), which are
        not added here. A row without them is refused: its vector would be no text's, and
        OpenAI's tiktoken ids that fall inside the vocabulary (langchain-openai's default,
        "hello world") were embedded as other tokens, silently (an outside check).

        Each id must be in [0, vocab size); a row longer than the model's limit is cut to it,
        between its frame as a text's tokens are, or refused with 413 (`truncate` None:
        limits.truncate; `direction`: the end the cut takes ids from). `hint`: check_ids'."""
        self.check_ids(rows, param, hint)
        head, tail = self._frame
        cut = _hint(truncate)
        truncate = self.truncate if truncate is None else truncate
        room = self.max_tokens - len(head) - len(tail)
        truncated = 0
        kept = []
        for i, row in enumerate(rows):
            if len(row) < len(head) + len(tail) or row[:len(head)] != head or (
                    tail and row[-len(tail):] != tail):
                raise ApiError("invalid_request", f"'{param}[{i}]' does not begin with {head} "
                               f"and end with {tail}, the special token ids the tokenizer of "
                               f"model {self.name!r} puts around every text: send ids as it "
                               "gives them for a text (POST /tokenize), else the vector is no "
                               f"text's{hint}", param=param)
            if len(row) == len(head) + len(tail):  # an empty text's ids: refused as "" is
                raise ApiError("invalid_request", f"'{param}[{i}]' holds no token between "
                               f"{head} and {tail}: an empty text, which is refused",
                               param=param)
            if len(row) > self.max_tokens:
                if not truncate:
                    raise ApiError("too_large", f"'{param}[{i}]' has {len(row)} tokens; the "
                                   f"model's limit is {self.max_tokens} (or {cut})",
                                   param=param)
                body = row[len(head):len(row) - len(tail)]
                row = head + (body[len(body) - room:] if direction == "left" else body[:room]) \
                    + tail
                truncated += 1
            kept.append(row)
        return _flat(kept, truncated)

    @functools.cached_property
    def _frame(self) -> tuple[list[int], list[int]]:
        """The special token ids the tokenizer puts before and after a text."""
        framed = self._tok.encode("a", add_special_tokens=True).ids
        bare = self._tok.encode("a", add_special_tokens=False).ids
        for k in range(len(framed) - len(bare) + 1):
            if framed[k:k + len(bare)] == bare:
                return framed[:k], framed[k + len(bare):]
        return [], []  # a tokenizer that changes the text's own ids: nothing to check

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        """Full encodings (tokens, offsets, special-token masks), never truncated."""
        return self._variant(False, "right").encode_batch(texts,
                                                          add_special_tokens=add_special_tokens)


def _flat(rows: list[list[int]], truncated: int) -> Encoded:
    """Rows of token ids as one flat buffer and its offsets."""
    offsets = np.zeros(len(rows) + 1, np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.fromiter((t for r in rows for t in r), np.int32, int(offsets[-1]))
    return Encoded(ids, offsets, truncated)


def _cut_document(encoding: Encoding, room: int, start: int) -> list[int]:
    """`room` of a yes/no prompt's middle ids, the document (from character `start` on) cut
    from its start: the instruction and the query stay, as a cross-encoder's left cut keeps
    its query. (The whole middle's tail was kept, and the query with the instruction went:
    every query scored the same, an outside check.) A middle whose part before the document
    fills the room alone is cut from its end, as the model card cuts it."""
    ids = encoding.ids
    kept = next((k for k, (_, end) in enumerate(encoding.offsets) if end > start), len(ids))
    if kept >= room:
        return ids[:room]
    return ids[:kept] + ids[len(ids) - (room - kept):]


def _hint(asked: bool | None) -> str:
    """How to have a too-long input cut: the request itself said not to, or the server does."""
    return "set limits.truncate" if asked is None else "send truncate: true"


def _which(param: str, i: int, pairs: bool) -> str:
    """The input a too-long error names: a cross-encoder reads the query and a document as
    one input, so either may be the long part."""
    return f"the query with '{param}[{i}]'" if pairs else f"'{param}[{i}]'"


def _after(prompt: str, texts: list[str]) -> list[str]:
    """Each text with `prompt` before it."""
    return [prompt + text for text in texts] if prompt else texts
