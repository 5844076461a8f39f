"""Multi-LoRA through the services: executor (EXECUTOR_LORA_ADAPTERS),
scheduler and gateway, one stack for the module, on the tiny random Llama
of tests/lora.py with four PEFT adapters (ranks 8, 16, 64) and two device
slots (EXECUTOR_MAX_LORAS=2), so the scheduler loads and evicts them; and
adapters loaded at runtime from EXECUTOR_RUNTIME_LORA_DIR through vLLM's
/v1/load_lora_adapter (GATEWAY_ALLOW_RUNTIME_LORA=on)."""

import json

import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from llmsched.launch import wait_serving
from llmsched.v1 import scheduler_pb2 as spb

from tests.integration.conftest import scheduler_metric, start_gateway_stack
from tests.lora import ADAPTERS, hf_peft_greedy, make_adapter, make_base_and_adapters

pytestmark = pytest.mark.slow

NAMES = ["a8", "b16", "c64", "d8"]
PROMPT = [1, 300, 301, 302, 303, 304, 305, 306, 307]
MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The base, its start-up adapters, and the runtime directory: two
    adapters of the same shape with other weights (v1 and v2, loaded in
    turn under one name), one with DoRA set, and a symlink out of it."""
    directory = tmp_path_factory.mktemp("lora")
    base, adapters = make_base_and_adapters(directory, NAMES)
    runtime = directory / "runtime"
    runtime.mkdir()
    versions = {v: make_adapter(base, runtime / v, *ADAPTERS["e16"], seed=seed) for v, seed in (("v1", 10), ("v2", 11))}
    shutil.copytree(runtime / "v1", runtime / "dora")
    cfg = json.loads((runtime / "dora" / "adapter_config.json").read_text())
    (runtime / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    os.symlink(adapters["a8"], runtime / "escape")
    return base, adapters, runtime, versions


@pytest.fixture(scope="module")
def runtime_adapters(checkpoints) -> tuple[str, str]:
    """v1 and v2, the two runtime adapters' paths."""
    versions = checkpoints[3]
    return versions["v1"], versions["v2"]


