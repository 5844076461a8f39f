"""The engine loop: the only code that mutates scheduler state.

gRPC handlers never touch the Scheduler directly. They queue adds and
aborts, which the loop applies at the next step boundary, so a step being
planned never sees its requests change under it.

The loop keeps up to SCHEDULER_MAX_PLANS_IN_FLIGHT plans on the step
stream: it sends the plan for step N+1 before the result of step N
arrives, so the executor finds its next plan waiting when a step ends, and
detokenizing and streaming to clients happen while it computes. The
executor applies plans and returns results strictly in order.

What to send when, admission and what a result does are decided by the
synchronous EngineCore (engine_core.py), which the simulator drives too.
This module adds the I/O: the step stream and what a lost executor means
for the requests, with the executor link (executor_link.py), the request
streams (streams.py) and metrics and spans (engine_telemetry.py) beside
it. It reads time only through its Clock (clock.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from opentelemetry import trace

from llmsched.tracing import Tracing, traceparent_of
from scheduler_svc import telemetry
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.core.clock import SYSTEM_CLOCK, Clock
from scheduler_svc.core.engine_core import (CoreListener, EngineCore, InFlightStep, Tee, TurnKind, core_limits,
                                       scheduler_config)
from scheduler_svc.core.lora_registry import AdapterRefused, LoraRegistry, RuntimeAdapter
from scheduler_svc.core.model_facts import ModelFacts
from scheduler_svc.core.plan import PromptOutput, SampledToken
from scheduler_svc.core.policy import parse_weights
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine_telemetry import EngineTelemetry
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.output_processor import RequestDelta, RequestOutputState
from scheduler_svc.streams import RequestStream, Streams

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """No executor can serve right now."""


# An executor refusal that means it is gone, not that it refused the adapter.
_GONE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# Refusals of the path itself: the request's lora_path is at fault.
_PATH_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)


def _executor_gone(exc: Exception) -> bool:
    return isinstance(exc, ExecutorUnavailable) or exc.code() in _GONE_CODES


class Engine(CoreListener):
    def __init__(
        self,
        settings: SchedulerSettings,
        tracing: Tracing,
        client: ExecutorClient,
        on_serving_change: Callable[[bool], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ):
        self.settings = settings
        self.tracing = tracing
        self.clock = clock
        self._wakeup = asyncio.Event()
        self.link = ExecutorLink(settings, client, clock, on_serving_change or (lambda serving: None),
                                 on_lost=self._wakeup.set)
        self.streams = Streams()
        self.telemetry = EngineTelemetry(tracing, clock, self.streams, settings.max_tenant_labels)
        self.core = EngineCore(core_limits(settings), Tee(self.telemetry, self))
        # LoRA adapters by name, runtime ones included (lora_registry.py),
        # and what each connect bumps: a load whose register raced a
        # reconnect registers again on the new step stream.
        self.lora_registry = LoraRegistry()
        self._num_connects = 0
        self._lora_tasks: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        # Set by stop(): the loop ends at its next turn instead of recovering.
        # Cancelling it is not enough: Python 3.11's asyncio.wait_for drops a
        # cancellation when the result arrives at the same moment (fixed in
        # 3.12), and the loop then reconnected and waited until CLOSE_TIMEOUT_S.
        self._stopping = False
        # SCHEDULER_POLICY=fair's tenant weights, read at each connect: a bad
        # value stops the start now rather than at the first connect.
        parse_weights(settings.tenant_weights)

    @property
    def scheduler(self) -> Scheduler | None:
        return self.core.scheduler

    # ----- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        await self._connect(self.settings.executor_connect_timeout_s, check=self.link.refuse_unsupported)
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        has_work = lambda: self.scheduler is not None and self.scheduler.has_work  # noqa: E731
        self._watchdog = asyncio.create_task(self.link.watch_progress(has_work), name="engine-watchdog")

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        tasks = [t for t in (self._task, self._watchdog, *self.link.tasks()) if t is not None]
        for task in tasks:
            task.cancel()
        # A task that missed its cancellation ends when the channel closes
        # (the loop, seeing _stopping, returns).
        await self.link.close()
        if tasks:
            await asyncio.wait(tasks)

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: refuse new requests, let live ones finish for
        up to timeout_s, then abort the rest (their streams end with
        FINISH_REASON_ABORT)."""
        self.link.draining = True
        self.link.update_health()
        try:
            await asyncio.wait_for(self.streams.idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            live = list(self.streams)
            log.warning("drain timeout: aborting %d requests", len(live))
            for request_id in live:
                self.abort(request_id)
            try:
                await asyncio.wait_for(self.streams.idle.wait(), 5.0)
            except asyncio.TimeoutError:
                self._fail_all("UNAVAILABLE", "server shut down")

    async def _connect(self, timeout_s: float, check: Callable[[ModelFacts], None] | None = None) -> None:
        """Connects, and fits the scheduler to the executor: the same one
        for the same model and geometry, a new one otherwise."""
        previous = await self.link.connect(timeout_s, check, watch=not self._stopping)
        facts = self.link.facts
        if self.scheduler is not None and previous is not None:  # a reconnect
            if facts.geometry != previous.geometry:
                self._fail_all("UNAVAILABLE",
                               "the executor came back with a different model, LoRA adapters or KV geometry")
                self.core.detach()
            elif facts.num_host_kv_blocks != previous.num_host_kv_blocks:
                # _recover emptied the host tier already (the process is gone
                # with its memory), so only its size changes: requests go on,
                # recomputing what they lost as after any restart.
                log.warning("the executor came back with a host KV tier of %d blocks (was %d)",
                            facts.num_host_kv_blocks, previous.num_host_kv_blocks)
                self.scheduler.replace_host_tier(facts.num_host_kv_blocks)
                self.link.warn_swap_without_host()
        if self.scheduler is None:
            scheduler = self.core.attach(scheduler_config(self.settings, facts.num_kv_blocks, facts.block_size,
                                                          facts.max_model_len, facts.num_host_kv_blocks,
                                                          facts.speculative_tokens, facts.batch_invariant,
                                                          facts.lora_adapters, facts.max_loras,
                                                          bool(facts.runtime_lora_dir)))
            self.telemetry.attach(scheduler)
            if previous is not None:
                self.link.warn_swap_without_host()
        self._num_connects += 1
        self.lora_registry.static = facts.lora_adapters
        await self._register_runtime_adapters()
        self.core.last_result_at = self.clock.perf_counter()

    async def _register_runtime_adapters(self) -> None:
        """The step stream is new, so the executor holds no runtime adapter
        (a restart, or the same process: either forgets them): each one
        loaded here, or unloaded and still in use, is registered again
        before the first plan. One the executor will not take back (its
        files changed, the directory setting did) is served no more, and
        its live requests fail."""
        self._release_adapters()
        for adapter in self.lora_registry.registered():
            try:
                await self.link.client.register_lora(adapter.key, adapter.path)
            except (grpc.aio.AioRpcError, ExecutorUnavailable) as exc:
                if _executor_gone(exc):
                    self.link.lost(f"could not register LoRA adapter {adapter.name!r} again: {exc}")
                    return  # the next turn recovers, and registers them all again
                message = (f"LoRA adapter {adapter.name!r} ({adapter.path}) could not be registered again with the "
                           f"executor after it reconnected: {exc.details()}")
                log.error("%s; its requests fail", message)
                self.lora_registry.drop(adapter.key)
                self.core.fail_adapter(adapter.key, "UNAVAILABLE", message)
                if self.scheduler is not None and self.scheduler.lora is not None:
                    self.scheduler.lora.forget(adapter.key)
                continue
            if self.scheduler is not None and self.scheduler.lora is not None:
                self.scheduler.lora.register(adapter.key)

    # ----- runtime LoRA adapters (lora_registry.py) -------------------------

    async def load_lora(self, name: str, path: str) -> RuntimeAdapter:
        """Registers the adapter with the executor, which reads and checks
        it, then serves it under `name`. Raises AdapterRefused (with the
        executor's reason) or Unavailable."""
        facts = self.link.facts
        if not self.link.connected or facts is None or self.scheduler is None:
            raise Unavailable("no executor is connected")
        if not facts.runtime_lora_dir:
            raise AdapterRefused("FAILED_PRECONDITION", "runtime LoRA loading is off: the executor has no "
                                                        "EXECUTOR_RUNTIME_LORA_DIR (the directory adapters are "
                                                        "loaded from)")
        adapter = self.lora_registry.begin_load(name, path)
        try:
            while True:
                connects = self._num_connects
                try:
                    resp = await self.link.client.register_lora(adapter.key, path)
                except (grpc.aio.AioRpcError, ExecutorUnavailable) as exc:
                    if _executor_gone(exc):
                        raise Unavailable(f"executor unavailable: {exc}") from None
                    field = "lora_path" if exc.code() in _PATH_CODES else None
                    raise AdapterRefused(exc.code().name, exc.details(), field) from None
                if connects == self._num_connects:
                    break  # else the register went to a step stream since replaced: again, on the new one
        except BaseException:
            self.lora_registry.abandon_load(adapter)
            telemetry.LORA_RUNTIME_CHANGES.labels("load_refused").inc()
            raise
        self.lora_registry.finish_load(adapter, resp.resolved_path, resp.rank)
        if self.scheduler is not None and self.scheduler.lora is not None:
            self.scheduler.lora.register(adapter.key)
        telemetry.LORA_RUNTIME_CHANGES.labels("load").inc()
        log.info("LoRA adapter %r loaded at runtime from %s (rank %d, key %s)", name, resp.resolved_path, resp.rank,
                 adapter.key)
        return adapter

    def unload_lora(self, name: str) -> int:
        """New requests naming it are refused from now on; returns how many
        live ones still run with it (it is freed after them)."""
        adapter = self.lora_registry.unload(name)
        num_live = len(self.core.adapter_users(adapter.key))
        telemetry.LORA_RUNTIME_CHANGES.labels("unload").inc()
        log.info("LoRA adapter %r unloaded (%d live requests finish with it first)", name, num_live)
        self._release_adapters()
        return num_live

    def adapter_key(self, name: str) -> str | None:
        """The key requests naming this adapter run with, None when not served."""
        return self.lora_registry.key_of(name)

    def _release_adapters(self) -> None:
        """Frees each unloaded adapter that nothing uses any more: it leaves
        the slots, and the executor forgets it."""
        for key in list(self.lora_registry.retiring):
            if self.core.release_adapter(key):
                self.lora_registry.retired(key)
                telemetry.LORA_RUNTIME_CHANGES.labels("freed").inc()
                if self.link.connected:
                    task = asyncio.create_task(self._unregister(key), name=f"lora-unregister-{key}")
                    self._lora_tasks.add(task)
                    task.add_done_callback(self._lora_tasks.discard)

    async def _unregister(self, key: str) -> None:
        try:
            await self.link.client.unregister_lora(key)
        except (grpc.aio.AioRpcError, ExecutorUnavailable) as exc:
            # The executor keeps its copy until its next step stream, which forgets it.
            log.warning("could not tell the executor to forget LoRA adapter %s: %s", key, exc)

    # ----- called by gRPC handlers ----------------------------------------

    def is_live(self, request_id: str) -> bool:
        return request_id in self.streams

    def submit(self, request: Request, span: trace.Span, owner: str | None = None) -> RequestStream:
        """Queues a validated request. Raises ValueError when it can never
        fit, Overloaded when admission control sheds it, Unavailable when no
        executor is connected."""
        if self.link.draining:
            raise Unavailable("the server is shutting down")
        if not self.link.connected or self.scheduler is None:
            raise Unavailable("no executor is connected")
        if request.request_id in self.streams:
            raise ValueError(f"request_id {request.request_id!r} is already live")
        self.core.check(request)
        stream = RequestStream(
            state=RequestOutputState(request, self.link.tokenizer),
            telemetry=telemetry.RequestTelemetry(span, self.tracing.enabled, request.tenant, self.clock),
            owner=owner,
        )
        stream.telemetry.on_queued(request.num_prompt_tokens)
        self.streams.add(request.request_id, stream)
        self.core.enqueue(request)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Ends a live request at the next step boundary. Idempotent. Only
        the owner (the API key that created it) may abort it; to anyone
        else it does not exist."""
        stream = self.streams.get(request_id)
        if stream is None or stream.owner != owner:
            return False
        self.core.abort(request_id)
        self._wakeup.set()
        return True

    # ----- the loop --------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._turn()
            except Exception:
                if self._stopping:
                    return  # the step stream closed under it
                # A bug must not leave every stream hanging: fail what is
                # live (blocks are freed and the executor told) and go on.
                log.exception("engine step crashed; failing live requests")
                self._fail_all("INTERNAL", "internal scheduler error")
                # Results of plans in flight can no longer be matched: start
                # the executor over on a fresh stream.
                self.link.lost("internal scheduler error")

    async def _turn(self) -> None:
        """One turn, as EngineCore.next_turn decides: send a plan, apply the
        oldest result, or wait for new work."""
        self.core.apply_pending()
        if self.link.lost_reason is not None:
            await self._recover(self.link.lost_reason)
            return
        turn = self.core.next_turn()
        if turn.kind is TurnKind.SEND:
            await self._send(turn.step)
        elif turn.kind is TurnKind.RECEIVE:
            await self._receive()
        elif turn.kind is TurnKind.STUCK:
            # Nothing runnable and nothing in flight: waiting here instead
            # of spinning keeps it visible.
            log.error("scheduler has work but scheduled nothing; waiting for new input")
            await self._wait_for_input()
        elif turn.kind is TurnKind.WAIT:
            await self._wait_for_input()
            self.link.progress()
        # TurnKind.AGAIN: what the plan freed lets the next one run.

    async def _wait_for_input(self) -> None:
        # Only ever reached with nothing in flight (see EngineCore.next_turn).
        self._wakeup.clear()
        await self._wakeup.wait()

    async def _send(self, step: InFlightStep) -> None:
        after_idle = self.core.take_after_idle()
        traceparent = traceparent_of(step.span) if self.tracing.enabled else ""
        timeout = self.settings.step_timeout_s
        try:
            await asyncio.wait_for(self.link.client.send(step.out, after_idle, traceparent), timeout)
        except (ExecutorUnavailable, asyncio.TimeoutError) as exc:
            self.link.lost(str(exc) or f"could not send a step within {timeout}s")
            return
        self.core.on_sent(step, self.clock.perf_counter())

    async def _receive(self) -> None:
        timeout = self.settings.step_timeout_s
        try:
            outcome = await asyncio.wait_for(self.link.client.receive(), timeout)
        except (ExecutorUnavailable, asyncio.TimeoutError) as exc:
            # A timeout (the executor stopped answering) has an empty message.
            self.link.lost(str(exc) or f"no step result within {timeout}s")
            return
        self.core.on_result(outcome, self.clock.perf_counter())
        if self.lora_registry.retiring:
            self._release_adapters()

    async def _recover(self, reason: str) -> None:
        """The executor is gone: keep every request, reconnect, recompute.
        Results of plans in flight will never come; their requests are
        requeued with everything else."""
        if self._stopping:
            return  # stop() closed the connection: nothing to recover
        log.warning("executor lost: %s", reason)
        await self.link.disconnect()
        self.telemetry.executor_lost(self.core.drop_in_flight(), reason)
        if self.scheduler is not None:
            # Whether the same process answers again or not, what it holds
            # cannot be trusted: its host tier counts as gone too.
            self.scheduler.reset_executor_state(host_lost=True)
        try:
            await self._connect(self.settings.executor_reconnect_timeout_s)
        except ExecutorUnavailable as exc:
            log.error("%s; failing in-flight requests", exc)
            self._fail_all("UNAVAILABLE", f"executor unavailable: {exc}")
            # Keep trying in the background; new requests get UNAVAILABLE
            # meanwhile (not connected).
            while not self.link.connected and not self._stopping:
                try:
                    await self._connect(self.settings.executor_reconnect_timeout_s)
                except ExecutorUnavailable:
                    pass

    def _fail_all(self, code: str, message: str) -> None:
        sched = self.scheduler
        for request_id in self.streams:
            if sched is not None:
                sched.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            self.streams.fail(request_id, code, message)
        self.core.clear_pending()

    # ----- what the core tells the engine (CoreListener, after EngineTelemetry)

    def tokens(self, tokens: list[SampledToken], num_dropped: int) -> None:
        self.link.progress()
        self.streams.emit(tokens, stop=self.scheduler.stop_by_string)

    def prompt_outputs(self, outputs: list[PromptOutput]) -> None:
        self.link.progress()
        self.streams.emit_prompt_outputs(outputs)

    def request_failed(self, request_id: str, code: str, message: str) -> None:
        self.streams.fail(request_id, code, message)

    def aborted(self, request: Request) -> None:
        self.streams.finish(request, RequestDelta())
