"""A canary request driven through a ModelRunner in-process, alone or among
neighbours, for the batch-invariance tests: a small stand-in for the
scheduler that chunks prompts, admits requests in a given order, serves a
prefix from another request's blocks, and preempts by recompute or swap.

What comes back is the canary's sampled tokens with their logprobs and top
logprobs, exactly as the runner reported them (Python floats of the fp32
values), so two runs compare bitwise with ==.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from executor_svc.attention import make_backend
from executor_svc.model.batch_invariant import make_batch_invariant
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.step.host_kv import HostKVPool
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner, NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings

BLOCK = 16
CANARY = 0  # the canary's handle
MAX_LEN = 512  # stories260K's max_position_embeddings
BLOCKS_PER_REQUEST = MAX_LEN // BLOCK
# Seeded, sampled at temperature 1: the path most likely to show a
# difference (a token is drawn from the logits' every bit), with the top 5.
CANARY_SAMPLING = SamplingSettings(temperature=1.0, top_p=0.95, top_k=0, seed=1234, logprobs=5)


def canary_prompt(n: int = 100) -> list[int]:
    rng = random.Random(38)
    return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]


def make_runner(stories_path, invariant: bool, num_requests: int = 64, host_blocks: int = 0) -> ModelRunner:
    ckpt = load_checkpoint(str(stories_path))
    cfg = read_config(ckpt.hf_config)
    cpu = torch.device("cpu")
    model = build_model(cfg, ckpt.state_dict, MAX_LEN, cpu, torch.float32)
    if invariant:
        make_batch_invariant(model)
    pool = KVCachePool(cfg, num_requests * BLOCKS_PER_REQUEST, BLOCK, cpu, torch.float32)
    host = HostKVPool(pool, host_blocks, cpu) if host_blocks else None
    return ModelRunner(model, pool, make_backend("torch", cpu, batch_invariant=invariant), cpu, max_model_len=MAX_LEN,
                       host_kv=host, batch_invariant=invariant)


@dataclass(slots=True)
class Req:
    handle: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingSettings
    arrival: int = 0  # the step it arrives at
    # Its first cached_blocks blocks are another request's, already computed.
    shared_blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)
    computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    def blocks(self) -> list[int]:
        own = range(self.handle * BLOCKS_PER_REQUEST, (self.handle + 1) * BLOCKS_PER_REQUEST)
        return self.shared_blocks + list(own)[len(self.shared_blocks):]


def neighbours(n: int, seed: int, max_arrival: int = 200, max_prompt: int = 300, max_tokens: int = 160) -> list[Req]:
    """n random requests: prompts of 2 to max_prompt tokens, 1 to
    max_tokens generated, greedy, seeded or unseeded, arriving over the
    canary's first max_arrival steps."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, max_prompt))]
        temperature = rng.choice([0.0, 0.8, 1.0])
        seed_ = rng.choice([None, rng.randrange(1 << 32)])
        sampling = SamplingSettings(temperature=temperature, top_p=rng.choice([1.0, 0.9]), top_k=0, seed=seed_,
                                    logprobs=rng.choice([0, 2]))
        out.append(Req(i + 1, prompt, rng.randrange(1, max_tokens), sampling, arrival=rng.randrange(0, max_arrival)))
    return out


@dataclass(slots=True)
class Preemption:
    at_output: int  # preempted once the canary has this many tokens
    swap: bool  # by swap (blocks copied to the host tier and back), else by recompute
    resume_after: int = 3  # steps it waits


def run(runner: ModelRunner, reqs: list[Req], chunk: int, preempt: Preemption | None = None) -> list[tuple]:
    """Steps until every request is done; returns the canary's (token,
    logprob, top ids, top logprobs) per generated token. Each step
    schedules every arrived request in list order: a prompt chunk of up to
    `chunk` tokens, or one token."""
    runner.reset()
    step, canary = 0, next((r for r in reqs if r.handle == CANARY), Req(CANARY, [], 0, CANARY_SAMPLING))
    paused_until, finished = -1, []
    while not all(r.done for r in reqs):
        plan = StepPlan(step, finished_handles=finished)
        finished = []
        if preempt is not None and canary.sent and len(canary.output) == preempt.at_output and paused_until < 0:
            plan.finished_handles.append(CANARY)
            if preempt.swap:
                n = -(-canary.computed // BLOCK)
                plan.swap_out_device_blocks, plan.swap_out_host_blocks = canary.blocks()[:n], list(range(n))
            else:
                canary.computed = 0
            canary.sent = False
            paused_until = step + preempt.resume_after
        for r in reqs:
            if r.done or r.arrival > step or (r is canary and step < paused_until):
                continue
            if r is canary and paused_until >= 0 and step >= paused_until and preempt is not None and preempt.swap \
                    and not r.sent:
                n = -(-canary.computed // BLOCK)
                runner.pool.storage[:, :, canary.blocks()[:n]] = float("nan")  # the device blocks were reused
                plan.swap_in_host_blocks, plan.swap_in_device_blocks = list(range(n)), canary.blocks()[:n]
            remaining = len(r.tokens) - r.computed
            q = min(chunk, remaining)
            if not r.sent:
                plan.new_requests.append(NewRequestData(r.handle, r.tokens, r.blocks(), r.computed, q, r.sampling,
                                                        len(r.output)))
                r.sent = True
            else:
                plan.cached_handles.append(r.handle)
                plan.cached_num_scheduled_tokens.append(q)
            r.computed += q
        res = runner.execute(plan)
        assert res.error is None, res.error
        by_handle = {r.handle: r for r in reqs}
        for i, (h, t) in enumerate(zip(res.sampled_handles, res.sampled_token_ids)):
            r = by_handle[h]
            r.output.append(t)
            if h == CANARY:
                # Under tensor parallelism only rank 0 gets logprobs.
                lp = res.logprobs[i] if res.logprobs is not None else (None, (), ())
                r.logprobs.append((t, lp[0], tuple(lp[1]), tuple(lp[2])))
            if r.done:
                finished.append(h)
        step += 1
    return canary.logprobs
