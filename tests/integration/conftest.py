"""Integration fixtures: both services as real processes on free loopback
ports, talking real gRPC."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest

from llmsched.launch import launch
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from tests.oracle import hf_greedy


@dataclass
class Client:
    address: str
    model: str  # what EXECUTOR_MODEL was set to, for the HF oracle
    channel: grpc.Channel
    stub: spb_grpc.SchedulerStub

    def generate(self, timeout=60, **kwargs):
        """Returns (token_ids, text, last_response, number_of_responses)."""
        sampling = kwargs.pop("sampling", None)
        req = spb.GenerateRequest(sampling=spb.SamplingParams(**(sampling or {})), **kwargs)
        tokens, text, last, n = [], "", None, 0
        for resp in self.stub.Generate(req, timeout=timeout):
            tokens += resp.token_ids
            text += resp.text
            last, n = resp, n + 1
        return tokens, text, last, n

    def cancel_after(self, prompt: str, num_responses: int = 2) -> None:
        """A long greedy stream of prompt, cancelled by the client once
        num_responses have arrived (mid-decode)."""
        call = self.stub.Generate(spb.GenerateRequest(prompt=prompt, sampling=spb.SamplingParams(
            max_tokens=200, temperature=0)), timeout=60)
        for _ in range(num_responses):
            next(call)
        call.cancel()

    def info(self) -> spb.ServerInfo:
        return self.stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=10)

    def assert_no_leaked_blocks(self, timeout_s: float = 10.0) -> None:
        """Aborts land at the next step boundary, so allow a moment."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            if info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0 and info.num_waiting == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"KV blocks leaked: {info.num_kv_blocks - info.num_free_kv_blocks} of {info.num_kv_blocks} "
                    f"still held, running={info.num_running}, waiting={info.num_waiting}"
                )
            time.sleep(0.05)


def assert_32_concurrent_mixed_requests_match_hf(client: Client, base: list[int]) -> None:
    """32 greedy requests at once, prompts of 3..62 leading tokens of
    `base` and max_tokens 8..40, each equal to HF's solo greedy output;
    then no KV block is still held."""
    cases = []
    for i in range(32):
        n = 3 + (i * 7) % min(60, len(base) - 1)  # prompt lengths 3..62
        cases.append((list(base[: n]), 8 + (i * 5) % 33))  # max_tokens 8..40
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(
            lambda c: client.generate(prompt_token_ids=c[0], sampling={"max_tokens": c[1], "temperature": 0})[0], cases
        ))
    for (prompt_ids, max_tokens), got in zip(cases, results):
        assert got == hf_greedy(client.model, prompt_ids, max_tokens), f"prompt of {len(prompt_ids)} tokens"
    client.assert_no_leaked_blocks()


def start_services(model: str, executor_env=None, scheduler_env=None):
    services = launch(
        executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_NUM_THREADS": "1", **(executor_env or {})},
        scheduler_env=scheduler_env,
    ).start()
    channel = grpc.insecure_channel(services.scheduler_address)
    return services, Client(services.scheduler_address, model, channel, spb_grpc.SchedulerStub(channel))


# The default stacks, shared by every module that only reads from them (one
# per xdist worker): each test leaves them as it found them, with no
# request running and no KV block held. Tests that kill, stall or
# reconfigure a process start their own.
@pytest.fixture(scope="session")
def stories(stories_path):
    services, client = start_services(str(stories_path))
    yield client
    client.channel.close()
    services.stop()


@pytest.fixture(scope="session")
def tiny():
    services, client = start_services("tiny-random")
    yield client
    client.channel.close()
    services.stop()


@dataclass
class GatewayStack:
    """Executor, scheduler and gateway, with the official `openai` client
    and a gRPC client of the scheduler."""

    services: object
    grpc: Client
    openai: object  # openai.OpenAI
    model: str  # the served model's name

    def stop(self) -> None:
        self.openai.close()
        self.grpc.channel.close()
        self.services.stop()


def start_gateway_stack(model: str, executor_env=None, scheduler_env=None, gateway_env=None) -> GatewayStack:
    import openai

    services = launch(executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_NUM_THREADS": "1", **(executor_env or {})},
                      scheduler_env=scheduler_env, gateway_env=gateway_env, with_gateway=True).start()
    channel = grpc.insecure_channel(services.scheduler_address)
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return GatewayStack(services, Client(services.scheduler_address, model, channel, spb_grpc.SchedulerStub(channel)),
                        client, client.models.list().data[0].id)


def scheduler_metric(services, name: str) -> float:
    """A scheduler metric from its /metrics, summed over its labels."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{services.scheduler_metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def num_admitted(services) -> float:
    """Requests the scheduler has scheduled or finished (a refused one
    is neither)."""
    return (scheduler_metric(services, "llmsched_request_queue_time_seconds_count")
            + scheduler_metric(services, "llmsched_request_success_total"))


@pytest.fixture(scope="session")
def embedder(stories_path, tmp_path_factory):
    """stories260K with a sentence-transformers pooling config (mean, then
    Normalize) and a chat template, behind the gateway, prompts prefilled in
    chunks of 16, at most 4 inputs per /v1/embeddings request: the stack for
    embeddings and prompt logprobs."""
    from tests.embeddings import embedding_checkpoint

    path = embedding_checkpoint(stories_path, tmp_path_factory.mktemp("embedder") / "stories-embed")
    stack = start_gateway_stack(str(path), scheduler_env={"SCHEDULER_MAX_PREFILL_CHUNK": "16"},
                                gateway_env={"GATEWAY_MAX_EMBEDDING_INPUTS": "4"})
    yield stack
    stack.stop()
