"""python -m scheduler_svc: serve llmsched.v1.Scheduler until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from llmsched import cpus, logs
from llmsched import server as srv
from llmsched.errors import StartupError, exit_with, load_settings
from llmsched.security import ApiKeyInterceptor, load_api_keys, server_credentials
from llmsched.tracing import setup_tracing
from llmsched.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.engine import Engine
from scheduler_svc.executor_link import make_executor_client
from scheduler_svc.service import SchedulerService
from scheduler_svc.tenants import ApiKeys

log = logging.getLogger("scheduler_svc")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# gRPC grace (5 s) plus closing the executor connection.
CLOSE_TIMEOUT_S = 10.0


async def serve(settings: SchedulerSettings) -> NoReturn:
    """Serves until SIGTERM or SIGINT, then drains and exits the process
    (code 0, or 1 when it could not start); a StartupError is raised for
    main() to print."""
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
    engine = Engine(settings, tracing, make_executor_client(settings), on_serving_change)
    entries = load_api_keys(settings.api_keys, settings.api_keys_file)
    api_keys = ApiKeys.parse(entries) if entries else None
    service = SchedulerService(engine, tracing, api_keys=api_keys, request_log=settings.request_log)
    server, port, health = srv.create_server(
        f"{settings.host}:{settings.port}",
        "SCHEDULER_PORT",
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, s),
        [SERVICE_NAME],
        settings.max_message_bytes,
        credentials=server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
        interceptors=[ApiKeyInterceptor(api_keys.keys)] if api_keys else [],
    )
    health_ref["servicer"] = health
    # NOT_SERVING until an executor is connected: probes and launchers
    # must not send traffic that can only get UNAVAILABLE.
    await srv.set_serving(health, [SERVICE_NAME], False)
    stop = asyncio.Event()
    srv.install_stop_signals(stop)
    await server.start()
    frozen = srv.freeze_start_up_objects()
    log.info("scheduler listening on %s:%d; connecting to executor at %s (%d start-up objects moved out of the "
             "garbage collector's reach)", settings.host, port, settings.executor_address, frozen)
    start = asyncio.create_task(engine.start())
    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    refused = None  # a StartupError: main() prints it as its one line
    if start in done and start.exception() is None:
        await stop_wait  # health follows the engine's connection from here
    elif start in done and isinstance(start.exception(), StartupError):
        refused, code = start.exception(), 1
    elif start in done:
        log.error("could not start: %s", start.exception())
        code = 1
    log.info("shutting down: draining for up to %.0fs", settings.drain_timeout_s)
    await srv.set_serving(health, [SERVICE_NAME], False)
    if start in done and start.exception() is None:
        # New calls get UNAVAILABLE; live ones finish or end with ABORT.
        await engine.drain(settings.drain_timeout_s)
    start.cancel()
    stop_wait.cancel()
    # Every request has finished or been aborted by now; what is left closes
    # connections. Bounded: the process exits anyway, saying where it hung.
    closed = await srv.finished_within(_close(server, engine), CLOSE_TIMEOUT_S, "closing connections")
    tracing.shutdown()
    if refused is not None and closed:
        raise refused
    # Nothing is owed to anyone now. Exiting here skips asyncio.run's and
    # the interpreter's teardown, which wait on every thread the process
    # started (tokenizer and grammar-compile workers, gRPC's own): a stop
    # once took past the launcher's 15 s with no line after "draining".
    log.info("stopped")
    srv.exit_now(code)


async def _close(server, engine: Engine) -> None:
    await server.stop(grace=5.0)
    await engine.stop()


def main() -> None:
    # Configured from the environment first, so that a settings error is
    # already in the format asked for.
    logs.setup("scheduler", fmt=logs.format_from_env("SCHEDULER"))
    try:
        cpus.apply_from_env("scheduler")  # before gRPC starts its threads
        settings = load_settings(SchedulerSettings)
        logs.setup("scheduler", settings.log_level, settings.log_format)
        asyncio.run(serve(settings))
    except StartupError as exc:
        exit_with("scheduler", exc)


if __name__ == "__main__":
    main()
