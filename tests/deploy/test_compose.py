"""Static checks of the container deployment (docker-compose.yml, the CPU
override, docker/*.Dockerfile, docker/prometheus.yml, .dockerignore): that
they agree with the code they deploy. No Docker engine is needed; the one
test that runs a compose CLI skips without one."""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from concurrent import futures
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from executor_svc.config import ExecutorSettings
from gateway_svc.config import GatewaySettings
from scheduler_svc.config import SchedulerSettings
from tests.deploy.deployfiles import (
    REPO,
    DockerIgnore,
    PythonCall,
    commands,
    copies,
    environment,
    exec_form,
    exposed_ports,
    imported_modules,
    interpolated_variables,
    load_compose,
    load_yaml,
    parse_dockerfile,
    port_mappings,
    python_calls,
    shell_commands,
)

BASE = REPO / "docker-compose.yml"
CPU = REPO / "docker-compose.cpu.yml"
# "nvidia" is the base file alone, "cpu" the base plus the CPU override. (Not
# "gpu": tests/conftest.py skips every test whose name or id contains it.)
VARIANTS = {"nvidia": (BASE,), "cpu": (BASE, CPU)}


def _load(files: tuple[Path, ...]) -> dict | Exception:
    # A file that does not parse fails the tests that read it, not collection.
    try:
        return load_compose(*files)
    except Exception as exc:  # noqa: BLE001
        return exc


MODELS = {name: _load(files) for name, files in VARIANTS.items()}
PARSED = [v for v, m in MODELS.items() if isinstance(m, dict)]
SETTINGS = {"scheduler": SchedulerSettings, "executor": ExecutorSettings, "gateway": GatewaySettings}
PROJECT_PACKAGES = {"llmsched", "scheduler_svc", "executor_svc", "gateway_svc", "llmsched_kernels", "bench"}


def role(svc_name: str) -> str:
    """`replica-a-scheduler` plays the scheduler's part."""
    return svc_name.rsplit("-", 1)[-1]
DOCKERIGNORE = DockerIgnore.read(REPO / ".dockerignore")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
TORCH_PIN = next(
    re.search(r"==\s*([\w.]+)", r).group(1) for r in PYPROJECT["optional-dependencies"]["executor"] if r.startswith("torch")
)


def model(variant: str) -> dict:
    loaded = MODELS[variant]
    if not isinstance(loaded, dict):
        pytest.fail(f"{' + '.join(f.name for f in VARIANTS[variant])} does not load: {loaded}")
    return loaded


def service(variant: str, name: str) -> dict:
    services = model(variant)["services"]
    assert name in services, f"{VARIANTS[variant][-1].name}: no service {name!r}"
    return services[name]


def env_name(settings_cls, field: str) -> str:
    return settings_cls.model_config["env_prefix"] + field.upper()


def setting(variant: str, name: str, field: str):
    """The value a service gets for a settings field: compose env or default."""
    cls = SETTINGS[name]
    assert field in cls.model_fields, f"{cls.__name__} has no field {field!r} (env {env_name(cls, field)})"
    raw = environment(service(variant, name)).get(env_name(cls, field))
    return type(cls.model_fields[field].default)(raw) if raw is not None else cls.model_fields[field].default


def dockerfile_of(variant: str, name: str):
    build = service(variant, name)["build"]
    path = REPO / build.get("context", ".") / build["dockerfile"]
    return parse_dockerfile(path), {k: str(v) for k, v in (build.get("args") or {}).items()}, build.get("target")


def run_commands(stages) -> list[list[str]]:
    return [argv for stage in stages for ins in stage.instructions if ins.keyword == "RUN" for argv in shell_commands(ins.args)]


def pip_installs(stages) -> list[str]:
    """Each `pip install ...` of the stages, as one string."""
    return [
        shlex.join(argv)
        for argv in run_commands(stages)
        if {"pip", "pip3"} & set(argv) and "install" in argv
    ]


