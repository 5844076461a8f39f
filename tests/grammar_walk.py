"""Random outputs of a grammar, drawn the way a constrained sampler draws
them: llguidance's mask at every step, a uniformly random allowed token,
until EOS. Test-only (the gateway never imports llguidance); it shows that
the grammars the gateway writes compile and that everything they allow
reads back as intended."""

from __future__ import annotations

import random

import llguidance
import numpy as np


def tokenizer(tokenizer_json: str) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer_json)


def compile_error(tok: llguidance.LLTokenizer, kind: str, text: str) -> str:
    """llguidance's error for a constraint ("" when it compiles)."""
    return llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(kind, text), tok)


def walk(tok: llguidance.LLTokenizer, kind: str, text: str, n: int, seed: int = 0, max_tokens: int = 2000) -> list[str]:
    grammar = llguidance.grammar_from(kind, text)
    rng = random.Random(seed)
    words = (tok.vocab_size + 31) // 32
    outputs = []
    for _ in range(n):
        matcher = llguidance.LLMatcher(tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        tokens = []
        for _ in range(max_tokens):
            mask = np.zeros(words, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:tok.vocab_size]
            token = rng.choice(np.flatnonzero(bits).tolist())
            if token == tok.eos_token:
                break
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        else:
            raise AssertionError(f"no EOS within {max_tokens} tokens")
        outputs.append(tok.decode_str(tokens))
    return outputs
