"""Many replicas behind an existing router: N replicas (executor +
scheduler + gateway each) and the SGLang Model Gateway (PyPI
`sglang-router`) in HTTP mode in front of their gateways. Used by the
replicas test and the P10 benchmark.

What the router (0.3.2) needs, as found against it:
- It registers a worker once GET /health answers 200 (a fixed path).
- --disable-retries --disable-circuit-breaker: otherwise a 429 or 503 is
  retried 5 times and then every request gets 503 for 60 s; with them our
  400 / 429 (Retry-After) / 503 pass through unchanged.
- Its Prometheus listener cannot be turned off and a port clash makes it
  exit, so it gets a free port, on loopback like the router itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmsched.launch import Services, launch, stop_process
from llmsched.server import free_port


def router_available() -> str | None:
    """None when sglang-router can run here, else why not."""
    try:
        # The Rust router itself, an extension module in the wheel.
        import sglang_router.sglang_router_rs  # noqa: F401
    except ImportError as exc:
        return f"sglang-router cannot be imported ({exc}); pip install sglang-router==0.3.2"
    return None


def router_command(worker_urls: list[str], policy: str, port: int, prometheus_port: int) -> list[str]:
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--disable-retries", "--disable-circuit-breaker",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        "--log-level", "warn",
    ]


@dataclass
class Router:
    worker_urls: list[str]
    policy: str = "cache_aware"
    port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    stdout: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "Router":
        self.proc = subprocess.Popen(router_command(self.worker_urls, self.policy, self.port, self.prometheus_port),
                                     stdout=self.stdout, stderr=self.stdout)
        deadline = time.monotonic() + timeout_s
        while self.healthy_workers() < len(self.worker_urls):
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"sglang-router did not register {len(self.worker_urls)} workers in {timeout_s}s")
            time.sleep(0.2)  # start-up probe of another process: no event to wait on
        return self

    def workers(self) -> list[dict]:
        try:
            with urllib.request.urlopen(self.url + "/workers", timeout=2) as resp:
                return json.loads(resp.read())["workers"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return []

    def healthy_workers(self) -> int:
        return sum(1 for w in self.workers() if w.get("is_healthy"))

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)


def launch_replicas(n: int, executor_env: Mapping[str, str], scheduler_env: Mapping[str, str] | None = None,
                    stdout=None) -> list[Services]:
    """n replicas on loopback, started one after the other; all stopped if
    one fails to start."""
    replicas: list[Services] = []
    try:
        for _ in range(n):
            s = launch(executor_env=executor_env, scheduler_env=scheduler_env, with_gateway=True)
            s.stdout = stdout
            replicas.append(s.start())
    except BaseException:
        for s in replicas:
            s.stop()
        raise
    return replicas
