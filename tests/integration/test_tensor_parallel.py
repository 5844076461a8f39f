"""Tensor parallelism through both real services: an executor over 2 gloo
ranks on CPU (EXECUTOR_TENSOR_PARALLEL_SIZE=2), unchanged scheduler.
Greedy streams equal HF's under 32 concurrent mixed requests; errors every
rank meets alike keep the group up; a killed or hung rank stops the group
(fail-stop), and the scheduler carries every stream across the restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from llmsched.launch import free_port, launch, wait_serving
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from tests.families import CASES, make_checkpoint
from tests.integration.conftest import assert_32_concurrent_mixed_requests_match_hf, scheduler_metric, start_services
from tests.integration.test_reliability import Streams, wait_until
from tests.oracle import hf_greedy

TP2 = {"EXECUTOR_TENSOR_PARALLEL_SIZE": "2"}


def ranks_of(executor: subprocess.Popen) -> list[int]:
    """pids of the ranks rank 0 started (its children, from whichever of its
    threads started them: the step thread, which loads the model)."""
    return [int(pid) for task in Path(f"/proc/{executor.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()]


@pytest.fixture(scope="module")
def tp2(stories_path):
    # With a device pool too small for the 32 concurrent requests and a host
    # tier, they are preempted by swap: each rank copies its slice. One step
    # a plan, as in test_host_kv_tier.py: a victim with a multi-step run in
    # flight is recomputed, and the swap test counts recomputed tokens.
    services, client = start_services(
        str(stories_path), executor_env={**TP2, "EXECUTOR_NUM_KV_BLOCKS": "64", "EXECUTOR_HOST_KV_CACHE_MEMORY_MB": "2"},
        scheduler_env={"SCHEDULER_PREEMPTION_MODE": "swap", "SCHEDULER_MULTI_STEP_DECODE": "1"})
    yield services, client
    client.channel.close()
    services.stop()


def test_server_info_reports_the_tensor_parallel_size(tp2):
    services, client = tp2
    assert client.info().tensor_parallel_size == 2
    assert len(ranks_of(services.executor)) == 1, "rank 0 starts one other rank"


def test_32_concurrent_mixed_requests_match_hf_greedy_at_tp2_swapping_to_the_host_tier(tp2):
    services, client = tp2
    swapped = scheduler_metric(services, 'llmsched_num_preemptions_total{mode="swap"}')
    base = [1, 403, 407, 261, 378, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309] * 5
    assert_32_concurrent_mixed_requests_match_hf(client, base)
    assert scheduler_metric(services, 'llmsched_num_preemptions_total{mode="swap"}') > swapped, (
        "the device pool was meant to be too small: nothing was swapped out")
    assert scheduler_metric(services, "llmsched_recomputed_tokens_total") == 0


def test_sampling_with_logprobs_and_a_seed_repeats_at_tp2(tp2):
    """Rank 0 samples alone and shares the ids: a seeded stream repeats, and
    logprobs (rank 0's full-vocabulary logits) come back."""
    _, client = tp2
    req = spb.GenerateRequest(prompt="Once upon a time", sampling=spb.SamplingParams(
        max_tokens=20, temperature=0.9, seed=7, logprobs=3))

    def run():
        responses = list(client.stub.Generate(req, timeout=60))
        return [t for r in responses for t in r.token_ids], [lp for r in responses for lp in r.logprobs]

    (tokens, logprobs), (again, _) = run(), run()
    assert tokens == again and len(tokens) == 20
    assert len(logprobs) == 20 and all(len(lp.top_token_ids) == 3 for lp in logprobs)


def test_constrained_requests_are_enforced_at_tp2(tp2):
    """Rank 0 alone samples, so it alone keeps the matchers: the other rank
    follows the ids it shares."""
    _, client = tp2
    pattern = r"[a-z]{3,8}-[0-9]{2}"
    for seed in range(4):
        req = spb.GenerateRequest(prompt="Once upon a time", structured=spb.StructuredOutput(regex=pattern),
                                  sampling=spb.SamplingParams(max_tokens=30, temperature=1.0, seed=seed))
        responses = list(client.stub.Generate(req, timeout=60))
        text = "".join(r.text for r in responses)
        assert re.fullmatch(pattern, text) and responses[-1].finish_reason == spb.FINISH_REASON_STOP, text
    client.assert_no_leaked_blocks()


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "deepseek-v3"])
def test_other_families_match_hf_at_tp2(family, tmp_path):
    """Qwen3-MoE's experts split along their units, DeepSeek-V3's MLA heads
    split with the latent cache replicated: 8 concurrent greedy requests at
    TP=2 give HF's tokens, which tests/integration/test_families.py holds
    TP=1 to on the same checkpoint and prompts (so TP=2 equals TP=1)."""
    from tests.integration.test_families import CONCURRENT, EXECUTOR_ENV, SCHEDULER_ENV, check_against_hf

    path = str(make_checkpoint(CASES[family], tmp_path / family))
    services, client = start_services(path, executor_env=EXECUTOR_ENV | TP2, scheduler_env=SCHEDULER_ENV)
    try:
        check_against_hf(path, client, CONCURRENT, max_new=24)
    finally:
        client.channel.close()
        services.stop()


