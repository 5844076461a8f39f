"""The scheduler's link to its executor: connecting and reconnecting, the
model facts the handshake gives and what is built from them (the
tokenizer, the constraint compiler), and health: the executor's own,
watched while connected, and the progress watchdog. The engine decides
what a reconnect means for the requests (engine.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tokenizers import Tokenizer

from llmsched.errors import StartupError
from llmsched.llguidance_tokenizer import make_tokenizer
from llmsched.security import channel_credentials
from scheduler_svc import telemetry
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.constraints import ConstraintCompiler
from scheduler_svc.core.clock import SYSTEM_CLOCK, Clock
from scheduler_svc.core.model_facts import ModelFacts
from scheduler_svc.executor_client import ExecutorClient

log = logging.getLogger(__name__)


def make_executor_client(settings: SchedulerSettings, clock: Clock = SYSTEM_CLOCK) -> ExecutorClient:
    return ExecutorClient(
        settings.executor_address,
        settings.max_message_bytes,
        channel_credentials(settings.executor_tls_ca, settings.executor_tls_cert, settings.executor_tls_key),
        keepalive_s=settings.executor_keepalive_s,
        clock=clock,
        step_socket=settings.executor_step_socket,
    )


class ExecutorLink:
    def __init__(self, settings: SchedulerSettings, client: ExecutorClient, clock: Clock,
                 on_serving_change: Callable[[bool], None], on_lost: Callable[[], None]):
        self.settings = settings
        self.client = client
        self.clock = clock
        self.facts: ModelFacts | None = None
        self.tokenizer: Tokenizer | None = None
        # Compiles `structured` constraints against the model's tokenizer.
        self.constraints: ConstraintCompiler | None = None
        # Bounds the characters a prompt of max_model_len tokens can have.
        self.max_token_chars = 1
        self.connected = False
        self.draining = False
        self.stalled = False
        # Set (with the reason) when the executor is found gone; the engine
        # loop then recovers at its next turn.
        self.lost_reason: str | None = None
        self._on_serving_change = on_serving_change
        self._on_lost = on_lost
        self._serving: bool | None = None
        self._health_watch: asyncio.Task | None = None
        self._last_progress = clock.monotonic()

    async def connect(self, timeout_s: float, check: Callable[[ModelFacts], None] | None = None,
                      watch: bool = True) -> ModelFacts | None:
        """Handshakes and opens the step stream; returns the facts of the
        executor connected before (None at the first connect). A new model
        or KV geometry gets a new tokenizer and constraint compiler."""
        facts = await self.client.connect(timeout_s, check)
        previous, self.facts = self.facts, facts
        if previous is None or previous.geometry != facts.geometry:
            self.tokenizer = Tokenizer.from_str(facts.tokenizer_json)
            self.max_token_chars = max(1, max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)))
            if self.constraints is not None:
                self.constraints.close()
            # Building llguidance's tokenizer walks the whole vocabulary.
            lltok = await asyncio.to_thread(make_tokenizer, facts.tokenizer_json, facts.vocab_size,
                                            list(facts.eos_token_ids))
            self.constraints = ConstraintCompiler(lltok, self.settings.constraint_compile_timeout_s,
                                                  self.settings.constraint_cache_size)
        self.connected = True
        telemetry.STEP_SOCKET.set(self.client.transport == "unix socket")
        if watch:  # a reconnect that stop() overtook leaves no watch behind
            self._health_watch = asyncio.create_task(self._watch_executor(), name="executor-health-watch")
        self.progress()
        self.update_health()
        log.info("connected to executor %s (%s, steps over %s): model=%s kv_blocks=%d host_kv_blocks=%d "
                 "block_size=%d max_model_len=%d", facts.instance_id, self.settings.executor_address,
                 self.client.transport, facts.model, facts.num_kv_blocks, facts.num_host_kv_blocks,
                 facts.block_size, facts.max_model_len)
        return previous

    def refuse_unsupported(self, facts: ModelFacts) -> None:
        """At start-up: settings this executor cannot serve are refused by
        name, rather than quietly served otherwise."""
        if self.settings.preemption_mode == "swap" and not facts.num_host_kv_blocks:
            raise StartupError(f"SCHEDULER_PREEMPTION_MODE=swap: the executor at {self.settings.executor_address} "
                               "has no host KV tier (EXECUTOR_HOST_KV_CACHE_MEMORY_MB=0); give it one, or use "
                               "auto or recompute")

    def warn_swap_without_host(self) -> None:
        # At start-up this is refused (refuse_unsupported); an executor that
        # comes back without its host tier is served, recomputing victims.
        if self.settings.preemption_mode == "swap" and not self.facts.num_host_kv_blocks:
            log.warning("SCHEDULER_PREEMPTION_MODE=swap, but the executor has no host KV tier "
                        "(EXECUTOR_HOST_KV_CACHE_MEMORY_MB=0): preempted requests recompute")

    async def disconnect(self) -> None:
        """After a loss: health turns NOT_SERVING and the watch ends."""
        self.connected = False
        self.update_health()
        if self._health_watch is not None:
            self._health_watch.cancel()
            # asyncio.wait, not `await task` in a try: a CancelledError caught
            # there could be the caller's own (stop() cancelling the loop),
            # and swallowing it would leave the loop running past its stop.
            await asyncio.wait({self._health_watch})
            self._health_watch = None
        self.lost_reason = None  # the watch may have noted the same loss

    def lost(self, reason: str) -> None:
        """Noted here, handled by the engine loop's next turn."""
        if self.lost_reason is None:
            self.lost_reason = reason
        self._on_lost()

    async def _watch_executor(self) -> None:
        """Follows the executor's health while connected, idle or busy, so
        health turns NOT_SERVING when it dies or freezes with no traffic."""
        self.lost(await self.client.watch_health())

    def tasks(self) -> list[asyncio.Task]:
        return [self._health_watch] if self._health_watch is not None else []

    async def close(self) -> None:
        # Closing the executor's channel ends the step and health streams,
        # so a task that missed its cancellation returns with an error.
        await self.client.close()
        if self.constraints is not None:
            self.constraints.close()

    # ----- health ----------------------------------------------------------

    def update_health(self) -> None:
        serving = self.connected and not self.stalled and not self.draining
        if serving != self._serving:
            self._serving = serving
            self._on_serving_change(serving)

    def progress(self) -> None:
        """A step completed (or the engine went idle): the watchdog's clock restarts."""
        self._last_progress = self.clock.monotonic()

    async def watch_progress(self, has_work: Callable[[], bool]) -> None:
        """The watchdog: when work is pending but no step completed for
        SCHEDULER_STALL_TIMEOUT_S, health reports NOT_SERVING."""
        timeout = self.settings.stall_timeout_s
        while True:
            # A timer, not a poll for work: it only judges elapsed time.
            await asyncio.sleep(timeout / 4)
            stalled = has_work() and self.clock.monotonic() - self._last_progress > timeout
            if stalled != self.stalled:
                log.warning("no step completed for %.0fs with work pending" if stalled else "progress resumed", timeout)
                self.stalled = stalled
                self.update_health()
