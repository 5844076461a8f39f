"""Executor crashes, failing steps, stalls and graceful shutdown, through
real processes on stories260K."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import scheduler_metric, start_services
from tests.oracle import hf_greedy


def health(client) -> int:
    stub = health_pb2_grpc.HealthStub(client.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def wait_until(predicate, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Streams:
    """Runs Generate calls in threads and counts tokens as they arrive."""

    def __init__(self, client, requests):
        self.client, self.requests = client, requests
        self.tokens = [[] for _ in requests]
        self.errors: list[grpc.RpcError | None] = [None] * len(requests)
        self.finish = [None] * len(requests)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(requests))]
        self._lock = threading.Lock()
        self._triggers: list[list] = []  # [total, callback, fired]

    def _run(self, i):
        try:
            for resp in self.client.stub.Generate(self.requests[i], timeout=240):
                self.tokens[i].extend(resp.token_ids)
                if resp.finish_reason:
                    self.finish[i] = resp.finish_reason
                self._fire_triggers()
        except grpc.RpcError as exc:
            self.errors[i] = exc

    def when_total_exceeds(self, total: int, callback) -> None:
        """Runs callback, once, on the receiving thread that first sees more
        than `total` tokens in all: at once, however late the test's own
        thread would notice (32 receiving threads can starve it for seconds)."""
        with self._lock:
            self._triggers.append([total, callback, False])
        self._fire_triggers()

    def _fire_triggers(self) -> None:
        with self._lock:
            due = [t for t in self._triggers if not t[2] and self.total_tokens > t[0]]
            for t in due:
                t[2] = True
        for _, callback, _ in due:
            callback()

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def join(self):
        for t in self.threads:
            t.join(300)

    @property
    def total_tokens(self):
        return sum(len(t) for t in self.tokens)

    def describe(self) -> str:
        """Per stream: tokens so far, finish reason, error; for failure messages."""
        return "; ".join(f"#{i}: {len(t)} tokens, finish={f}, error={e.code().name + ' ' + e.details() if e else None}"
                         for i, (t, f, e) in enumerate(zip(self.tokens, self.finish, self.errors)))


@pytest.fixture
def fresh(stories_path):
    # A short step timeout: should a restarted executor leave a step unanswered,
    # the scheduler reconnects instead of waiting for the default 120 s.
    # The executor speculates (n-gram, every running request may draft), so
    # the kills land on steps in flight that verify drafts; test_pipelining
    # and the host-tier, structured and TP tests kill plain decoding.
    services, client = start_services(
        str(stories_path), executor_env={"EXECUTOR_SPECULATIVE_METHOD": "ngram"},
        scheduler_env={"SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "60", "SCHEDULER_STEP_TIMEOUT_S": "10",
                       "SCHEDULER_SPECULATIVE_MAX_BATCH": "64"})
    yield services, client
    client.channel.close()
    services.stop()


def restart_executor(services):
    services.executor.send_signal(signal.SIGKILL)
    services.executor.wait(10)
    services.start_executor()


def test_streams_survive_two_executor_kills_with_oracle_tokens(fresh):
    services, client = fresh
    # 8 distinct prompts: fewer oracle runs. Long outputs, so that both kills
    # land mid-generation.
    prompts = [[1, 403, 407, 261, 378 + (i % 8)] for i in range(32)]
    greedy = [spb.GenerateRequest(prompt_token_ids=p, sampling=spb.SamplingParams(max_tokens=300, temperature=0))
              for p in prompts[:28]]
    seeded = [spb.GenerateRequest(prompt_token_ids=p, sampling=spb.SamplingParams(max_tokens=300, temperature=0.8, seed=i))
              for i, p in enumerate(prompts[28:])]
    # The no-fault run of the seeded requests, for comparison.
    baseline = Streams(client, seeded).start()
    baseline.join()
    expected_seeded = baseline.tokens
    first_id = client.info().executor_instance_id

    # Each kill is sent by the receiving thread that sees the total pass its
    # mark, so it lands mid-generation even when this thread is starved.
    killed = [threading.Event(), threading.Event()]
    unfinished_at_kill = [0, 0]

    def kill(n: int, executor) -> None:
        unfinished_at_kill[n] = sum(f is None for f in streams.finish)
        executor.send_signal(signal.SIGKILL)
        killed[n].set()

    streams = Streams(client, greedy + seeded)
    first = services.executor
    streams.when_total_exceeds(32 * 10, lambda: kill(0, first))
    streams.start()
    assert killed[0].wait(60), f"no first tokens: {streams.describe()}"
    first.wait(10)
    # Nothing is generated while no executor runs: 320 tokens past this
    # mark are progress on the restarted executor. The trigger is set
    # before that executor starts, so no wait of this thread can let the
    # streams finish first; it kills whichever executor then runs.
    mark = streams.total_tokens
    streams.when_total_exceeds(mark + 32 * 10, lambda: kill(1, services.executor))
    services.start_executor(wait=False)
    assert killed[1].wait(120), f"no progress after the first restart from {mark} tokens: {streams.describe()}"
    services.executor.wait(10)
    services.start_executor()
    streams.join()
    assert min(unfinished_at_kill) > 0, f"a kill landed after every stream had finished: {unfinished_at_kill}"
    assert streams.errors == [None] * 32, streams.describe()
    for req, tokens in zip(greedy, streams.tokens[:28]):
        assert tokens == hf_greedy(client.model, list(req.prompt_token_ids), 300)
    assert streams.tokens[28:] == expected_seeded, "seeded sampling must not change across recomputes"
    assert scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total") > 0, "no draft was accepted"
    assert client.info().executor_instance_id != first_id
    client.assert_no_leaked_blocks()
    assert health(client) == health_pb2.HealthCheckResponse.SERVING


def test_without_an_executor_requests_fail_unavailable_and_health_follows(stories_path):
    services, client = start_services(str(stories_path), scheduler_env={"SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "2"})
    try:
        streams = Streams(client, [spb.GenerateRequest(prompt="Once", sampling=spb.SamplingParams(
            max_tokens=400, ignore_eos=True, temperature=0))]).start()
        wait_until(lambda: streams.total_tokens > 5, what="first tokens")
        services.executor.send_signal(signal.SIGKILL)
        services.executor.wait(10)
        streams.join()
        assert streams.errors[0] is not None and streams.errors[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "executor" in streams.errors[0].details()
        wait_until(lambda: health(client) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            client.generate(prompt="Once")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2
        services.start_executor()
        wait_until(lambda: health(client) == health_pb2.HealthCheckResponse.SERVING, 30, "SERVING again")
        tokens, *_ = client.generate(prompt_token_ids=[1, 403, 407, 261, 378], sampling={"max_tokens": 10, "temperature": 0})
        assert tokens == hf_greedy(client.model, [1, 403, 407, 261, 378], 10)
        client.assert_no_leaked_blocks()
    finally:
        client.channel.close()
        services.stop()


def test_failing_step_fails_only_the_poisoned_request(stories_path):
    services, client = start_services(str(stories_path), executor_env={"EXECUTOR_DEBUG_FAIL_ON_TOKEN": "500"})
    try:
        good = [spb.GenerateRequest(prompt_token_ids=[1, 403, 407, 261, 378 + i],
                                    sampling=spb.SamplingParams(max_tokens=30, temperature=0)) for i in range(4)]
        poisoned = spb.GenerateRequest(prompt_token_ids=[1, 403, 500], sampling=spb.SamplingParams(max_tokens=30))
        streams = Streams(client, [*good, poisoned]).start()
        streams.join()
        assert streams.errors[4] is not None and streams.errors[4].code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in streams.errors[4].details()
        assert streams.errors[:4] == [None] * 4
        for req, tokens in zip(good, streams.tokens[:4]):
            assert tokens == hf_greedy(client.model, list(req.prompt_token_ids), 30)
        assert services.executor.poll() is None, "the executor stays up after a failed step"
        client.assert_no_leaked_blocks()
    finally:
        client.channel.close()
        services.stop()


# The abort case needs streams that outlast the drain: 500 tokens take at
# least 0.25 s even at 0.5 ms a step, against a 0.1 s drain.
@pytest.mark.parametrize("drain_s, expect", [("60", "complete"), ("0.1", "abort")])
def test_sigterm_drains_then_exits_zero(stories_path, drain_s, expect):
    services, client = start_services(str(stories_path), scheduler_env={"SCHEDULER_DRAIN_TIMEOUT_S": drain_s})
    try:
        max_tokens = 60 if expect == "complete" else 500  # + 5 prompt tokens: within max_model_len 512
        streams = Streams(client, [spb.GenerateRequest(prompt_token_ids=[1, 403, 407, 261, 378 + i], sampling=spb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True)) for i in range(4)]).start()
        wait_until(lambda: all(streams.tokens), what="all streams started")
        services.scheduler.send_signal(signal.SIGTERM)
        wait_until(lambda: health(client) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as exc:
            client.generate(prompt="Once")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        streams.join()
        assert services.scheduler.wait(30) == 0
        assert streams.errors == [None] * 4
        if expect == "complete":
            assert all(len(t) == max_tokens for t in streams.tokens)
            assert streams.finish == [spb.FINISH_REASON_LENGTH] * 4
        else:
            assert streams.finish == [spb.FINISH_REASON_ABORT] * 4
            assert all(len(t) < max_tokens for t in streams.tokens)
    finally:
        client.channel.close()
        services.stop()


def test_health_reports_a_stalled_executor_and_recovers(stories_path):
    services, client = start_services(str(stories_path), scheduler_env={"SCHEDULER_STALL_TIMEOUT_S": "1"})
    try:
        streams = Streams(client, [spb.GenerateRequest(prompt_token_ids=[1, 403, 407, 261, 378], sampling=spb.SamplingParams(
            max_tokens=60, temperature=0))]).start()
        wait_until(lambda: streams.total_tokens > 3, what="first tokens")
        services.executor.send_signal(signal.SIGSTOP)  # alive, but answers nothing
        try:
            wait_until(lambda: health(client) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING on stall")
        finally:
            services.executor.send_signal(signal.SIGCONT)
        wait_until(lambda: health(client) == health_pb2.HealthCheckResponse.SERVING, 10, "SERVING after progress")
        streams.join()
        assert streams.errors == [None]
        assert streams.tokens[0] == hf_greedy(client.model, [1, 403, 407, 261, 378], 60)
    finally:
        client.channel.close()
        services.stop()


def test_executor_sigterm_exits_zero_and_a_restart_resumes_the_streams(fresh):
    services, client = fresh
    prompt = [1, 403, 407, 261, 378]
    streams = Streams(client, [spb.GenerateRequest(prompt_token_ids=prompt, sampling=spb.SamplingParams(
        max_tokens=80, temperature=0)) for _ in range(4)]).start()
    wait_until(lambda: streams.total_tokens > 20, what="first tokens")
    services.executor.send_signal(signal.SIGTERM)
    assert services.executor.wait(30) == 0
    services.start_executor()
    streams.join()
    want = hf_greedy(client.model, prompt, 80)
    assert streams.errors == [None] * 4 and streams.tokens == [want] * 4
    client.assert_no_leaked_blocks()
