"""`make serve`'s entry point answers a client that knows only reflection,
and Ctrl-C stops both services cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmsched.launch import free_port, wait_serving


def test_make_serve_entry_point_answers_a_reflection_only_client():
    sched_port, exec_port = free_port(), free_port()
    env = {**os.environ, "SCHEDULER_PORT": str(sched_port), "EXECUTOR_PORT": str(exec_port)}
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
