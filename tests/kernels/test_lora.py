"""llmsched_kernels.lora (multi-LoRA shrink and expand over tokens of mixed adapters)
against llmsched_kernels.reference.lora_shrink / lora_expand, through the Triton
interpreter without CUDA: ranks 8, 16 and 64 in one launch, base-model tokens
interleaved, a batch of base tokens only, token counts that are not a multiple
of the tile, one, two and three parts, fp32, fp16 and bf16. The slot buffers
hold NaN past each adapter's rank, and shrink's output NaN where it is not
defined, so a kernel that read past a rank or a base token's row would fail."""

from __future__ import annotations

import pytest
import torch

from llmsched_kernels import reference

kl = pytest.importorskip("llmsched_kernels.lora")

NAN = float("nan")


def make(num_tokens: int, k: int, part_rows: tuple[int, ...], ranks: list[int], dtype: torch.dtype,
         base_every: int = 3, seed: int = 0, device: str = "cpu"):
    """Slot buffers for adapters of `ranks` (0: an empty slot), NaN past each
    rank; x, a base output y, and token slots round-robin over the adapters
    with every base_every-th token on the base model (0: none).
    Returns x, y, a, b, token_slots, ranks, scales."""
    g = torch.Generator().manual_seed(seed)
    num_slots, max_rank, n = len(ranks), 64, sum(part_rows)
    a = torch.full((num_slots, len(part_rows), max_rank, k), NAN)
    b = torch.full((num_slots, max_rank, n), NAN)
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = torch.randn(len(part_rows), r, k, generator=g) / k**0.5
        b[slot, :r] = torch.randn(r, n, generator=g) / max(r, 1)**0.5
    used = [slot for slot, r in enumerate(ranks) if r]
    slots = torch.tensor([-1 if base_every and t % base_every == base_every - 1 else used[t % len(used)]
                          for t in range(num_tokens)])
    slots = slots[torch.randperm(num_tokens, generator=g)]
    x, y = torch.randn(num_tokens, k, generator=g), torch.randn(num_tokens, n, generator=g)
    scales = torch.tensor([0.5 + slot for slot in range(num_slots)], dtype=torch.float32)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (to(x), to(y), to(a), to(b), slots.to(device), torch.tensor(ranks, dtype=torch.int32, device=device),
            scales.to(device))


def defined(token_slots: torch.Tensor, ranks: torch.Tensor, num_parts: int, max_rank: int) -> torch.Tensor:
    """[num_tokens, num_parts, max_rank] bool: the entries of s shrink defines."""
    r = torch.where(token_slots >= 0, ranks[token_slots.clamp(min=0)].long(), 0)  # [num_tokens]
    return (torch.arange(max_rank, device=r.device) < r[:, None])[:, None, :].expand(-1, num_parts, -1)


