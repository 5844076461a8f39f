"""HF transformers as the greedy-decoding oracle, on the very same weights
the executor loads (a checkpoint directory or a built-in model)."""

from __future__ import annotations

import functools

import torch

# Story openings stories260K continues (the oracle tests' prompts).
STORY_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day, a big bird",
    "Sam had a red ball.",
    "The sun was hot and",
    "Mom said",
    "There was a cat who liked to",
    "Tim wanted to play with his friend, but",
]


@functools.lru_cache(maxsize=4)
def hf_model(model: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.baselines import hf_builtin
    from executor_svc.model.builtin import BUILTIN_MODELS
    from executor_svc.model.checkpoint import load_checkpoint

    if model in BUILTIN_MODELS:
        return hf_builtin(model).eval()
    ckpt = load_checkpoint(model)
    cfg = LlamaConfig(**ckpt.hf_config)
    hf = LlamaForCausalLM(cfg)
    missing, unexpected = hf.load_state_dict(ckpt.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


# model, prompt, ignore_eos -> (the longest continuation computed, the
# max_new_tokens it was computed for). Greedy decoding is prefix-stable: the
# first n tokens of a longer run are the n-token run, and a run that ended
# early ended at EOS, so it answers every longer request too.
_GREEDY: dict[tuple[str, tuple[int, ...], bool], tuple[list[int], int]] = {}


def hf_greedy(model: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy continuation as HF generate(do_sample=False) produces it, EOS
    included when it stops there. Runs HF once per prompt and length: a
    shorter request for the same prompt is served from the longer run."""
    key = (model, tuple(prompt_ids), ignore_eos)
    if key in _GREEDY:
        tokens, computed_for = _GREEDY[key]
        if max_new_tokens <= computed_for or len(tokens) < computed_for:
            return tokens[:max_new_tokens]
    tokens = _hf_generate(model, prompt_ids, max_new_tokens, ignore_eos)
    _GREEDY[key] = (tokens, max_new_tokens)
    return list(tokens)


def hf_greedy_penalised(model: str, prompt_ids: list[int], max_new_tokens: int, repetition_penalty: float,
                        ignore_eos: bool = False) -> list[int]:
    """Greedy continuation with HF's repetition penalty, as
    generate(repetition_penalty=..., do_sample=False) produces it."""
    return _hf_generate(model, prompt_ids, max_new_tokens, ignore_eos, repetition_penalty=repetition_penalty)


def _hf_generate(model: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool, **extra) -> list[int]:
    hf = hf_model(model)
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    kwargs.update(extra)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt_ids):].tolist()
