"""Tensor parallelism over NCCL through the real services: a TP=2 executor
on two GPUs serves the greedy tokens one GPU serves. Needs at least two
CUDA devices (`make gpu-check` runs it where there are); the CPU (gloo)
path is tested in test_tensor_parallel.py."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmsched.launch import launch
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from tests.integration.conftest import Client


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(_cuda_devices() < 2, reason=f"needs at least 2 CUDA devices for NCCL tensor parallelism; "
                                                   f"torch sees {_cuda_devices()}"),
]

MODEL = "bench-small"
# Prompts of several lengths (one spans blocks, one is a single token) and
# a batch decoded together, so prefill, decode and mixed steps all run.
PROMPTS = [[1], [5, 9, 33, 71, 200], list(range(3, 40)), [4000 + 7 * i for i in range(70)]]
BATCH = [[11 + j, 400 + 13 * j, 2 * j + 1, 900] for j in range(16)]
MAX_TOKENS = 24


def _serve(size: int, log_path) -> tuple[object, Client, object]:
    # fp32 on both sides: the all-reduce then changes sums by rounding only,
    # well under bench-small's greedy top-2 gaps (above 1e-4, see
    # tests/unit/test_cuda_graphs.py).
    # CUDA graphs off: a group runs decode steps eagerly, so one GPU does too.
    env = {"EXECUTOR_MODEL": MODEL, "EXECUTOR_DEVICE": "cuda", "EXECUTOR_DTYPE": "float32",
           "EXECUTOR_CUDA_GRAPHS": "off", "EXECUTOR_TENSOR_PARALLEL_SIZE": str(size)}
    services = launch(executor_env=env)
    log = open(log_path, "w")
    services.stdout = log
    try:
        services.start()
    except BaseException:
        log.close()
        raise
    channel = grpc.insecure_channel(services.scheduler_address)
    return services, Client(services.scheduler_address, MODEL, channel, spb_grpc.SchedulerStub(channel)), log


def _outputs(client: Client) -> tuple[list[list[int]], list[list[int]]]:
    def one(prompt):
        return client.generate(prompt_token_ids=prompt, sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                                  "ignore_eos": True})[0]

    alone = [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(BATCH)) as pool:
        together = list(pool.map(one, BATCH))
    return alone, together


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{size: (alone, together, info, log text)} for TP=1 and TP=2."""
    out = {}
    for size in (1, 2):
        log_path = tmp_path_factory.mktemp(f"tp{size}") / "services.log"
        services, client, log = _serve(size, log_path)
        try:
            alone, together = _outputs(client)
            client.assert_no_leaked_blocks()
            info = client.info()
        finally:
            client.channel.close()
            services.stop()
            log.close()
        out[size] = (alone, together, info, log_path.read_text())
    return out


def test_two_ranks_over_nccl_each_take_their_own_gpu(served):
    *_, info, log = served[2]
    assert info.tensor_parallel_size == 2, info
    assert re.search(r"rank 0 of 2 joining the tensor-parallel group \(nccl", log), log[-3000:]
    assert re.search(r"rank 1 of 2 ready on cuda:1", log), f"rank 1 did not report cuda:1:\n{log[-3000:]}"
    assert "device=cuda:0" in log, f"rank 0 did not serve on cuda:0:\n{log[-3000:]}"


def test_tp2_over_nccl_serves_the_greedy_tokens_of_one_gpu(served):
    alone1, together1, *_ = served[1]
    alone2, together2, *_ = served[2]
    assert all(len(t) == MAX_TOKENS for t in alone2 + together2), "TP=2 stopped early"
    for i, (a, b) in enumerate(zip(alone1, alone2)):
        assert a == b, f"prompt {i} (length {len(PROMPTS[i])}): TP=1 {a} vs TP=2 {b}"
    differ = [j for j, (a, b) in enumerate(zip(together1, together2)) if a != b]
    assert not differ, f"batched requests {differ} of {len(BATCH)} differ between TP=1 and TP=2"
