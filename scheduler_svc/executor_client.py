"""The scheduler's side of the step channel: handshake, then one
bidirectional stream on which each plan gets exactly one result, in order.
Plans may be sent before earlier results are read (pipelining).

Plans go out and results come back as the plain dataclasses the engine
core uses (StepPlan, StepResult), and the handshake as ModelFacts:
protobuf stays in this module and convert.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsched.v1 import executor_pb2 as pb
from llmsched.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc import convert
from scheduler_svc.core.clock import SYSTEM_CLOCK, Clock
from scheduler_svc.core.model_facts import ModelFacts
from scheduler_svc.core.plan import StepPlan, StepResult

log = logging.getLogger(__name__)


class ExecutorUnavailable(Exception):
    """The executor cannot be reached or the step stream broke."""


class ExecutorClient:
    def __init__(self, address: str, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None,
                 keepalive_s: float = 10.0, clock: Clock = SYSTEM_CLOCK):
        self.address = address
        self.clock = clock
        self._credentials = credentials
        ms = int(keepalive_s * 1000)
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Keepalive pings find an executor that died or froze even when
            # no step is in flight: the health watch below then breaks.
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_timeout_ms", ms),
            # Newer gRPC cores time keepalive pings out by this one.
            ("grpc.http2.ping_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        self._channel: grpc.aio.Channel | None = None
        self._call = None

    async def connect(self, timeout_s: float,
                      check: Callable[[ModelFacts], None] | None = None) -> ModelFacts:
        """Handshakes and opens a fresh step stream, retrying with capped
        exponential backoff until timeout_s. The executor serves one
        scheduler at a time and refuses a second stream with
        FAILED_PRECONDITION; that is retried too, so a standby scheduler
        takes over once the first one is gone. `check` sees the handshake
        before the stream is asked for, and may refuse the executor by
        raising."""
        await self.close()
        deadline = self.clock.monotonic() + timeout_s
        delay = 0.05
        last_refusal = None
        while True:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            stub = pb_grpc.ExecutorStub(self._channel)
            try:
                handshake = await stub.Handshake(pb.HandshakeRequest(),
                                                 timeout=max(0.1, min(5.0, deadline - self.clock.monotonic())))
                info = convert.model_facts(handshake)
                if check is not None:
                    try:
                        check(info)
                    except BaseException:
                        await self._channel.close()
                        self._channel = None
                        raise
                self._call = stub.Step()
                # The executor sends initial metadata once it has accepted
                # this stream as its only one.
                await asyncio.wait_for(self._call.initial_metadata(), max(0.1, min(5.0, deadline - self.clock.monotonic())))
                if self._call.done():  # ended before accepting: refused or broken
                    code, details = await self._call.code(), await self._call.details()
                else:
                    return info
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
            except asyncio.TimeoutError:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "no answer"
            if self._call is not None:
                self._call.cancel()
                self._call = None
            await self._channel.close()
            self._channel = None
            if code == grpc.StatusCode.FAILED_PRECONDITION and details != last_refusal:
                log.warning("executor at %s refused the step stream: %s; retrying", self.address, details)
                last_refusal = details
            if self.clock.monotonic() + delay > deadline:
                raise ExecutorUnavailable(f"executor at {self.address} unavailable: {details}")
            log.debug("executor not ready (%s); retrying in %.2fs", code, delay)
            await asyncio.sleep(delay)  # backoff between connection attempts, not a poll for work
            delay = min(delay * 2, 1.0)

    async def send(self, out: StepPlan, after_idle: bool = False, traceparent: str = "") -> None:
        plan = convert.plan_to_proto(out)
        plan.after_idle = after_idle
        if traceparent:
            plan.traceparent = traceparent
        await self.send_plan(plan)

    async def send_plan(self, plan: pb.StepPlan) -> None:
        if self._call is None:
            raise ExecutorUnavailable("no step stream")
        try:
            await self._call.write(plan)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc

    async def receive(self) -> StepResult:
        """The result of the oldest plan sent and not yet answered."""
        return convert.outcome_from_proto(await self.receive_result())

    async def receive_result(self) -> pb.StepResult:
        if self._call is None:
            raise ExecutorUnavailable("no step stream")
        try:
            result = await self._call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc
        if result is grpc.aio.EOF:
            raise ExecutorUnavailable("executor closed the step stream")
        return result

    async def watch_health(self) -> str:
        """Returns when the executor stops serving or the connection to it
        breaks, with the reason. Runs while connected, busy or idle."""
        channel = self._channel
        if channel is None:
            return "not connected"
        try:
            async for resp in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="")):
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    return "executor health is NOT_SERVING"
            return "executor ended its health stream"
        except grpc.aio.AioRpcError as exc:
            return f"executor connection lost: {exc.code().name} {exc.details()}"

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
