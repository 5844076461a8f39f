"""python -m executor_svc: serve llmsched.v1.Executor until SIGTERM/SIGINT."""

from __future__ import annotations

import os

from llmsched import cpus
from llmsched.errors import StartupError, exit_with

# Compiled decode steps (EXECUTOR_TORCH_COMPILE) are cached across restarts
# in a directory of our own, not in /tmp where inductor puts them (in a
# subdirectory per vector ISA: inductor_cache.py).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmsched", "inductor"))
# Before anything loads torch: the threads torch starts inherit this
# process's cores (llmsched/cpus.py).
try:
    cpus.apply_from_env("executor")
except StartupError as exc:
    exit_with("executor", exc)

import asyncio  # noqa: E402
import logging  # noqa: E402

import torch  # noqa: E402

from executor_svc.config import ExecutorSettings  # noqa: E402
from executor_svc.loading import load  # noqa: E402
from executor_svc.model.model_config import UnsupportedConfig  # noqa: E402
from executor_svc.service import ExecutorService  # noqa: E402
from executor_svc.step.step_loop import load_on_step_thread  # noqa: E402
from executor_svc.tensor_parallel import is_worker_rank  # noqa: E402
from executor_svc.tp_worker import run_worker  # noqa: E402
from llmsched import logs  # noqa: E402
from llmsched import server as srv  # noqa: E402
from llmsched import step_socket  # noqa: E402
from llmsched.errors import load_settings  # noqa: E402
from llmsched.security import server_credentials  # noqa: E402
from llmsched.tracing import setup_tracing  # noqa: E402
from llmsched.v1 import executor_pb2, executor_pb2_grpc  # noqa: E402

log = logging.getLogger("executor_svc")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
# gRPC's grace (5 s) plus draining the step sockets (5 s).
CLOSE_TIMEOUT_S = 12.0


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """Ping the scheduler every interval_s and drop it after as long without
    an answer; accept the scheduler's own pings (it sends them every few
    seconds, idle or not, which gRPC servers otherwise punish)."""
    ms = int(interval_s * 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        # Newer gRPC cores time keepalive pings out by this one.
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


async def start_step_socket(settings: ExecutorSettings, service: ExecutorService) -> asyncio.AbstractServer | None:
    """EXECUTOR_STEP_SOCKET: the step stream on a Unix socket too, for a
    scheduler on this host; None when it is off, or TLS guards the stream."""
    if settings.step_socket == "off":
        return None
    if settings.tls_cert:
        log.info("step socket not offered: EXECUTOR_TLS_CERT is set, so every step goes through TLS")
        return None
    path = step_socket.socket_path(service.instance_id, settings.step_socket_dir)
    try:
        server = await step_socket.start_server(service.serve_step_socket, path)
    except (OSError, ValueError) as exc:  # ValueError: a path past a Unix socket's 107 bytes
        # `auto` offers what it can: the step stream stays on gRPC, which serves the same.
        log.warning("step socket not offered: cannot listen at %s: %s (set EXECUTOR_STEP_SOCKET_DIR to a short, "
                    "writable directory, or EXECUTOR_STEP_SOCKET=off); steps go over gRPC",
                    path, getattr(exc, "strerror", None) or exc)
        return None
    service.step_socket_path = path
    log.info("step stream also offered on %s", path)
    return server


async def serve(settings: ExecutorSettings) -> None:
    # The metrics port first: a clash then shows before the model loads.
    srv.start_metrics_server(settings.metrics_port, settings.host, "EXECUTOR_METRICS_PORT")
    tracing = setup_tracing("executor")
    loaded, step_thread = await load_on_step_thread(lambda: load(settings))
    # OpenMP keeps the thread count per thread, and compiled kernels start
    # teams of that count: the event loop, where a one-thread executor runs
    # its decode steps, takes the loading thread's (else it would start
    # teams of one thread per core, whose idle threads spin).
    torch.set_num_threads(loaded.torch_threads)
    service = ExecutorService(settings, tracing, loaded, step_thread)
    frozen = srv.freeze_start_up_objects()
    log.info("start-up done: %d objects moved out of the garbage collector's reach", frozen)
    server, port, health = srv.create_server(
        f"{settings.host}:{settings.port}",
        "EXECUTOR_PORT",
        lambda s: executor_pb2_grpc.add_ExecutorServicer_to_server(service, s),
        [SERVICE_NAME],
        settings.max_message_bytes,
        credentials=server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
        options=keepalive_options(settings.scheduler_keepalive_s),
    )
    await srv.set_serving(health, [SERVICE_NAME], False)
    stop = asyncio.Event()
    srv.install_stop_signals(stop)
    await server.start()
    socket_server = await start_step_socket(settings, service)
    await srv.set_serving(health, [SERVICE_NAME], True)
    log.info("executor listening on %s:%d", settings.host, port)
    heartbeats = asyncio.create_task(service.heartbeats()) if service.tp else None
    await stop.wait()
    log.info("shutting down")
    service.stopping = True
    await srv.set_serving(health, [SERVICE_NAME], False)
    # Bounded, as in the scheduler: a gRPC call that never finishes
    # cancelling would otherwise hold the process until it is killed.
    closed = await srv.finished_within(_close_connections(server, socket_server, service), CLOSE_TIMEOUT_S,
                                       "closing connections")
    if heartbeats:
        heartbeats.cancel()  # only now: the other ranks wait on them until the shutdown message
    service.close()
    tracing.shutdown()
    log.info("stopped" if closed else "stopped without closing every connection")
    # Without the interpreter's teardown: everything the executor owes
    # anyone is done (the last step answered, sockets removed, traces
    # flushed); what is left is Python unloading torch's thousands of
    # objects, about 0.5-0.9 s a process on two cores, that a restart or an
    # orchestrator's rolling update would wait for.
    srv.exit_now(0)


async def _close_connections(server, socket_server, service: ExecutorService) -> None:
    # The grace period lets the step in flight finish and reach the scheduler.
    await server.stop(grace=5.0)
    if socket_server is not None:
        socket_server.close()
        await service.drain_step_sockets(grace_s=5.0)
        service.step_socket_path.unlink(missing_ok=True)


def main() -> None:
    logs.setup("executor", fmt=logs.format_from_env("EXECUTOR"))
    try:
        settings = load_settings(ExecutorSettings)
        logs.setup("executor", settings.log_level, settings.log_format)
        if is_worker_rank(settings):
            loaded = load(settings)
            srv.freeze_start_up_objects()
            run_worker(loaded)  # tensor-parallel rank > 0: no gRPC, no metrics
        else:
            asyncio.run(serve(settings))
    except StartupError as exc:
        exit_with("executor", exc)
    except UnsupportedConfig as exc:
        # Refusing to start beats serving a checkpoint with wrong tokens.
        log.error("cannot serve %s: %s", settings.model, exc)
        raise SystemExit(2) from None
    srv.exit_now(0)  # a tensor-parallel worker's clean stop: as serve()'s


if __name__ == "__main__":
    main()
