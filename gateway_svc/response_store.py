"""The Responses API's store: responses kept for `GET /v1/responses/{id}`
and `previous_response_id`, bounded per owner in entries, in bytes and in
time.

An owner is the caller's API key (a hash of it; `anonymous` without one):
the gateway learns a key's tenant only from the scheduler's trailers of a
call, and GET and DELETE make none, so a response is visible to the key that
created it and nobody else. Each owner's entries sit in insertion order, so
the oldest is both the first to expire (one TTL for all) and the first to be
evicted when a cap is reached: every bound is kept with O(1) work per entry.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the Response object as GET returns it
    conversation: list[dict]  # input items then output items: what previous_response_id continues
    num_bytes: int
    expires_at: float

    @classmethod
    def make(cls, response: dict, conversation: list[dict], expires_at: float) -> "StoredResponse":
        # The JSON size stands for the memory held: both grow with the text.
        num_bytes = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        return cls(response, conversation, num_bytes, expires_at)


class _OwnerStore:
    __slots__ = ("entries", "num_bytes")

    def __init__(self):
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def pop(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry


def owner_of(authorization: str | None) -> str:
    """The store's owner of a request: its API key, hashed so that the key
    itself is not kept."""
    if not authorization:
        return "anonymous"
    return "key-" + hashlib.sha256(authorization.encode()).hexdigest()[:32]


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._owners: dict[str, _OwnerStore] = {}

    def can_put(self, entry: StoredResponse) -> bool:
        """An entry bigger than a whole owner's byte cap is never kept."""
        return entry.num_bytes <= self.max_bytes

    def put(self, owner: str, response_id: str, response: dict, conversation: list[dict]) -> bool:
        """Keeps the response (replacing one with its id), evicting the
        owner's oldest entries until both caps hold; False when it is too
        big to keep at all."""
        entry = StoredResponse.make(response, conversation, self.clock() + self.ttl_s)
        store = self._owners.setdefault(owner, _OwnerStore())
        store.pop(response_id)
        self._expire(store)
        if not self.can_put(entry):
            self._drop_if_empty(owner, store)
            return False
        while store.entries and (len(store.entries) >= self.max_entries
                                 or store.num_bytes + entry.num_bytes > self.max_bytes):
            store.pop(next(iter(store.entries)))
        store.entries[response_id] = entry
        store.num_bytes += entry.num_bytes
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        store = self._owners.get(owner)
        if store is None:
            return None
        self._expire(store)
        entry = store.entries.get(response_id)
        self._drop_if_empty(owner, store)
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        store = self._owners.get(owner)
        if store is None:
            return False
        found = store.pop(response_id) is not None
        self._drop_if_empty(owner, store)
        return found

    def usage(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) the owner holds now."""
        store = self._owners.get(owner)
        if store is None:
            return 0, 0
        self._expire(store)
        return len(store.entries), store.num_bytes

    def _expire(self, store: _OwnerStore) -> None:
        # Insertion order is expiry order: every entry gets the same TTL.
        now = self.clock()
        while store.entries:
            first_id, first = next(iter(store.entries.items()))
            if first.expires_at > now:
                break
            store.pop(first_id)

    def _drop_if_empty(self, owner: str, store: _OwnerStore) -> None:
        if not store.entries:
            self._owners.pop(owner, None)
