"""The scheduler's side of the step channel: handshake, then one
bidirectional stream on which each plan gets exactly one result."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from llmsched.v1 import executor_pb2 as pb
from llmsched.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class ExecutorUnavailable(Exception):
    """The executor cannot be reached or the step stream broke."""


class ExecutorClient:
    def __init__(self, address: str, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self._credentials = credentials
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._channel: grpc.aio.Channel | None = None
        self._call = None

    async def connect(self, timeout_s: float) -> pb.HandshakeResponse:
        """Handshakes, retrying with capped exponential backoff until
        timeout_s; then opens a fresh step stream."""
        await self.close()
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            stub = pb_grpc.ExecutorStub(self._channel)
            try:
                info = await stub.Handshake(pb.HandshakeRequest(), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                self._call = stub.Step()
                return info
            except grpc.aio.AioRpcError as exc:
                await self._channel.close()
                self._channel = None
                if time.monotonic() + delay > deadline:
                    raise ExecutorUnavailable(f"executor at {self.address} unreachable: {exc.details()}") from exc
                log.debug("executor not ready (%s); retrying in %.2fs", exc.code(), delay)
                await asyncio.sleep(delay)  # backoff between connection attempts, not a poll for work
                delay = min(delay * 2, 1.0)

    async def step(self, plan: pb.StepPlan) -> pb.StepResult:
        if self._call is None:
            raise ExecutorUnavailable("no step stream")
        try:
            await self._call.write(plan)
            result = await self._call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ExecutorUnavailable(f"step stream broke: {exc}") from exc
        if result is grpc.aio.EOF:
            raise ExecutorUnavailable("executor closed the step stream")
        return result

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