@pytest.fixture(scope="module")
def lora_stack(checkpoints):
    base, adapters, runtime, _ = checkpoints
    stack = start_gateway_stack(base, executor_env={
        "EXECUTOR_LORA_ADAPTERS": ",".join(f"{n}={p}" for n, p in adapters.items()),
        "EXECUTOR_MAX_LORAS": "2", "EXECUTOR_BLOCK_SIZE": "4", "EXECUTOR_DTYPE": "float32",
        "EXECUTOR_RUNTIME_LORA_DIR": str(runtime)}, gateway_env={"GATEWAY_ALLOW_RUNTIME_LORA": "on"})
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
    one of up to 5 alternating rounds (a 2-core host shared with other
    tests is noisy: a fresh-clone CI run saw 3.8x, 4.7x and 3.9x in its
    three rounds, where alone the same code gives 1.2x-3.7x). When an
    adapter had to wait for every running request of another to end, it
    was 5-25x. About 5 s."""
    stack, base, adapters = lora_stack
    want = {n: tuple(hf_peft_greedy(base, adapters[n], PROMPT, MAX_NEW)) for n in NAMES}
    ratios = []
    for _ in range(5):
        loaded, _ = _ttfts(stack, NAMES[:2], 48, 0.01, MAX_NEW)
        thrash, outputs = _ttfts(stack, NAMES, 48, 0.01, MAX_NEW)
        assert outputs == {n: {want[n]} for n in NAMES}
        ratios.append(thrash[-1] / loaded[-1])
        print(f"TTFT p99 all loaded {loaded[-1] * 1e3:.1f} ms, 4 adapters in 2 slots {thrash[-1] * 1e3:.1f} ms "
              f"({ratios[-1]:.2f}x); p50 {loaded[len(loaded) // 2] * 1e3:.1f} / {thrash[len(thrash) // 2] * 1e3:.1f} ms")
        if ratios[-1] <= 3.0:
            break
    assert min(ratios) <= 3.0, f"TTFT p99 under adapter thrash / all loaded: {ratios}"
    assert scheduler_metric(stack.services, "llmsched_lora_requests_waiting_for_slot") == 0
    stack.grpc.assert_no_leaked_blocks()


def test_runtime_load_matches_hf_peft_and_a_reload_under_the_same_name_never_hits_the_old_cache(
        lora_stack, runtime_adapters):
    stack, base, _ = lora_stack
    v1, v2 = runtime_adapters
    http = Http(stack.services.gateway_url)
    long_prompt = [1, *range(340, 368)]  # 7 whole blocks of 4

    def cached(model):
        r = stack.openai.completions.create(model=model, prompt=long_prompt, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    def tokens(adapter):
        return stack.grpc.generate(prompt_token_ids=PROMPT, adapter=adapter,
                                   sampling={"max_tokens": MAX_NEW, "temperature": 0})[0]

    r = http.post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": v1})
    assert r.status_code == 200 and "'rt' added successfully" in r.text, r.text
    listed = {m.id: m for m in stack.openai.models.list().data}
    assert listed["rt"].parent == stack.model, "/v1/models does not list the runtime adapter"
    assert "rt" in stack.grpc.info().lora_adapters and stack.grpc.info().runtime_lora
    v1_tokens = tokens("rt")
    assert v1_tokens == hf_peft_greedy(base, v1, PROMPT, MAX_NEW), "runtime adapter v1 differs from HF + PEFT"
    assert cached("rt") == 0 and cached("rt") > 0, "the prefix cache does not serve a runtime adapter's own blocks"

    r = http.post("/v1/unload_lora_adapter", {"lora_name": "rt"})
    assert r.status_code == 200 and "'rt' removed successfully" in r.text, r.text
    assert "rt" not in {m.id for m in stack.openai.models.list().data}
    with pytest.raises(openai.NotFoundError) as exc:
        stack.openai.completions.create(model="rt", prompt=PROMPT, max_tokens=1)
    assert exc.value.code == "model_not_found", "an unloaded adapter still serves"

    r = http.post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "v2"})  # relative to the dir
    assert r.status_code == 200, r.text
    assert cached("rt") == 0, "a reload under the same name hit blocks cached under the old weights"
    v2_tokens = tokens("rt")
    assert v2_tokens == hf_peft_greedy(base, v2, PROMPT, MAX_NEW), "the reloaded name serves the old weights"
    assert v2_tokens != v1_tokens
    assert http.post("/v1/unload_lora_adapter", {"lora_name": "rt"}).status_code == 200
    _wait_freed(stack)
    stack.grpc.assert_no_leaked_blocks()


def test_runtime_lora_refusals_say_why(lora_stack, runtime_adapters):
    stack, _, adapters = lora_stack
    v1, _ = runtime_adapters
    http = Http(stack.services.gateway_url)

    def load(name, path):
        return http.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    outside = load("out", adapters["a8"])
    assert outside.status_code == 403 and outside.json()["error"]["param"] == "lora_path", outside.text
    assert "outside EXECUTOR_RUNTIME_LORA_DIR" in outside.json()["error"]["message"]
    symlink = load("out", "escape")
    assert symlink.status_code == 403, f"a symlink out of the directory was loaded: {symlink.text}"
    dotdot = load("out", "../a8")
    assert dotdot.status_code == 403, f"a .. path out of the directory was loaded: {dotdot.text}"
    dora = load("dora", "dora")
    assert dora.status_code == 400 and "DoRA (use_dora) is not implemented" in dora.json()["error"]["message"]
    assert load("a8", v1).status_code == 400, "a start-up adapter's name was loaded over"
    assert load("dup", v1).status_code == 200
    duplicate = load("dup", v1)
    assert duplicate.status_code == 400 and "has already been loaded" in duplicate.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", {"lora_name": "dup"}).status_code == 200
    unknown = http.post("/v1/unload_lora_adapter", {"lora_name": "never"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "lora_adapter_not_found", unknown.text
    static = http.post("/v1/unload_lora_adapter", {"lora_name": "a8"})
    assert static.status_code == 400 and "EXECUTOR_LORA_ADAPTERS" in static.text
    # gRPC: the same refusals, by status.
    with pytest.raises(grpc.RpcError) as rpc:
        stack.grpc.stub.UnloadLoraAdapter(spb.UnloadLoraAdapterRequest(lora_name="never"))
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as rpc:
        stack.grpc.stub.LoadLoraAdapter(spb.LoadLoraAdapterRequest(lora_name="out", lora_path="escape"))
    assert rpc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Serving goes on after every refusal.
    assert stack.openai.completions.create(model="a8", prompt=PROMPT, max_tokens=1).choices[0].text is not None
    _wait_freed(stack)
    assert {m.id for m in stack.openai.models.list().data} == {stack.model, *NAMES}


def test_a_restarted_executor_gets_the_runtime_adapters_again(lora_stack, runtime_adapters):
    """The scheduler owns the runtime list: after an executor SIGKILL and
    restart it registers them again, so the name serves the same weights."""
    stack, base, _ = lora_stack
    v1, _ = runtime_adapters
    http = Http(stack.services.gateway_url)
    assert http.post("/v1/load_lora_adapter", {"lora_name": "kept", "lora_path": v1}).status_code == 200
    services = stack.services
    services.executor.send_signal(signal.SIGKILL)
    services.executor.wait(30)
    services.start_executor()
    wait_serving(services.scheduler_address, 60, services.scheduler)
    tokens = stack.grpc.generate(prompt_token_ids=PROMPT, adapter="kept",
                                 sampling={"max_tokens": MAX_NEW, "temperature": 0})[0]
    assert tokens == hf_peft_greedy(base, v1, PROMPT, MAX_NEW), "the restarted executor lost the runtime adapter"
    assert "kept" in {m.id for m in stack.openai.models.list().data}
    assert http.post("/v1/unload_lora_adapter", {"lora_name": "kept"}).status_code == 200
    _wait_freed(stack)
    stack.grpc.assert_no_leaked_blocks()


class Http:
    """POSTs JSON to the gateway (urllib: the suite's HTTP client)."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def post(self, path: str, body: dict) -> "Answer":
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return Answer(resp.status, resp.read().decode())
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, exc.read().decode())


class Answer:
    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = status_code, text

    def json(self) -> dict:
        return json.loads(self.text)


def _wait_freed(stack, timeout_s: float = 10.0) -> None:
    """Unloaded adapters are freed after their last step's result."""
    deadline = time.monotonic() + timeout_s
    while scheduler_metric(stack.services, 'llmsched_lora_runtime_changes_total{change="freed"}') < \
            scheduler_metric(stack.services, 'llmsched_lora_runtime_changes_total{change="unload"}'):
        assert time.monotonic() < deadline, "an unloaded adapter was never freed"
        time.sleep(0.05)
