"""The scheduler's side of the step channel: handshake, then one
bidirectional stream on which each plan gets exactly one result, in order.
Plans may be sent before earlier results are read (pipelining). The stream
is gRPC's, or the executor's Unix socket when it offers one that can be
reached from here (llmsched/step_socket.py): the same messages, a quarter
of the round-trip cost.

Plans go out and results come back as the plain dataclasses the engine
core uses (StepPlan, StepResult), and the handshake as ModelFacts:
protobuf stays in this module and convert.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsched import step_socket
from llmsched.v1 import executor_pb2 as pb
from llmsched.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc import convert
from scheduler_svc.core.clock import SYSTEM_CLOCK, Clock
from scheduler_svc.core.model_facts import ModelFacts
from scheduler_svc.core.plan import StepPlan, StepResult

log = logging.getLogger(__name__)
# An adapter register reads it from disk and waits behind the step running.
LORA_RPC_TIMEOUT_S = 120.0
# The longest wait between connection attempts. An attempt is a handshake
# on loopback or a LAN, so a few a second cost nothing, and an executor
# that comes up (or back) is found within a quarter of a second, not a
# second later.
RETRY_CAP_S = 0.25


class ExecutorUnavailable(Exception):
    """The executor cannot be reached or the step stream broke."""


class GrpcStepStream:
    """The step stream as a gRPC bidirectional call."""

    transport = "grpc"

    def __init__(self, call):
        self.call = call

    async def write(self, plan: pb.StepPlan) -> None:
        try:
            await self.call.write(plan)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc

    async def read(self) -> pb.StepResult | None:
        try:
            result = await self.call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc
        return None if result is grpc.aio.EOF else result

    async def close(self) -> None:
        self.call.cancel()


class SocketStepStream:
    """The step stream as frames on the executor's Unix socket
    (llmsched/step_socket.py). While it is open, a frame goes out at least
    every half of the executor's keepalive interval (a KEEPALIVE when no
    plan did), which is how the executor tells a live scheduler from a
    frozen one on a socket (gRPC's own pings do it on gRPC)."""

    transport = "unix socket"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_bytes: int,
                 keepalive_s: float, clock: Clock):
        self.reader, self.writer, self.max_bytes = reader, writer, max_bytes
        self.clock = clock
        self._last_write = clock.monotonic()
        self._keepalive = asyncio.create_task(self._keep_alive(max(0.01, keepalive_s / 2)),
                                              name="step-socket-keepalive")

    async def _keep_alive(self, interval_s: float) -> None:
        while not self.writer.is_closing():
            # A timer, not a poll for work: it only judges elapsed time.
            await asyncio.sleep(max(0.0, self._last_write + interval_s - self.clock.monotonic()))
            if self.clock.monotonic() - self._last_write >= interval_s and not self.writer.is_closing():
                self._write(step_socket.KEEPALIVE, b"")

    def _write(self, kind: bytes, payload: bytes) -> None:
        step_socket.write_frame(self.writer, kind, payload)
        self._last_write = self.clock.monotonic()

    async def write(self, plan: pb.StepPlan) -> None:
        try:
            self._write(step_socket.PLAN, plan.SerializeToString())
            await self.writer.drain()
        except (ConnectionError, RuntimeError) as exc:  # RuntimeError: written after close
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc

    async def read(self) -> pb.StepResult | None:
        try:
            frame = await step_socket.read_frame(self.reader, self.max_bytes)
            if frame is None:
                return None
            kind, payload = frame
            if kind != step_socket.RESULT:
                raise step_socket.FrameError(f"a frame of kind {kind!r} where results come")
            return pb.StepResult.FromString(payload)
        except (ConnectionError, asyncio.IncompleteReadError, step_socket.FrameError, DecodeError) as exc:
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc

    async def close(self) -> None:
        self._keepalive.cancel()
        self.writer.close()


