"""Start-up and stop of the real service processes: a setting or file that
keeps a service from starting is named in one line on stderr, with exit
code 1, within seconds; a second copy on a port in use does not start; a
dead trace collector does not hold up a stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from unittest import mock
from pathlib import Path

import grpc
import pytest

from llmsched import cpus
from llmsched.launch import free_port, launch
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

# Generous for two shared CPU cores; a failing start takes 2-4 s here.
START_FAILS_WITHIN_S = 20.0
TERABYTES_IN_MB = str(100 * 1024 * 1024)


@pytest.fixture(scope="module")
def running():
    """One executor + scheduler pair whose ports the second copies clash with,
    placed on the cores as `make serve` places them (the suite otherwise
    runs with LLMSCHED_PIN_CPUS=off: tests/conftest.py)."""
    with mock.patch.dict(os.environ, {cpus.PIN_SETTING: "auto"}):
        services = launch().start()
    yield services
    services.stop()


def test_launch_runs_the_scheduler_on_one_core_and_the_executor_on_the_rest(running):
    usable = cpus.usable_cpus()
    if len(usable) < 2:
        pytest.skip(f"one usable core ({cpus.format_cpu_list(usable)}): nothing to split")
    executor, scheduler = os.sched_getaffinity(running.executor.pid), os.sched_getaffinity(running.scheduler.pid)
    want = usable - scheduler if len(usable) > 2 else usable  # on two cores the executor keeps both
    assert scheduler == {min(usable)} and executor == want, (
        f"executor on {cpus.format_cpu_list(executor)}, scheduler on {cpus.format_cpu_list(scheduler)}, "
        f"of {cpus.format_cpu_list(usable)}")
    threads = {int(t) for t in os.listdir(f"/proc/{running.executor.pid}/task")}
    strays = {t: cores for t in threads if (cores := os.sched_getaffinity(t)) != executor}
    assert not strays, f"executor threads started before it was pinned: {strays}"


def generate(address: str, max_tokens: int = 4) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = spb.GenerateRequest(prompt="hi", sampling=spb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return [t for r in spb_grpc.SchedulerStub(channel).Generate(req, timeout=30) for t in r.token_ids]


def checkpoint_without(tmp_path: Path, stories: Path, missing: str, replace: dict[str, str] | None = None) -> str:
    """stories260K's files, linked into tmp_path, less one; replace writes
    a file's text instead of linking it."""
    d = tmp_path / f"ckpt-without-{missing}"
    d.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name == missing:
            continue
        if replace and name in replace:
            (d / name).write_text(replace[name])
        else:
            (d / name).symlink_to(stories / name)
    return str(d)


@dataclass
class BadStart:
    service: str  # executor_svc | scheduler_svc | gateway_svc
    env: dict[str, str]
    names: str  # what the one-line error must name


