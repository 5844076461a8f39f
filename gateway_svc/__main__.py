"""python -m gateway_svc: serve the OpenAI-compatible API until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

import uvicorn

from gateway_svc.app import create_app
from gateway_svc.config import GatewaySettings
from llmsched import cpus, logs
from llmsched import server as srv
from llmsched.errors import StartupError, exit_with, load_settings
from llmsched.tracing import setup_tracing


def main() -> None:
    logs.setup("gateway", fmt=logs.format_from_env("GATEWAY"))
    try:
        cpus.apply_from_env("gateway")
        settings = load_settings(GatewaySettings)
    except StartupError as exc:
        exit_with("gateway", exc)
    logs.setup("gateway", settings.log_level, settings.log_format)
    try:
        listener = srv.listen_tcp(settings.host, settings.port, "GATEWAY_PORT")
    except StartupError as exc:
        exit_with("gateway", exc)
    tracing = setup_tracing("gateway")
    interceptors = None
    if tracing.enabled:
        # The instrumentation packages make the HTTP span the parent of the
        # client's Generate call and put its traceparent in the gRPC
        # metadata, where the scheduler picks it up.
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        interceptors = aio_client_interceptors(tracer_provider=tracing.provider)
    app = create_app(settings, interceptors)
    if tracing.enabled:
        FastAPIInstrumentor.instrument_app(app, tracer_provider=tracing.provider, excluded_urls="health,metrics")
    try:
        # uvicorn handles SIGTERM and SIGINT itself: it stops accepting,
        # lets live responses finish, then runs the app's shutdown.
        # log_config=None: its loggers go through the handler set up above
        # (text or JSON) instead of uvicorn's own.
        logging.getLogger("gateway_svc").info("gateway listening on %s:%d; scheduler at %s", settings.host,
                                              listener.getsockname()[1], settings.scheduler_address)
        config = uvicorn.Config(app, log_level=settings.log_level.lower(), access_log=False, log_config=None)
        uvicorn.Server(config).run(sockets=[listener])
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
