"""Test factories, so scheduler tests read as scenarios."""

from __future__ import annotations

import itertools

from scheduler_svc.core.request import Request, SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig

EOS = 2
_ids = itertools.count()


def make_scheduler(**overrides) -> Scheduler:
    cfg = dict(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
               max_prefill_chunk=32)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def make_request(prompt_len: int = 8, max_tokens: int = 4, request_id: str | None = None,
                 prompt: list[int] | None = None, priority: int = 0, adapter: str = "", **sampling) -> Request:
    """Prompts are distinct per request (no accidental prefix hits) unless
    `prompt` is given."""
    sampling.setdefault("temperature", 0.0)
    n = next(_ids)
    return Request(
        request_id=request_id or f"req-{n}",
        prompt_token_ids=list(prompt) if prompt is not None else [10 + 1000 * n + i for i in range(prompt_len)],
        priority=priority,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=frozenset({EOS}),
        adapter=adapter,
    )


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, **kw) -> list[Request]:
    return [make_request(prompt_len, max_tokens, **kw) for _ in range(n)]


class FakeExecutor:
    """Answers a plan the way the executor would: a token for every request
    whose scheduled tokens reach its end. Tokens come from `next_token`."""

    def __init__(self, next_token=lambda req: 100):
        self.next_token = next_token

    def run(self, out) -> list[tuple[int, int, None]]:
        return [(h, self.next_token(out.entries[h].request), None) for h in out.sampling_handles()]


def run_step(sched: Scheduler, executor: FakeExecutor | None = None):
    out = sched.schedule()
    sampled = (executor or FakeExecutor()).run(out)
    return out, sched.update_from_output(out, sampled)
