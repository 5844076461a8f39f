"""The host KV tier through both real services on stories260K, one stack
for the module: preemption by swap recomputes nothing and keeps HF's
tokens, an evicted prefix comes back from the host tier (and counts as
cached, in gRPC's usage and in OpenAI's through the gateway), a SIGKILLed
executor with requests swapped out loses none of them (though it comes back
with another host tier size), and copies that fail fall back to recompute
for their own requests.
`recompute` mode and the swap/recompute choice are scheduler decisions,
tested without processes in tests/unit/test_host_tier.py."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmsched.launch import wait_serving
from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import scheduler_metric, start_gateway_stack
from tests.integration.test_reliability import Streams
from tests.oracle import hf_greedy

# One worker for the whole module: its tests share a stack and run in order
# (the last two restart the executor), and the oracle's runs are computed
# once. slow: about 30 s on 2 cores, so its group starts early.
pytestmark = [pytest.mark.xdist_group("host-kv-tier"), pytest.mark.slow]

# 12 blocks of 16 tokens hold 192; 8 generations of 5 + 40 tokens need 24
# blocks (384 tokens): the pool is oversubscribed twice over.
DEVICE_BLOCKS = 12
PROMPTS = [[1, 403, 407, 261, 378 + i] for i in range(4)]
MAX_TOKENS = 40
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
# Requests in flight when the executor is killed: three times the pool, so
# that some wait swapped out most of the time.
NUM_KILLED = 12


def long_generations(client, n: int = 8) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(lambda i: client.generate(prompt_token_ids=PROMPTS[i % 4], sampling=GREEDY)[0], range(n)))


def want(model: str, i: int) -> list[int]:
    return hf_greedy(model, PROMPTS[i % 4], MAX_TOKENS, ignore_eos=True)


def assert_both_pools_whole(client, timeout_s: float = 10.0) -> None:
    client.assert_no_leaked_blocks(timeout_s)
    deadline = time.monotonic() + timeout_s
    while (info := client.info()).num_free_host_kv_blocks != info.num_host_kv_blocks:
        assert time.monotonic() < deadline, (
            f"host KV blocks leaked: {info.num_host_kv_blocks - info.num_free_host_kv_blocks} of "
            f"{info.num_host_kv_blocks} still held")
        time.sleep(0.05)


def metric_delta(services, name: str):
    before = scheduler_metric(services, name)
    return lambda: scheduler_metric(services, name) - before


def restart_executor(services, sig: int = signal.SIGKILL, **env: str) -> None:
    """Stops the executor and starts it again (with env added), and returns
    once the scheduler has reconnected to it: until then a new request is
    refused with UNAVAILABLE."""
    services.executor.send_signal(sig)
    services.executor.wait(30)
    services.executor_env.update(env)
    services.start_executor()
    wait_serving(services.scheduler_address, 60, services.scheduler)


@pytest.fixture(scope="module")
def gateway_stack(stories_path):
    # A short step timeout: should a restarted executor leave a step
    # unanswered, the scheduler reconnects instead of waiting 120 s. One
    # step a plan: a request whose multi-step run is in flight when it is
    # preempted is recomputed, not swapped (Scheduler._should_swap: which of
    # its slots hold tokens is unknown until the result), so with multi-step
    # decode how many victims swap depends on timing, and these tests count.
    gs = start_gateway_stack(
        str(stories_path),
        executor_env={"EXECUTOR_NUM_KV_BLOCKS": str(DEVICE_BLOCKS), "EXECUTOR_HOST_KV_CACHE_MEMORY_MB": "4"},
        scheduler_env={"SCHEDULER_PREEMPTION_MODE": "swap", "SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "60",
                       "SCHEDULER_STEP_TIMEOUT_S": "10", "SCHEDULER_MULTI_STEP_DECODE": "1"})
    yield gs
    gs.stop()


@pytest.fixture(scope="module")
def stack(gateway_stack):
    return gateway_stack.services, gateway_stack.grpc


def test_preempted_by_swap_requests_recompute_nothing_and_return_hfs_tokens(stack):
    services, client = stack
    assert client.info().num_host_kv_blocks > DEVICE_BLOCKS
    swapped = metric_delta(services, 'llmsched_num_preemptions_total{mode="swap"}')
    swapped_in = metric_delta(services, 'llmsched_kv_swapped_blocks_total{direction="in",reason="resume"}')
    recomputed = metric_delta(services, "llmsched_recomputed_tokens_total")
    got = long_generations(client)
    assert swapped() > 0, "the pool was meant to be too small: nothing was swapped out"
    assert swapped_in() > 0, "swapped-out requests resume by swapping back in"
    assert recomputed() == 0, "a request swapped out and back recomputes no token"
    for i, tokens in enumerate(got):
        assert tokens == want(client.model, i), f"request {i}"
    assert_both_pools_whole(client)


def test_an_evicted_prefix_comes_back_from_the_host_tier_and_counts_as_cached(stack):
    services, client = stack
    # 7 full blocks of its own, then other prompts that take every device
    # block: its blocks are evicted from the device pool, spilled to the host.
    prompt = [1] + [300 + (i * 7) % 200 for i in range(119)]
    host_hits = metric_delta(services, 'llmsched_prefix_cache_hits_total{tier="host"}')
    first, _, last1, _ = client.generate(prompt_token_ids=prompt, sampling={"max_tokens": 8, "temperature": 0})
    evict_from_the_device_pool(client, 200)
    second, _, last2, _ = client.generate(prompt_token_ids=prompt, sampling={"max_tokens": 8, "temperature": 0})
    assert last1.usage.cached_prompt_tokens == 0
    assert host_hits() == 7 * 16, "every block of the prefix came back from the host tier"
    assert last2.usage.cached_prompt_tokens == 7 * 16, "usage counts the host tier's hits as cached"
    assert second == first == hf_greedy(client.model, prompt, 8)
    assert_both_pools_whole(client)


def evict_from_the_device_pool(client, token: int) -> None:
    """Prompts that take every device block, so that blocks cached before
    are evicted from the device pool (and spilled to the host tier). Each
    caller gives its own token, so that these prompts are never prefix hits
    themselves."""
    for k in range(2):
        client.generate(prompt_token_ids=[1] + [token + k] * 170, sampling={"max_tokens": 4, "temperature": 0})


def test_openai_usage_counts_the_host_tiers_hits_as_cached_tokens(gateway_stack):
    services, client = gateway_stack.services, gateway_stack.grpc
    prompt = [1] + [250 + (i * 11) % 200 for i in range(103)]  # 6 full blocks and 8 tokens
    host_hits = metric_delta(services, 'llmsched_prefix_cache_hits_total{tier="host"}')
    first = gateway_stack.openai.completions.create(model=gateway_stack.model, prompt=prompt, max_tokens=6,
                                                    temperature=0)
    evict_from_the_device_pool(client, 210)
    second = gateway_stack.openai.completions.create(model=gateway_stack.model, prompt=prompt, max_tokens=6,
                                                     temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert host_hits() == 6 * 16, "the prefix was meant to come back from the host tier"
    assert second.usage.prompt_tokens_details.cached_tokens == 6 * 16, (
        "usage.prompt_tokens_details.cached_tokens counts the host tier's hits")
    assert second.choices[0].text == first.choices[0].text
    assert_both_pools_whole(client)


def test_sigkill_with_requests_swapped_out_loses_no_request(stack):
    services, client = stack
    lost_swaps = metric_delta(services, 'llmsched_recomputed_tokens_total{cause="swap"}')
    requests = [spb.GenerateRequest(prompt_token_ids=PROMPTS[i % 4], sampling=spb.SamplingParams(**GREEDY))
                for i in range(NUM_KILLED)]
    killed = threading.Event()
    unfinished_at_kill = []

    def kill() -> None:
        # From a receiving thread, once the host tier holds blocks of
        # requests swapped out (cached blocks are free: they do not count).
        info = client.info()
        if info.num_free_host_kv_blocks == info.num_host_kv_blocks:
            streams.when_total_exceeds(streams.total_tokens, kill)
            return
        unfinished_at_kill.append(sum(f is None for f in streams.finish))
        services.executor.send_signal(signal.SIGKILL)
        killed.set()

    streams = Streams(client, requests)
    streams.when_total_exceeds(NUM_KILLED * 8, kill)
    streams.start()
    assert killed.wait(120), f"never swapped: {streams.describe()}"
    host_blocks = client.info().num_host_kv_blocks
    # It comes back with twice the host tier: a new size, not a new geometry.
    restart_executor(services, EXECUTOR_HOST_KV_CACHE_MEMORY_MB="8")
    streams.join()
    assert client.info().num_host_kv_blocks in (2 * host_blocks, 2 * host_blocks + 1)  # whole blocks of each size
    assert unfinished_at_kill[0] > 0, "the kill landed after every stream had finished"
    assert streams.errors == [None] * NUM_KILLED, streams.describe()
    assert lost_swaps() > 0, "requests swapped out when the executor died recompute"
    for i, tokens in enumerate(streams.tokens):
        assert tokens == want(client.model, i), f"request {i}"
    assert_both_pools_whole(client)


def test_failed_copies_fall_back_to_recompute_for_their_own_requests(stack):
    services, client = stack
    # Every third block copy fails, either way.
    restart_executor(services, EXECUTOR_DEBUG_FAIL_SWAP_EVERY="3")
    failures = metric_delta(services, "llmsched_kv_swap_failures_total")
    lost_swaps = metric_delta(services, 'llmsched_recomputed_tokens_total{cause="swap"}')
    got = long_generations(client)
    assert failures() > 0 and lost_swaps() > 0
    for i, tokens in enumerate(got):
        assert tokens == want(client.model, i), f"request {i}"
    assert services.executor.poll() is None, "a failed copy fails no step"
    assert_both_pools_whole(client)
