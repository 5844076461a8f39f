"""Multi-LoRA through the services: executor (EXECUTOR_LORA_ADAPTERS),
scheduler and gateway, one stack for the module, on the tiny random Llama
of tests/lora.py with four PEFT adapters (ranks 8, 16, 64) and two device
slots (EXECUTOR_MAX_LORAS=2), so the scheduler loads and evicts them."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from llmsched.v1 import scheduler_pb2 as spb

from tests.integration.conftest import scheduler_metric, start_gateway_stack
from tests.lora import hf_peft_greedy, make_base_and_adapters

pytestmark = pytest.mark.slow

NAMES = ["a8", "b16", "c64", "d8"]
PROMPT = [1, 300, 301, 302, 303, 304, 305, 306, 307]
MAX_NEW = 8


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory):
    base, adapters = make_base_and_adapters(tmp_path_factory.mktemp("lora"), NAMES)
    stack = start_gateway_stack(base, executor_env={
        "EXECUTOR_LORA_ADAPTERS": ",".join(f"{n}={p}" for n, p in adapters.items()),
        "EXECUTOR_MAX_LORAS": "2", "EXECUTOR_BLOCK_SIZE": "4", "EXECUTOR_DTYPE": "float32"})
    yield stack, base, adapters
    stack.stop()


def test_adapters_mixed_in_one_batch_match_hf_peft_and_never_share_cache(lora_stack):
    stack, base, adapters = lora_stack
    listed = {m.id: m for m in stack.openai.models.list().data}
    assert {n: listed[n].parent for n in NAMES} == {n: stack.model for n in NAMES}
    models = [stack.model, *NAMES]

    def complete(model, prompt=PROMPT, max_tokens=MAX_NEW):
        return stack.openai.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)

    def generate(model):
        return stack.grpc.generate(prompt_token_ids=PROMPT, adapter=model if model in adapters else "",
                                   sampling={"max_tokens": MAX_NEW, "temperature": 0})

    assert stack.grpc.info().max_loras == 2
    # The base and every adapter at once, each through gRPC and the gateway:
    # four adapters take turns in two slots.
    with ThreadPoolExecutor(2 * len(models)) as pool:
        grpc_runs = [pool.submit(generate, m) for m in models]
        openai_runs = [pool.submit(complete, m) for m in models]
        grpc_results = [f.result() for f in grpc_runs]
        openai_results = [f.result() for f in openai_runs]
    for model, (tokens, text, _, _), r in zip(models, grpc_results, openai_results):
        assert tokens == hf_peft_greedy(base, adapters.get(model), PROMPT, MAX_NEW), model
        assert r.model == model and r.choices[0].text == text, model
    assert len({tuple(g[0]) for g in grpc_results}) == len(models), "each adapter changes the continuation"
    # Isolation: a prompt of whole blocks, cached under a8, is not a hit
    # under b16, and is one under a8 again.
    long_prompt = [1, *range(310, 338)]
    assert complete("a8", long_prompt, 1).usage.prompt_tokens_details.cached_tokens == 0
    assert complete("b16", long_prompt, 1).usage.prompt_tokens_details.cached_tokens == 0
    assert complete("a8", long_prompt, 1).usage.prompt_tokens_details.cached_tokens > 0
    stack.grpc.assert_no_leaked_blocks()
    assert scheduler_metric(stack.services, "llmsched_lora_loads_total") >= 4
    assert scheduler_metric(stack.services, "llmsched_lora_evictions_total") >= 2
    assert scheduler_metric(stack.services, "llmsched_lora_slots_in_use") == 2


def test_an_unknown_adapter_is_refused_by_name(lora_stack):
    stack, _, _ = lora_stack
    with pytest.raises(openai.NotFoundError) as exc:
        stack.openai.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert exc.value.code == "model_not_found" and "nope" in str(exc.value)
    with pytest.raises(grpc.RpcError) as rpc:
        stack.grpc.generate(prompt_token_ids=PROMPT, adapter="nope", sampling={"max_tokens": 1})
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in rpc.value.details()


def _ttfts(stack, adapters: list[str], n: int, interval_s: float, max_tokens: int) -> tuple[list[float], dict]:
    """n greedy requests through gRPC, one every interval_s, adapters in
    turn: each one's time to first token, sorted, and the tokens each
    adapter's requests produced."""

    def one(adapter: str):
        t0 = time.perf_counter()
        req = spb.GenerateRequest(prompt_token_ids=PROMPT, adapter=adapter,
                                  sampling=spb.SamplingParams(max_tokens=max_tokens, temperature=0))
        first, tokens = None, []
        for resp in stack.grpc.stub.Generate(req, timeout=120):
            first = first or time.perf_counter() - t0
            tokens += resp.token_ids
        return first, adapter, tuple(tokens)

    with ThreadPoolExecutor(n) as pool:
        start = time.perf_counter()
        runs = []
        for i in range(n):
            time.sleep(max(0.0, start + i * interval_s - time.perf_counter()))
            runs.append(pool.submit(one, adapters[i % len(adapters)]))
        results = [f.result() for f in runs]
    outputs: dict[str, set] = {}
    for _, adapter, tokens in results:
        outputs.setdefault(adapter, set()).add(tokens)
    return sorted(r[0] for r in results), outputs


@pytest.mark.alone  # timing-sensitive: TTFTs compared
def test_four_adapters_round_robin_in_two_slots_starve_nobody(lora_stack):
    """The thrash acceptance (issue 39): 4 adapters sent round-robin into 2
    slots, against the same arrivals on 2 adapters (both stay loaded).
    Every request finishes with its adapter's HF + PEFT tokens, and the
    TTFT p99 (here the slowest of 48) is at most 3x the all-loaded one, in
    the better of 3 alternating rounds (a 2-core host shared with other
    tests is noisy). When an adapter had to wait for every running request
    of another to end, it was 5-25x. About 5 s."""
    stack, base, adapters = lora_stack
    want = {n: tuple(hf_peft_greedy(base, adapters[n], PROMPT, MAX_NEW)) for n in NAMES}
    ratios = []
    for _ in range(3):
        loaded, _ = _ttfts(stack, NAMES[:2], 48, 0.01, MAX_NEW)
        thrash, outputs = _ttfts(stack, NAMES, 48, 0.01, MAX_NEW)
        assert outputs == {n: {want[n]} for n in NAMES}
        ratios.append(thrash[-1] / loaded[-1])
        print(f"TTFT p99 all loaded {loaded[-1] * 1e3:.1f} ms, 4 adapters in 2 slots {thrash[-1] * 1e3:.1f} ms "
              f"({ratios[-1]:.2f}x); p50 {loaded[len(loaded) // 2] * 1e3:.1f} / {thrash[len(thrash) // 2] * 1e3:.1f} ms")
    assert min(ratios) <= 3.0, f"TTFT p99 under adapter thrash / all loaded: {ratios}"
    assert scheduler_metric(stack.services, "llmsched_lora_requests_waiting_for_slot") == 0
    stack.grpc.assert_no_leaked_blocks()
