"""python -m executor_svc: serve llmsched.v1.Executor until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import start_http_server

from executor_svc.config import ExecutorSettings
from executor_svc.model_config import UnsupportedConfig
from executor_svc.service import ExecutorService
from llmsched import server as srv
from llmsched.security import server_credentials
from llmsched.tracing import setup_tracing
from llmsched.v1 import executor_pb2, executor_pb2_grpc

log = logging.getLogger("executor_svc")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


async def serve(settings: ExecutorSettings) -> None:
    tracing = setup_tracing("executor")
    service = ExecutorService(settings, tracing)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)
    server, port, health = srv.create_server(
        f"{settings.host}:{settings.port}",
        lambda s: executor_pb2_grpc.add_ExecutorServicer_to_server(service, s),
        [SERVICE_NAME],
        settings.max_message_bytes,
        credentials=server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
    )
    stop = asyncio.Event()
    srv.install_stop_signals(stop)
    await server.start()
    await srv.set_serving(health, [SERVICE_NAME], True)
    log.info("executor listening on %s:%d", settings.host, port)
    await stop.wait()
    log.info("shutting down")
    service.stopping = True
    await srv.set_serving(health, [SERVICE_NAME], False)
    # The grace period lets the step in flight finish and reach the scheduler.
    await server.stop(grace=5.0)
    service.close()
    tracing.shutdown()


def main() -> None:
    settings = ExecutorSettings()
    srv.setup_logging(settings.log_level)
    try:
        asyncio.run(serve(settings))
    except UnsupportedConfig as exc:
        # Refusing to start beats serving a checkpoint with wrong tokens.
        log.error("cannot serve %s: %s", settings.model, exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
