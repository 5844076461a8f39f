"""Offline checks of the Kubernetes manifests in deploy/k8s/: built-in
kinds validate against the Kubernetes OpenAPI schemas (kubernetes-validate,
no cluster), and the pieces agree with each other and with the code: one
Pod per replica with three containers and a loopback-only executor, the
router's worker URLs, the InferencePool's ports and metric names, and the
tensor-parallel LeaderWorkerSet (its own schema, its Pod templates as
built-in PodTemplates, each rank's torchrun variables after LWS and the
kubelet fill them in)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from executor_svc.config import ExecutorSettings
from gateway_svc.config import GatewaySettings
from llmsched.router import router_available
from scheduler_svc.config import SchedulerSettings
from tests.deploy.deployfiles import uneven_tp_splits

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
    assert {"replicas.yaml", "router.yaml", "inferencepool.yaml", "tensor-parallel.yaml"} <= {
        p.name for p in K8S.glob("*.yaml")}


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


# ------------------------------------------------- tensor parallelism (LWS)

LWS_SCHEMA = Path(__file__).resolve().parent / "schemas" / "leaderworkerset-v1.json"
TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
# LeaderWorkerSet's Pod labels (api/leaderworkerset/v1 in kubernetes-sigs/lws).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def _lws() -> dict:
    return _one("LeaderWorkerSet", "llmsched-tp")


def _templates() -> dict[str, dict]:
    lwt = _lws()["spec"]["leaderWorkerTemplate"]
    return {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}


def _pod_containers(template: dict) -> dict[str, dict]:
    return {c["name"]: c for c in template["spec"]["containers"]}


def _expand(value: str, defined: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in an env value: VAR defined earlier
    in the container's env is replaced, $$ escapes, anything else stays."""
    def sub(m: re.Match) -> str:
        if m[0].startswith("$$"):
            return m[0][1:]
        return defined.get(m[1], m[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def _rank_env(worker_index: int, group: int = 0, namespace: str = "default") -> dict[str, str]:
    """The executor env of one rank's Pod as the process sees it: LWS puts
    its three variables first (pkg/utils/pod in kubernetes-sigs/lws), then the
    kubelet expands $(...) in order."""
    lws = _lws()
    name, size = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]["size"]
    template = _templates()["leader" if worker_index == 0 else "worker"]
    # Subdomain: the shared headless Service LWS names after itself (the default networkConfig).
    env = {"LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{namespace}", "LWS_GROUP_SIZE": str(size),
           "LWS_WORKER_INDEX": str(worker_index)}
    for e in _pod_containers(template)["executor"]["env"]:
        assert "value" in e, f"executor env {e['name']} has no literal value"
        env[e["name"]] = _expand(e["value"], env)
    return env


def test_expand_follows_the_kubelet_rules():
    assert _expand("$(A)-$(B)-$$(A)-$(C", {"A": "1"}) == "1-$(B)-$(A)-$(C"


def test_lws_validates_against_the_leaderworkerset_schema():
    import jsonschema

    schema = json.loads(LWS_SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(_lws()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_lws_schema_refuses_a_misspelled_field():
    import jsonschema

    broken = json.loads(json.dumps(_lws()))
    broken["spec"]["leaderWorkerTemplate"]["restartpolicy"] = "RecreateGroupOnPodRestart"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(LWS_SCHEMA.read_text()))


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_lws_pod_template_validates_as_a_kubernetes_pod_template(role):
    import kubernetes_validate

    template = _templates()[role]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"llmsched-tp-{role}"},
                                  "template": template}, KUBERNETES_VERSION, strict=True)


def test_lws_recreates_the_group_on_any_restart_and_starts_workers_with_the_leader():
    spec = _lws()["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart", (
        "a rank that restarts alone cannot rejoin a running group: the whole group must restart")
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated", (
        "LeaderReady deadlocks: the leader is ready only once every rank has joined")


def test_every_rank_gets_one_gpu_and_a_memory_backed_dev_shm():
    for role, template in _templates().items():
        containers = _pod_containers(template)
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for name, c in containers.items():
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            assert gpus == (1 if name == "executor" else None), f"{role} {name} asks for {gpus} GPUs"
        mounts = {m["mountPath"]: m["name"] for m in containers["executor"].get("volumeMounts", [])}
        assert "/dev/shm" in mounts, f"{role} executor has the default 64 MiB /dev/shm"
        assert volumes[mounts["/dev/shm"]]["emptyDir"].get("medium") == "Memory"


def _ranks() -> range:
    try:
        return range(_lws()["spec"]["leaderWorkerTemplate"]["size"])
    except Exception:  # noqa: BLE001 -- the manifest's own tests report it, not collection
        return range(1)


