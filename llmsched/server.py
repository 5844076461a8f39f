"""One place that builds a gRPC server for either service: health,
reflection, message-size limits and graceful shutdown."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import io
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from llmsched.errors import StartupError

log = logging.getLogger(__name__)

# A port handed out by free_port stays reserved this long, host-wide: the
# child that will bind it (an executor importing torch) may take seconds to
# get there, and meanwhile the kernel would happily hand the same port to
# another process's bind(0), e.g. another pytest-xdist worker.
PORT_RESERVATION_S = 120.0
_PORT_REGISTRY = Path(tempfile.gettempdir()) / f"llmsched-ports-{os.getuid()}.json"


def free_port() -> int:
    """A loopback port that is free now and that no free_port call in any
    process on this host handed out in the last PORT_RESERVATION_S."""
    with open(_PORT_REGISTRY, "a+") as registry:
        fcntl.flock(registry, fcntl.LOCK_EX)
        registry.seek(0)
        try:
            handed_out = {int(k): t for k, t in json.loads(registry.read() or "{}").items()}
        except (ValueError, AttributeError):
            handed_out = {}  # a torn or foreign file: start afresh
        now = time.time()
        handed_out = {port: t for port, t in handed_out.items() if now - t < PORT_RESERVATION_S}
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in handed_out:
                break
        handed_out[port] = now
        registry.seek(0)
        registry.truncate()
        registry.write(json.dumps(handed_out))
        return port

# Overall health is reported under the empty service name, as grpc health
# probes expect.
OVERALL = ""


def create_server(
    address: str,
    port_setting: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    max_message_bytes: int,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Iterable[tuple[str, int | str]] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Builds (but does not start) an aio server bound to address, with
    TLS when credentials are given. port_setting names the variable the
    port came from (EXECUTOR_PORT), for the error when it cannot bind.

    Returns the server, the bound port (useful with port 0) and the health
    servicer. gRPC's servicer starts the overall status as SERVING; callers
    must `await set_serving(..., False)` before starting the server and
    flip it when ready.
    """
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC sets SO_REUSEPORT by default: a second copy would bind
            # the same port and silently take half of the requests.
            ("grpc.so_reuseport", 0),
            *options,
        ],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        host, _, wanted = address.rpartition(":")
        raise StartupError(f"{port_setting}={wanted}: {_why_unbindable(host, int(wanted))} ({address})")
    return server, port, health_servicer


def _why_unbindable(host: str, port: int) -> str:
    """gRPC only says that the bind failed; a plain socket tells why."""
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host.strip("[]"), port))
    except OSError as exc:
        return _describe(exc)
    return "could not bind"


def _describe(exc: OSError) -> str:
    return "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))


def listen_tcp(host: str, port: int, port_setting: str) -> socket.socket:
    """A listening TCP socket for an HTTP server (the gateway's uvicorn),
    bound here so that a clash is the same one-line StartupError naming
    the setting as the gRPC services give, not the server's own message."""
    bare = host.strip("[]")
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle off on accepted
    # connections only for that proto, and with Nagle on each answer's body
    # waited for the client's delayed ACK of its headers (40 ms on Linux).
    sock = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no wait after a restart
    try:
        sock.bind((bare, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"{port_setting}={port}: {_describe(exc)} ({host}:{port})") from None
    sock.set_inheritable(True)
    return sock


def start_metrics_server(port: int, host: str, port_setting: str) -> None:
    """The Prometheus /metrics endpoint; port 0 turns it off."""
    if not port:
        return
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise StartupError(f"{port_setting}={port}: {_describe(exc)} ({host}:{port})") from None


async def set_serving(health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in [OVERALL, *names]:
        await health_servicer.set(name, status)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop`; the service then drains and exits."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def finished_within(awaitable, timeout_s: float, what: str) -> bool:
    """Awaits `awaitable` for at most timeout_s. On timeout logs `what`
    with every pending task's stack and returns False: the caller then
    exits with exit_now, since asyncio.run would wait on the stuck task
    forever. gRPC aio has been seen (about 1 stop in 20 under load) never
    to finish cancelling a call inside server.stop."""
    task = asyncio.ensure_future(awaitable)
    finished, _ = await asyncio.wait({task}, timeout=timeout_s)
    if finished:
        if task.exception() is not None:
            log.error("%s failed", what, exc_info=task.exception())
        return True
    log.error("%s did not finish within %.0fs; exiting without it. Pending tasks:\n%s", what, timeout_s,
              task_stacks())
    return False


def task_stacks() -> str:
    out = io.StringIO()
    for task in asyncio.all_tasks():
        try:
            task.print_stack(file=out)
        except Exception:  # gRPC's tasks run Cython coroutines, which have no frames
            out.write(f"{task!r}\n")
    return out.getvalue()


def exit_now(code: int) -> NoReturn:
    """os._exit(code) once the log handlers are flushed: for a process that
    must not run interpreter teardown (it would wait on a peer or a task
    that never ends), without losing the lines that say why, nor what was
    printed."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def freeze_start_up_objects() -> int:
    """Collects once, then moves every object alive after start-up (the
    model's modules, compiled graphs, tokenizers, imported libraries) into
    the collector's permanent generation: its collections then walk only
    what serving allocates, not the hundreds of thousands of objects that
    live as long as the process. Each step allocates Python objects, so
    collections run during steps; on stories260K's compiled decode graph,
    called in a loop in process, they took about a tenth of each call
    (perf: gc_collect_main and its visits), and freezing cut the call from
    189-228 to 174-181 µs. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
