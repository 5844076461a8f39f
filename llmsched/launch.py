"""Starts the executor, the scheduler and (optionally) the OpenAI gateway
as processes and stops them together. Used by `make serve`, the integration
tests and the benchmarks.

    python -m llmsched.launch            # tiny-random on 50051/50052, OpenAI API on 8080

It reads the services' own variables (ports, TLS) and two of its own:
LLMSCHED_START_TIMEOUT_S, how long each service may take to start (120 s;
a large checkpoint on a slow disk needs more), and LLMSCHED_PIN_CPUS: `auto`
(the default) runs the scheduler and gateway on the lowest core and the
executor on the others (on both of two), where there are two or more
(llmsched/cpus.py); `off` leaves placement to the operating system.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsched import cpus, logs
from llmsched.errors import StartupError
from llmsched.security import channel_credentials
from llmsched.server import free_port

DEFAULT_START_TIMEOUT_S = 120.0
START_TIMEOUT_SETTING = "LLMSCHED_START_TIMEOUT_S"
# A channel to a port nobody listens on yet backs off before it tries again,
# by gRPC's default from 1 s up to 2 minutes, so a probe sharing one channel
# would see a service up to seconds after it listens. Probes of a local
# start-up retry within a tenth of a second instead.
PROBE_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                         ("grpc.max_reconnect_backoff_ms", 100)]


def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Blocks until the health service at address reports SERVING."""
    deadline = time.monotonic() + timeout_s
    channel = (grpc.secure_channel(address, credentials, options=PROBE_CHANNEL_OPTIONS) if credentials
               else grpc.insecure_channel(address, options=PROBE_CHANNEL_OPTIONS))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {proc.returncode} before serving")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become SERVING within {timeout_s}s")
            time.sleep(0.1)  # start-up probe of another process: no event to wait on


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Blocks until GET url answers 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s}s")
        time.sleep(0.1)  # start-up probe of another process: no event to wait on


