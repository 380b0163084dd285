"""A text much longer than a model reads, tokenized from a piece of it (frontend.tokenizer)."""

from __future__ import annotations

# A text much longer than the model reads is tokenized from a piece of it: about this many
# characters a token of the model's limit (a suffix when the cut is from the left), cut at a
# whitespace, and grown x4 until it holds LONG_MARGIN tokens past the limit. The tokenizer's
# time and memory then follow the model's limit, not the text's length (a request of 80 texts
# of 100,000 characters took 6 s of a frontend's CPU and 200 MB it kept), and what the model
# reads is the same: tokens are made word by word, and the words past the piece are cut anyway.
CHARS_PER_TOKEN = 8
LONG_MARGIN = 16
WHITESPACE_WINDOW = 128  # how far back (forward, from the left) a cut looks for whitespace


def cut_piece(text: str, cap: int, direction: str) -> str:
    """About `cap` characters of `text` from the end the model reads (the start, or with a
    left cut the end), cut at a whitespace when one is near."""
    if direction == "left":
        start = len(text) - cap
        for k in range(start, min(start + WHITESPACE_WINDOW, len(text))):
            if text[k].isspace():
                return text[k:]
        return text[start:]
    for k in range(cap, max(cap - WHITESPACE_WINDOW, 0), -1):
        if text[k].isspace():
            return text[:k]
    return text[:cap]


def head_tokens(tokenizer, text: str, tokens: int) -> str:
    """`text` cut after its first `tokens` tokens, tokenized alone without the special tokens
    by `tokenizer` (one that does not truncate), from its head only (CHARS_PER_TOKEN a token,
    at most; the whole text where the head holds too few: tokens of more characters); a
    shorter text as it is. Cohere's max_tokens_per_doc (frontend.scores.rerank)."""
    cap = (tokens + 1) * CHARS_PER_TOKEN
    offsets = tokenizer.encode(text[:cap], add_special_tokens=False).offsets
    if len(offsets) <= tokens < len(offsets) + len(text) - cap:
        offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    return text[:offsets[tokens - 1][1]] if len(offsets) > tokens else text


def counted(n: int, lower_bound: bool) -> str:
    """A long text is counted only as far as it passes the limit (Encoder._pieces)."""
    return f"at least {n}" if lower_bound else str(n)