# Each case builds its environment from the running pair, tmp_path and the
# checkpoint, so that ports and paths are real.
CASES = {
    "checkpoint-without-tokenizer.json": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {"EXECUTOR_MODEL": (m := checkpoint_without(tmp, ckpt, "tokenizer.json"))},
        f"{m}/tokenizer.json"),
    "corrupt-config.json": lambda pair, tmp, ckpt: BadStart(
        "executor_svc",
        {"EXECUTOR_MODEL": (m := checkpoint_without(tmp, ckpt, "", {"config.json": '{"vocab_size": 512,'}))},
        f"{m}/config.json"),
    "kv-memory-beyond-free-memory": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {"EXECUTOR_MODEL": str(ckpt), "EXECUTOR_KV_CACHE_MEMORY_MB": TERABYTES_IN_MB},
        f"EXECUTOR_KV_CACHE_MEMORY_MB={TERABYTES_IN_MB}"),
    "kv-blocks-beyond-free-memory": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {"EXECUTOR_MODEL": str(ckpt), "EXECUTOR_NUM_KV_BLOCKS": "10000000000"},
        "EXECUTOR_NUM_KV_BLOCKS=10000000000"),
    "model-neither-directory-nor-built-in": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {"EXECUTOR_MODEL": str(tmp / "no-such-dir")}, f"EXECUTOR_MODEL='{tmp / 'no-such-dir'}'"),
    "port-not-a-number": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {"SCHEDULER_PORT": "fifty"}, "SCHEDULER_PORT='fifty'"),
    "executor-metrics-port-in-use": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {"EXECUTOR_METRICS_PORT": str(pair.executor_metrics_port)},
        f"EXECUTOR_METRICS_PORT={pair.executor_metrics_port}: address already in use"),
    "scheduler-metrics-port-in-use": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {"SCHEDULER_METRICS_PORT": str(pair.scheduler_metrics_port)},
        f"SCHEDULER_METRICS_PORT={pair.scheduler_metrics_port}: address already in use"),
    "second-executor-on-a-port-in-use": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {"EXECUTOR_PORT": str(pair.executor_port)},
        f"EXECUTOR_PORT={pair.executor_port}: address already in use"),
    "gateway-on-a-port-in-use": lambda pair, tmp, ckpt: BadStart(
        "gateway_svc", {"GATEWAY_PORT": str(pair.scheduler_metrics_port)},
        f"GATEWAY_PORT={pair.scheduler_metrics_port}: address already in use"),
    "bad-tenant-weight": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {"SCHEDULER_TENANT_WEIGHTS": "teamA=2,teamB=0"}, "SCHEDULER_TENANT_WEIGHTS: the weight of "
        "'teamB' must be a finite number > 0"),
    "bad-tenant-in-an-api-key-entry": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {"SCHEDULER_API_KEYS": "team A:secret"}, "SCHEDULER_API_KEYS: tenant 'team A'"),
    "swap-preemption-without-a-host-tier": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {"SCHEDULER_EXECUTOR_ADDRESS": pair.executor_address, "SCHEDULER_PREEMPTION_MODE": "swap"},
        "SCHEDULER_PREEMPTION_MODE=swap: the executor at"),
    "executor-on-cores-it-may-not-use": lambda pair, tmp, ckpt: BadStart(
        "executor_svc", {cpus.CPUS_ENV: "4095"}, f"{cpus.CPUS_ENV}='4095' names cores the executor may not run on"),
    "scheduler-on-a-cpu-list-that-is-not-one": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {cpus.CPUS_ENV: "two"}, f"{cpus.CPUS_ENV}='two': 'two' is not a CPU number or range"),
    "second-scheduler-on-a-port-in-use": lambda pair, tmp, ckpt: BadStart(
        "scheduler_svc", {"SCHEDULER_PORT": str(pair.scheduler_port)},
        f"SCHEDULER_PORT={pair.scheduler_port}: address already in use"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_setting_or_file_stops_the_start_with_one_line_naming_it(case, running, tmp_path, stories_path):
    bad = CASES[case](running, tmp_path, stories_path)
    env = {
        **os.environ,
        # Free ports and no executor to reach, unless the case says otherwise.
        "EXECUTOR_PORT": str(free_port()), "EXECUTOR_METRICS_PORT": "0", "EXECUTOR_NUM_THREADS": "1",
        "SCHEDULER_PORT": str(free_port()), "SCHEDULER_METRICS_PORT": "0",
        "SCHEDULER_EXECUTOR_ADDRESS": f"127.0.0.1:{free_port()}",
        **bad.env,
    }
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", bad.service], env=env, capture_output=True, text=True,
                              timeout=START_FAILS_WITHIN_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{bad.service} with {bad.env} still running after {START_FAILS_WITHIN_S}s: "
                             f"{(exc.stderr or b'')[-2000:]!r}") from None
    took = time.monotonic() - started
    service = bad.service.removesuffix("_svc")
    ours = [line for line in proc.stderr.splitlines() if line.startswith(f"{service}: cannot start: ")]
    assert proc.returncode == 1, f"exit code {proc.returncode} after {took:.1f}s; stderr: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, f"a traceback instead of one line: {proc.stderr[-3000:]}"
    assert len(ours) == 1 and bad.names in ours[0], (
        f"expected one '{service}: cannot start:' line naming {bad.names!r}; stderr: {proc.stderr[-2000:]}")
    # The pair whose ports were taken still serves, on its own.
    assert running.executor.poll() is None and running.scheduler.poll() is None
    assert len(generate(running.scheduler_address)) == 4


# Alone: it times the scheduler's stop.
@pytest.mark.alone
def test_a_dead_trace_collector_does_not_hold_up_a_stop():
    """Spans queued for a collector that is down: SIGTERM still ends the
    scheduler in seconds (the SDK alone retries each batch for 10 s)."""
    dead = f"http://127.0.0.1:{free_port()}"
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": dead, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            # Small batches: many exports pending at the stop.
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4"}
    services = launch(executor_env={"EXECUTOR_NUM_THREADS": "1"}, scheduler_env=otel).start()
    try:
        for _ in range(4):
            assert len(generate(services.scheduler_address, max_tokens=8)) == 8
        started = time.monotonic()
        services.scheduler.send_signal(signal.SIGTERM)
        try:
            code = services.scheduler.wait(15)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - started
    finally:
        services.stop()
    assert code == 0 and took < 5.0, f"the scheduler took {took:.1f}s to stop (exit code {code})"
