"""Rerankers that are causal language models answering "yes" or "no" (Qwen3-Reranker).

Such a model is saved as a causal LM (`Qwen3ForCausalLM`), not a sequence classifier. Its
model card scores a (query, document) pair by putting it in a chat prompt that asks whether
the document meets the query, and reading the next token's logits for "yes" and "no":

    score = exp(yes) / (exp(yes) + exp(no)) = sigmoid(yes - no)

So it is served as a cross-encoder with one logit, `yes - no` (the difference of the two rows
of its vocabulary head: gpu_workers.qwen3), under a sigmoid; the frontend builds the prompt
(frontend.tokenizer). PREFIX, SUFFIX and the instruction are the model card's.
"""

from __future__ import annotations

from pathlib import Path

from shmserve.model_files import ModelSourceError, tokenizer

ARCHITECTURES = ("Qwen3ForCausalLM",)

PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the '
          'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
          '<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                       "query")


def applies(task: str, model_cfg: dict) -> bool:
    """Whether a rerank model's checkpoint is a causal LM read this way."""
    architectures = [str(a) for a in model_cfg.get("architectures") or []]
    return task == "rerank" and any(a in ARCHITECTURES for a in architectures)


def answer_tokens(directory: Path) -> tuple[int, int]:
    """The ids of the tokens "yes" and "no" in the model's vocabulary (its tokenizer's
    `convert_tokens_to_ids`)."""
    tok = tokenizer(directory)
    ids = tok.token_to_id("yes"), tok.token_to_id("no")
    if None in ids:
        lacking = " and ".join(repr(t) for t, i in zip(("yes", "no"), ids) if i is None)
        raise ModelSourceError(f"{directory}: a yes/no reranker reads the logits of the "
                               f"tokens 'yes' and 'no'; tokenizer.json lacks {lacking}")
    return ids


def pair_format(instruction: str) -> tuple[str, str, str, str]:
    """(prefix, before the query, between query and document, suffix): a pair is read as
    prefix + before + query + between + document + suffix, the prefix and suffix tokenized
    alone and the middle cut to fit the model's limit, as the model card does."""
    return (PREFIX, f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: ",
            "\n<Document>: ", SUFFIX)