# ------------------------------------------------------------------ files


@pytest.mark.parametrize("path", [BASE, CPU, REPO / "docker" / "prometheus.yml"], ids=lambda p: p.name)
def test_deploy_yaml_file_parses(path):
    assert isinstance(load_yaml(path), dict), f"{path.name} is not a YAML mapping"


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_defines_jaeger_executor_scheduler_and_prometheus(variant):
    assert {"jaeger", "executor", "scheduler", "prometheus"} <= set(model(variant)["services"])


def _interpolations():
    for path in (BASE, CPU):
        for name, op, default in interpolated_variables(path.read_text()):
            yield pytest.param(name, op, default, id=f"{path.name}:{name}")


@pytest.mark.parametrize("name,op,default", list(_interpolations()))
def test_compose_variable_has_a_default_so_up_works_without_env_file(name, op, default):
    assert op in (":-", "-") and default, f"${{{name}}} has no default: `docker compose up` would need it set"


# -------------------------------------------------------------- settings


def _settings_env_vars():
    for variant in PARSED:
        for svc_name, svc in MODELS[variant]["services"].items():
            for var in environment(svc):
                if var.startswith(("SCHEDULER_", "EXECUTOR_", "GATEWAY_")):
                    yield pytest.param(variant, svc_name, var, id=f"{variant}:{svc_name}:{var}")


@pytest.mark.parametrize("variant,svc_name,var", list(_settings_env_vars()))
def test_compose_env_var_is_a_settings_field(variant, svc_name, var):
    owner = var.split("_", 1)[0].lower()
    cls = SETTINGS[owner]
    fields = {env_name(cls, f) for f in cls.model_fields}
    assert var in fields, f"{svc_name} sets {var}, which {cls.__name__} does not read (fields: {sorted(fields)})"
    assert role(svc_name) == owner, f"{var} is set on {svc_name}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("svc_name", ["scheduler", "executor"])
def test_compose_env_values_validate_as_settings(variant, svc_name):
    cls = SETTINGS[svc_name]
    prefix = cls.model_config["env_prefix"]
    values = {k[len(prefix) :].lower(): v for k, v in environment(service(variant, svc_name)).items() if k.startswith(prefix)}
    cls(**{k: v for k, v in values.items() if k in cls.model_fields})  # raises on a bad value


def test_scheduler_metrics_port_setting_exists():
    assert "metrics_port" in SchedulerSettings.model_fields, "SchedulerSettings has no metrics_port (SCHEDULER_METRICS_PORT)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_executor_binds_all_interfaces_on_the_compose_network(variant):
    assert environment(service(variant, "executor")).get("EXECUTOR_HOST") == "0.0.0.0", (
        "EXECUTOR_HOST must be 0.0.0.0 in compose: the default 127.0.0.1 is unreachable from the scheduler container"
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_executor_default_model_is_builtin_or_under_the_models_mount(variant):
    import ast

    tree = ast.parse((REPO / "executor_svc" / "model" / "builtin.py").read_text())
    builtins = {
        k.value
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict)
        for k in node.value.keys
        if isinstance(k, ast.Constant)
    }
    model = setting(variant, "executor", "model")
    targets = {str(v).split(":")[1] for v in service(variant, "executor").get("volumes") or [] if isinstance(v, str)}
    assert model in builtins or any(model.startswith(t.rstrip("/") + "/") for t in targets), (
        f"EXECUTOR_MODEL default {model!r} is neither a built-in ({sorted(builtins)}) nor under a mounted dir {targets}"
    )


def test_model_volume_is_mounted_read_only():
    volumes = [v for v in service("nvidia", "executor").get("volumes") or [] if ":/models" in str(v)]
    assert volumes, "executor mounts no /models volume"
    assert all(str(v).endswith(":ro") for v in volumes), f"model volume must be read-only: {volumes}"


