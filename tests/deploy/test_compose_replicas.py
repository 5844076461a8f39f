"""Static checks of the gateway service and the `replicas` profile in
docker-compose.yml: two replicas wired each to its own executor and
scheduler, and the router in front of their gateways with the flags the
SGLang Model Gateway needs, published on 127.0.0.1 only."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from llmsched.router import router_available
from tests.deploy.deployfiles import REPO, commands, copies, environment, exposed_ports, parse_dockerfile, port_mappings
from tests.deploy.test_compose import (
    GatewaySettings,
    dockerfile_of,
    model,
    pip_installs,
    run_commands,
    service,
    setting,
)

REPLICAS = ("replica-a", "replica-b")
ROLES = ("executor", "scheduler", "gateway")


def test_replicas_profile_is_two_replicas_and_the_router():
    profiled = {n for n, svc in model("nvidia")["services"].items() if "replicas" in (svc.get("profiles") or [])}
    assert profiled == {f"{r}-{role}" for r in REPLICAS for role in ROLES} | {"router"}, profiled


@pytest.mark.parametrize("variant", ["nvidia", "cpu"])
@pytest.mark.parametrize("replica", REPLICAS)
def test_each_replica_is_wired_to_its_own_executor_and_scheduler(variant, replica):
    executor = environment(service(variant, f"{replica}-executor"))
    scheduler = environment(service(variant, f"{replica}-scheduler"))
    gateway = environment(service(variant, f"{replica}-gateway"))
    assert executor["EXECUTOR_HOST"] == "0.0.0.0", "the scheduler container must reach the executor"
    assert scheduler["SCHEDULER_EXECUTOR_ADDRESS"] == f"{replica}-executor:{executor['EXECUTOR_PORT']}"
    assert int(executor["EXECUTOR_PORT"]) in exposed_ports(service(variant, f"{replica}-executor"))
    assert gateway["GATEWAY_SCHEDULER_ADDRESS"] == f"{replica}-scheduler:{scheduler['SCHEDULER_PORT']}"
    assert int(scheduler["SCHEDULER_PORT"]) in exposed_ports(service(variant, f"{replica}-scheduler"))
    for role in ROLES:
        assert not service(variant, f"{replica}-{role}").get("ports"), f"{replica}-{role} is published: only the router is"
    depends = service(variant, f"{replica}-gateway")["depends_on"]
    assert depends[f"{replica}-scheduler"]["condition"] == "service_healthy"


def test_cpu_override_moves_the_replica_executors_to_cpu():
    for replica in REPLICAS:
        svc = service("cpu", f"{replica}-executor")
        assert environment(svc)["EXECUTOR_DEVICE"] == "cpu" and svc["build"]["args"]["TORCH_FLAVOR"] == "cpu"
        assert not svc["deploy"]["resources"]["reservations"].get("devices")


def _router_args() -> list[str]:
    return [str(a) for a in service("nvidia", "router")["command"]]


def _flag(args: list[str], name: str) -> list[str]:
    """Values of --name (as --name=value or --name v1 v2 ...)."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return [a.split("=", 1)[1]]
        if a == name:
            values = []
            for v in args[i + 1:]:
                if v.startswith("--"):
                    break
                values.append(v)
            return values
    return []


def test_router_fronts_both_replica_gateways_cache_aware_without_retries():
    args = _router_args()
    ports = {r: environment(service("nvidia", f"{r}-gateway"))["GATEWAY_PORT"] for r in REPLICAS}
    assert _flag(args, "--worker-urls") == [f"http://{r}-gateway:{ports[r]}" for r in REPLICAS]
    assert _flag(args, "--policy") == ["cache_aware"]
    assert "--disable-retries" in args and "--disable-circuit-breaker" in args, (
        "without them a 429/503 is retried 5 times, then every request gets 503 for 60 s")
    depends = service("nvidia", "router")["depends_on"]
    assert all(depends[f"{r}-gateway"]["condition"] == "service_healthy" for r in REPLICAS), (
        "the router registers a worker only once its /health answers 200")


def test_router_and_its_prometheus_port_are_published_on_loopback_only():
    args = _router_args()
    port, prom = int(_flag(args, "--port")[0]), int(_flag(args, "--prometheus-port")[0])
    mappings = port_mappings(service("nvidia", "router"))
    assert {m.target for m in mappings} == {port, prom}, mappings
    assert all(m.host_ip == "127.0.0.1" for m in mappings), mappings


def test_router_image_runs_the_pinned_sglang_router():
    dockerfile, args, target = dockerfile_of("nvidia", "router")
    stages, _ = dockerfile.chain(args, target)
    runs = " ".join(" ".join(a) for a in run_commands(stages))
    assert "--extra router --only sglang-router" in runs, "the version must come from pyproject.toml's pin"
    entry = next(i for s in stages for i in s.instructions if i.keyword == "ENTRYPOINT")
    assert "sglang_router.launch_router" in entry.args


@pytest.mark.skipif(router_available() is not None, reason=f"sglang-router cannot run here: {router_available()}")
def test_router_flags_are_ones_the_pinned_router_accepts():
    help_text = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    for arg in _router_args():
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] + " " in help_text or arg.split("=", 1)[0] + "\n" in help_text, arg


@pytest.mark.parametrize("name", ["gateway", "replica-a-gateway", "replica-b-gateway"])
def test_gateway_env_validates_and_its_healthcheck_probes_its_port(name):
    env = environment(service("nvidia", name))
    GatewaySettings(**{k[len("GATEWAY_"):].lower(): v for k, v in env.items() if k.startswith("GATEWAY_")})
    probe = commands(service("nvidia", name))[-1]
    assert probe[-1] == f"http://127.0.0.1:{env['GATEWAY_PORT']}/health", probe


def test_the_default_gateway_serves_the_default_scheduler_on_a_published_port():
    assert setting("nvidia", "gateway", "scheduler_address") == f"scheduler:{setting('nvidia', 'scheduler', 'port')}"
    assert setting("nvidia", "gateway", "port") in {m.target for m in port_mappings(service("nvidia", "gateway"))}


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(_Health.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_healthcheck_passes_on_200_and_fails_on_503():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = commands(service("nvidia", "gateway"))[-1]
    url = f"http://127.0.0.1:{server.server_port}/health"
    try:
        for status, ok in ((200, True), (503, False)):
            _Health.status = status
            result = subprocess.run([sys.executable, *probe[1:-1], url], capture_output=True, timeout=20)
            assert (result.returncode == 0) == ok, f"healthcheck on {status}: exit {result.returncode}"
    finally:
        server.shutdown()


def test_gateway_image_installs_no_torch_and_copies_no_executor_code():
    dockerfile, args, target = dockerfile_of("nvidia", "gateway")
    stages, _ = dockerfile.chain(args, target)
    assert "torch" not in " ".join(pip_installs(stages))
    copied = {src.split("/")[0] for s in stages for c in copies(s) for src in c.sources}
    assert "gateway_svc" in copied and not copied & {"executor_svc", "llmsched_kernels", "scheduler_svc"}, copied


def test_every_dockerfile_parses():
    for path in (REPO / "docker").glob("*.Dockerfile"):
        assert parse_dockerfile(path).stages, path.name
