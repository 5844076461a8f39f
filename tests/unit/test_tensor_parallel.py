"""Tensor parallelism over real gloo groups (one process per rank): greedy
tokens equal one device's and HF transformers', and the logits rank 0
samples from equal one device's within 1e-5 of their scale, at TP=2 and
TP=4 (tiny-random's and the family checkpoints' 2 KV heads are replicated
at TP=4), for Llama and other families, and with a vocabulary that needs
padding."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

from tests import tp_ranks
from tests.families import CASES, FamilyCase, make_checkpoint
from tests.families import hf_greedy as family_hf_greedy
from tests.oracle import hf_greedy
from tests.quantized import write_compressed_tensors, write_fp8, write_gptq

PROMPTS = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309], [1, 50]]
MAX_NEW, CHUNK = 8, 3
# Within 1e-5 of the logits' scale (the row's largest |logit|, at least
# 1): partial sums over ranks add in another fp32 order, and the hidden
# state's rounding moves every logit of a row alike, so stories260K's logits
# (up to ~20) differ by up to ~2e-5 absolute, small ones included.
LOGITS_TOL = 1e-5

ODD_VOCAB = dataclasses.replace(CASES["llama3"], name="llama-vocab-510", config={**CASES["llama3"].config,
                                                                                  "vocab_size": 510})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, str] = {}

    def get(case: FamilyCase) -> str:
        if case.name not in made:
            made[case.name] = str(make_checkpoint(case, tmp_path_factory.mktemp(case.name)))
        return made[case.name]

    return get


@functools.lru_cache(maxsize=8)
def single_device(model: str):
    return tp_ranks.run_group(model, 1, PROMPTS, MAX_NEW, CHUNK)


def assert_same_as_one_device(model: str, size: int):
    tokens, logits, _ = tp_ranks.run_group(model, size, PROMPTS, MAX_NEW, CHUNK)
    want_tokens, want_logits, _ = single_device(model)
    assert tokens == want_tokens, f"TP={size} greedy tokens differ from TP=1"
    assert len(logits) == len(want_logits)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert got.shape == want.shape, f"step {step}: logits shape {got.shape} at TP={size}, {want.shape} at TP=1"
        scale = np.maximum(1.0, np.abs(want).max(axis=1, keepdims=True))  # [rows, 1]
        excess = np.abs(got - want) - LOGITS_TOL * scale
        i = np.unravel_index(int(excess.argmax()), excess.shape)
        assert excess[i] <= 0, (f"step {step}: logit {i} is {got[i]:.7f} at TP={size}, {want[i]:.7f} at TP=1, "
                                f"more than {LOGITS_TOL} x {float(scale[i[0], 0]):.2f} (the row's largest |logit|) apart")
    return tokens


@pytest.mark.parametrize("model,size", [("stories", 2), ("stories", 4), ("tiny-random", 2),
                                        pytest.param("tiny-random", 4, marks=pytest.mark.slow)])
def test_llama_greedy_tokens_and_logits_equal_one_device_and_hf(model, size, stories_path):
    name = str(stories_path) if model == "stories" else model
    tokens = assert_same_as_one_device(name, size)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_greedy(name, prompt, MAX_NEW, ignore_eos=True), f"TP={size} differs from HF on {prompt}"


@pytest.mark.parametrize("family,size", [("phi3", 2), ("gemma2", 4), pytest.param("qwen3", 2, marks=pytest.mark.slow),
                                         ("qwen3-moe", 2), ("gpt-oss", 2), ("deepseek-v3", 2)])
def test_other_families_equal_one_device_and_hf(family, size, checkpoints):
    """Phi-3's fused q/k/v and gate/up are split per rank without reading
    the rest; Gemma 2's softcaps and embedding scale, at TP=4 with its 2 KV
    heads replicated; Qwen 3's per-head q/k norms; experts split along
    their intermediate units (Qwen3-MoE), with gpt-oss's interleaved gate/up,
    per-head sinks and biases counted once; DeepSeek-V3's MLA heads split
    over ranks with the latent replicated."""
    path = checkpoints(CASES[family])
    tokens = assert_same_as_one_device(path, size)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == family_hf_greedy(path, prompt, MAX_NEW).tokens, f"{family} TP={size} differs from HF"


@pytest.mark.parametrize("family, block", [("llama3", (16, 16)), ("deepseek-v3", (8, 8))])
def test_fp8_block_checkpoint_at_tp2_equals_one_device_and_hf(family, block, checkpoints, tmp_path):
    """Each rank reads its rows (q/k/v, gate/up, q_b/kv_b) or columns (o,
    down) of every FP8 weight and of its grid of block scales; DeepSeek-V3's
    experts split by units, its latent projections replicated."""
    path = str(write_fp8(Path(checkpoints(CASES[family])), tmp_path / "fp8", block))
    tokens = assert_same_as_one_device(path, 2)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == family_hf_greedy(path, prompt, MAX_NEW).tokens, f"{family} FP8 TP=2 differs from HF"


@pytest.mark.parametrize("fmt", ["compressed-tensors-w4a16", "gptq-act-order"])
def test_w4a16_checkpoint_at_tp2_equals_one_device_and_hf(fmt, checkpoints, tmp_path):
    """Each rank unpacks its rows (q/k/v, gate/up) or columns (o, down) of
    the packed weights with their groups' scales and zero points; with
    act-order, every rank keeps every group and its columns' g_idx."""
    plain = Path(checkpoints(CASES["llama3"]))
    if fmt == "gptq-act-order":
        path, oracle = (str(p) for p in write_gptq(plain, tmp_path / "q", tmp_path / "dense", 4, 32, False, True))
    else:
        args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
        path = oracle = str(write_compressed_tensors(plain, tmp_path / "q", args))
    tokens = assert_same_as_one_device(path, 2)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == family_hf_greedy(oracle, prompt, MAX_NEW).tokens, f"{fmt} TP=2 differs from HF"


def test_ngram_speculation_at_tp2_equals_hf(stories_path):
    """Both ranks propose the same drafts from the same tokens; rank 0
    draws at every verified position and shares the draws, so both accept
    alike: greedy tokens equal HF's, in fewer steps than tokens."""
    max_new = 24
    tokens, _, steps = tp_ranks.run_group(str(stories_path), 2, PROMPTS, max_new, CHUNK, drafts=3)
    for prompt, got in zip(PROMPTS, tokens):
        assert got[:max_new] == hf_greedy(str(stories_path), prompt, max_new, ignore_eos=True), prompt
    prefill_steps = -(-max(len(p) for p in PROMPTS) // CHUNK)
    assert steps < prefill_steps + max_new, f"{steps} steps: no draft was ever accepted"


def test_padded_vocabulary_is_never_sampled(checkpoints):
    """510 tokens over 4 ranks: the last rank holds 2 zero padding rows;
    rank 0 cuts them off, so logits have 510 columns and tokens match."""
    path = checkpoints(ODD_VOCAB)
    assert_same_as_one_device(path, 4)
    _, logits, _ = single_device(path)
    assert logits[0].shape[1] == 510
