"""The waiting queue, ordered by the scheduling policy's key.

fcfs: arrival order. priority: `priority` (lower = more urgent), then
arrival. A preempted request keeps its key, so it goes back ahead of every
request that arrived after it: under fcfs, the front of the queue.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Collection, Iterator

from scheduler_svc.core.request import Request


class RequestQueue:
    def __init__(self, key: Callable[[Request], tuple]):
        self._key = key
        self._items: list[Request] = []
        self.num_tokens = 0  # tokens still to compute, over all queued requests
        self._per_tenant: Counter[str] = Counter()

    def begin_step(self) -> None:
        """The order does not depend on the step (see FairQueue.begin_step)."""

    def push(self, req: Request) -> None:
        bisect.insort(self._items, req, key=self._key)
        self.num_tokens += req.num_tokens
        self._per_tenant[req.tenant] += 1

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        req = self._items.pop(0)
        self.num_tokens -= req.num_tokens
        self._uncount(req)
        return req

    def first_not_of(self, adapters: Collection[str]) -> Request | None:
        """The first request in order whose adapter is not one of these (the
        adapters waiting for a LoRA slot, lora_slots.py), or None."""
        return next((r for r in self._items if r.adapter not in adapters), None)

    def take(self, req: Request) -> Request:
        """Takes req (the head, or first_not_of's) off the queue to run."""
        self.remove(req)
        return req

    def remove(self, req: Request) -> None:
        self._items.remove(req)
        self.num_tokens -= req.num_tokens
        self._uncount(req)

    def _uncount(self, req: Request) -> None:
        self._per_tenant[req.tenant] -= 1
        if not self._per_tenant[req.tenant]:
            del self._per_tenant[req.tenant]

    def ahead_for(self, req: Request) -> tuple[int, int]:
        """Requests and tokens queued in front of req, were it queued now:
        behind every request with its key (the key ends with the arrival
        order)."""
        key = self._key(req)[:-1]
        ahead = [r for r in self._items if self._key(r)[:-1] <= key]
        return len(ahead), sum(r.num_tokens for r in ahead)

    def num_waiting_of(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def waiting_by_tenant(self) -> dict[str, int]:
        return dict(self._per_tenant)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
