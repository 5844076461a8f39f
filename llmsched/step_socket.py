"""The step stream over a Unix socket, for a scheduler on the executor's
own host (issue 37: the hand-off between steps).

gRPC's step stream costs about 300 µs a plan round trip between two Python
processes on one host (HTTP/2 framing, gRPC's own threads and queues, and
the hops between them and asyncio); length-prefixed frames on a Unix
socket, read by asyncio directly, cost about 80 µs (2 cores, the bench in
docs/performance.md P24). Everything else stays on gRPC: the handshake,
health and the public API. The messages are the same StepPlan and
StepResult protobufs, so the two paths differ only in transport.

A frame is a 4-byte little-endian length, then one kind byte and its
payload:

- the executor's first frame is ACCEPT (its instance id, which the
  scheduler checks against the handshake's: the socket is found by a path,
  and the path must lead to the executor it handshook with; and its
  keepalive interval) or REFUSE (the reason, as gRPC's FAILED_PRECONDITION:
  another scheduler holds the stream);
- then the scheduler sends PLAN frames and the executor RESULT frames, one
  per plan, in order, as on the gRPC stream;
- the scheduler also sends a KEEPALIVE frame whenever it has sent nothing
  for half the executor's keepalive interval. The executor drops a stream
  silent for twice that interval: a frozen scheduler (stopped, not dead)
  would otherwise hold the executor for ever, where gRPC's pings drop it.

Closing the socket ends the stream, either way. The socket file is made
readable and writable by its owner only: a process that may connect is one
that could read the executor's memory anyway.
"""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
from pathlib import Path

ACCEPT, REFUSE, PLAN, RESULT, KEEPALIVE = b"A", b"R", b"P", b"S", b"K"
_LENGTH = struct.Struct("<I")


class FrameError(Exception):
    """A frame that breaks the protocol: too long, empty or of an unexpected kind."""


def socket_path(instance_id: str, directory: str = "") -> Path:
    """Where an executor offers its step socket: one path per executor
    instance, so that a path left behind by a killed one is never reused
    (and a scheduler that finds a path finds the executor that made it).
    Unix socket paths are limited to 107 bytes: the id is shortened."""
    return Path(directory or tempfile.gettempdir()) / f"llmsched-step-{instance_id[:16]}.sock"


def accept_payload(instance_id: str, keepalive_s: float) -> bytes:
    return f"{instance_id} {keepalive_s!r}".encode()


def parse_accept(payload: bytes) -> tuple[str, float] | None:
    """(instance id, keepalive interval in seconds) of an ACCEPT frame, or None if malformed."""
    try:
        instance_id, keepalive_s = payload.decode().split(" ")
        return instance_id, float(keepalive_s)
    except ValueError:
        return None


def write_frame(writer: asyncio.StreamWriter, kind: bytes, payload: bytes = b"") -> None:
    writer.write(_LENGTH.pack(len(payload) + 1) + kind + payload)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes] | None:
    """(kind, payload) of the next frame, or None at a clean end of stream."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("the stream ended inside a frame's length") from None
        return None
    (length,) = _LENGTH.unpack(head)
    if length == 0 or length > max_bytes + 1:
        raise FrameError(f"a frame of {length} bytes (the most is {max_bytes + 1})")
    body = await reader.readexactly(length)
    return body[:1], body[1:]


async def start_server(handler, path: Path) -> asyncio.AbstractServer:
    """Listens at path, owner-only. A file already there is replaced (paths
    are per instance: only a dead namesake could have left one)."""
    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        return await asyncio.start_unix_server(handler, str(path))
    finally:
        os.umask(old)