def test_a_failing_step_resets_every_rank_and_the_group_serves_on(stories_path):
    """An injected fault is met by both ranks alike, before any collective:
    only the poisoned request fails, the same group keeps serving, and
    later streams still match HF."""
    services, client = start_services(str(stories_path), executor_env={**TP2, "EXECUTOR_DEBUG_FAIL_ON_TOKEN": "500"})
    try:
        instance = client.info().executor_instance_id
        good = [spb.GenerateRequest(prompt_token_ids=[1, 403, 407, 261, 378 + i],
                                    sampling=spb.SamplingParams(max_tokens=30, temperature=0)) for i in range(4)]
        poisoned = spb.GenerateRequest(prompt_token_ids=[1, 403, 500], sampling=spb.SamplingParams(max_tokens=30))
        streams = Streams(client, [*good, poisoned]).start()
        streams.join()
        assert streams.errors[4] is not None and "injected fault" in streams.errors[4].details()
        assert streams.errors[:4] == [None] * 4
        for req, tokens in zip(good, streams.tokens[:4]):
            assert tokens == hf_greedy(client.model, list(req.prompt_token_ids), 30)
        assert services.executor.poll() is None and client.info().executor_instance_id == instance
        client.assert_no_leaked_blocks()
    finally:
        client.channel.close()
        services.stop()


@pytest.mark.slow
def test_killing_rank_1_stops_the_group_and_streams_finish_after_a_restart(stories_path):
    services, client = start_services(str(stories_path), executor_env=TP2,
                                      scheduler_env={"SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "60",
                                                     "SCHEDULER_STEP_TIMEOUT_S": "10"})
    try:
        prompts = [[1, 403, 407, 261, 378 + (i % 8)] for i in range(16)]
        reqs = [spb.GenerateRequest(prompt_token_ids=p, sampling=spb.SamplingParams(max_tokens=200, temperature=0))
                for p in prompts]
        first_id = client.info().executor_instance_id
        streams = Streams(client, reqs).start()
        wait_until(lambda: streams.total_tokens > 16 * 10, what="first tokens")
        (rank1,) = ranks_of(services.executor)
        os.kill(rank1, signal.SIGKILL)
        code = services.executor.wait(10)
        assert code != 0, "rank 0 must exit non-zero when a rank dies"
        mark = streams.total_tokens
        time.sleep(1.0)
        assert not any(streams.finish), "no stream may finish while the executor is down"
        assert streams.total_tokens == mark
        services.start_executor()
        wait_until(lambda: client.info().executor_instance_id != first_id, what="reconnect")
        streams.join()
        assert streams.errors == [None] * 16
        for req, tokens in zip(reqs, streams.tokens):
            assert tokens == hf_greedy(client.model, list(req.prompt_token_ids), 200)
        client.assert_no_leaked_blocks()
    finally:
        client.channel.close()
        services.stop()


