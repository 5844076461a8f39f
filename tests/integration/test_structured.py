"""Constrained decoding through both real services, over the public gRPC
API: constrained outputs validate while unconstrained requests sharing
their batches still equal HF greedy; cancels release every matcher and
block; constrained outputs stay valid across a preempting pool and an
executor SIGKILL (the executor replays each re-sent request's output into
a fresh matcher); and a constraint over the compile time limit is refused
before anything is queued. The OpenAI-level acceptance (response_format,
tools) is in test_structured_outputs.py and test_tool_calling.py."""

from __future__ import annotations

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from tokenizers import Tokenizer

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import start_services
from tests.integration.test_observability import metric, scrape
from tests.integration.test_reliability import Streams, wait_until
from tests.oracle import hf_greedy

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                                  "floor": {"type": "integer", "minimum": -2, "maximum": 40}},
                 "required": ["city", "floor"], "additionalProperties": False},
    },
    "required": ["name", "age", "pets", "home"],
    "additionalProperties": False,
}
EOS = 2
WORD_RE = r"[a-z]{40,60}"  # long enough to be cancelled or killed mid-stream


def person(seed: int) -> spb.GenerateRequest:
    return spb.GenerateRequest(prompt="Once upon a time", structured=spb.StructuredOutput(json_schema=json.dumps(PERSON)),
                               sampling=spb.SamplingParams(max_tokens=120, temperature=1.0, seed=seed))


def words(seed: int) -> spb.GenerateRequest:
    return spb.GenerateRequest(prompt="Once", structured=spb.StructuredOutput(regex=WORD_RE),
                               sampling=spb.SamplingParams(max_tokens=80, temperature=1.0, seed=seed))


def run(client, req: spb.GenerateRequest, timeout: float = 120) -> tuple[list[int], str, int]:
    tokens, text, last = [], "", None
    for resp in client.stub.Generate(req, timeout=timeout):
        tokens += resp.token_ids
        text += resp.text
        last = resp
    return tokens, text, last.finish_reason


def test_constrained_requests_validate_while_unconstrained_neighbours_still_equal_hf(stories):
    free = [[1, 403, 407, 261, 378 + i] for i in range(8)]
    with ThreadPoolExecutor(16) as pool:
        constrained = [pool.submit(run, stories, person(i)) for i in range(8)]
        greedy = [pool.submit(stories.generate, prompt_token_ids=p, sampling={"max_tokens": 30, "temperature": 0})
                  for p in free]
        for p, f in zip(free, greedy):
            assert f.result()[0] == hf_greedy(stories.model, p, 30), f"an unconstrained neighbour changed: {p}"
        for f in constrained:
            _, text, finish = f.result()
            assert finish == spb.FINISH_REASON_STOP, text
            jsonschema.validate(json.loads(text), PERSON)
    stories.assert_no_leaked_blocks()


def test_the_same_requests_without_the_constraint_do_not_validate(stories):
    """So the test above can fail: stories260K writes stories, not JSON."""
    for i in range(4):
        req = person(i)
        req.ClearField("structured")
        _, text, _ = run(stories, req)
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(text), PERSON)


@pytest.fixture(scope="module")
def faulty(stories_path):
    """A stack of its own: its executor is killed, and the pool is small
    enough that 16 constrained requests preempt each other."""
    services, client = start_services(str(stories_path), executor_env={"EXECUTOR_NUM_KV_BLOCKS": "40"},
                                      scheduler_env={"SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "60",
                                                     "SCHEDULER_STEP_TIMEOUT_S": "10"})
    yield services, client
    client.channel.close()
    services.stop()


def matchers(services) -> float:
    return metric(scrape(services.executor_metrics_port), "llmsched_executor_constraint_matchers")


def test_cancelling_30_percent_mid_stream_releases_every_matcher_and_block(faulty):
    services, client = faulty
    calls = [client.stub.Generate(words(i), timeout=120) for i in range(20)]
    texts: dict[int, str] = {}

    def consume(i: int, call) -> None:
        if i % 10 < 3:
            next(call)  # in flight for sure
            call.cancel()
        else:
            texts[i] = "".join(r.text for r in call)

    threads = [threading.Thread(target=consume, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(texts) == [i for i in range(20) if i % 10 >= 3]
    for text in texts.values():
        assert re.fullmatch(WORD_RE, text), text
    client.assert_no_leaked_blocks()
    wait_until(lambda: matchers(services) == 0, 10, "the executor's matchers gauge to return to 0")


def test_constrained_outputs_stay_valid_across_preemptions_and_an_executor_sigkill(faulty, stories_path):
    services, client = faulty
    before = client.info().num_preemptions
    streams = Streams(client, [words(i) for i in range(16)]).start()
    killed = threading.Event()

    def kill() -> None:
        services.executor.send_signal(signal.SIGKILL)
        killed.set()

    streams.when_total_exceeds(16 * 15, kill)
    assert killed.wait(60), f"no tokens: {streams.describe()}"
    services.executor.wait(10)
    services.start_executor()
    streams.join()
    assert streams.errors == [None] * 16, streams.describe()
    assert client.info().num_preemptions > before, "40 blocks were meant to be too few: nothing was preempted"
    tok = Tokenizer.from_file(str(stories_path / "tokenizer.json"))
    for tokens in streams.tokens:
        text = tok.decode([t for t in tokens if t != EOS])
        assert re.fullmatch(WORD_RE, text), f"an output broke its constraint across the recompute: {text!r}"
    client.assert_no_leaked_blocks()
    wait_until(lambda: matchers(services) == 0, 10, "the executor's matchers gauge to return to 0")


def test_a_constraint_over_the_compile_time_limit_is_refused_and_nothing_is_queued():
    services, client = start_services("tiny-random", scheduler_env={"SCHEDULER_CONSTRAINT_COMPILE_TIMEOUT_S": "0.05"})
    try:
        # A 470 KB schema: hundreds of milliseconds to compile.
        huge = json.dumps({"enum": [f"value-{i}-" + "x" * (i % 17) for i in range(20000)]})
        with pytest.raises(grpc.RpcError) as exc:
            run(client, spb.GenerateRequest(prompt="Hi", structured=spb.StructuredOutput(json_schema=huge)))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith("structured.json_schema: did not compile within 0.05 s")
        info = client.info()
        assert info.num_waiting == 0 and info.num_running == 0
        # A small one still compiles in time.
        _, text, finish = run(client, spb.GenerateRequest(
            prompt="Hi", structured=spb.StructuredOutput(choice=spb.Choice(values=["yes", "no"]))))
        assert text in ("yes", "no") and finish == spb.FINISH_REASON_STOP
    finally:
        client.channel.close()
        services.stop()
