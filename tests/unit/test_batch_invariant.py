"""EXECUTOR_BATCH_INVARIANT=on: a canary request's sampled tokens, logprobs
and top logprobs over 256 generated tokens are bitwise the same alone,
among 63 random neighbours in 5 arrival orders, with prompt chunks of 16,
64 and 512, with its prefix cached, and through preemption by recompute and
by swap; with the mode off the same comparison shows a difference on this
host (the negative control), so the tests can tell the two apart.

Run on one torch thread, as the benchmarks are: a thread's share of a GEMM
is part of what the mode keeps invariant (batch_invariant.py), and two
threads on this shared 2-core machine only add waiting.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import TorchAttentionBackend
from executor_svc.config import ExecutorSettings
from executor_svc.loading import check_batch_invariant, load
from executor_svc.model.batch_invariant import ROW_UNIT, linear_rows_invariant
from executor_svc.step.invariance_check import self_test
from llmsched.errors import StartupError
from tests.invariance import (
    CANARY, CANARY_SAMPLING, Preemption, Req, canary_prompt, make_runner, neighbours, run,
)

NEW_TOKENS = 256


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runner_on(stories_path):
    return make_runner(stories_path, invariant=True, host_blocks=64)


@pytest.fixture(scope="module")
def alone(runner_on):
    """The reference: the canary alone, its prompt in one chunk (on one
    thread, like the tests: module fixtures are made before one_thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(runner_on, [canary()], chunk=512)
    finally:
        torch.set_num_threads(before)


def canary(**kw) -> Req:
    return Req(CANARY, canary_prompt(), NEW_TOKENS, CANARY_SAMPLING, **kw)


def first_difference(a: list[tuple], b: list[tuple]) -> str | None:
    assert len(a) == len(b) == NEW_TOKENS
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"generated token {i}: {x} != {y}"
    return None


def arrival_order(order: int) -> list[Req]:
    """The same 63 neighbours (seed 1: prompts up to 200 tokens, up to 48
    generated), arriving in the order'th permutation of their arrival
    steps over the canary's first 120, the canary at a step of its own."""
    reqs = neighbours(63, seed=1, max_arrival=120, max_prompt=200, max_tokens=48)
    rng = random.Random(order)
    steps = [r.arrival for r in reqs]
    rng.shuffle(steps)
    for r, s in zip(reqs, steps):
        r.arrival = s
    rng.shuffle(reqs)
    reqs.insert(rng.randrange(len(reqs) + 1), canary(arrival=rng.choice([0, 5, 40])))
    return reqs


def test_an_fp32_gemm_row_depends_on_the_batch_on_this_host_and_padding_rows_removes_it():
    """What the mode corrects: a row's result changes with the rows beside
    it (1 vs 2-3 vs 4+ rows on the development machine), and with rows
    padded to a multiple of ROW_UNIT it does not."""
    w = torch.randn(192, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    alone_row = F.linear(x[:1], w)[0]
    if all(torch.equal(F.linear(x[:m], w)[0], alone_row) for m in (2, 3, 4, 8)):
        pytest.skip("this host's GEMM gives a row the same bits at every batch size even without padding")
    assert linear_rows_invariant(w, rows=64, unit=1) is not None, "unpadded GEMM rows agreed, though row 0 did not"
    assert linear_rows_invariant(w, rows=64, unit=ROW_UNIT) is None


def test_fixed_split_attention_gives_a_query_the_same_bits_whatever_shares_its_step():
    """The torch backend in fixed-split mode: one query's output alone, among
    other decodes, inside its whole prompt's prefill, in a 16-token chunk,
    and beside other prefills."""
    gen = torch.Generator().manual_seed(0)
    bs, kvh, h, d = 16, 4, 8, 8
    k_cache, v_cache = torch.randn(1200, bs, kvh, d, generator=gen), torch.randn(1200, bs, kvh, d, generator=gen)
    backend = TorchAttentionBackend(fixed_split_tokens=256)

    def attend(reqs):  # (request, query tokens, context): request r owns blocks [40 r, 40 r + 40)
        qs = [torch.randn(700, h, d, generator=torch.Generator().manual_seed(r))[s - q:s] for r, q, s in reqs]
        q_lens, seq_lens = [q for _, q, _ in reqs], [s for _, _, s in reqs]
        meta = AttentionMetadata(torch.zeros(sum(q_lens), dtype=torch.long),
                                 torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32),
                                 torch.stack([torch.arange(40 * r, 40 * r + 40, dtype=torch.int32) for r, _, _ in reqs]),
                                 q_lens, seq_lens)
        out, at = backend.attend(torch.cat(qs), k_cache, v_cache, meta, 0.35), 0
        for (r, q, s) in reqs:
            if r == 0:
                return out[at + q - 1]  # request 0's last query: position s - 1
            at += q

    reference = attend([(0, 1, 300)])
    cases = {
        "among decodes": [(5, 1, 100), (0, 1, 300), (3, 1, 600), *[(9 + i, 1, 50 + 37 * i) for i in range(12)]],
        "its whole prompt": [(0, 300, 300)],
        "a 16-token chunk": [(0, 16, 300)],
        "beside prefills": [(2, 1, 20), (0, 44, 300), (4, 100, 500)],
    }
    for name, reqs in cases.items():
        assert torch.equal(attend(reqs), reference), f"the query's attention differs {name}"


@pytest.mark.parametrize("order", range(5))
def test_canary_is_bitwise_equal_among_63_neighbours_in_5_arrival_orders(runner_on, alone, order):
    diff = first_difference(alone, run(runner_on, arrival_order(order), chunk=64))
    assert diff is None, f"arrival order {order}: the canary among 63 neighbours differs from alone at {diff}"


@pytest.mark.parametrize("chunk", [16, 64, 512])
def test_canary_is_bitwise_equal_whatever_its_prefill_chunk(runner_on, alone, chunk):
    reqs = [canary()] + neighbours(7, seed=2, max_arrival=10)
    diff = first_difference(alone, run(runner_on, reqs, chunk=chunk))
    assert diff is None, f"prompt in chunks of {chunk} (7 neighbours): differs from one chunk alone at {diff}"


def test_canary_is_bitwise_equal_with_its_prefix_cached(runner_on, alone):
    """A first request computes the canary's first 5 blocks (80 of its 100
    prompt tokens) in other company; the canary then starts from them."""
    donor = Req(63, canary_prompt()[:80] + [7, 8, 9], 1, CANARY_SAMPLING)
    first = neighbours(5, seed=3, max_arrival=2)
    run(runner_on, [donor] + first, chunk=48)
    # run() forgets the rows, not the pool: the donor's blocks keep their KV.
    cached = canary(shared_blocks=donor.blocks()[:5])
    cached.computed = 80
    diff = first_difference(alone, run(runner_on, [cached], chunk=64))
    assert diff is None, f"prefix of 80 tokens from the cache: differs from uncached at {diff}"


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_canary_is_bitwise_equal_through_a_preemption(runner_on, alone, swap):
    reqs = [canary()] + neighbours(7, seed=4, max_arrival=100)
    diff = first_difference(alone, run(runner_on, reqs, chunk=64, preempt=Preemption(at_output=100, swap=swap)))
    assert diff is None, f"preempted by {'swap' if swap else 'recompute'} at token 100: differs at {diff}"


def test_negative_control_with_the_mode_off_the_canary_differs_among_neighbours(stories_path):
    """The same comparison with the mode off: at least one difference, or
    this host is invariant anyway and the test says so (skipped)."""
    runner_off = make_runner(stories_path, invariant=False)
    alone_off = run(runner_off, [canary()], chunk=512)
    among = run(runner_off, arrival_order(0), chunk=64)
    if alone_off == among:
        pytest.skip("with EXECUTOR_BATCH_INVARIANT=off the canary is bitwise equal among neighbours anyway: "
                    "this host is batch-invariant without the mode, so the tests above cannot fail here")
    assert first_difference(alone_off, among) is not None


@pytest.mark.parametrize("setting, value, named", [
    ("torch_compile", "on", "EXECUTOR_TORCH_COMPILE"),
    ("speculative_method", "ngram", "EXECUTOR_SPECULATIVE_METHOD"),
    ("tensor_parallel_size", 4, "EXECUTOR_TENSOR_PARALLEL_SIZE"),
])
def test_combinations_the_mode_cannot_keep_invariant_are_refused_by_name(setting, value, named):
    with pytest.raises(StartupError, match=named) as err:
        check_batch_invariant(ExecutorSettings(batch_invariant="on", **{setting: value}))
    assert "EXECUTOR_BATCH_INVARIANT=on" in str(err.value)
    assert check_batch_invariant(ExecutorSettings(**{setting: value})) is False


def test_the_self_test_passes_in_the_mode_and_finds_the_difference_without_it(stories_path):
    assert self_test(make_runner(stories_path, invariant=True, num_requests=8)) is None
    why = self_test(make_runner(stories_path, invariant=False, num_requests=8))
    if why is None:
        pytest.skip("with the mode off the self-test's probe is bitwise equal anyway: this host is invariant")
    assert "differ" in why


def test_start_up_is_refused_by_name_when_the_host_does_not_keep_the_mode(stories_path, monkeypatch):
    """A host whose GEMMs would still depend on the batch, simulated by
    leaving the rows unpadded: load() refuses with one line naming the setting."""
    settings = ExecutorSettings(model=str(stories_path), device="cpu", dtype="float32", block_size=16,
                                num_kv_blocks=128, batch_invariant="on", num_threads=1)
    assert load(settings).runner.batch_invariant
    monkeypatch.setattr("executor_svc.loading.make_batch_invariant", lambda model: 0)
    with pytest.raises(StartupError, match="EXECUTOR_BATCH_INVARIANT=on, but this host does not keep it") as err:
        load(settings)
    assert "\n" not in str(err.value) and "EXECUTOR_BATCH_INVARIANT=off" in str(err.value)


def test_at_tp2_the_canary_is_bitwise_equal_alone_and_among_63_neighbours(stories_path):
    """Two gloo ranks on the CPU, each with half the heads and the MLP: the
    all-reduces sum two terms, the same either way; each rank's GEMMs are
    padded as on one device. load() runs the self-test on both ranks."""
    from tests import tp_ranks

    alone_tp, among_tp = tp_ranks.run_canary_group(str(stories_path), 2)
    assert all(lp is not None for _, lp, _, _ in alone_tp), "rank 0 reported no logprobs"
    diff = first_difference(alone_tp, among_tp)
    assert diff is None, f"at TP=2 the canary among 63 neighbours differs from alone at {diff}"


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen2-moe", "gpt-oss", "qwen3-moe", "deepseek-v3"])
def test_the_self_test_passes_on_families_with_softcaps_windows_sinks_experts_and_latent_attention(
        family, tmp_path):
    """Each family's tiny random checkpoint loads in the mode, so its start-up
    self-test (a 250-token probe alone vs in chunks among others) passed:
    Gemma 2's soft-capped, windowed attention (the explicit-softmax path),
    gpt-oss's sinks, windows and biased experts, Qwen3-MoE's routed experts,
    DeepSeek-V3's latent attention and grouped routing."""
    from tests.families import CASES, make_checkpoint

    directory = make_checkpoint(CASES[family], tmp_path)
    settings = ExecutorSettings(model=str(directory), device="cpu", dtype="float32", block_size=16,
                                num_kv_blocks=128, batch_invariant="on", num_threads=1)
    assert load(settings).runner.batch_invariant
