"""python -m scheduler_svc: serve llmsched.v1.Scheduler until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import faulthandler
import logging

from llmsched import server as srv
from llmsched.errors import StartupError, exit_with, load_settings
from llmsched.security import ApiKeyInterceptor, load_api_keys, server_credentials
from llmsched.tracing import setup_tracing
from llmsched.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.engine import Engine
from scheduler_svc.service import SchedulerService

log = logging.getLogger("scheduler_svc")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


async def serve(settings: SchedulerSettings) -> int:
    """Returns the process exit code."""
    health_ref = {}
    health_lock = asyncio.Lock()  # FIFO: changes land in the order they happen

    async def set_serving(serving: bool) -> None:
        async with health_lock:
            await srv.set_serving(health_ref["servicer"], [SERVICE_NAME], serving)

    def on_serving_change(serving: bool) -> None:
        if "servicer" in health_ref:
            asyncio.get_running_loop().create_task(set_serving(serving))

    tracing = setup_tracing("scheduler")
    srv.start_metrics_server(settings.metrics_port, settings.host, "SCHEDULER_METRICS_PORT")
    engine = Engine(settings, tracing, on_serving_change)
    keys = load_api_keys(settings.api_keys, settings.api_keys_file)
    service = SchedulerService(engine, tracing, api_keys_on=bool(keys))
    server, port, health = srv.create_server(
        f"{settings.host}:{settings.port}",
        "SCHEDULER_PORT",
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, s),
        [SERVICE_NAME],
        settings.max_message_bytes,
        credentials=server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
        interceptors=[ApiKeyInterceptor(keys)] if keys else [],
    )
    health_ref["servicer"] = health
    # NOT_SERVING until an executor is connected: probes and launchers
    # must not send traffic that can only get UNAVAILABLE.
    await srv.set_serving(health, [SERVICE_NAME], False)
    stop = asyncio.Event()
    srv.install_stop_signals(stop)
    await server.start()
    log.info("scheduler listening on %s:%d; connecting to executor at %s", settings.host, port, settings.executor_address)
    start = asyncio.create_task(engine.start())
    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if start in done and start.exception() is None:
        await stop_wait  # health follows the engine's connection from here
    elif start in done:
        log.error("could not start: %s", start.exception())
        code = 1
    log.info("shutting down: draining for up to %.0fs", settings.drain_timeout_s)
    # Shutdown is bounded (drain, then 5 s of aborts, 5 s of gRPC grace, 2 s
    # of trace flush): should it still hang, here or in the interpreter's
    # teardown, every thread's stack goes to stderr, so the log says where.
    # Left armed until the process exits.
    faulthandler.dump_traceback_later(settings.drain_timeout_s + 20, exit=False)
    await srv.set_serving(health, [SERVICE_NAME], False)
    if start in done and start.exception() is None:
        # New calls get UNAVAILABLE; live ones finish or end with ABORT.
        await engine.drain(settings.drain_timeout_s)
    await server.stop(grace=5.0)
    start.cancel()
    stop_wait.cancel()
    await engine.stop()
    tracing.shutdown()
    return code


def main() -> None:
    try:
        settings = load_settings(SchedulerSettings)
        srv.setup_logging(settings.log_level)
        code = asyncio.run(serve(settings))
    except StartupError as exc:
        exit_with("scheduler", exc)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