class ExecutorClient:
    def __init__(self, address: str, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None,
                 keepalive_s: float = 10.0, clock: Clock = SYSTEM_CLOCK, step_socket: str = "auto"):
        self.address = address
        self.clock = clock
        self.max_message_bytes = max_message_bytes
        # SCHEDULER_EXECUTOR_STEP_SOCKET: whether to take the socket an executor offers.
        self.use_step_socket = step_socket == "auto"
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
        self._stream: GrpcStepStream | SocketStepStream | None = None
        # The socket path a connect could not use, so that it is not tried
        # again (and logged again) at every reconnect to the same executor.
        self._unusable_socket = ""

    @property
    def transport(self) -> str:
        """What carries the step stream: "grpc" or "unix socket" ("" when none is open)."""
        return self._stream.transport if self._stream is not None else ""

    async def connect(self, timeout_s: float,
                      check: Callable[[ModelFacts], None] | None = None) -> ModelFacts:
        """Handshakes and opens a fresh step stream, retrying with capped
        exponential backoff until timeout_s. The stream goes over the Unix
        socket the executor offers when it can be reached from here, over
        gRPC otherwise. The executor serves one scheduler at a time and
        refuses a second stream with FAILED_PRECONDITION; that is retried
        too, so a standby scheduler takes over once the first one is gone.
        `check` sees the handshake before the stream is asked for, and may
        refuse the executor by raising."""
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
                wait = max(0.1, min(5.0, deadline - self.clock.monotonic()))
                refusal = None
                if self.use_step_socket and handshake.step_socket and handshake.step_socket != self._unusable_socket:
                    refusal = await self._open_socket(handshake.step_socket, handshake.instance_id, wait)
                if self._stream is None and refusal is None:
                    refusal = await self._open_grpc(stub, wait)
                if refusal is None:
                    return info
                code, details = refusal
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
            if self._stream is not None:
                await self._stream.close()
                self._stream = None
            await self._channel.close()
            self._channel = None
            if code == grpc.StatusCode.FAILED_PRECONDITION and details != last_refusal:
                log.warning("executor at %s refused the step stream: %s; retrying", self.address, details)
                last_refusal = details
            if self.clock.monotonic() + delay > deadline:
                raise ExecutorUnavailable(f"executor at {self.address} unavailable: {details}")
            log.debug("executor not ready (%s); retrying in %.2fs", code, delay)
            await asyncio.sleep(delay)  # backoff between connection attempts, not a poll for work
            delay = min(delay * 2, RETRY_CAP_S)

    async def _open_grpc(self, stub: pb_grpc.ExecutorStub, wait_s: float) -> tuple[grpc.StatusCode, str] | None:
        """Opens the gRPC step stream; None once the executor accepted it,
        else why not."""
        call = stub.Step()
        self._stream = GrpcStepStream(call)
        # The executor sends initial metadata once it has accepted this
        # stream as its only one.
        try:
            await asyncio.wait_for(call.initial_metadata(), wait_s)
        except asyncio.TimeoutError:
            return grpc.StatusCode.DEADLINE_EXCEEDED, "no answer"
        if call.done():  # ended before accepting: refused or broken
            return await call.code(), await call.details()
        return None

    async def _open_socket(self, path: str, instance_id: str, wait_s: float) -> tuple[grpc.StatusCode, str] | None:
        """Opens the step stream on the executor's Unix socket. None when
        it is open or cannot be used from here (the caller then uses gRPC;
        an executor in another container or on another host offers a path
        that is not there); else the executor's refusal."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), wait_s)
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("executor's step socket %s not usable from here (%s): using gRPC", path,
                     getattr(exc, "strerror", None) or type(exc).__name__)
            self._unusable_socket = path
            return None
        try:
            frame = await asyncio.wait_for(step_socket.read_frame(reader, self.max_message_bytes), wait_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, step_socket.FrameError) as exc:
            writer.close()
            return grpc.StatusCode.UNAVAILABLE, f"step socket {path}: {str(exc) or type(exc).__name__}"
        accepted = frame is not None and frame[0] == step_socket.ACCEPT and step_socket.parse_accept(frame[1])
        if accepted and accepted[0] == instance_id:
            self._stream = SocketStepStream(reader, writer, self.max_message_bytes, accepted[1], self.clock)
            return None
        writer.close()
        if frame is None:  # closed before answering: the executor is going away
            return grpc.StatusCode.UNAVAILABLE, f"step socket {path} closed before accepting the stream"
        if frame[0] == step_socket.REFUSE:
            return grpc.StatusCode.FAILED_PRECONDITION, frame[1].decode()
        # Some other executor answers at that path, not the one handshaken with.
        log.warning("step socket %s is not executor %s's: using gRPC", path, instance_id)
        self._unusable_socket = path
        return None

    async def send(self, out: StepPlan, after_idle: bool = False, traceparent: str = "") -> None:
        plan = convert.plan_to_proto(out)
        plan.after_idle = after_idle
        if traceparent:
            plan.traceparent = traceparent
        await self.send_plan(plan)

    async def send_plan(self, plan: pb.StepPlan) -> None:
        if self._stream is None:
            raise ExecutorUnavailable("no step stream")
        await self._stream.write(plan)

    async def receive(self) -> StepResult:
        """The result of the oldest plan sent and not yet answered."""
        return convert.outcome_from_proto(await self.receive_result())

    async def receive_result(self) -> pb.StepResult:
        if self._stream is None:
            raise ExecutorUnavailable("no step stream")
        result = await self._stream.read()
        if result is None:
            raise ExecutorUnavailable("executor closed the step stream")
        return result

    async def register_lora(self, key: str, path: str) -> pb.RegisterLoraAdapterResponse:
        """Raises grpc.aio.AioRpcError with the executor's refusal, or
        ExecutorUnavailable when not connected."""
        if self._channel is None:
            raise ExecutorUnavailable("not connected")
        return await pb_grpc.ExecutorStub(self._channel).RegisterLoraAdapter(
            pb.RegisterLoraAdapterRequest(key=key, path=path), timeout=LORA_RPC_TIMEOUT_S)

    async def unregister_lora(self, key: str) -> bool:
        if self._channel is None:
            raise ExecutorUnavailable("not connected")
        resp = await pb_grpc.ExecutorStub(self._channel).UnregisterLoraAdapter(
            pb.UnregisterLoraAdapterRequest(key=key), timeout=LORA_RPC_TIMEOUT_S)
        return resp.found

    async def watch_health(self) -> str:
        """Returns when the executor stops serving or the connection to it
        breaks, with the reason. Runs while connected, busy or idle."""
        reason = await self._health_watch()
        if isinstance(self._stream, SocketStepStream):
            # gRPC's keepalive ends a gRPC step stream to a frozen executor;
            # a socket stays open to one, so a read waiting on it is ended here.
            await self._stream.close()
        return reason

    async def _health_watch(self) -> str:
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
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
