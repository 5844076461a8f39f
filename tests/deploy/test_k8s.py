"""Offline checks of the Kubernetes manifests in deploy/k8s/: built-in
kinds validate against the Kubernetes OpenAPI schemas (kubernetes-validate,
no cluster), and the pieces agree with each other and with the code: one
Pod per replica with three containers and a loopback-only executor, the
router's worker URLs, the InferencePool's ports and metric names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from executor_svc.config import ExecutorSettings
from gateway_svc.config import GatewaySettings
from llmsched.router import router_available
from scheduler_svc.config import SchedulerSettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"
SETTINGS = {"executor": ExecutorSettings, "scheduler": SchedulerSettings, "gateway": GatewaySettings}


def _docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


DOCS = _docs()


def _one(kind: str, name: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _containers(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["spec"]["template"]["spec"]["containers"]}


def _flag(args: list[str], name: str) -> list[str]:
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return [a.split("=", 1)[1]]
        if a == name:
            return [v for v in _take_values(args[i + 1:])]
    return []


def _take_values(rest: list[str]):
    for v in rest:
        if v.startswith("--"):
            return
        yield v


def test_manifests_exist():
    assert {"replicas.yaml", "router.yaml", "inferencepool.yaml"} <= {p.name for p in K8S.glob("*.yaml")}


@pytest.mark.parametrize("doc", [d for _, d in DOCS if "." not in d["apiVersion"].split("/")[0] or
                                 d["apiVersion"].startswith(("apps/", "rbac.authorization.k8s.io/"))],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_built_in_kinds_validate_against_the_kubernetes_schema(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_one_pod_per_replica_with_executor_scheduler_and_gateway():
    sts = _one("StatefulSet", "llmsched")
    containers = _containers(sts)
    assert list(containers) == ["executor", "scheduler", "gateway"]
    for name, c in containers.items():
        cls = SETTINGS[name]
        env = {k[len(cls.model_config["env_prefix"]):].lower(): v for k, v in _env(c).items()}
        assert set(env) <= set(cls.model_fields), f"{name} sets unknown settings {set(env) - set(cls.model_fields)}"
        cls(**env)  # values validate
    executor, scheduler, gateway = (_env(containers[n]) for n in ("executor", "scheduler", "gateway"))
    assert executor["EXECUTOR_HOST"] == "127.0.0.1", "the executor's step channel must bind loopback only"
    assert not containers["executor"].get("ports"), "the executor must expose no port"
    assert scheduler["SCHEDULER_EXECUTOR_ADDRESS"] == f"127.0.0.1:{executor['EXECUTOR_PORT']}"
    assert gateway["GATEWAY_SCHEDULER_ADDRESS"] == f"127.0.0.1:{scheduler['SCHEDULER_PORT']}"
    ports = {p["name"]: p["containerPort"] for c in containers.values() for p in c.get("ports", [])}
    assert ports == {"grpc": int(scheduler["SCHEDULER_PORT"]), "metrics": int(scheduler["SCHEDULER_METRICS_PORT"]),
                     "http": int(gateway["GATEWAY_PORT"])}
    assert containers["gateway"]["readinessProbe"]["httpGet"]["path"] == "/health"


def test_headless_service_selects_the_replica_pods_by_their_named_ports():
    sts, svc = _one("StatefulSet", "llmsched"), _one("Service", "llmsched")
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "llmsched"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    named = {p["name"] for c in _containers(sts).values() for p in c.get("ports", [])}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named


def _router_args() -> list[str]:
    return _containers(_one("Deployment", "llmsched-router"))["router"]["args"]


def test_router_sends_to_every_replica_gateway_cache_aware_without_retries():
    sts = _one("StatefulSet", "llmsched")
    port = _env(_containers(sts)["gateway"])["GATEWAY_PORT"]
    expected = [f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}"
                for i in range(sts["spec"]["replicas"])]
    args = _router_args()
    assert _flag(args, "--worker-urls") == expected
    assert _flag(args, "--policy") == ["cache_aware"]
    assert "--disable-retries" in args and "--disable-circuit-breaker" in args
    svc = _one("Service", "llmsched-router")
    assert {p["port"] for p in svc["spec"]["ports"]} == {int(_flag(args, "--port")[0]),
                                                         int(_flag(args, "--prometheus-port")[0])}


@pytest.mark.skipif(router_available() is not None, reason=f"sglang-router cannot run here: {router_available()}")
def test_router_args_are_flags_the_pinned_router_accepts():
    help_text = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    for arg in _router_args():
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert flag + " " in help_text or flag + "\n" in help_text, f"sglang-router has no {flag}"


def test_inference_pool_targets_the_gateways_and_scores_by_our_metric_names():
    from prometheus_client import REGISTRY

    import scheduler_svc.telemetry  # noqa: F401 -- registers the scheduler's metrics

    pool = _one("InferencePool", "llmsched")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    sts = _one("StatefulSet", "llmsched")
    assert pool["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    containers = _containers(sts)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [int(_env(containers["gateway"])["GATEWAY_PORT"])]
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = _one("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_svc["spec"]["ports"]}
    args = _containers(_one("Deployment", "llmsched-epp"))["epp"]["args"]
    known = {m.name for m in REGISTRY.collect()}
    queued = _flag(args, "--total-queued-requests-metric")
    kv = _flag(args, "--kv-cache-usage-percentage-metric")
    assert queued == ["llmsched_num_requests_waiting"] and kv == ["llmsched_kv_cache_usage_ratio"]
    assert {queued[0], kv[0]} <= known, f"the scheduler exports no such metric: {sorted(known)[:20]}"
    assert _flag(args, "--model-server-metrics-port") == [_env(containers["scheduler"])["SCHEDULER_METRICS_PORT"]]
    assert _flag(args, "--pool-name") == [pool["metadata"]["name"]]
