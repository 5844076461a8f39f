"""The FP8 KV cache's oracle on stories260K: the same prompts run with the
cache in float32 (`auto`, greedy) and in FP8, the FP8 run teacher-forced on
auto's tokens, logits compared position by position.

Both runs go through the executor's own parts (the model, its KV pool and
the torch attention backend, which the CPU executor uses): the prompt as
one prefill, then one decode step a token, every step writing its K/V into
the pool and reading the whole context back from it. FP8's rounding may
flip a near tie, so top-1 must agree wherever auto's top-1/top-2 logit gap
is at least MARGIN (1.5 for e4m3), and the share of all positions that
agree is printed and held to a floor. One more test starts both services with an FP8 cache.

    .venv/bin/pytest -q -s tests/integration/test_fp8_kv_cache.py
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.step.kv_cache import MIB, KVCachePool, resolve_kv_cache_dtype
from tests.integration.conftest import start_services
from tests.oracle import STORY_PROMPTS

PROMPTS = STORY_PROMPTS[:8]  # the figures in docs/architecture.md are over these 8
NEW_TOKENS = 120
BLOCK_SIZE = 16
# Per format: auto's top-1 over top-2 by at least this many logits must not
# flip, and the floor on the share of all positions whose top-1 agrees.
# e4m3's is the issue's rule; e5m2 keeps one mantissa bit less, so its
# rounding flips wider gaps (measured figures in docs/architecture.md).
MARGIN = {"fp8_e4m3": 1.5, "fp8_e5m2": 2.5}
AGREEMENT_FLOOR = {"fp8_e4m3": 0.85, "fp8_e5m2": 0.80}  # measured: 0.951, 0.898


@pytest.fixture(scope="module")
def stories_model(stories_path):
    ckpt = load_checkpoint(str(stories_path))
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), torch.float32)
    # One thread: stories260K's ops are tiny, and a thread pool whose threads
    # another process holds waits milliseconds per op (a run took 43 s instead of 3).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, cfg, Tokenizer.from_str(ckpt.tokenizer_json)
    torch.set_num_threads(threads)


def _meta(start: int, num_tokens: int) -> AttentionMetadata:
    """One request whose positions start:start + num_tokens are this step's, in blocks 0, 1, 2, ..."""
    seq_len = start + num_tokens
    num_blocks = -(-seq_len // BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.arange(start, seq_len), cu_query_lens=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], query_lens_host=[num_tokens],
        seq_lens_host=[seq_len])


@torch.inference_mode()
def run(model, cfg, prompt: list[int], kv_cache_dtype: str, forced: list[int] | None,
        num_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of prompt (or, given forced, that continuation fed
    back token by token) through a fresh pool in kv_cache_dtype. Returns the
    tokens and the logits that chose each, [num_tokens, vocab]."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
    pool = KVCachePool(cfg, -(-(len(prompt) + num_tokens) // BLOCK_SIZE), BLOCK_SIZE, torch.device("cpu"), dtype)
    caches, backend = pool.layer_caches(), TorchAttentionBackend()
    tokens, logits = [], []
    step_ids, start = prompt, 0
    for i in range(num_tokens):
        ids = torch.tensor(step_ids)
        hidden = model(ids, torch.arange(start, start + len(step_ids)), caches, _meta(start, len(step_ids)), backend)
        row = model.compute_logits(hidden[-1:])[0]
        logits.append(row)
        tokens.append(forced[i] if forced is not None else int(row.argmax()))
        start += len(step_ids)
        step_ids = [tokens[-1]]
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_agrees_with_auto_teacher_forced_on_stories260k(stories_model, kv_cache_dtype):
    model, cfg, tokenizer = stories_model
    positions = agree = 0
    widest = 0.0  # the largest auto top-1/top-2 gap at a flipped position
    for text in PROMPTS:
        prompt = tokenizer.encode(text).ids
        auto_tokens, auto_logits = run(model, cfg, prompt, "auto", None)
        _, fp8_logits = run(model, cfg, prompt, kv_cache_dtype, auto_tokens)
        top2 = auto_logits.topk(2, dim=-1).values  # [NEW_TOKENS, 2]
        gap = top2[:, 0] - top2[:, 1]
        clear = gap >= MARGIN[kv_cache_dtype]
        same = fp8_logits.argmax(-1) == auto_logits.argmax(-1)
        flipped = (clear & ~same).nonzero().flatten().tolist()
        assert not flipped, (f"{kv_cache_dtype}, {text!r}: top-1 differs at positions {flipped} where auto's "
                             f"top-1/top-2 gap is >= {MARGIN[kv_cache_dtype]}")
        positions += len(same)
        agree += int(same.sum())
        widest = max(widest, float(gap[~same].max()) if (~same).any() else 0.0)
    share = agree / positions
    print(f"\nEXECUTOR_KV_CACHE_DTYPE={kv_cache_dtype} vs auto on stories260K (float32), teacher-forced: top-1 agrees "
          f"at {agree} of {positions} positions ({share:.1%}); the widest gap flipped: {widest:.2f} "
          f"(allowed < {MARGIN[kv_cache_dtype]})")
    assert share >= AGREEMENT_FLOOR[kv_cache_dtype]


def test_both_services_serve_with_an_fp8_cache_of_four_times_float32s_blocks(stories_path):
    env = {"EXECUTOR_KV_CACHE_DTYPE": "fp8_e4m3", "EXECUTOR_KV_CACHE_MEMORY_MB": "5", "EXECUTOR_BLOCK_SIZE": "16",
           "EXECUTOR_DTYPE": "float32"}
    services, client = start_services(str(stories_path), executor_env=env)
    try:
        info = client.info()
        # stories260K keeps K and V x 4 KV heads x 8 dims x 5 layers = 320 values a token:
        # 320 bytes in FP8, 1280 in float32, in blocks of 16 tokens.
        assert info.num_kv_blocks == 5 * MIB // (16 * 320) == 4 * (5 * MIB // (16 * 1280))
        tokens, text, last, _ = client.generate(prompt="Once upon a time",
                                                sampling={"max_tokens": 16, "temperature": 0})
        assert len(tokens) == 16 and text.strip() and last.finish_reason
    finally:
        client.channel.close()
        services.stop()
