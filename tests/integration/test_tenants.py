"""Tenants through the real services: API keys name them, a key cannot
speak for another tenant, the prefix cache is isolated per tenant (or per
cache_salt), one tenant's excess is shed before anyone else's, and under
SCHEDULER_POLICY=fair a flood from one key through the OpenAI gateway does
not starve another key's requests. Fairness itself (the split of service
and the bound) is measured by `python -m bench.fairness` (P18) and checked
by tests/unit/test_fair_share.py."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from llmsched.launch import launch
from tests.integration.conftest import Client, GatewayStack, scheduler_metric
from tests.integration.test_reliability import wait_until

KEYS = {"A": "alpha-key", "B": "bravo-key"}
PROMPT = list(range(10, 60))  # 50 tokens: three full 16-token blocks to share, or not


@pytest.fixture(scope="module")
def keyed():
    """Two tenants by API key, fair share, the prefix cache scoped per
    tenant, at most 6 waiting requests per tenant and 2 running, no
    predicted-wait shedding."""
    services = launch(executor_env={"EXECUTOR_MODEL": "tiny-random", "EXECUTOR_NUM_THREADS": "1"}, scheduler_env={
        "SCHEDULER_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items()),
        "SCHEDULER_POLICY": "fair", "SCHEDULER_PREFIX_CACHE_SCOPE": "tenant",
        "SCHEDULER_MAX_QUEUED_REQUESTS_PER_TENANT": "6", "SCHEDULER_MAX_NUM_SEQS": "2",
        # Only the per-tenant limit sheds here: the predicted-wait check
        # would refuse anyone behind two long running requests.
        "SCHEDULER_MAX_QUEUE_DELAY_MS": "0"}, with_gateway=True).start()
    channel = grpc.insecure_channel(services.scheduler_address)
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key=KEYS["A"], max_retries=0, timeout=120)
    stack = GatewayStack(services, Client(services.scheduler_address, "tiny-random", channel,
                                          spb_grpc.SchedulerStub(channel)), client, client.models.list().data[0].id)
    yield stack
    stack.grpc.channel.close()
    stack.services.stop()


def generate(stack, tenant_key: str, timeout: float = 60, **fields) -> tuple[list[int], spb.GenerateResponse]:
    sampling = fields.pop("sampling", {"max_tokens": 4, "temperature": 0})
    req = spb.GenerateRequest(sampling=spb.SamplingParams(**sampling), **fields)
    tokens, last = [], None
    for resp in stack.grpc.stub.Generate(req, metadata=(("authorization", f"Bearer {tenant_key}"),), timeout=timeout):
        tokens += resp.token_ids
        last = resp
    return tokens, last


def cached(stack, key: str, **fields) -> int:
    return generate(stack, key, prompt_token_ids=PROMPT, **fields)[1].usage.cached_prompt_tokens


def test_tenant_scope_keeps_one_tenants_cached_prompt_from_another(keyed):
    assert cached(keyed, KEYS["A"]) == 0
    assert cached(keyed, KEYS["A"]) == 48, "A hits its own blocks"
    assert cached(keyed, KEYS["B"]) == 0, "B must not hit A's blocks: timing would reveal A's prompt"


def test_the_same_cache_salt_shares_across_tenants_and_another_does_not(keyed):
    assert cached(keyed, KEYS["A"], cache_salt="shared-1") == 0
    assert cached(keyed, KEYS["B"], cache_salt="shared-1") == 48
    assert cached(keyed, KEYS["B"], cache_salt="shared-2") == 0


def test_under_global_scope_another_request_hits_the_same_prompt(tiny):
    prompt = [1, *range(200, 249)]  # this test's own first block
    first = tiny.generate(prompt_token_ids=prompt, sampling={"max_tokens": 2, "temperature": 0})[2]
    second = tiny.generate(prompt_token_ids=prompt, sampling={"max_tokens": 2, "temperature": 0}, tenant="other")[2]
    assert first.usage.cached_prompt_tokens == 0 and second.usage.cached_prompt_tokens == 48


def test_a_key_cannot_speak_for_another_tenant(keyed):
    with pytest.raises(grpc.RpcError) as exc:
        generate(keyed, KEYS["A"], prompt="Hi", tenant="B")
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and exc.value.details().startswith("tenant:")
    assert generate(keyed, KEYS["A"], prompt="Hi", tenant="A")[1].finish_reason, "naming its own tenant is fine"


def test_an_abort_of_another_tenants_request_is_refused(keyed):
    call = keyed.grpc.stub.Generate(
        spb.GenerateRequest(request_id="a-long-one", prompt="Hi", sampling=spb.SamplingParams(
            max_tokens=1000, ignore_eos=True)), metadata=(("authorization", f"Bearer {KEYS['A']}"),), timeout=60)
    next(call)
    found = keyed.grpc.stub.Abort(spb.AbortRequest(request_id="a-long-one"),
                                  metadata=(("authorization", f"Bearer {KEYS['B']}"),))
    assert not found.found, "B must not see, let alone abort, A's request"
    call.cancel()
    wait_until(lambda: idle(keyed), 10, "A's cancelled request to free its blocks")


def server_info(stack) -> spb.ServerInfo:
    return stack.grpc.stub.GetServerInfo(spb.GetServerInfoRequest(),
                                         metadata=(("authorization", f"Bearer {KEYS['A']}"),), timeout=10)


def idle(stack) -> bool:
    info = server_info(stack)
    return info.num_running == info.num_waiting == 0 and info.num_free_kv_blocks == info.num_kv_blocks


@pytest.mark.parametrize("fields, field", [
    ({"tenant": "no spaces"}, "tenant"), ({"tenant": "x" * 65}, "tenant"),
    ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": "s" * 257}, "cache_salt"),
], ids=["tenant-with-a-space", "tenant-too-long", "empty-salt", "salt-too-long"])
def test_a_bad_tenant_or_salt_is_refused_naming_the_field(tiny, fields, field):
    with pytest.raises(grpc.RpcError) as exc:
        tiny.generate(prompt="Hi", **fields)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith(f"{field}:")


def test_one_tenants_excess_is_shed_while_another_tenant_is_served(keyed):
    shed_before = scheduler_metric(keyed.services, "llmsched_tenant_requests_shed_total")

    def a_request(_):
        try:
            return generate(keyed, KEYS["A"], prompt="Hi", sampling={"max_tokens": 200, "ignore_eos": True})
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(16) as pool:
        flood = [pool.submit(a_request, i) for i in range(14)]
        time.sleep(0.5)  # A's requests are queued by now
        b_tokens, _ = generate(keyed, KEYS["B"], prompt="Hi", sampling={"max_tokens": 4, "ignore_eos": True})
        results = [f.result() for f in flood]
    shed = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(b_tokens) == 4, "B is under its own limit"
    assert shed, "14 requests against A's limit of 6 waiting and 2 running must shed some"
    for exc in shed:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "SCHEDULER_MAX_QUEUED_REQUESTS_PER_TENANT" in \
            exc.details()
        assert any(k == "retry-after-ms" for k, _ in exc.trailing_metadata())
    assert scheduler_metric(keyed.services, "llmsched_tenant_requests_shed_total") - shed_before == len(shed)


def test_through_the_gateway_a_flood_from_one_key_does_not_starve_another(keyed):
    """A keeps its 6 waiting and 2 running slots full; B's requests, sent
    after A's, are still admitted before most of A's (fcfs would serve B
    after all of them)."""
    clients = {t: openai.OpenAI(base_url=keyed.services.gateway_url + "/v1", api_key=k, max_retries=0, timeout=120)
               for t, k in KEYS.items()}
    finished: list[str] = []

    def one(tenant: str) -> None:
        # A's requests are long: under fcfs B would wait for 6 of them.
        clients[tenant].completions.create(model=keyed.model, prompt="Hi", max_tokens=400 if tenant == "A" else 20,
                                           temperature=0, extra_body={"ignore_eos": True})
        finished.append(tenant)

    with ThreadPoolExecutor(12) as pool:
        # Two first, running before the other six arrive: eight at once could
        # all be waiting before a step admits any, and the seventh and eighth
        # would be shed by A's limit of 6 waiting.
        flood = [pool.submit(one, "A") for _ in range(2)]
        wait_until(lambda: server_info(keyed).num_running == 2, 30, "A's first two requests to run")
        flood += [pool.submit(one, "A") for _ in range(6)]
        time.sleep(0.5)
        late = [pool.submit(one, "B") for _ in range(3)]
        for f in flood + late:
            f.result()
    assert sorted(finished) == ["A"] * 8 + ["B"] * 3
    assert max(i for i, t in enumerate(finished) if t == "B") < 8, f"B finished behind A's flood: {finished}"
    text = urllib.request.urlopen(f"http://127.0.0.1:{keyed.services.scheduler_metrics_port}/metrics").read().decode()
    served = [line for line in text.splitlines() if line.startswith("llmsched_tenant_served_tokens_total{")
              and 'tenant="B"' in line and 'kind="output"' in line]
    assert served and float(served[0].rsplit(" ", 1)[1]) > 0, "per-tenant metrics count B's service"
