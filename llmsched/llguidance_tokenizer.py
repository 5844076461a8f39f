"""llguidance's view of a model's tokenizer, shared by the scheduler (which
checks constraints against it) and the executor (whose matchers mask
logits with it)."""

from __future__ import annotations

import llguidance


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """From the contents of a tokenizer.json, with the model's EOS ids. Masks
    are as wide as the larger of the model's vocabulary (its logits may be
    padded past the tokenizer's) and the tokenizer's (a checkpoint may
    declare fewer rows than its tokenizer has tokens; those ids are never
    sampled)."""
    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_token_ids))
    if tokenizer.vocab_size < vocab_size:
        tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    return tokenizer