@pytest.mark.parametrize("worker_index", _ranks(), ids=lambda i: f"rank{i}")
def test_each_rank_gets_torchrun_variables_for_its_place_in_the_group(worker_index):
    env = _rank_env(worker_index)
    size = _lws()["spec"]["leaderWorkerTemplate"]["size"]
    unexpanded = {k: v for k, v in env.items() if "$(" in v}
    assert not unexpanded, f"left unexpanded (not defined before use): {unexpanded}"
    assert env["RANK"] == str(worker_index) and env["WORLD_SIZE"] == str(size) and env["LOCAL_RANK"] == "0", env
    leader = _pod_containers(_templates()["leader"])["executor"]
    rendezvous = {p["containerPort"] for p in leader.get("ports", []) if p["name"] == "rendezvous"}
    assert env["MASTER_ADDR"] == env["LWS_LEADER_ADDRESS"], f"MASTER_ADDR {env['MASTER_ADDR']} is not the leader Pod"
    assert {int(env["MASTER_PORT"])} == rendezvous, f"MASTER_PORT {env['MASTER_PORT']}, rank 0 declares {rendezvous}"
    settings = {k[len("EXECUTOR_"):].lower(): v for k, v in env.items() if k.startswith("EXECUTOR_")}
    unknown = set(env) - TORCHRUN_VARS - {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"} - {
        f"EXECUTOR_{f.upper()}" for f in ExecutorSettings.model_fields}
    assert not unknown, f"rank {worker_index} sets variables nothing reads: {sorted(unknown)}"
    parsed = ExecutorSettings(**settings)
    assert parsed.tensor_parallel_size == size, f"EXECUTOR_TENSOR_PARALLEL_SIZE={parsed.tensor_parallel_size}, LWS size {size}"
    assert parsed.device == "cuda"


def test_tp_leader_pod_is_executor_scheduler_and_gateway_with_a_loopback_step_channel():
    containers = _pod_containers(_templates()["leader"])
    assert list(containers) == ["executor", "scheduler", "gateway"]
    for name in ("scheduler", "gateway"):
        cls = SETTINGS[name]
        env = {k[len(cls.model_config["env_prefix"]):].lower(): v for k, v in _env(containers[name]).items()}
        assert set(env) <= set(cls.model_fields), f"{name} sets unknown settings {set(env) - set(cls.model_fields)}"
        cls(**env)
    executor, scheduler, gateway = _rank_env(0), _env(containers["scheduler"]), _env(containers["gateway"])
    assert executor["EXECUTOR_HOST"] == "127.0.0.1", "the step channel has no authentication: loopback only"
    ports = {p["name"]: p["containerPort"] for p in containers["executor"].get("ports", [])}
    assert ports == {"rendezvous": int(executor["MASTER_PORT"])}, f"the executor exposes {ports}, only rendezvous"
    assert scheduler["SCHEDULER_EXECUTOR_ADDRESS"] == f"127.0.0.1:{executor['EXECUTOR_PORT']}"
    assert gateway["GATEWAY_SCHEDULER_ADDRESS"] == f"127.0.0.1:{scheduler['SCHEDULER_PORT']}"
    probe = " ".join(containers["executor"]["startupProbe"]["exec"]["command"])
    assert f"127.0.0.1:{executor['EXECUTOR_PORT']}" in probe, "the startup probe checks another port"


def test_tp_worker_pod_is_one_executor_with_the_leaders_image_and_model_settings():
    leader, worker = (_pod_containers(_templates()[r]) for r in ("leader", "worker"))
    assert list(worker) == ["executor"], f"worker Pods run {list(worker)}: ranks 1.. serve nothing"
    assert worker["executor"]["image"] == leader["executor"]["image"]
    assert "command" not in worker["executor"] and "args" not in worker["executor"], "every rank runs the image's command"
    serving = {"EXECUTOR_HOST", "EXECUTOR_PORT", "EXECUTOR_METRICS_PORT"}  # rank 0's alone
    lead, work = _rank_env(0), _rank_env(1)
    differ = {k for k in (set(lead) | set(work)) - serving - {"RANK", "LWS_WORKER_INDEX"} if lead.get(k) != work.get(k)}
    assert not differ, f"rank 0 and rank 1 disagree on {sorted(differ)}: every rank must load the same model the same way"
    assert leader["executor"]["volumeMounts"] == worker["executor"]["volumeMounts"]


def test_tp_api_service_selects_the_leader_pods_by_their_named_ports():
    lws, svc = _lws(), _one("Service", "llmsched-tp-api")
    assert not [d for _, d in DOCS if d["kind"] == "Service" and d["metadata"]["name"] == lws["metadata"]["name"]], (
        "LWS creates the headless Service named after the LeaderWorkerSet; another of that name clashes")
    assert svc["spec"]["selector"] == {LWS_NAME_LABEL: lws["metadata"]["name"], LWS_WORKER_INDEX_LABEL: "0"}
    named = {p["name"] for c in _pod_containers(_templates()["leader"]).values() for p in c.get("ports", [])}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named - {"rendezvous"}


def test_the_lws_model_splits_evenly_over_its_ranks():
    env, size = _rank_env(0), _lws()["spec"]["leaderWorkerTemplate"]["size"]
    uneven = uneven_tp_splits(env["EXECUTOR_MODEL"], size)
    assert not uneven, f"{env['EXECUTOR_MODEL']}: {uneven} do not split over {size} ranks"