def assert_close(got: torch.Tensor, want: torch.Tensor):
    """fp32: to rounding; 16-bit: both sum in fp32 and round once, in another
    order, so one unit in the last place."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), diff.max()
    else:
        ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=1)
        assert (diff <= ulp).all(), diff.max()


def check(num_tokens, k, part_rows, ranks, dtype, base_every=3, device="cpu"):
    x, y, a, b, token_slots, r, scales = make(num_tokens, k, part_rows, ranks, dtype, base_every, device=device)
    order, starts = kl.sort_by_slot(token_slots, len(ranks))
    got_s = kl.lora_shrink(x, a, order, starts, r)
    want_s = reference.lora_shrink(x, a, token_slots, r)
    mask = defined(token_slots, r, len(part_rows), a.shape[2])
    assert_close(got_s[mask], want_s[mask])
    # Expand from the reference's s, NaN where shrink leaves it undefined: never read.
    s = torch.where(mask, want_s, torch.full_like(want_s, NAN))
    got_y = kl.lora_expand(y.clone(), s, b, order, starts, r, scales, part_rows)
    want_y = reference.lora_expand(y, want_s, b, token_slots, r, scales, part_rows)
    assert_close(got_y, want_y)
    base = token_slots < 0
    assert torch.equal(got_y[base], y[base]), "a base-model token's row changed"
    return got_y, y


# (num_tokens, K, part_rows, ranks per slot): BLOCK_M is 16..64, BLOCK_N 32 (fp32) or 64, BLOCK_K 32 or 64.
CASES = {
    "decode_qkv_mixed_ranks": (5, 64, (48, 16, 16), [8, 16, 64]),
    "prefill_qkv_ragged": (37, 72, (40, 24, 24), [64, 0, 8, 16]),  # an empty slot; K and N not whole tiles
    "gate_up_two_parts": (21, 48, (80, 80), [16, 8]),
    "o_proj_one_part": (9, 96, (40,), [64, 8]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_shrink_and_expand_match_the_reference(case, dtype):
    check(*CASES[case], dtype)


def test_one_adapter_s_tokens_span_several_row_tiles():
    """70 tokens, all on one rank-16 adapter: BLOCK_M is 64, so two tiles of
    its run, the second mostly past it."""
    check(70, 32, (32,), [16], torch.float32, base_every=0)


def test_a_batch_of_base_tokens_only_adds_nothing():
    x, y, a, b, token_slots, ranks, scales = make(6, 32, (16, 16), [8, 64], torch.float32)
    token_slots[:] = -1
    order, starts = kl.sort_by_slot(token_slots, 2)
    assert starts.tolist() == [6, 6, 6]
    kl.lora_shrink(x, a, order, starts, ranks)
    s = torch.full((6, 2, 64), NAN)  # shrink writes nothing, and expand reads nothing of it
    got = kl.lora_expand(y.clone(), s, b, order, starts, ranks, scales, (16, 16))
    assert torch.equal(got, y)


def test_sort_by_slot_orders_tokens_slot_by_slot_base_first():
    order, starts = kl.sort_by_slot(torch.tensor([2, -1, 0, 2, -1, 0, 0]), 4)
    assert order.dtype == starts.dtype == torch.int32
    assert order.tolist() == [1, 4, 2, 5, 6, 0, 3] and starts.tolist() == [2, 5, 5, 7, 7]


def test_the_references_are_peft_s_shrink_expand_then_scale():
    """Per slot and part, the reference is (x A^T) B^T * scale, as PEFT computes it."""
    x, y, a, b, token_slots, ranks, scales = make(7, 24, (16, 8), [8, 16], torch.float32)
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    s = reference.lora_shrink(x, a, token_slots, ranks)
    got = reference.lora_expand(y, s, b, token_slots, ranks, scales, (16, 8))
    for t, slot in enumerate(token_slots.tolist()):
        want = y[t] if slot < 0 else y[t] + torch.cat(
            [(x[t] @ a[slot, p].T) @ b[slot, :, cols] for p, cols in enumerate((slice(0, 16), slice(16, 24)))]
        ) * scales[slot]
        assert torch.allclose(got[t], want, atol=1e-5), t


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_shrink_and_expand_on_a_gpu_at_llama_shapes(num_tokens, dtype):
    """Llama-3-8B's q/k/v (4096 -> 4096 + 1024 + 1024) on the real compiler:
    decode and prefill, ranks 8, 16 and 64 and base tokens in one batch."""
    x, y, a, b, token_slots, ranks, scales = make(num_tokens, 4096, (4096, 1024, 1024), [8, 16, 64], dtype,
                                                  device="cuda")
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    order, starts = kl.sort_by_slot(token_slots, 3)
    s = kl.lora_shrink(x, a, order, starts, ranks)
    want_s = reference.lora_shrink(x, a, token_slots, ranks)
    mask = defined(token_slots, ranks, 3, 64)
    assert torch.allclose(s[mask].float(), want_s[mask].float(), rtol=2e-2, atol=2e-2)
    got = kl.lora_expand(y.clone(), want_s, b, order, starts, ranks, scales, (4096, 1024, 1024)).float()
    want = reference.lora_expand(y, want_s, b, token_slots, ranks, scales, (4096, 1024, 1024)).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (got - want).abs().max()
