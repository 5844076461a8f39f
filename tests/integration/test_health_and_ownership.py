"""Health that tells the truth, one scheduler per executor, and requests
that belong to the API key that created them: regression tests over real
processes (issue #10)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsched.launch import free_port, launch
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from tests.integration.conftest import start_services

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(address: str) -> int | None:
    """Overall health, or None while nothing answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        except grpc.RpcError:
            return None


def wait_for_health(address: str, want: int, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while (status := health_of(address)) != want:
        assert time.monotonic() - started < timeout_s, f"{what}: health still {status} after {timeout_s}s"
        time.sleep(0.1)  # probing another process: nothing to wait on
    return time.monotonic() - started


def start_scheduler(executor_address: str, **env) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler_svc"],
        env={**os.environ, "SCHEDULER_PORT": str(port), "SCHEDULER_METRICS_PORT": "0",
             "SCHEDULER_EXECUTOR_ADDRESS": executor_address, **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def generate(address: str, timeout: float = 30, **sampling) -> tuple[list[int], spb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        req = spb.GenerateRequest(prompt="Once upon a time", sampling=spb.SamplingParams(**sampling))
        tokens, last = [], None
        for resp in spb_grpc.SchedulerStub(channel).Generate(req, timeout=timeout):
            tokens += resp.token_ids
            last = resp
        return tokens, last


def test_scheduler_without_an_executor_reports_not_serving_until_one_connects():
    services = launch(executor_env={"EXECUTOR_MODEL": "tiny-random", "EXECUTOR_NUM_THREADS": "1"})
    scheduler, address = start_scheduler(services.executor_address)
    try:
        wait_for_health(address, NOT_SERVING, 30, "scheduler alone")
        with pytest.raises(grpc.RpcError) as exc:
            generate(address, max_tokens=2)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        time.sleep(1.0)
        assert health_of(address) == NOT_SERVING, "scheduler claimed SERVING with no executor connected"
        services.start_executor()
        wait_for_health(address, SERVING, 60, "after the executor started")
        assert len(generate(address, max_tokens=3, ignore_eos=True)[0]) == 3
    finally:
        stop(scheduler)
        services.stop()


def test_idle_scheduler_notices_its_executor_dying_and_coming_back():
    services, client = start_services("tiny-random", scheduler_env={"SCHEDULER_EXECUTOR_KEEPALIVE_S": "1"})
    try:
        assert len(client.generate(prompt="hi", sampling={"max_tokens": 3, "ignore_eos": True})[0]) == 3
        services.executor.kill()
        services.executor.wait()
        took = wait_for_health(services.scheduler_address, NOT_SERVING, 10, "idle scheduler after executor SIGKILL")
        assert took < 10
        services.start_executor()
        wait_for_health(services.scheduler_address, SERVING, 60, "after the executor restarted")
        assert len(client.generate(prompt="hi", sampling={"max_tokens": 3, "ignore_eos": True})[0]) == 3
    finally:
        client.channel.close()
        services.stop()


def test_idle_scheduler_notices_a_frozen_executor():
    services, client = start_services("tiny-random", scheduler_env={"SCHEDULER_EXECUTOR_KEEPALIVE_S": "1"})
    try:
        services.executor.send_signal(signal.SIGSTOP)
        wait_for_health(services.scheduler_address, NOT_SERVING, 15, "idle scheduler with a frozen executor")
        services.executor.send_signal(signal.SIGCONT)
        wait_for_health(services.scheduler_address, SERVING, 60, "after the executor resumed")
        assert len(client.generate(prompt="hi", sampling={"max_tokens": 3, "ignore_eos": True})[0]) == 3
    finally:
        services.executor.send_signal(signal.SIGCONT)
        client.channel.close()
        services.stop()


# Alone: with 1 s keepalives, a starved first scheduler would lose its executor.
@pytest.mark.alone
def test_second_scheduler_is_refused_while_the_first_holds_the_executor():
    """One scheduler per executor: a second one stays NOT_SERVING while the
    first is alive. When the first freezes, the executor drops it after
    its keepalive and the second takes over; the first, resumed, is the
    one refused."""
    services, first = start_services(
        "tiny-random",
        executor_env={"EXECUTOR_SCHEDULER_KEEPALIVE_S": "1"},
        scheduler_env={"SCHEDULER_EXECUTOR_KEEPALIVE_S": "1"},
    )
    second, second_address = start_scheduler(services.executor_address, SCHEDULER_EXECUTOR_KEEPALIVE_S="1")
    try:
        wait_for_health(second_address, NOT_SERVING, 30, "second scheduler while the first is alive")
        time.sleep(3.0)
        assert health_of(second_address) == NOT_SERVING, "a second scheduler took a live executor"
        tokens = first.generate(prompt="hi", sampling={"max_tokens": 3, "ignore_eos": True})[0]
        assert len(tokens) == 3, "the first scheduler must keep serving"

        services.scheduler.send_signal(signal.SIGSTOP)
        wait_for_health(second_address, SERVING, 30, "second scheduler after the first froze")
        assert len(generate(second_address, max_tokens=3, ignore_eos=True)[0]) == 3

        services.scheduler.send_signal(signal.SIGCONT)
        wait_for_health(services.scheduler_address, NOT_SERVING, 30, "first scheduler after it resumed")
        with pytest.raises(grpc.RpcError) as exc:
            first.generate(prompt="hi", sampling={"max_tokens": 3}, timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(generate(second_address, max_tokens=3, ignore_eos=True)[0]) == 3, "the second scheduler must keep serving"
    finally:
        services.scheduler.send_signal(signal.SIGCONT)
        first.channel.close()
        stop(second)
        services.stop()


def test_stop_string_completed_on_the_last_allowed_token_finishes_with_stop(stories_path):
    services, client = start_services(str(stories_path))
    try:
        full, _, _, _ = client.generate(prompt="Once upon a time", sampling={"max_tokens": 10, "temperature": 0})
        _, text, last, _ = client.generate(prompt="Once upon a time",
                                           sampling={"max_tokens": 10, "temperature": 0, "stop": ["Lily"]})
        # The scenario needs "Lily" to end exactly at the 10th token.
        plain = client.generate(prompt="Once upon a time", sampling={"max_tokens": 10, "temperature": 0})[1]
        assert plain.endswith("Lily") and len(full) == 10, f"scenario changed: {plain!r}"
        assert "Lily" not in text
        assert last.finish_reason == spb.FINISH_REASON_STOP
    finally:
        client.channel.close()
        services.stop()


def test_abort_is_scoped_to_the_api_key_that_created_the_request():
    services, _ = start_services("tiny-random", scheduler_env={"SCHEDULER_API_KEYS": "key-one,key-two"})
    channel = grpc.insecure_channel(services.scheduler_address)
    stub = spb_grpc.SchedulerStub(channel)
    owner = (("authorization", "Bearer key-one"),)
    other = (("authorization", "Bearer key-two"),)
    finish = []

    def run():
        req = spb.GenerateRequest(request_id="mine", prompt="hello",
                                  sampling=spb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))
        for resp in stub.Generate(req, metadata=owner, timeout=120):
            if resp.finish_reason:
                finish.append(resp.finish_reason)

    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while stub.GetServerInfo(spb.GetServerInfoRequest(), metadata=owner, timeout=5).num_running == 0:
            assert time.monotonic() < deadline, "request never started"
            time.sleep(0.05)
        assert not stub.Abort(spb.AbortRequest(request_id="mine"), metadata=other, timeout=5).found, (
            "another API key aborted the request")
        time.sleep(0.5)
        assert thread.is_alive() and not finish, "the request must survive another key's Abort"
        assert stub.Abort(spb.AbortRequest(request_id="mine"), metadata=owner, timeout=5).found
        thread.join(30)
        assert finish == [spb.FINISH_REASON_ABORT]
    finally:
        thread.join(60)
        channel.close()
        services.stop()


def _step_socket_gauge(services) -> float:
    from bench.server_metrics import scrape

    return scrape(services.scheduler_metrics_port)["llmsched_executor_step_socket"]


def test_the_step_stream_takes_the_executors_unix_socket_unless_told_not_to_with_the_same_tokens(tmp_path):
    """A scheduler on the executor's host steps over the executor's Unix
    socket (llmsched/step_socket.py); SCHEDULER_EXECUTOR_STEP_SOCKET=off
    keeps gRPC. The socket is the executor's instance's and goes with it."""
    sampling = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    # Short: a Unix socket's path has at most 107 bytes, and pytest's tmp_path under xdist can pass that.
    socket_dir = Path(tempfile.mkdtemp(prefix="llmsched-t-", dir="/tmp"))
    on, on_client = start_services("tiny-random", executor_env={"EXECUTOR_STEP_SOCKET_DIR": str(socket_dir)})
    off, off_client = start_services("tiny-random", executor_env={"EXECUTOR_STEP_SOCKET_DIR": str(socket_dir)},
                                     scheduler_env={"SCHEDULER_EXECUTOR_STEP_SOCKET": "off"})
    try:
        assert len(list(socket_dir.glob("llmsched-step-*.sock"))) == 2, "each executor offers a socket of its own"
        assert _step_socket_gauge(on) == 1, "the scheduler on the executor's host did not take its socket"
        assert _step_socket_gauge(off) == 0, "SCHEDULER_EXECUTOR_STEP_SOCKET=off still took the socket"
        for prompt in ("hi", "a longer prompt that spans more than one block of sixteen tokens, twice over"):
            assert on_client.generate(prompt=prompt, sampling=sampling)[0] == \
                off_client.generate(prompt=prompt, sampling=sampling)[0]
    finally:
        for services, client in ((on, on_client), (off, off_client)):
            client.channel.close()
            services.stop()
    assert not list(socket_dir.glob("*.sock")), "a stopped executor left its socket behind"
    socket_dir.rmdir()


def test_a_step_socket_that_cannot_be_made_leaves_the_stream_on_grpc(tmp_path):
    """EXECUTOR_STEP_SOCKET=auto offers what it can: a directory whose
    socket path passes 107 bytes is logged, and steps go over gRPC."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    services, client = start_services("tiny-random", executor_env={"EXECUTOR_STEP_SOCKET_DIR": str(deep)})
    try:
        assert _step_socket_gauge(services) == 0
        assert len(client.generate(prompt="hi", sampling={"max_tokens": 3, "ignore_eos": True})[0]) == 3
    finally:
        client.channel.close()
        services.stop()
