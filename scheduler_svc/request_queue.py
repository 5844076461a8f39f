"""The waiting queue, ordered by the scheduling policy's key.

fcfs: arrival order. priority: `priority` (lower = more urgent), then
arrival. A preempted request keeps its key, so it goes back ahead of every
request that arrived after it: under fcfs, the front of the queue.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from scheduler_svc.request import Request


class RequestQueue:
    def __init__(self, key: Callable[[Request], tuple]):
        self._key = key
        self._items: list[Request] = []
        self.num_tokens = 0  # tokens still to compute, over all queued requests

    def push(self, req: Request) -> None:
        bisect.insort(self._items, req, key=self._key)
        self.num_tokens += req.num_tokens

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        req = self._items.pop(0)
        self.num_tokens -= req.num_tokens
        return req

    def remove(self, req: Request) -> None:
        self._items.remove(req)
        self.num_tokens -= req.num_tokens

    def tokens_ahead_of(self, key: tuple) -> int:
        """Tokens queued in front of a request that would have this key."""
        return sum(r.num_tokens for r in self._items if self._key(r) < key)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