# ------------------------------------------------------------------ ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_scheduler_executor_address_points_at_executor_port(variant):
    address = setting(variant, "scheduler", "executor_address")
    host, _, port = address.rpartition(":")
    assert host == "executor", f"SCHEDULER_EXECUTOR_ADDRESS={address}: host is not the executor service"
    assert int(port) == setting(variant, "executor", "port"), (
        f"SCHEDULER_EXECUTOR_ADDRESS={address} but the executor listens on {setting(variant, 'executor', 'port')}"
    )
    assert int(port) in exposed_ports(service(variant, "executor")), f"executor does not expose {port}"


@pytest.mark.parametrize("field", ["port", "metrics_port"])
def test_scheduler_published_port_matches_its_setting(field):
    port = setting("nvidia", "scheduler", field)
    targets = {m.target for m in port_mappings(service("nvidia", "scheduler"))}
    assert port in targets, f"scheduler {field}={port} is not published (published targets: {sorted(targets)})"


def test_executor_step_channel_is_not_published_to_the_host():
    assert not service("nvidia", "executor").get("ports"), "the executor's unauthenticated step channel must stay private"


@pytest.mark.parametrize("svc_name", ["executor", "scheduler"])
def test_otel_exports_to_jaeger_otlp_port(svc_name):
    env = environment(service("nvidia", svc_name))
    assert env.get("OTEL_TRACES_EXPORTER", "otlp") == "otlp"
    assert env.get("OTEL_SERVICE_NAME") == svc_name, f"OTEL_SERVICE_NAME of {svc_name} is {env.get('OTEL_SERVICE_NAME')!r}"
    url = urlparse(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
    assert url.hostname == "jaeger", f"{svc_name}: OTEL_EXPORTER_OTLP_ENDPOINT={url.geturl()!r} is not the jaeger service"
    jaeger = service("nvidia", "jaeger")
    assert url.port in exposed_ports(jaeger), f"jaeger does not expose OTLP port {url.port}"
    if env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc":
        assert url.port == 4317, "the OTLP gRPC receiver is on 4317"


def test_jaeger_accepts_otlp_and_publishes_its_ui():
    jaeger = service("nvidia", "jaeger")
    assert str(environment(jaeger).get("COLLECTOR_OTLP_ENABLED")).lower() == "true"
    assert 16686 in {m.target for m in port_mappings(jaeger)}, "Jaeger UI (16686) is not published"


def test_prometheus_scrapes_the_metrics_ports():
    prom = service("nvidia", "prometheus")
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in prom.get("volumes") or []}
    assert mounts.get("/etc/prometheus/prometheus.yml") == "./docker/prometheus.yml", f"prometheus mounts {mounts}"
    config = load_yaml(REPO / "docker" / "prometheus.yml")
    targets = {
        job["job_name"]: [t for sc in job.get("static_configs", []) for t in sc["targets"]] for job in config["scrape_configs"]
    }
    assert targets.get("scheduler") == [f"scheduler:{setting('nvidia', 'scheduler', 'metrics_port')}"], targets
    if "metrics_port" in ExecutorSettings.model_fields:
        port = setting("nvidia", "executor", "metrics_port")
        assert targets.get("executor") == [f"executor:{port}"], targets
        assert port in exposed_ports(service("nvidia", "executor"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bind_mount_sources_in_the_repo_exist(variant):
    for svc_name, svc in model(variant)["services"].items():
        for volume in svc.get("volumes") or []:
            source = str(volume).split(":")[0]
            if source.startswith("./docker"):
                assert (REPO / source).exists(), f"{svc_name} mounts missing {source}"


def test_third_party_images_are_pinned():
    for svc_name, svc in model("nvidia")["services"].items():
        if "build" in svc:
            continue
        image = svc["image"]
        tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
        assert tag and tag != "latest", f"{svc_name} image {image} is not pinned to a version tag"


# ----------------------------------------------------------- dependencies


def test_scheduler_waits_for_a_healthy_executor():
    depends = service("nvidia", "scheduler").get("depends_on") or {}
    assert isinstance(depends, dict) and depends.get("executor", {}).get("condition") == "service_healthy", depends
    assert service("nvidia", "executor").get("healthcheck"), "executor has no healthcheck to wait for"


def test_base_compose_reserves_one_nvidia_device():
    devices = service("nvidia", "executor")["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], devices
    assert environment(service("nvidia", "executor")).get("EXECUTOR_DEVICE") in ("cuda", "auto")


def test_cpu_override_drops_the_gpu_and_runs_on_cpu():
    executor = service("cpu", "executor")
    devices = (((executor.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
    assert not devices, f"CPU override still reserves {devices}"
    assert environment(executor).get("EXECUTOR_DEVICE") == "cpu"
    assert executor["build"]["args"].get("TORCH_FLAVOR") == "cpu"
    assert executor["image"] != service("nvidia", "executor")["image"], "CPU and GPU executor images share a tag"


# --------------------------------------------------------------- commands


def _python_calls_of(variant: str, svc_name: str) -> list[PythonCall]:
    """python -m / -c calls a service makes: compose command and healthcheck,
    the image's CMD, and the RUN steps that build it."""
    dockerfile, args, target = dockerfile_of(variant, svc_name)
    stages, _ = dockerfile.chain(args, target)
    argvs = commands(service(variant, svc_name))
    if not service(variant, svc_name).get("command"):
        cmd = next((i for s in stages for i in reversed(s.instructions) if i.keyword == "CMD"), None)
        assert cmd is not None, f"{dockerfile.path.name}: no CMD and compose sets no command"
        argvs.append(exec_form(cmd.args))
    argvs += run_commands(stages)
    return [call for argv in argvs for call in python_calls(argv)]


def _service_commands():
    for variant in PARSED:
        for svc_name in ("executor", "scheduler", "gateway", "replica-a-executor", "replica-a-scheduler",
                         "replica-a-gateway", "tp-executor", "tp-scheduler", "tp-gateway"):
            try:
                calls = _python_calls_of(variant, svc_name)
            except (Exception, pytest.fail.Exception) as exc:  # reported by the test, not at collection
                yield pytest.param(variant, svc_name, exc, id=f"{variant}:{svc_name}:unreadable")
                continue
            for call in calls:
                what = f"-m {call.module}" if call.module else "-c"
                yield pytest.param(variant, svc_name, call, id=f"{variant}:{svc_name}:python {what}")


@functools.cache
def _distribution_modules() -> dict[str, list[str]]:
    return metadata.packages_distributions()


@functools.cache
def _image_modules(variant: str, svc_name: str) -> set[str]:
    """Top-level modules the image has: stdlib, the project packages it
    copies, and those of the distributions its requirements name."""
    dockerfile, args, target = dockerfile_of(variant, svc_name)
    stages, _ = dockerfile.chain(args, target)
    copied = {Path(src).parts[0] for s in stages for c in copies(s) for src in c.sources}
    reqs = list(PYPROJECT["dependencies"])
    if role(svc_name) in ("executor", "gateway"):
        reqs += PYPROJECT["optional-dependencies"][role(svc_name)]
    dists = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-") for r in reqs}
    modules = {m for m, ds in _distribution_modules().items() if {d.lower().replace("_", "-") for d in ds} & dists}
    # pip comes with every Python base image; build steps use it.
    return set(sys.stdlib_module_names) | (copied & PROJECT_PACKAGES) | modules | {"pip"}


@pytest.mark.parametrize("variant,svc_name,call", list(_service_commands()))
def test_python_command_refers_to_modules_the_image_has(variant, svc_name, call):
    if isinstance(call, BaseException):
        pytest.fail(f"could not read the commands of {svc_name}: {call}")
    available = _image_modules(variant, svc_name)
    if call.module:
        assert call.module.split(".")[0] in available, f"{svc_name} image lacks {call.module}"
        if call.module.split(".")[0] == "pip":
            # Every Python base image has pip. And find_spec("pip") would
            # make setuptools' distutils hack believe pip is running: it
            # turns its distutils shim off for this whole process, and any
            # later `import setuptools` (inductor's C++ builder) fails.
            return
        spec = importlib.util.find_spec(call.module)
        assert spec is not None, f"python -m {call.module}: no such module"
        if spec.submodule_search_locations:
            assert importlib.util.find_spec(call.module + ".__main__"), f"python -m {call.module}: package has no __main__"
        return
    for module, names in imported_modules(call.code):
        assert module.split(".")[0] in available, f"{svc_name} image lacks {module} (imported by python -c {call.code!r})"
        assert importlib.util.find_spec(module) is not None, f"python -c imports missing module {module}"
        for name in names:
            if importlib.util.find_spec(f"{module}.{name}") is None:
                assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"


@pytest.mark.parametrize("svc_name", ["executor", "scheduler"])
def test_healthcheck_probes_the_service_port(svc_name):
    argv = commands(service("nvidia", svc_name))[-1]
    address = argv[-1]
    assert address.rpartition(":")[2] == str(setting("nvidia", svc_name, "port")), (
        f"{svc_name} healthcheck probes {address}, the service listens on {setting('nvidia', svc_name, 'port')}"
    )


@pytest.fixture(scope="module")
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _run_healthcheck(svc_name: str, address: str) -> subprocess.CompletedProcess:
    argv = commands(service("nvidia", svc_name))[-1]
    assert re.fullmatch(r"python3?", argv[0]), argv[0]
    return subprocess.run([sys.executable, *argv[1:-1], address], capture_output=True, text=True, timeout=20)


def test_healthcheck_passes_on_serving_and_fails_on_not_serving(health_server):
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    results = {}
    threads = [
        threading.Thread(target=lambda n=n: results.__setitem__(n, _run_healthcheck(n, address)))
        for n in ("executor", "scheduler")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for svc_name, result in results.items():
        assert result.returncode == 0, f"{svc_name} healthcheck failed against a SERVING server: {result.stderr}"
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = _run_healthcheck("executor", address)
    assert result.returncode != 0, "healthcheck passed against a NOT_SERVING server"


# ------------------------------------------------------------ Dockerfiles


def test_scheduler_image_installs_no_torch_and_no_executor_extra():
    dockerfile, args, target = dockerfile_of("nvidia", "scheduler")
    stages, base = dockerfile.chain(args, target)
    assert re.fullmatch(r"python:3\.11[\w.-]*", base), f"scheduler image starts from {base}, not slim Python 3.11"
    installs = pip_installs(stages)
    assert installs, "the scheduler Dockerfile installs nothing"
    text = "\n".join(i.args for s in stages for i in s.instructions if i.keyword == "RUN")
    assert "torch" not in " ".join(installs), f"scheduler Dockerfile pip-installs torch: {installs}"
    assert not re.search(r"\[[^\]]*executor|--extra", text), "scheduler Dockerfile installs the executor extra"
    copied = {Path(src).parts[0] for s in stages for c in copies(s) for src in c.sources}
    assert not copied & {"executor_svc", "llmsched_kernels"}, f"scheduler image copies executor code: {copied}"


def test_executor_cuda_image_starts_from_pytorch_cuda_base_with_the_pinned_torch():
    dockerfile, args, target = dockerfile_of("nvidia", "executor")
    stages, base = dockerfile.chain(args, target)
    m = re.fullmatch(r"pytorch/pytorch:(?P<torch>[\d.]+)-cuda[\d.]+-cudnn\d+-(?:runtime|devel)", base)
    assert m, f"GPU executor image starts from {base}, not a pytorch/pytorch CUDA image"
    assert m["torch"] == TORCH_PIN, f"base image has torch {m['torch']}, pyproject.toml pins {TORCH_PIN}"
    for cmd in pip_installs(stages):
        assert "torch" not in cmd, f"GPU executor image reinstalls torch: {cmd}"
    runs = [shlex.join(argv) for argv in run_commands(stages)]
    assert any("--check-installed torch" in c for c in runs), "GPU image does not check the base image's torch version"
    assert all("--exclude torch" in c for c in runs if "--extra executor" in c), "executor requirements include torch"


def test_executor_cpu_image_installs_pinned_torch_from_cpu_index():
    dockerfile, args, target = dockerfile_of("cpu", "executor")
    stages, base = dockerfile.chain(args, target)
    assert re.fullmatch(r"python:3\.11[\w.-]*", base), f"CPU executor image starts from {base}"
    torch_installs = [c for c in pip_installs(stages) if "torch" in c]
    assert torch_installs, "CPU executor image installs no torch"
    for cmd in torch_installs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in cmd, f"torch not from the CPU index: {cmd}"


def _dockerfile_copies():
    for path in sorted((REPO / "docker").glob("*.Dockerfile")):
        for stage in parse_dockerfile(path).stages:
            for copy in copies(stage):
                if copy.from_stage is None:
                    for src in copy.sources:
                        yield pytest.param(path, src, id=f"{path.name}:{src}")


@pytest.mark.parametrize("path,source", list(_dockerfile_copies()))
def test_dockerfile_copy_source_exists_and_is_in_build_context(path, source):
    matches = list(REPO.glob(source))
    assert matches, f"{path.name}: COPY {source} does not exist in the repository"
    for match in matches:
        rel = match.relative_to(REPO).as_posix()
        assert not DOCKERIGNORE.excluded(rel), f"{path.name}: COPY {source}, but .dockerignore leaves {rel} out"


@pytest.mark.parametrize(
    "path", [".venv/bin/python", ".git/HEAD", ".pytest_cache/x", ".hypothesis/x", "bench_results/x.json",
             "models/stories260K/model.safetensors", "tests/conftest.py", "llmsched/__pycache__/server.cpython-311.pyc",
             "scheduler_svc/x.pyc", "llmsched.egg-info/PKG-INFO"],
)
def test_dockerignore_keeps_out_of_build_context(path):
    assert DOCKERIGNORE.excluded(path), f".dockerignore lets {path} into the build context"


def test_requirements_helper_splits_base_and_executor_dependencies():
    spec = importlib.util.spec_from_file_location("docker_requirements", REPO / "docker" / "requirements.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    pyproject = REPO / "pyproject.toml"
    names = lambda reqs: {helper.requirement_name(r) for r in reqs}  # noqa: E731
    base = names(helper.requirements(pyproject, [], [], []))
    assert "torch" not in base and {"grpcio", "grpcio-health-checking"} <= base
    executor = names(helper.requirements(pyproject, ["executor"], ["torch"], []))
    assert "torch" not in executor and {"safetensors", "numpy"} <= executor
    assert helper.requirements(pyproject, ["executor"], [], ["torch"]) == [f"torch=={TORCH_PIN}"]


# ------------------------------------------------------------ compose CLI


@functools.cache
def _compose_cli() -> tuple[list[str], str] | None:
    """A compose that can run `config` without an engine, and its version."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        try:
            out = subprocess.run([*argv, "version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        m = re.search(r"v?(\d+\.\d+\.\d+)", out.stdout)
        if out.returncode == 0 and m:
            return argv, m.group(1)
    return None


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_cli_config_accepts_the_files(variant):
    found = _compose_cli()
    if found is None:
        pytest.skip("no `docker compose` plugin or docker-compose binary on PATH to run `config`")
    argv, version = found
    if variant == "cpu" and tuple(map(int, version.split("."))) < (2, 24, 0):
        pytest.skip(f"compose {version} predates `!reset` (v2.24), which docker-compose.cpu.yml uses")
    files = [arg for f in VARIANTS[variant] for arg in ("-f", str(f))]
    result = subprocess.run([*argv, *files, "config", "-q"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"compose {version} rejects {variant}: {result.stderr}"
