"""Static checks of the `tp` profile in docker-compose.yml: one executor
container split over two devices by tensor parallelism, with its own
scheduler and gateway. The executor starts its other ranks itself, so it
needs as many devices as ranks, room in /dev/shm, and none of torchrun's
variables (with them it would wait for a group nobody starts)."""

from __future__ import annotations

import re

import pytest

from executor_svc.config import ExecutorSettings
from tests.deploy.deployfiles import (
    REPO,
    commands,
    environment,
    exposed_ports,
    load_yaml,
    port_mappings,
    uneven_tp_splits,
)
from tests.deploy.test_compose import VARIANTS, model, service

TP = "tp"
ROLES = ("executor", "scheduler", "gateway")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def executor_settings(variant: str) -> ExecutorSettings:
    env = environment(service(variant, "tp-executor"))
    return ExecutorSettings(**{k[len("EXECUTOR_"):].lower(): v for k, v in env.items() if k.startswith("EXECUTOR_")})


def _bytes(size: str | int) -> int:
    """Compose's byte values: 2gb, 512m, 1073741824."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).strip().lower())
    assert m, f"unreadable size {size!r}"
    return int(m[1]) * 1024 ** "_kmg".index(m[2] or "_")


def test_bytes_reads_compose_sizes():
    assert _bytes("2gb") == 2 << 30 and _bytes("512m") == 512 << 20 and _bytes(1024) == 1024 and _bytes("64k") == 64 << 10


def test_tp_profile_is_one_executor_scheduler_and_gateway():
    profiled = {n for n, svc in model("nvidia")["services"].items() if TP in (svc.get("profiles") or [])}
    assert profiled == {f"tp-{role}" for role in ROLES}, profiled


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_executor_runs_more_than_one_rank_with_a_fail_stop_timeout(variant):
    settings = executor_settings(variant)
    assert settings.tensor_parallel_size == 2, f"EXECUTOR_TENSOR_PARALLEL_SIZE is {settings.tensor_parallel_size}"
    assert settings.tensor_parallel_timeout_s > 0
    assert settings.host == "0.0.0.0", "the tp-scheduler container must reach the executor"


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_executor_starts_its_own_ranks_so_sets_no_torchrun_variables(variant):
    env = environment(service(variant, "tp-executor"))
    assert not set(TORCHRUN_VARS) & set(env), (
        f"tp-executor sets {sorted(set(TORCHRUN_VARS) & set(env))}: the executor would join an outside group "
        "instead of starting its ranks")


def test_tp_executor_reserves_one_gpu_per_rank():
    svc = service("nvidia", "tp-executor")
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": executor_settings("nvidia").tensor_parallel_size,
                        "capabilities": ["gpu"]}], devices
    assert environment(svc)["EXECUTOR_DEVICE"] == "cuda", "fail at start-up without GPUs, not fall back to the CPU"


def test_cpu_override_runs_the_tp_ranks_on_the_cpu():
    svc = service("cpu", "tp-executor")
    assert environment(svc)["EXECUTOR_DEVICE"] == "cpu" and svc["build"]["args"]["TORCH_FLAVOR"] == "cpu"
    assert svc["image"] != service("nvidia", "tp-executor")["image"], "CPU and GPU executor images share a tag"
    assert not svc["deploy"]["resources"]["reservations"].get("devices"), "the CPU override still reserves GPUs"


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_executor_has_shared_memory_for_its_ranks(variant):
    svc = service(variant, "tp-executor")
    if svc.get("ipc") == "host":
        return
    assert "shm_size" in svc, "the ranks share /dev/shm; Docker's default is 64 MB"
    assert _bytes(svc["shm_size"]) >= 1 << 30, f"shm_size {svc['shm_size']} is under 1 GiB"


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_scheduler_and_gateway_are_wired_to_the_tp_executor(variant):
    executor = environment(service(variant, "tp-executor"))
    scheduler = environment(service(variant, "tp-scheduler"))
    gateway = environment(service(variant, "tp-gateway"))
    assert scheduler["SCHEDULER_EXECUTOR_ADDRESS"] == f"tp-executor:{executor['EXECUTOR_PORT']}"
    assert int(executor["EXECUTOR_PORT"]) in exposed_ports(service(variant, "tp-executor"))
    assert gateway["GATEWAY_SCHEDULER_ADDRESS"] == f"tp-scheduler:{scheduler['SCHEDULER_PORT']}"
    assert service(variant, "tp-scheduler")["depends_on"]["tp-executor"]["condition"] == "service_healthy"
    assert service(variant, "tp-gateway")["depends_on"]["tp-scheduler"]["condition"] == "service_healthy"
    probe = commands(service(variant, "tp-executor"))[-1]
    assert probe[-1] == f"127.0.0.1:{executor['EXECUTOR_PORT']}", f"the healthcheck probes {probe[-1]}"


def test_tp_apis_are_published_on_loopback_only_and_the_executor_not_at_all():
    assert not service("nvidia", "tp-executor").get("ports"), "the executor's step channel must stay private"
    published = {}
    for name, field in (("tp-scheduler", "SCHEDULER_PORT"), ("tp-gateway", "GATEWAY_PORT")):
        mappings = port_mappings(service("nvidia", name))
        assert [m.target for m in mappings] == [int(environment(service("nvidia", name))[field])], mappings
        assert all(m.host_ip == "127.0.0.1" for m in mappings), f"{name} is published beyond loopback: {mappings}"
        published[name] = mappings[0].published
    taken = {m.published for n, s in model("nvidia")["services"].items() if not n.startswith("tp-")
             for m in port_mappings(s)}
    assert not set(published.values()) & taken, f"tp ports {published} clash with other services' {sorted(taken)}"


def test_the_default_model_splits_evenly_over_the_tp_ranks():
    settings = executor_settings("nvidia")
    uneven = uneven_tp_splits(settings.model, settings.tensor_parallel_size)
    assert not uneven, f"{settings.model}: {uneven} do not split over {settings.tensor_parallel_size} ranks"


def test_prometheus_scrapes_the_tp_services():
    config = load_yaml(REPO / "docker" / "prometheus.yml")
    targets = {t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    expected = {f"tp-executor:{executor_settings('nvidia').metrics_port}",
                f"tp-scheduler:{environment(service('nvidia', 'tp-scheduler'))['SCHEDULER_METRICS_PORT']}",
                f"tp-gateway:{environment(service('nvidia', 'tp-gateway'))['GATEWAY_PORT']}"}
    assert expected <= targets, f"prometheus does not scrape {sorted(expected - targets)}"
