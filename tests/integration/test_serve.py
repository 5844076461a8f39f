"""`make serve`'s entry point (python -m llmsched.launch) answers a client
that knows only reflection, picks free ports when asked for port 0, starts
with TLS from the environment alone, and Ctrl-C stops both services cleanly,
even under a shell that ignores SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmsched.launch import free_port, wait_serving
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from tests.integration.test_security import creds, pki  # noqa: F401 (pki is a fixture)

SERVING_LINE = re.compile(r"serving llmsched\.v1\.Scheduler on (\S+) and the OpenAI API on \S+ \(executor on (\S+);")
# No clash with the defaults (8000, 8001, 8080) or with other runs on this
# machine: metrics off, the gateway on a free port.
NO_METRICS = {"SCHEDULER_METRICS_PORT": "0", "EXECUTOR_METRICS_PORT": "0", "GATEWAY_PORT": "0"}


def test_make_serve_entry_point_answers_a_reflection_only_client():
    sched_port, exec_port = free_port(), free_port()
    env = {**os.environ, "SCHEDULER_PORT": str(sched_port), "EXECUTOR_PORT": str(exec_port), **NO_METRICS}
    proc = subprocess.Popen([sys.executable, "-m", "llmsched.launch"], env=env)
    try:
        wait_serving(f"127.0.0.1:{sched_port}", 120, proc)
        with grpc.insecure_channel(f"127.0.0.1:{sched_port}") as channel:
            pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            method = pool.FindServiceByName("llmsched.v1.Scheduler").methods_by_name["Generate"]
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            generate = channel.unary_stream(
                "/llmsched.v1.Scheduler/Generate",
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            req = request_cls(prompt="hello")
            req.sampling.max_tokens = 8
            req.sampling.ignore_eos = True
            responses = list(generate(req, timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 8
        assert responses[-1].finish_reason == 2  # FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 8
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 0


class Launcher:
    """python -m llmsched.launch as a child, its stdout read by a thread so
    the serving line (which names the ports) can be awaited."""

    def __init__(self, env: dict[str, str], ignore_sigint: bool = False):
        # SIG_IGN survives exec: the launcher starts as under `cmd &` in a
        # non-interactive shell.
        preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        self.proc = subprocess.Popen([sys.executable, "-m", "llmsched.launch"], env={**os.environ, **NO_METRICS, **env},
                                     stdout=subprocess.PIPE, text=True, preexec_fn=preexec)
        self.lines: list[str] = []
        self.serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if SERVING_LINE.search(line):
                self.serving.set()

    def wait_serving(self, timeout_s: float = 120) -> tuple[str, str]:
        """The scheduler's and the executor's address, from the serving line."""
        deadline = time.monotonic() + timeout_s
        while not self.serving.wait(0.2):
            assert self.proc.poll() is None, f"the launcher exited with {self.proc.returncode}: {self.lines}"
            assert time.monotonic() < deadline, f"no serving line within {timeout_s}s: {self.lines}"
        return next(m.groups() for line in self.lines if (m := SERVING_LINE.search(line)))

    def stop(self, sig=signal.SIGINT, timeout_s: float = 30) -> int:
        children = child_pids(self.proc.pid) if self.proc.poll() is None else []
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            # Which service held the stop up: its log lines are in the
            # captured stderr above.
            alive = [command_line(pid) for pid in children if Path(f"/proc/{pid}").exists()]
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the launcher ignored signal {sig!r} for {timeout_s}s; "
                                 f"children still running: {alive}") from None


def generate_tokens(address: str, credentials=None) -> int:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        req = spb.GenerateRequest(prompt="hi", sampling=spb.SamplingParams(max_tokens=4, ignore_eos=True))
        return sum(len(r.token_ids) for r in spb_grpc.SchedulerStub(channel).Generate(req, timeout=60))


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return f"{pid} (gone)"


def test_port_zero_starts_on_free_ports_that_the_serving_line_names():
    launcher = Launcher({"SCHEDULER_PORT": "0", "EXECUTOR_PORT": "0"})
    try:
        scheduler, executor = launcher.wait_serving()
        assert not scheduler.endswith(":0") and not executor.endswith(":0"), launcher.lines
        assert generate_tokens(scheduler) == 4
    finally:
        code = launcher.stop()
    assert code == 0


def test_sigint_stops_a_launcher_started_with_sigint_ignored():
    launcher = Launcher({"SCHEDULER_PORT": "0", "EXECUTOR_PORT": "0"}, ignore_sigint=True)
    try:
        launcher.wait_serving()
        children = child_pids(launcher.proc.pid)
        assert len(children) == 3, f"expected the executor, the scheduler and the gateway as children, got {children}"
    finally:
        code = launcher.stop(signal.SIGINT)
    assert code == 0
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists() and "Z" not in
             Path(f"/proc/{pid}/stat").read_text().split()[2]]
    assert not alive, f"children still running after the launcher stopped: {alive}"


def test_launcher_with_tls_from_the_environment_alone_serves(pki):  # noqa: F811
    server_cert, server_key = pki["ca-server"]
    client_cert, client_key = pki["ca-client"]
    launcher = Launcher({
        "SCHEDULER_PORT": "0", "EXECUTOR_PORT": "0",
        "EXECUTOR_TLS_CERT": server_cert, "EXECUTOR_TLS_KEY": server_key, "EXECUTOR_TLS_CLIENT_CA": pki["ca"],
        "SCHEDULER_TLS_CERT": server_cert, "SCHEDULER_TLS_KEY": server_key,
        "SCHEDULER_EXECUTOR_TLS_CA": pki["ca"], "SCHEDULER_EXECUTOR_TLS_CERT": client_cert,
        "SCHEDULER_EXECUTOR_TLS_KEY": client_key,
    })
    try:
        scheduler, _ = launcher.wait_serving()
        assert generate_tokens(scheduler, creds(pki)) == 4
    finally:
        code = launcher.stop()
    assert code == 0