def test_a_hung_rank_stops_the_group_within_its_timeout(stories_path):
    """SIGSTOP freezes rank 1; the next heartbeat (every timeout / 4) gets no
    answer, so rank 0 exits non-zero within about 1.25 timeouts, and takes
    the frozen rank with it."""
    timeout_s = 6.0  # also bounds the rendezvous: rank 1 must import torch within it
    services, client = start_services(str(stories_path), executor_env={
        **TP2, "EXECUTOR_TENSOR_PARALLEL_TIMEOUT_S": str(timeout_s)})
    try:
        (rank1,) = ranks_of(services.executor)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        code = services.executor.wait(timeout_s * 1.25 + 10)
        took = time.monotonic() - stopped
        assert code != 0, "rank 0 must exit non-zero when a rank hangs"
        assert took <= timeout_s * 1.25 + 5, f"the group took {took:.1f}s to stop, timeout {timeout_s}s"
        wait_until(lambda: not Path(f"/proc/{rank1}").exists() or "Z" in Path(f"/proc/{rank1}/stat").read_text().split()[2],
                   timeout_s=10, what="the frozen rank to be killed with rank 0")
    finally:
        client.channel.close()
        services.stop()


def test_a_size_that_does_not_divide_the_model_is_refused_with_the_sizes_that_work(stories_path):
    env = {**os.environ, "EXECUTOR_MODEL": str(stories_path), "EXECUTOR_TENSOR_PARALLEL_SIZE": "3",
           "EXECUTOR_PORT": "0", "EXECUTOR_METRICS_PORT": "0"}
    proc = subprocess.run([sys.executable, "-m", "executor_svc"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "EXECUTOR_TENSOR_PARALLEL_SIZE=3" in proc.stderr and "sizes that work: 1, 2, 4" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_ranks_started_torchrun_style_join_one_group(stories_path):
    """As a LeaderWorkerSet or torchrun starts them: every rank is its own
    process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
    rank 1 before rank 0; rank 0 alone serves."""
    executor_port, master_port = free_port(), free_port()
    common = {**os.environ, "EXECUTOR_MODEL": str(stories_path), "EXECUTOR_TENSOR_PARALLEL_SIZE": "2",
              "EXECUTOR_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(master_port), "LOCAL_RANK": "0"}
    rank1 = subprocess.Popen([sys.executable, "-m", "executor_svc"], env={**common, "RANK": "1"})
    rank0 = subprocess.Popen([sys.executable, "-m", "executor_svc"], env={
        **common, "RANK": "0", "EXECUTOR_PORT": str(executor_port), "EXECUTOR_METRICS_PORT": "0"})
    services = launch(executor_port=executor_port)
    try:
        wait_serving(services.executor_address, 120, rank0)
        assert rank1.poll() is None, "rank 1 serves nothing but stays in the group"
        services.start_scheduler()
        channel = grpc.insecure_channel(services.scheduler_address)
        stub = spb_grpc.SchedulerStub(channel)
        req = spb.GenerateRequest(prompt_token_ids=[1, 403, 407, 261, 378],
                                  sampling=spb.SamplingParams(max_tokens=30, temperature=0))
        tokens = [t for resp in stub.Generate(req, timeout=60) for t in resp.token_ids]
        assert tokens == hf_greedy(str(stories_path), [1, 403, 407, 261, 378], 30)
        channel.close()
        services.stop()  # the scheduler
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(30) == 0 and rank1.wait(30) == 0, "a clean stop ends every rank with 0"
    finally:
        services.stop()
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
