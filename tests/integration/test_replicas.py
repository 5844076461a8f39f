"""Two replicas (executor + scheduler + gateway each, stories260K) behind
the SGLang Model Gateway (`sglang-router`, HTTP mode), all real processes
on loopback."""

from __future__ import annotations

import signal
import threading
import urllib.request

import openai
import pytest

from llmsched.router import Router, launch_replicas, router_available
from tests.integration.test_observability import metric

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(router_available() is not None, reason=f"sglang-router cannot run here: {router_available()}"),
]

# Three story openings of ~60 tokens each (several 16-token blocks), and
# short endings: requests sharing an opening share a prefix. Three, an odd
# number, so round-robin cannot line them up with the two replicas.
PREFIXES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
    "red ball. One day, she saw a big tree in the park and wanted to climb it. ",
    "Tom was a small boy who lived in a blue house near the sea. Every morning he walked to the beach with "
    "his dog Max to look for shells. One day they found a shiny box in the sand. ",
    "In a quiet forest, a little bird named Pip could not fly yet. His mother told him to be brave and try "
    "every day. The other animals came to watch him flap his wings. ",
]
ENDINGS = ["Then", "She said", "He was happy", "They all laughed"]


@pytest.fixture(scope="module")
def replicas(stories_path):
    reps = launch_replicas(2, {"EXECUTOR_MODEL": str(stories_path), "EXECUTOR_NUM_THREADS": "1"},
                           {"SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "2"})
    yield reps
    for r in reps:
        r.stop()


def _gateway_metric(replica, name: str) -> float:
    with urllib.request.urlopen(replica.gateway_url + "/metrics", timeout=5) as resp:
        return metric(resp.read().decode(), name)


def _completed(replica) -> float:
    return _gateway_metric(replica, 'llmsched_gateway_requests_total{code="200",endpoint="/v1/completions"}')


def _streaming(replica) -> float:
    return _gateway_metric(replica, 'llmsched_gateway_requests_in_flight{endpoint="/v1/completions"}')


def _run_workload(router: Router, tag: str) -> list[list[int]]:
    """Cached prompt tokens of each request, per prefix in sending order.
    The first request of every prefix goes out at once, so the router
    spreads them over both replicas; then the rest, one at a time. `tag`
    opens every prompt, so runs under different policies share nothing."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    cached: list[list[int]] = [[] for _ in PREFIXES]

    def send(p: int, ending: str) -> None:
        out = client.completions.create(model="stories260K", prompt=f"{tag}. {PREFIXES[p]}{ending}", max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        cached[p].append(out.usage.prompt_tokens_details.cached_tokens)

    first = [threading.Thread(target=send, args=(p, ENDINGS[0])) for p in range(len(PREFIXES))]
    for t in first:
        t.start()
    for t in first:
        t.join()
    for ending in ENDINGS[1:]:
        for p in range(len(PREFIXES)):
            send(p, ending)
    client.close()
    return cached


def _hit_share(cached: list[list[int]]) -> float:
    """Share of requests after each prefix's first that found it cached."""
    later = [c for per_prefix in cached for c in per_prefix[1:]]
    return sum(1 for c in later if c > 0) / len(later)


def test_cache_aware_keeps_each_prefix_on_its_replica_and_beats_round_robin(replicas):
    urls = [r.gateway_url for r in replicas]
    before = [_completed(r) for r in replicas]
    router = Router(urls, policy="cache_aware").start()
    try:
        aware = _run_workload(router, "Cache aware")
    finally:
        router.stop()
    served = [_completed(r) - b for r, b in zip(replicas, before)]
    assert all(n > 0 for n in served), f"cache_aware sent everything to one replica: {served}"
    for p, per_prefix in enumerate(aware):
        assert all(c > 0 for c in per_prefix[1:]), (
            f"prefix {p}: cached tokens per request {per_prefix}: a request after the first missed the replica "
            "that holds its prefix")

    router = Router(urls, policy="round_robin").start()
    try:
        rr = _run_workload(router, "Round robin")
    finally:
        router.stop()
    assert _hit_share(rr) < _hit_share(aware), f"round_robin {rr} vs cache_aware {aware}"


def test_killing_one_replicas_executor_loses_no_request_sent_to_the_other(replicas):
    a, b = replicas
    router = Router([a.gateway_url, b.gateway_url], policy="cache_aware").start()
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    results: dict[int, str] = {}
    started = threading.Barrier(9)

    def stream(i: int) -> None:
        try:
            # Distinct openings: new prefixes go to the least-loaded replica.
            out = client.completions.create(model="stories260K", prompt=f"Story {i}: {PREFIXES[i % 3]}",
                                            max_tokens=200, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
            chunks = iter(out)
            next(chunks)
            started.wait(60)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            results[i] = finish[-1] if finish else "no finish"
        except Exception as exc:  # noqa: BLE001 -- recorded, judged below
            if not started.broken:
                started.abort()
            results[i] = f"{type(exc).__name__}: {exc}"

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first token
        routed = [_streaming(a), _streaming(b)]
        assert routed[0] > 0 and routed[1] > 0, f"the router did not use both replicas: {routed}"
        b.executor.send_signal(signal.SIGKILL)
        b.executor.wait()
        for t in threads:
            t.join(120)
    finally:
        client.close()
        router.stop()
    finished = sorted(i for i, r in results.items() if r == "length")
    lost = {i: r for i, r in results.items() if r != "length"}
    assert len(finished) == routed[0], (
        f"{routed[0]} requests went to the surviving replica but {len(finished)} finished; others: {lost}")
    assert len(lost) == routed[1], f"only the killed replica's {routed[1]} requests may fail: {lost}"
