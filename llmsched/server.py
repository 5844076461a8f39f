"""One place that builds a gRPC server for either service: health,
reflection, message-size limits and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Overall health is reported under the empty service name, as grpc health
# probes expect.
OVERALL = ""


def create_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    max_message_bytes: int,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Iterable[tuple[str, int | str]] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Builds (but does not start) an aio server bound to address, with
    TLS when credentials are given.

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
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    return server, port, health_servicer


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


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
