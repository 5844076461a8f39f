"""The LoRA adapters served, by name: the executor's start-up ones
(EXECUTOR_LORA_ADAPTERS) and those loaded at runtime (LoadLoraAdapter).
The scheduler is the source of truth for the runtime ones: gateways list
them from ServerInfo, and a restarted executor gets them again from here.

Below the service edge an adapter is known by its *key*: a start-up
adapter's is its name; a runtime one's is made new at each load
("name@<scheduler>.<n>", and '@' is never in a runtime name). Requests,
LoRA slots, plans, the executor and the prefix cache (kv_cache_manager.py
folds the key into the hash root) all use the key, so an adapter unloaded
and loaded again under the same name, with other weights, is another
adapter everywhere: no cached block and no slot of the old one serves the
new one, and requests still running with the old one finish with it.

Unloading (the rule): the name leaves at once (new requests get
NOT_FOUND); the key is *retiring* until no live request uses it and no
plan in flight names it (EngineCore.release_adapter), then the executor
forgets it (UnregisterLoraAdapter).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
NAME_RULE = "1-128 characters of [A-Za-z0-9_.:/-], starting with a letter or digit"


class AdapterRefused(Exception):
    """A load or unload refused: `code` is the gRPC status name, `field`
    the request field at fault (None when none is)."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.field = code, field


@dataclass(slots=True)
class RuntimeAdapter:
    name: str
    path: str  # lora_path as the client gave it: sent again to a restarted executor
    key: str
    resolved_path: str = ""  # as the executor resolved it
    rank: int = 0


class LoraRegistry:
    def __init__(self, static: Iterable[str] = (), instance: str | None = None):
        self.static: tuple[str, ...] = tuple(static)
        # name -> adapter, in load order; and names whose load is in progress.
        self.served: dict[str, RuntimeAdapter] = {}
        self.loading: set[str] = set()
        # key -> an unloaded adapter that live requests or plans still use.
        self.retiring: dict[str, RuntimeAdapter] = {}
        # Keys stay unique across scheduler processes sharing an executor
        # over time (a new step stream forgets the old ones anyway).
        self._prefix = instance or uuid.uuid4().hex[:8]
        self._num_loads = 0

    def names(self) -> list[str]:
        """Every adapter name served, start-up ones first."""
        return [*self.static, *self.served]

    def key_of(self, name: str) -> str | None:
        """The key requests naming it run with, or None when not served."""
        if name in self.static:
            return name
        adapter = self.served.get(name)
        return adapter.key if adapter is not None else None

    def begin_load(self, name: str, path: str) -> RuntimeAdapter:
        """Reserves the name for a load (finish_load or abandon_load next)."""
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterRefused("INVALID_ARGUMENT", f"lora_name: {name!r} is not {NAME_RULE}", "lora_name")
        if not path:
            raise AdapterRefused("INVALID_ARGUMENT", "lora_path: must not be empty", "lora_path")
        if name in self.static or name in self.served or name in self.loading:
            raise AdapterRefused("ALREADY_EXISTS", f"the LoRA adapter {name!r} has already been loaded; unload it "
                                                   "first to load other weights under its name")
        self._num_loads += 1
        self.loading.add(name)
        return RuntimeAdapter(name, path, f"{name}@{self._prefix}.{self._num_loads}")

    def finish_load(self, adapter: RuntimeAdapter, resolved_path: str, rank: int) -> None:
        self.loading.discard(adapter.name)
        adapter.resolved_path, adapter.rank = resolved_path, rank
        self.served[adapter.name] = adapter

    def abandon_load(self, adapter: RuntimeAdapter) -> None:
        self.loading.discard(adapter.name)

    def unload(self, name: str) -> RuntimeAdapter:
        """The name stops being served; its key retires."""
        if name in self.static:
            raise AdapterRefused("FAILED_PRECONDITION", f"the LoRA adapter {name!r} is served from "
                                 "EXECUTOR_LORA_ADAPTERS (start-up); only adapters loaded at runtime can be unloaded")
        adapter = self.served.pop(name, None)
        if adapter is None:
            raise AdapterRefused("NOT_FOUND", f"the LoRA adapter {name!r} cannot be found; loaded at runtime: "
                                              f"{', '.join(self.served) or 'none'}", "lora_name")
        self.retiring[adapter.key] = adapter
        return adapter

    def retired(self, key: str) -> None:
        """The key left the scheduler (release_adapter); the executor may forget it."""
        self.retiring.pop(key, None)

    def registered(self) -> list[RuntimeAdapter]:
        """What the executor must hold: served and retiring runtime adapters."""
        return [*self.served.values(), *self.retiring.values()]

    def drop(self, key: str) -> RuntimeAdapter | None:
        """A runtime adapter a (re)connected executor would not take back:
        it is served no more, under its name or its key."""
        for name, adapter in self.served.items():
            if adapter.key == key:
                return self.served.pop(name)
        return self.retiring.pop(key, None)
