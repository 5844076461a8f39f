"""Scheduling policies: the order of the waiting queue, which running
request to preempt, and (for `fair`) each tenant's share of the service.

- fcfs: arrival order.
- priority: `priority` (lower = more urgent), then arrival.
- fair: the Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving
  Large Language Models", OSDI 2024) across tenants, and priority then
  arrival within a tenant.

VTC keeps a counter per tenant that grows with the service the tenant gets:
each prompt token computed counts prompt_weight, each output token sampled
output_weight, divided by the tenant's weight. Admission takes the head of
the backlogged (waiting) tenant with the lowest counter. A tenant that
becomes backlogged again has its counter lifted to the lowest counter among
the backlogged tenants (to the counter of the last tenant to leave the
queue, when none is), so time spent idle earns no credit and a returning
tenant cannot burst. The paper proves the counters of backlogged tenants
stay within a bound of each other (tests/unit/test_fair_share.py checks
ours); it is work-conserving, since whatever fits is admitted.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from llmsched.errors import StartupError
from scheduler_svc.core.request import Request
from scheduler_svc.core.request_queue import RequestQueue


@dataclass(slots=True)
class VirtualTokenCounters:
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    weights: dict[str, float] = field(default_factory=dict)  # tenants not named weigh 1
    counters: dict[str, float] = field(default_factory=dict)
    # The last tenant whose waiting requests all left the queue (admitted
    # or cancelled): an arrival into an empty queue is lifted to its counter.
    last_left: str | None = None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        service = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        self.counters[tenant] = self.counter(tenant) + service / self.weight(tenant)

    def lift(self, tenant: str, backlogged: list[str]) -> None:
        """`tenant` becomes backlogged while `backlogged` are."""
        if backlogged:
            floor = min(self.counter(t) for t in backlogged)
        elif self.last_left is not None:
            floor = self.counter(self.last_left)
        else:
            return
        self.counters[tenant] = max(self.counter(tenant), floor)


class FairQueue:
    """Waiting requests in one queue per tenant (each in `key` order);
    the head is that of the backlogged tenant with the lowest counter."""

    def __init__(self, vtc: VirtualTokenCounters, key: Callable[[Request], tuple]):
        self._vtc = vtc
        self._key = key
        self._queues: dict[str, list[Request]] = {}
        self._len = 0
        self.num_tokens = 0
        # The output each tenant's admissions in the step being planned may
        # still produce (weighted, as the counter would be charged). The
        # counters grow with output only as it is generated, so a step that
        # admits many requests at once (slots freed together) would
        # otherwise give them all to whoever was lowest; ordering a step's
        # admissions by counter + this splits the burst by share. Dropped
        # at the next step: the counters themselves stay pure VTC.
        self._admitted_output: dict[str, float] = {}

    def push(self, req: Request) -> None:
        queue = self._queues.get(req.tenant)
        if queue is None:
            self._vtc.lift(req.tenant, list(self._queues))
            queue = self._queues[req.tenant] = []
        bisect.insort(queue, req, key=self._key)
        self._len += 1
        self.num_tokens += req.num_tokens

    def begin_step(self) -> None:
        self._admitted_output.clear()

    def head_tenant(self) -> str:
        # Ties go to the tenant whose head came first.
        return min(self._queues, key=lambda t: (self._vtc.counter(t) + self._admitted_output.get(t, 0.0),
                                                self._key(self._queues[t][0])))

    def peek(self) -> Request:
        return self._queues[self.head_tenant()][0]

    def first_not_of(self, adapters: Collection[str]) -> Request | None:
        """The head as if the requests with these adapters (waiting for a
        LoRA slot, lora_slots.py) were not queued, or None."""
        firsts = {t: r for t, q in self._queues.items()
                  if (r := next((r for r in q if r.adapter not in adapters), None)) is not None}
        if not firsts:
            return None
        return firsts[min(firsts, key=lambda t: (self._vtc.counter(t) + self._admitted_output.get(t, 0.0),
                                                   self._key(firsts[t])))]

    def pop(self) -> Request:
        return self.take(self.peek())

    def take(self, req: Request) -> Request:
        """Takes req (the head, or first_not_of's) off the queue to run."""
        tenant = req.tenant
        self._queues[tenant].remove(req)
        vtc = self._vtc
        expected = vtc.output_weight * (req.sampling.max_tokens - len(req.output_token_ids)) / vtc.weight(tenant)
        self._admitted_output[tenant] = self._admitted_output.get(tenant, 0.0) + expected
        if not self._queues[tenant]:
            del self._queues[tenant]
            self._vtc.last_left = tenant
        self._len -= 1
        self.num_tokens -= req.num_tokens
        return req

    def remove(self, req: Request) -> None:
        queue = self._queues[req.tenant]
        queue.remove(req)
        if not queue:
            del self._queues[req.tenant]
            # Its running requests go on being served, so its counter stays
            # the floor for a newcomer, as when its queue empties by admission.
            self._vtc.last_left = req.tenant
        self._len -= 1
        self.num_tokens -= req.num_tokens

    @property
    def backlogged(self) -> list[str]:
        return list(self._queues)

    def num_waiting_of(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def waiting_by_tenant(self) -> dict[str, int]:
        return {t: len(q) for t, q in self._queues.items()}

    def ahead_for(self, req: Request) -> tuple[int, int]:
        """An estimate for backpressure: the requests and tokens of the
        tenant's own queue ahead of req, as often as there are backlogged
        tenants to take turns with (at most everything queued)."""
        own = [r for r in self._queues.get(req.tenant, ()) if self._key(r)[:-1] <= self._key(req)[:-1]]
        turns = len(self._queues) + (req.tenant not in self._queues)
        return min(self._len, len(own) * turns), min(self.num_tokens, sum(r.num_tokens for r in own) * turns)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (r for queue in self._queues.values() for r in queue)

    def __bool__(self) -> bool:
        return self._len > 0


class Policy:
    """fcfs (priority=False) or priority: one queue in key order, and the
    least urgent running request is preempted first."""

    name = "fcfs"

    def __init__(self, by_priority: bool = False):
        self.by_priority = by_priority
        self.name = "priority" if by_priority else "fcfs"
        # Tokens served per tenant, (prompt, output), for metrics.
        self.served: dict[str, list[int]] = {}

    def order_key(self, req: Request) -> tuple[int, int]:
        """Smaller runs first and is preempted last."""
        return (req.priority if self.by_priority else 0, req.arrival_seq)

    def make_queue(self) -> RequestQueue:
        return RequestQueue(self.order_key)

    def pick_victim(self, candidates: list[Request]) -> Request:
        """Which of candidates (running requests in order_key order, none yet
        scheduled this step) to preempt."""
        return candidates[-1]

    def charge(self, req: Request, start: int, num_tokens: int, samples: bool) -> None:
        """Positions [start, start + num_tokens) of req are computed this
        step; with samples, it samples an output token. A prompt token counts
        once, however often a preemption makes it recomputed, and a prompt
        token served from the prefix cache does not count."""
        num_prompt = req.num_prompt_tokens
        if start >= num_prompt and req.num_charged_prompt_tokens >= num_prompt:
            prompt = 0  # a decode step, its prompt charged (most calls: P1's per-request cost)
        else:
            end = min(start + num_tokens, num_prompt)
            prompt = max(0, end - max(start, req.num_charged_prompt_tokens))
            req.num_charged_prompt_tokens = max(req.num_charged_prompt_tokens, end)
        served = self.served.setdefault(req.tenant, [0, 0])
        served[0] += prompt
        served[1] += samples
        self._on_served(req.tenant, prompt, int(samples))

    def charge_accepted_drafts(self, req: Request, num_tokens: int) -> None:
        """A speculative step, charged one output token when planned, gave
        req num_tokens more (its accepted drafts): they count as generated,
        so a tenant whose answers repeat themselves does not get its tokens
        at a discount."""
        self.served.setdefault(req.tenant, [0, 0])[1] += num_tokens
        self._on_served(req.tenant, 0, num_tokens)

    def _on_served(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        pass

    @property
    def counters(self) -> dict[str, float]:
        """Each tenant's virtual token counter (fair only)."""
        return {}


class FairPolicy(Policy):
    """VTC across tenants; priority then arrival within one."""

    def __init__(self, vtc: VirtualTokenCounters):
        super().__init__(by_priority=True)
        self.name = "fair"
        self.vtc = vtc

    def make_queue(self) -> FairQueue:
        return FairQueue(self.vtc, self.order_key)

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The least urgent request of the tenant furthest above its share."""
        # Ties go to the least urgent candidate's tenant, so the choice never
        # depends on the order of a set (string hashes vary by process).
        tenant = max(reversed(candidates), key=lambda r: self.vtc.counter(r.tenant)).tenant
        return [r for r in candidates if r.tenant == tenant][-1]

    def _on_served(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        self.vtc.charge(tenant, prompt_tokens, output_tokens)

    @property
    def counters(self) -> dict[str, float]:
        return self.vtc.counters


def make_policy(name: str, prompt_weight: float = 1.0, output_weight: float = 2.0,
                weights: dict[str, float] | None = None) -> Policy:
    if name == "fair":
        return FairPolicy(VirtualTokenCounters(prompt_weight, output_weight, dict(weights or {})))
    if name in ("fcfs", "priority"):
        return Policy(by_priority=name == "priority")
    raise ValueError(f"unknown policy {name!r}; supported: fcfs, priority, fair")


# A tenant's name: in SCHEDULER_TENANT_WEIGHTS, in API-key entries and in
# GenerateRequest.tenant.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def parse_weights(text: str, setting: str = "SCHEDULER_TENANT_WEIGHTS") -> dict[str, float]:
    """`teamA=2,teamB=1` -> {"teamA": 2.0, "teamB": 1.0}; tenants not named
    weigh 1."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        tenant, sep, raw = part.partition("=")
        tenant = tenant.strip()
        if not sep or not TENANT_NAME.fullmatch(tenant):
            raise StartupError(f"{setting}: {part!r} is not tenant=weight (a tenant is 1-64 characters of "
                               "[A-Za-z0-9_.-])")
        try:
            weight = float(raw)
        except ValueError:
            weight = float("nan")
        if not (weight > 0 and weight < float("inf")):
            raise StartupError(f"{setting}: the weight of {tenant!r} must be a finite number > 0, got {raw.strip()!r}")
        weights[tenant] = weight
    return weights