def stop_process(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    """SIGTERM, then SIGKILL after timeout_s; the exit code, or None when
    there was no process. One that already exited is left as it is."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@dataclass
class Services:
    """The services as child processes (the gateway when gateway_port is set)."""

    scheduler_port: int
    executor_port: int
    scheduler_metrics_port: int = 0
    executor_metrics_port: int = 0
    executor_env: dict[str, str] = field(default_factory=dict)
    scheduler_env: dict[str, str] = field(default_factory=dict)
    # The OpenAI-compatible gateway; port 0 = not started.
    gateway_port: int = 0
    gateway_env: dict[str, str] = field(default_factory=dict)
    executor: subprocess.Popen | None = None
    scheduler: subprocess.Popen | None = None
    gateway: subprocess.Popen | None = None
    stdout: object = None
    # For the start-up health probes when a service uses TLS.
    scheduler_credentials: grpc.ChannelCredentials | None = None
    executor_credentials: grpc.ChannelCredentials | None = None
    # How long start() waits for each service to serve.
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    @property
    def executor_address(self) -> str:
        return f"127.0.0.1:{self.executor_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start_executor(self, timeout_s: float = 120.0, wait: bool = True) -> None:
        """Starts the executor; with wait, returns once it serves."""
        env = {
            **os.environ,
            "EXECUTOR_PORT": str(self.executor_port),
            "EXECUTOR_METRICS_PORT": str(self.executor_metrics_port),
            **self._cpus_env("executor"),
            **self.executor_env,
        }
        self.executor = subprocess.Popen([sys.executable, "-m", "executor_svc"], env=env, stdout=self.stdout, stderr=self.stdout)
        if wait:
            wait_serving(self.executor_address, timeout_s, self.executor, self.executor_credentials)

    def start_scheduler(self, timeout_s: float = 120.0, wait: bool = True) -> None:
        """Starts the scheduler; with wait, returns once it serves (which
        it does once connected to an executor)."""
        env = {
            **os.environ,
            "SCHEDULER_PORT": str(self.scheduler_port),
            "SCHEDULER_METRICS_PORT": str(self.scheduler_metrics_port),
            "SCHEDULER_EXECUTOR_ADDRESS": self.executor_address,
            **self._cpus_env("scheduler"),
            **self.scheduler_env,
        }
        self.scheduler = subprocess.Popen([sys.executable, "-m", "scheduler_svc"], env=env, stdout=self.stdout, stderr=self.stdout)
        if wait:
            wait_serving(self.scheduler_address, timeout_s, self.scheduler, self.scheduler_credentials)

    @staticmethod
    def _cpus_env(service: str) -> dict[str, str]:
        """LLMSCHED_CPUS for a child (llmsched/cpus.py): the executor on all
        cores but one, the scheduler and the gateway on that one. Nothing
        with LLMSCHED_PIN_CPUS=off, on one core, or where the caller set
        LLMSCHED_CPUS itself (then every child takes that)."""
        if cpus.CPUS_ENV in os.environ or cpus.pin_mode(os.environ) == "off":
            return {}
        split = cpus.split_for_services(cpus.usable_cpus())
        if split is None:
            return {}
        executor, others = split
        return {cpus.CPUS_ENV: cpus.format_cpu_list(executor if service == "executor" else others)}

    def start_gateway(self, timeout_s: float = 60.0) -> None:
        env = {
            **os.environ,
            "GATEWAY_PORT": str(self.gateway_port),
            "GATEWAY_SCHEDULER_ADDRESS": self.scheduler_address,
            **self._cpus_env("gateway"),
            **self.gateway_env,
        }
        self.gateway = subprocess.Popen([sys.executable, "-m", "gateway_svc"], env=env, stdout=self.stdout, stderr=self.stdout)
        wait_http_ok(f"{self.gateway_url}/health", timeout_s, self.gateway)

    def start(self) -> "Services":
        try:
            # The scheduler starts while the executor loads and connects to
            # it once it serves (retrying for SCHEDULER_EXECUTOR_CONNECT_TIMEOUT_S),
            # so their start-ups overlap: a second or two of each stack.
            self.start_executor(wait=False)
            connect = "SCHEDULER_EXECUTOR_CONNECT_TIMEOUT_S"
            if self.start_timeout_s > DEFAULT_START_TIMEOUT_S and connect not in os.environ:
                # The scheduler waits as long for the executor, unless told otherwise.
                self.scheduler_env.setdefault(connect, str(self.start_timeout_s))
            self.start_scheduler(wait=False)
            wait_serving(self.executor_address, self.start_timeout_s, self.executor, self.executor_credentials)
            wait_serving(self.scheduler_address, self.start_timeout_s, self.scheduler, self.scheduler_credentials)
            if self.gateway_port:
                self.start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        # Front to back: the scheduler never sees its executor vanish mid-step.
        stop_process(self.gateway, timeout_s)
        stop_process(self.scheduler, timeout_s)
        stop_process(self.executor, timeout_s)

    def __enter__(self) -> "Services":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(executor_env: Mapping[str, str] | None = None, scheduler_env: Mapping[str, str] | None = None,
           scheduler_port: int | None = None, executor_port: int | None = None,
           gateway_env: Mapping[str, str] | None = None, with_gateway: bool = False) -> Services:
    """Services on free loopback ports (metrics endpoints included), so
    several sets can run side by side; the gateway on loopback only when
    with_gateway. Each may take LLMSCHED_START_TIMEOUT_S to start, as under
    main() (the benchmarks start through here: a first compile of a large
    model's decode step takes minutes)."""
    return Services(
        start_timeout_s=start_timeout_from_env(),
        gateway_port=free_port() if with_gateway else 0,
        gateway_env={"GATEWAY_HOST": "127.0.0.1", **(gateway_env or {})},
        scheduler_port=scheduler_port or free_port(),
        executor_port=executor_port or free_port(),
        scheduler_metrics_port=free_port(),
        executor_metrics_port=free_port(),
        executor_env=dict(executor_env or {}),
        scheduler_env=dict(scheduler_env or {}),
    )


def probe_credentials(env: Mapping[str, str], prefix: str) -> grpc.ChannelCredentials | None:
    """How main() probes a service that has TLS on (prefix SCHEDULER or
    EXECUTOR): it trusts that service's own certificate, and where the
    service asks for client certificates it presents the one the scheduler
    presents to the executor (SCHEDULER_EXECUTOR_TLS_CERT/KEY)."""
    cert = env.get(f"{prefix}_TLS_CERT", "")
    if not cert:
        return None
    mutual = bool(env.get(f"{prefix}_TLS_CLIENT_CA"))
    return channel_credentials(cert, *((env.get("SCHEDULER_EXECUTOR_TLS_CERT", ""),
                                        env.get("SCHEDULER_EXECUTOR_TLS_KEY", "")) if mutual else ()))


def gateway_tls_env(env: Mapping[str, str]) -> dict[str, str]:
    """The gateway's TLS to a scheduler that has TLS on, by the same rule as
    probe_credentials: trust the scheduler's own certificate and, where it
    asks for client certificates, present SCHEDULER_EXECUTOR_TLS_CERT/KEY.
    GATEWAY_SCHEDULER_TLS_* set in the environment win."""
    cert = env.get("SCHEDULER_TLS_CERT", "")
    if not cert:
        return {}
    tls = {"GATEWAY_SCHEDULER_TLS_CA": cert}
    if env.get("SCHEDULER_TLS_CLIENT_CA"):
        tls["GATEWAY_SCHEDULER_TLS_CERT"] = env.get("SCHEDULER_EXECUTOR_TLS_CERT", "")
        tls["GATEWAY_SCHEDULER_TLS_KEY"] = env.get("SCHEDULER_EXECUTOR_TLS_KEY", "")
    return {k: v for k, v in tls.items() if not env.get(k)}


def start_timeout_from_env() -> float:
    raw = os.environ.get(START_TIMEOUT_SETTING, "")
    if not raw:
        return DEFAULT_START_TIMEOUT_S
    try:
        timeout = float(raw)
    except ValueError:
        timeout = 0.0
    if not timeout > 0:
        raise SystemExit(f"launch: {START_TIMEOUT_SETTING}={raw!r}: not a positive number of seconds")
    return timeout


def port_from_env(name: str, default: int) -> int:
    """A service port for main(). 0 means any free port, as it does for the
    services themselves; the launcher picks one here because it must know
    where to probe (a bind race with another process would now fail the
    start loudly, as the services bind without SO_REUSEPORT)."""
    raw = os.environ.get(name, str(default))
    try:
        port = int(raw)
    except ValueError:
        raise SystemExit(f"launch: {name}={raw!r}: not a port number") from None
    return port or free_port()


def _say(message: str, error: bool = False) -> None:
    """The launcher's own lines, among the services' on the same terminal:
    JSON objects too when LOG_FORMAT=json, so that a collector reading
    `make serve`'s output parses every line."""
    if logs.format_from_env("LLMSCHED") == "json":
        message = json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "level": "ERROR" if error else "INFO", "service": "launch", "msg": message})
    print(message, file=sys.stderr if error else sys.stdout, flush=True)


