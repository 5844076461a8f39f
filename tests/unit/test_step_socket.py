"""The step stream's frames on a Unix socket (llmsched/step_socket.py) and
the scheduler's side of it (SocketStepStream): what goes over the wire,
what breaks the protocol, and the keepalive frames an idle scheduler sends.
The executor's side runs in every integration test (the default)."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from llmsched import step_socket
from llmsched.v1 import executor_pb2 as pb
from scheduler_svc.core.clock import SYSTEM_CLOCK
from scheduler_svc.executor_client import ExecutorUnavailable, SocketStepStream


async def _pair(tmp_path, handler):
    path = tmp_path / "s.sock"
    server = await step_socket.start_server(handler, path)
    reader, writer = await asyncio.open_unix_connection(str(path))
    return server, path, reader, writer


def test_frames_cross_the_socket_whole_and_in_order_and_the_socket_is_owner_only(tmp_path):
    async def run():
        got = []

        async def handler(reader, writer):
            while (frame := await step_socket.read_frame(reader, 1 << 20)) is not None:
                got.append(frame)
            writer.close()

        server, path, reader, writer = await _pair(tmp_path, handler)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "the socket must be its owner's only"
        big = bytes(range(256)) * 1000
        for kind, payload in [(step_socket.PLAN, b"x"), (step_socket.KEEPALIVE, b""), (step_socket.PLAN, big)]:
            step_socket.write_frame(writer, kind, payload)
        await writer.drain()
        writer.close()
        await asyncio.sleep(0.1)
        server.close()
        return got, big

    got, big = asyncio.run(run())
    assert got == [(b"P", b"x"), (b"K", b""), (b"P", big)]


@pytest.mark.parametrize("raw, why", [
    (b"\x05\x00\x00\x00P", "a frame cut short"),
    (b"\x00\x00\x00\x00", "a frame of 0 bytes"),
    (b"\xff\xff\xff\x7f", "a frame of 2147483647 bytes"),
    (b"\x01\x00", "inside a frame's length"),
])
def test_a_frame_that_breaks_the_protocol_is_an_error_not_a_hang(tmp_path, raw, why):
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await step_socket.read_frame(reader, 1 << 20)

    with pytest.raises((step_socket.FrameError, asyncio.IncompleteReadError)):
        asyncio.run(run())


def test_accept_carries_the_instance_and_keepalive_and_a_malformed_one_is_none():
    assert step_socket.parse_accept(step_socket.accept_payload("abc123", 2.5)) == ("abc123", 2.5)
    assert step_socket.parse_accept(b"abc123") is None
    assert step_socket.parse_accept(b"a b c") is None


def test_the_socket_path_is_per_instance_and_fits_a_unix_socket_address():
    a, b = step_socket.socket_path("f" * 32), step_socket.socket_path("e" * 32)
    assert a != b
    assert len(str(step_socket.socket_path("f" * 32, "/tmp"))) < 108


def test_an_idle_scheduler_sends_keepalives_and_plans_and_results_pass_unchanged(tmp_path):
    async def run():
        frames = []

        async def executor(reader, writer):
            while (frame := await step_socket.read_frame(reader, 1 << 20)) is not None:
                frames.append(frame[0])
                if frame[0] == step_socket.PLAN:
                    plan = pb.StepPlan.FromString(frame[1])
                    step_socket.write_frame(writer, step_socket.RESULT,
                                            pb.StepResult(step_id=plan.step_id).SerializeToString())
            writer.close()

        server, _, reader, writer = await _pair(tmp_path, executor)
        stream = SocketStepStream(reader, writer, 1 << 20, keepalive_s=0.1, clock=SYSTEM_CLOCK)
        await asyncio.sleep(0.35)  # idle: a keepalive every 0.05 s
        await stream.write(pb.StepPlan(step_id=7))
        result = await stream.read()
        await stream.close()
        await asyncio.sleep(0.05)
        server.close()
        return frames, result

    frames, result = asyncio.run(run())
    assert result.step_id == 7
    assert frames.count(step_socket.KEEPALIVE) >= 3, f"an idle stream sent {frames}"
    assert frames[-1] == step_socket.PLAN


@pytest.mark.parametrize("sends, expect", [(b"R", "a frame of kind b'R' where results come"), (None, "closed")])
def test_an_executor_that_answers_out_of_protocol_or_closes_ends_the_stream(tmp_path, sends, expect):
    async def run():
        async def executor(reader, writer):
            if sends is not None:
                step_socket.write_frame(writer, sends, b"not a result")
                await writer.drain()
            writer.close()

        server, _, reader, writer = await _pair(tmp_path, executor)
        stream = SocketStepStream(reader, writer, 1 << 20, keepalive_s=10, clock=SYSTEM_CLOCK)
        try:
            return await stream.read()
        except ExecutorUnavailable as exc:
            return str(exc)
        finally:
            await stream.close()
            server.close()

    got = asyncio.run(run())
    if expect == "closed":
        assert got is None, "a closed socket is the end of the stream"
    else:
        assert expect in got
