"""Scheduler policies through both real services on stories260K:
preemption, prefix caching, cancellation at scale, overload shedding."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tokenizers import Tokenizer

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import start_services
from tests.oracle import hf_greedy

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big red ball under a tree. She ran to the ball and kicked it very hard. "
    "The ball flew up into the sky and landed on the roof of a house. Lily was sad because she could not "
    "get her ball back. Her friend Tom came to help her. He had a long stick and he used it to push the ball "
    "off the roof. Lily was very happy and she said thank you to Tom. They played with the ball all day."
)


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return Tokenizer.from_file(str(stories_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def small_pool(stories_path):
    # 24 blocks of 16 tokens cannot hold 16 requests of ~80 tokens at once.
    services, client = start_services(str(stories_path), executor_env={"EXECUTOR_NUM_KV_BLOCKS": "24"})
    yield client
    client.channel.close()
    services.stop()


def test_preempted_requests_still_return_their_hf_oracle_tokens(small_pool, tokenizer):
    words = STORY.split()
    cases = [(tokenizer.encode(" ".join(words[: 4 + i])).ids, 50 + (i % 4) * 5) for i in range(16)]
    before = small_pool.info().num_preemptions
    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(
            lambda c: small_pool.generate(prompt_token_ids=c[0], sampling={"max_tokens": c[1], "temperature": 0})[0],
            cases,
        ))
    preemptions = small_pool.info().num_preemptions - before
    assert preemptions > 0, "the pool was meant to be too small: no preemption happened"
    for (prompt, max_tokens), tokens in zip(cases, got):
        assert tokens == hf_greedy(small_pool.model, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
    small_pool.assert_no_leaked_blocks()


def test_repeated_200_token_prompt_is_served_from_the_prefix_cache(stories, tokenizer):
    # The stack is shared with other modules, whose prompts start as STORY
    # does: an opener of its own keeps the first block, and so every block
    # after it, out of the cache until this test sends it.
    prompt = tokenizer.encode("Tom saw a big blue kite in the tall tree by the old red barn. " + STORY).ids[:200]
    assert len(prompt) == 200
    first, _, last1, _ = stories.generate(prompt_token_ids=prompt, sampling={"max_tokens": 20, "temperature": 0})
    second, _, last2, _ = stories.generate(prompt_token_ids=prompt, sampling={"max_tokens": 20, "temperature": 0})
    assert last1.usage.cached_prompt_tokens == 0
    assert last2.usage.cached_prompt_tokens >= 192
    assert second == first == hf_greedy(stories.model, prompt, 20)
    stories.assert_no_leaked_blocks()


def test_cancelling_half_of_64_streams_leaves_no_block_held(stories, tokenizer):
    prompt = tokenizer.encode("Once upon a time").ids
    calls = [
        stories.stub.Generate(spb.GenerateRequest(prompt_token_ids=prompt + [300 + i], sampling=spb.SamplingParams(
            max_tokens=120, temperature=0, ignore_eos=True)))
        for i in range(64)
    ]
    finished = {}

    def consume(i, call):
        if i % 2:
            next(call)  # in flight for sure
            call.cancel()
        else:
            finished[i] = sum(len(r.token_ids) for r in call)

    threads = [threading.Thread(target=consume, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(finished) == list(range(0, 64, 2))
    assert all(n == 120 for n in finished.values())
    stories.assert_no_leaked_blocks()


@pytest.fixture(scope="module")
def bounded_queue(stories_path):
    services, client = start_services(
        str(stories_path),
        executor_env={"EXECUTOR_NUM_KV_BLOCKS": "40"},
        scheduler_env={"SCHEDULER_MAX_QUEUED_REQUESTS": "4", "SCHEDULER_MAX_NUM_SEQS": "4"},
    )
    yield client
    client.channel.close()
    services.stop()


def test_overload_burst_is_shed_with_resource_exhausted_and_admitted_requests_complete(bounded_queue, tokenizer):
    prompt = tokenizer.encode("Once upon a time").ids
    want = hf_greedy(bounded_queue.model, prompt, 30)

    def one(_):
        try:
            return bounded_queue.generate(prompt_token_ids=prompt, sampling={"max_tokens": 30, "temperature": 0})[0]
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=40) as pool:
        results = list(pool.map(one, range(40)))
    rejected = [r for r in results if isinstance(r, grpc.RpcError)]
    served = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert rejected, "a burst of 40 against a queue bound of 4 must shed some"
    assert served, "some requests must be admitted"
    for exc in rejected:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        assert "queue" in exc.details()
        assert any(k == "retry-after-ms" and int(v) > 0 for k, v in exc.trailing_metadata())
    assert all(tokens == want for tokens in served)
    bounded_queue.assert_no_leaked_blocks()