class _Stop(Exception):
    """SIGINT or SIGTERM reached main()."""


def _on_stop_signal(signum, frame) -> None:
    _ignore_stop_signals()
    raise _Stop


def _ignore_stop_signals() -> None:
    # Once stopping, a second Ctrl-C must not interrupt stopping the children.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def main() -> int:
    """Foreground run for `make serve`: Ctrl-C (or SIGTERM) stops both.
    Exit code 0 after a signal, 1 when a service failed to start or died."""
    # Installed explicitly: under a shell that ignores SIGINT (`cmd &` in a
    # script) Python raises no KeyboardInterrupt, and Ctrl-C did nothing.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_stop_signal)
    try:
        cpus.pin_mode(os.environ)
    except StartupError as exc:
        raise SystemExit(f"launch: {exc}") from None
    services = Services(
        scheduler_port=port_from_env("SCHEDULER_PORT", 50051),
        executor_port=port_from_env("EXECUTOR_PORT", 50052),
        scheduler_metrics_port=int(os.environ.get("SCHEDULER_METRICS_PORT", 8000)),
        executor_metrics_port=int(os.environ.get("EXECUTOR_METRICS_PORT", 8001)),
        scheduler_credentials=probe_credentials(os.environ, "SCHEDULER"),
        executor_credentials=probe_credentials(os.environ, "EXECUTOR"),
        gateway_port=port_from_env("GATEWAY_PORT", 8080),
        gateway_env=gateway_tls_env(os.environ),
        start_timeout_s=start_timeout_from_env(),
    )
    try:
        services.start()
        openai = f" and the OpenAI API on {services.gateway_url}/v1" if services.gateway is not None else ""
        _say(f"serving llmsched.v1.Scheduler on {services.scheduler_address}{openai} "
             f"(executor on {services.executor_address}; Ctrl-C stops)")
        children = {"scheduler": services.scheduler, "executor": services.executor, "gateway": services.gateway}
        children = {name: proc for name, proc in children.items() if proc is not None}
        while all(proc.poll() is None for proc in children.values()):
            try:
                services.scheduler.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        for name, proc in children.items():
            if proc.poll() is not None:
                _say(f"launch: the {name} exited with code {proc.returncode}", error=True)
        return 1
    except _Stop:
        return 0
    except (RuntimeError, TimeoutError) as exc:  # from start(): the service's own error is above it
        _say(f"launch: {exc}", error=True)
        return 1
    finally:
        _ignore_stop_signals()
        services.stop()


if __name__ == "__main__":
    raise SystemExit(main())
