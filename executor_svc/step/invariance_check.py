"""The start-up self-test of EXECUTOR_BATCH_INVARIANT=on: does this host,
with this model's own shapes, keep a request's logits independent of its
batch?

The mode rests on measured behaviour (batch_invariant.py: the CPU BLAS's
wide kernel from 4 rows on; the attention kernels' fixed shapes), which
another CPU, BLAS or GPU need not share. So before serving, the runner
computes a probe prompt twice: alone, its prompt in one chunk, then two
decode steps; and again in three uneven chunks beside three other
requests (one prefilling, two decoding, of other lengths), then the same
decode steps beside them. Every prompt position's top logprobs and each
generated token's must agree bitwise. A difference refuses start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor_svc.step.runner import ModelRunner, NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings

# Greedy, top 5 logprobs of every prompt position and generated token.
PROBE_SAMPLING = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=5, prompt_logprobs=5)
NEIGHBOUR_SAMPLING = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
# The probe's prompt: long enough for two attention pieces where the model allows.
PROBE_TOKENS = 300
DECODE_STEPS = 2
PROBE, FIRST_NEIGHBOUR = 1, 2


@dataclass(slots=True)
class _Layout:
    """Blocks and lengths for the probe and its three neighbours, within the pool and max_model_len."""

    length: int  # the probe's prompt
    neighbours: list[int]  # the neighbours' prompts
    blocks: list[list[int]]  # per request (probe first)


def _layout(runner: ModelRunner) -> _Layout | None:
    block_size, num_blocks = runner.pool.block_size, runner.pool.num_blocks
    # Four requests, each up to its prompt plus the decode steps, in a quarter of the pool.
    # Each request's prompt and the tokens it generates here (at most 1 + 3 chunk steps + the decode steps).
    extra = 4 + DECODE_STEPS
    per_request = min(runner.max_model_len - extra, num_blocks // 4 * block_size - extra)
    length = min(PROBE_TOKENS, per_request)
    if length < 4:
        return None
    neighbours = [max(2, length * 3 // 4), max(2, length // 3), max(2, length // 2 + 3)]
    blocks_each = -(-(length + extra) // block_size)
    return _Layout(length, [min(n, length) for n in neighbours],
                   [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(4)])


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _probe_alone(runner: ModelRunner, lay: _Layout, prompt: list[int]) -> list:
    seen = []
    res = runner.execute(StepPlan(0, [NewRequestData(PROBE, prompt, lay.blocks[0], 0, len(prompt), PROBE_SAMPLING, 0)]))
    seen += _observed(res)
    for i in range(DECODE_STEPS):
        seen += _observed(runner.execute(StepPlan(1 + i, cached_handles=[PROBE], cached_num_scheduled_tokens=[1])))
    runner.execute(StepPlan(1 + DECODE_STEPS, finished_handles=[PROBE]))
    return seen


def _probe_among(runner: ModelRunner, lay: _Layout, prompt: list[int]) -> list:
    vocab = runner.vocab_size
    others = [_tokens(n, vocab, 100 + i) for i, n in enumerate(lay.neighbours)]
    # Two neighbours prefill in one step first, and then decode beside the probe.
    plan = StepPlan(10, [NewRequestData(FIRST_NEIGHBOUR + i, others[i], lay.blocks[1 + i], 0, len(others[i]),
                                        NEIGHBOUR_SAMPLING, 0) for i in (0, 1)])
    runner.execute(plan)
    cuts = sorted({0, max(1, len(prompt) // 5), max(2, len(prompt) * 3 // 5), len(prompt)})
    seen, step = [], 11
    decoding = [FIRST_NEIGHBOUR, FIRST_NEIGHBOUR + 1]
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        plan = StepPlan(step, cached_handles=list(decoding), cached_num_scheduled_tokens=[1] * len(decoding))
        if j == 0:
            plan.new_requests.append(NewRequestData(PROBE, prompt, lay.blocks[0], 0, b - a, PROBE_SAMPLING, 0))
        else:
            plan.cached_handles.append(PROBE)
            plan.cached_num_scheduled_tokens.append(b - a)
        if j == 1:  # the third neighbour's whole prompt in the same step as a probe chunk
            third = FIRST_NEIGHBOUR + 2
            plan.new_requests.append(NewRequestData(third, others[2], lay.blocks[3], 0, len(others[2]),
                                                    NEIGHBOUR_SAMPLING, 0))
        seen += _observed(runner.execute(plan), PROBE)
        step += 1
    for _ in range(DECODE_STEPS):
        plan = StepPlan(step, cached_handles=[PROBE, *decoding], cached_num_scheduled_tokens=[1] * (1 + len(decoding)))
        seen += _observed(runner.execute(plan), PROBE)
        step += 1
    runner.execute(StepPlan(step, finished_handles=[PROBE, *decoding, FIRST_NEIGHBOUR + 2]))
    return seen


def _observed(res, handle: int = PROBE) -> list:
    """What the probe's step reported: its prompt logprobs and its sampled tokens with their logprobs."""
    if res.error is not None:
        raise RuntimeError(f"the batch-invariance self-test's step failed: {res.error}")
    out = [(p.first, p.logprobs, p.top_token_ids, p.top_logprobs) for p in res.prompt_logprobs if p.handle == handle]
    for i, h in enumerate(res.sampled_handles):
        if h == handle:
            out.append((res.sampled_token_ids[i], res.logprobs[i] if res.logprobs is not None else None))
    return out


def self_test(runner: ModelRunner) -> str | None:
    """None when the probe's logprobs agree bitwise alone and among others;
    else what differed. Every tensor-parallel rank runs it on the same
    plans; rank 0 alone sees logprobs (the others return None). Leaves the
    runner with no requests."""
    lay = _layout(runner)
    if lay is None:
        return "the KV pool is too small for the probe (4 requests of 4 tokens)"
    prompt = _tokens(lay.length, runner.vocab_size, 38)
    try:
        alone = _probe_alone(runner, lay, prompt)
        among = _probe_among(runner, lay, prompt)
    finally:
        runner.reset()
    if runner.tp is not None and runner.tp.rank != 0:
        return None
    alone_lp = [x for x in alone if len(x) == 4]
    among_lp = [x for x in among if len(x) == 4]
    flat_alone = _by_position(alone_lp)
    flat_among = _by_position(among_lp)
    for pos, value in flat_alone.items():
        if flat_among.get(pos) != value:
            return f"prompt position {pos} of a {lay.length}-token probe: its logprobs alone and in chunks among " \
                   "other requests differ"
    gen_alone = [x for x in alone if len(x) == 2]
    gen_among = [x for x in among if len(x) == 2]
    for i, (a, b) in enumerate(zip(gen_alone, gen_among)):
        if a != b:
            return f"generated token {i} of the probe: {a} alone, {b} among other requests"
    if len(gen_alone) != len(gen_among):
        return f"the probe generated {len(gen_alone)} tokens alone and {len(gen_among)} among others"
    return None


def _by_position(entries: list) -> dict[int, tuple]:
    """Prompt logprobs keyed by prompt position, whatever chunks reported them."""
    out = {}
    for first, lps, ids, tops in entries:
        k = len(ids) // max(1, len(lps))
        for j, lp in enumerate(lps):
            out[first + j] = (lp, tuple(ids[j * k:(j + 1) * k]), tuple(tops[j * k:(j + 1) * k]))
    return out
