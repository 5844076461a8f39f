"""Fuzzing the public API of the real services (stories260K, a small KV pool
so that preemption shows): random and adversarial GenerateRequests, mixed
with client cancels, short deadlines, Abort RPCs and GetServerInfo, several
at once from a thread pool.

Every call must end with OK or a documented status, and the status must be
the one the request deserves: a request this file's own reading of the API
contract (`expected_outcome`) judges bad gets INVALID_ARGUMENT naming one of
its bad fields, a message over 4 MiB gets RESOURCE_EXHAUSTED, a good request
streams a well-formed answer. After every example both processes are alive
and answering, no KV block is held, and no executor step has failed: no
request field may be able to break a step.

Reproducible: hypothesis is derandomized and keeps no example database.
The server's timing is not, so every check accepts each outcome a race may
legitimately produce (a cancel after the last token is OK, two requests
sharing an id may both run if the first ends before the second arrives).
"""

from __future__ import annotations

import math
import re
import struct
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import start_services

VOCAB = 512
MAX_MODEL_LEN = 512
EOS = 2
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Set above the vocabulary on purpose: the executor advertises at most the
# vocabulary size, and asking for more must be refused, not fail a step.
EXECUTOR_MAX_LOGPROBS = 1024
MAX_LOGPROBS = min(EXECUTOR_MAX_LOGPROBS, VOCAB)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
NUM_KV_BLOCKS = 64
U32, U64 = 2**32 - 1, 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
OK = grpc.StatusCode.OK
FIELD_PREFIX = re.compile(r"^[a-z_]+(\.[a-z_]+)?(\[\d+\])?")

# Request ids shared between ops of one example, so duplicates collide and
# Abort RPCs find live requests.
SHARED_IDS = ["dup-a", "dup-b", "dup-c"]
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big",
    "One day, a bird",
]
OVERSIZED_TEXT = "a" * (5 * 1024 * 1024)  # over SCHEDULER_MAX_MESSAGE_BYTES
BIG_TEXT = "Once upon a time there was a cat. " * 3000  # ~100 KB, far over max_model_len in tokens
ODD_CHARS = (
    "\x00\t\n\u00e9\u0301\u200b\u200d\u202e\u2028\ufeff\ufffd\uffff"  # controls, combining, zero-width, RTL, BOM
    "\u4e2d\u0644\U0001f600\U0001f468\u200d\U0001f469\U0010ffff"  # CJK, Arabic, emoji, ZWJ sequence, last code point
)


def f32(x: float) -> float:
    """What a float becomes on the wire (proto float is 32-bit)."""
    return struct.unpack("f", struct.pack("f", x))[0]


ABOVE_ONE_F32 = struct.unpack("f", struct.pack("I", 0x3F800001))[0]
TINY_F32 = struct.unpack("f", struct.pack("I", 1))[0]  # smallest positive denormal


# ----- the services ------------------------------------------------------


class Env:
    """What the tests need, with a short repr for hypothesis's report."""

    def __init__(self, services, client, tokenizer: Tokenizer):
        self.services, self.client, self.tokenizer = services, client, tokenizer

    def __repr__(self) -> str:
        return f"Env(scheduler at {self.client.address})"


@pytest.fixture(scope="module")
def env(stories_path):
    # A 64-block pool (1,024 token slots) against prompts and outputs of up
    # to 512 tokens, so concurrent long requests preempt each other; the
    # priority policy so that GenerateRequest.priority matters.
    services, client = start_services(
        str(stories_path),
        executor_env={"EXECUTOR_NUM_KV_BLOCKS": str(NUM_KV_BLOCKS), "EXECUTOR_MAX_LOGPROBS": str(EXECUTOR_MAX_LOGPROBS)},
        scheduler_env={"SCHEDULER_POLICY": "priority"},
    )
    yield Env(services, client, Tokenizer.from_file(str(stories_path / "tokenizer.json")))
    client.channel.close()
    services.stop()


def failed_steps(services) -> float:
    """The executor's own count of steps that raised (llmsched_executor_steps{outcome="error"})."""
    url = f"http://127.0.0.1:{services.executor_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == "llmsched_executor_steps"
               for sample in family.samples if sample.name.endswith("_total") and sample.labels.get("outcome") == "error")


def assert_alive(services, client) -> None:
    assert services.scheduler.poll() is None, f"scheduler exited with {services.scheduler.returncode}"
    assert services.executor.poll() is None, f"executor exited with {services.executor.returncode}"
    info = client.info()
    assert info.num_kv_blocks == NUM_KV_BLOCKS and info.max_model_len == MAX_MODEL_LEN
    assert failed_steps(services) == 0, "an executor step failed: a request reached the model that breaks it"


# ----- what a request deserves -------------------------------------------


@dataclass
class Expected:
    oversized: bool = False
    # Names that the INVALID_ARGUMENT message may start with: every field
    # this request gets wrong (the order the server checks them in is not
    # part of the contract).
    bad_fields: set[str] = field(default_factory=set)
    prompt_len: int | None = None
    max_tokens: int = 16
    greedy: bool = False

    @property
    def valid(self) -> bool:
        return not self.oversized and not self.bad_fields


def expected_outcome(req: spb.GenerateRequest, tokenizer: Tokenizer) -> Expected:
    """The API contract (proto comments, docs/grpc-api.md's Behaviour section), written
    down independently of scheduler_svc/validation.py."""
    exp = Expected()
    if req.ByteSize() > MAX_MESSAGE_BYTES:
        exp.oversized = True
        return exp
    bad = exp.bad_fields
    has_text, has_ids = bool(req.prompt), len(req.prompt_token_ids) > 0
    if has_text == has_ids:
        bad.add("prompt")
    for i, t in enumerate(req.prompt_token_ids):
        if t >= VOCAB:
            bad.add(f"prompt_token_ids[{i}]")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        bad.add("request_id")
    s = req.sampling
    exp.max_tokens = s.max_tokens or 16
    if exp.max_tokens > MAX_MODEL_LEN:
        bad.add("sampling.max_tokens")
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        bad.add("sampling.temperature")
    exp.greedy = temperature == 0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        bad.add("sampling.top_p")
    if s.top_k > VOCAB:
        bad.add("sampling.top_k")
    if len(s.stop) > MAX_STOP_STRINGS:
        bad.add("sampling.stop")
    for i, stop in enumerate(s.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            bad.add(f"sampling.stop[{i}]")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad.add("sampling.stop_token_ids")
    for i, t in enumerate(s.stop_token_ids):
        if t >= VOCAB:
            bad.add(f"sampling.stop_token_ids[{i}]")
    if s.logprobs > MAX_LOGPROBS:
        bad.add("sampling.logprobs")
    if has_text != has_ids:
        exp.prompt_len = len(tokenizer.encode(req.prompt).ids) if has_text else len(req.prompt_token_ids)
        if exp.prompt_len + exp.max_tokens > MAX_MODEL_LEN:
            # "prompt (N tokens) + max_tokens (M) exceeds max_model_len"
            bad.update({"prompt", "sampling.max_tokens"})
    return exp


# ----- strategies --------------------------------------------------------

odd_text = st.text(alphabet=st.sampled_from(ODD_CHARS), min_size=1, max_size=30)
valid_prompt = st.one_of(
    st.sampled_from(PROMPTS).map(lambda p: {"prompt": p}),
    st.sampled_from(PROMPTS).map(lambda p: {"prompt": p}),
    st.text(min_size=1, max_size=60).map(lambda p: {"prompt": p}),
    odd_text.map(lambda p: {"prompt": p}),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40).map(lambda ids: {"prompt_token_ids": ids}),
    st.integers(100, 300).map(lambda n: {"prompt_token_ids": [1] + [(7 * i) % VOCAB for i in range(n)]}),
)
bad_prompt = st.one_of(
    st.just({}),  # neither
    st.just({"prompt": ""}),
    st.tuples(st.sampled_from(PROMPTS), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)).map(
        lambda t: {"prompt": t[0], "prompt_token_ids": t[1]}  # both
    ),
    st.lists(st.integers(0, U32), min_size=1, max_size=8).map(lambda ids: {"prompt_token_ids": ids}),
    st.sampled_from([VOCAB, VOCAB + 1, U32]).map(lambda t: {"prompt_token_ids": [1, 5, t]}),
    st.sampled_from([MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 2000]).map(
        lambda n: {"prompt_token_ids": [5] * n}
    ),
    # Big values are named here and made in generate_requests, so that
    # hypothesis never has to print them.
    st.just({"big": "text"}),
    st.just({"big": "oversized_text"}),
    st.just({"big": "oversized_ids"}),
)
BIG_PROMPTS = {
    "text": lambda: {"prompt": BIG_TEXT},
    "oversized_text": lambda: {"prompt": OVERSIZED_TEXT},
    "oversized_ids": lambda: {"prompt_token_ids": [300] * 2_200_000},  # ~4.4 MB of varints
}

def sometimes(p_in_10: int):
    """True with about p_in_10 chances in 10 (hypothesis flattens nested
    one_of, so repeating branches does not weight them)."""
    return st.integers(0, 9).map(lambda i: i < p_in_10)


# Each field has a strategy of good values (edge values within the bounds
# included) and one that adds bad and extreme ones. A request draws from the
# adversarial side for some of its fields only, so that most requests are
# accepted and run, and the rest usually get one field wrong at a time.
FIELDS = {
    "max_tokens": (
        st.one_of(st.integers(0, 24), st.integers(0, 24), st.sampled_from([1, 60, 120])),
        st.sampled_from([200, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 4_000_000, U32]),
    ),
    "temperature": (
        st.one_of(st.none(), st.sampled_from([0.0, 0.0, -0.0, 0.5, 1.0]), st.floats(f32(0.01), 3.0, width=32)),
        st.one_of(
            st.sampled_from([1e-30, 1e-6, 100.0, 3.4e38, math.nan, math.inf, -math.inf, -1.0, -TINY_F32]),
            st.floats(width=32),
        ),
    ),
    "top_p": (
        st.one_of(st.none(), st.sampled_from([1.0, 0.9, 0.5]), st.floats(f32(0.05), 1.0, width=32)),
        st.one_of(
            st.sampled_from([0.0, -0.0, TINY_F32, 1e-6, ABOVE_ONE_F32, 2.0, math.nan, math.inf, -math.inf]),
            st.floats(width=32),
        ),
    ),
    "top_k": (
        st.one_of(st.just(0), st.integers(0, 40), st.sampled_from([1, VOCAB - 1, VOCAB])),
        st.sampled_from([VOCAB + 1, 10_000, U32]),
    ),
    "seed": (
        st.one_of(st.none(), st.integers(0, 1000)),
        st.sampled_from([0, 2**31, 2**63 - 1, 2**63, U64]),
    ),
    "stop": (
        st.one_of(
            st.just([]),
            st.lists(st.text(min_size=1, max_size=6), max_size=4),
            st.lists(st.sampled_from(["Lily", "the", ".", " ", "\n", "was a"]), max_size=3),
            st.lists(odd_text, max_size=3),
        ),
        st.sampled_from([
            [""],
            ["Lily", ""],
            ["x" * MAX_STOP_CHARS],
            ["x" * (MAX_STOP_CHARS + 1)],
            ["\U0001f600" * MAX_STOP_CHARS],  # at the bound in characters, 4x that in bytes
            ["a"] * (MAX_STOP_STRINGS + 1),
            [str(i) for i in range(MAX_STOP_STRINGS)],
        ]),
    ),
    "stop_token_ids": (
        st.one_of(st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=5)),
        st.one_of(
            st.lists(st.integers(0, U32), min_size=1, max_size=3),
            st.sampled_from([list(range(MAX_STOP_TOKEN_IDS + 1)), list(range(400, 400 + MAX_STOP_TOKEN_IDS))]),
        ),
    ),
    "ignore_eos": (st.booleans(), st.booleans()),
    "logprobs": (
        st.one_of(st.just(0), st.just(0), st.integers(0, 20), st.sampled_from([1, VOCAB - 1, VOCAB])),
        st.sampled_from([MAX_LOGPROBS, VOCAB + 1, EXECUTOR_MAX_LOGPROBS, EXECUTOR_MAX_LOGPROBS + 1, U32]),
    ),
}


@st.composite
def sampling_params(draw) -> dict:
    adversarial = set()
    if draw(sometimes(3)):
        adversarial = set(draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3)))
    s = {}
    for key, (good, bad) in FIELDS.items():
        value = draw(bad if key in adversarial else good)
        if value is not None:
            s[key] = value
    return s


request_ids = st.one_of(
    st.just(""),
    st.sampled_from(SHARED_IDS),
    st.text(max_size=20),
    st.sampled_from([
        "r" * MAX_REQUEST_ID_CHARS,
        "\u00e9" * MAX_REQUEST_ID_CHARS,  # at the bound in characters, 2x in bytes
        "r" * (MAX_REQUEST_ID_CHARS + 1),
    ]),
)

priorities = st.one_of(st.just(0), st.sampled_from([I32_MIN, I32_MAX, -1, 1]), st.integers(I32_MIN, I32_MAX))


@st.composite
def generate_requests(draw) -> spb.GenerateRequest:
    prompt = draw(bad_prompt if draw(sometimes(2)) else valid_prompt)
    if "big" in prompt:
        prompt = BIG_PROMPTS[prompt["big"]]()
    return spb.GenerateRequest(
        request_id=draw(request_ids),
        sampling=spb.SamplingParams(**draw(sampling_params())),
        priority=draw(priorities),
        **prompt,
    )


class GenerateOp:
    """Plain class, not a dataclass, so hypothesis prints it with __repr__
    (a 5 MiB prompt stays out of the report)."""

    def __init__(self, request: spb.GenerateRequest, mode: tuple, metadata: tuple = ()):
        self.request = request
        # ("read",) to the end; ("cancel", k): cancel after k responses
        # (0 = before the first); ("deadline", s): a client deadline of s seconds.
        self.mode = mode
        # Invocation metadata: the server parses W3C trace headers from it.
        self.metadata = metadata

    def __repr__(self) -> str:  # keep the falsifying example readable
        r = spb.GenerateRequest()
        r.CopyFrom(self.request)
        if len(r.prompt) > 200:
            r.prompt = f"<{len(r.prompt)} chars>"
        if len(r.prompt_token_ids) > 50:
            n = len(r.prompt_token_ids)
            del r.prompt_token_ids[20:]
            r.request_id += f" <prompt_token_ids truncated from {n}>"
        return f"GenerateOp(mode={self.mode}, metadata={self.metadata!r}, request={r!r})"


class AbortOp:
    def __init__(self, request_id: str):
        # "<oversized>" stands for an id over the 4 MiB message limit.
        self.request_id = OVERSIZED_TEXT if request_id == "<oversized>" else request_id

    def __repr__(self) -> str:
        rid = self.request_id if len(self.request_id) < 300 else f"<{len(self.request_id)} chars>"
        return f"AbortOp({rid!r})"


class InfoOp:
    def __repr__(self) -> str:
        return "InfoOp()"


modes = st.one_of(
    st.just(("read",)),
    st.just(("read",)),
    st.integers(0, 4).map(lambda k: ("cancel", k)),
    st.sampled_from([0.001, 0.05, 0.3]).map(lambda s: ("deadline", s)),
)
printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
metadata = st.one_of(
    st.just(()),
    st.just((("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)),
    st.text(printable, max_size=80).map(lambda v: (("traceparent", v),)),
    st.tuples(st.text(printable, max_size=60), st.text(printable, max_size=60)).map(
        lambda t: (("traceparent", t[0]), ("traceparent", t[1]), ("tracestate", t[1]))
    ),
    st.just((("traceparent", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"), ("tracestate", "k=" + "v" * 4000))),
)
ops = st.one_of(
    st.builds(GenerateOp, generate_requests(), modes, metadata),
    st.builds(GenerateOp, generate_requests(), modes, metadata),
    st.builds(GenerateOp, generate_requests(), modes, metadata),
    st.builds(AbortOp, st.one_of(st.sampled_from(SHARED_IDS), st.text(max_size=10), st.just("<oversized>"))),
    st.just(InfoOp()),
)


# ----- running ops -------------------------------------------------------


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    responses: list = field(default_factory=list)
    cancelled_by_us: bool = False


def run_generate(client, op: GenerateOp) -> Outcome:
    kind = op.mode[0]
    timeout = op.mode[1] if kind == "deadline" else 60
    call = client.stub.Generate(op.request, timeout=timeout, metadata=op.metadata)
    responses = []
    try:
        if kind == "cancel" and op.mode[1] == 0:
            call.cancel()
            return Outcome(call.code(), call.details() or "", responses, True)
        for resp in call:
            responses.append(resp)
            if kind == "cancel" and len(responses) >= op.mode[1]:
                call.cancel()
                return Outcome(call.code(), call.details() or "", responses, True)
        return Outcome(OK, "", responses)
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", responses)


def run_op(client, op) -> Outcome:
    try:
        if isinstance(op, GenerateOp):
            return run_generate(client, op)
        if isinstance(op, AbortOp):
            resp = client.stub.Abort(spb.AbortRequest(request_id=op.request_id), timeout=30)
            assert isinstance(resp.found, bool)
            return Outcome(OK, "", [resp])
        info = client.info()
        assert info.num_free_kv_blocks <= info.num_kv_blocks == NUM_KV_BLOCKS
        return Outcome(OK, "", [info])
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "")


# Greedy continuations seen so far, by prompt: every greedy answer must be a
# prefix of (or extend) the others for the same prompt, however it was
# batched, preempted or cut short.
GREEDY_SEEN: dict[tuple[int, ...], list[int]] = {}


def check_generate(op: GenerateOp, out: Outcome, exp: Expected, batch: list, tokenizer: Tokenizer) -> None:
    req, kind = op.request, op.mode[0]
    ctx = f"{op!r} -> {out.code} {out.details[:300]!r}"
    gen_ids = [o.request.request_id for o in batch if isinstance(o, GenerateOp)]
    shared_id = bool(req.request_id) and gen_ids.count(req.request_id) > 1
    aborted_by_rpc = bool(req.request_id) and any(isinstance(o, AbortOp) and o.request_id == req.request_id for o in batch)

    # Races a client may legitimately lose.
    if kind == "deadline" and out.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return
    if out.cancelled_by_us and out.code == grpc.StatusCode.CANCELLED:
        pass  # partial responses are checked below
    elif exp.oversized:
        assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ctx
        return
    elif exp.bad_fields:
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT, ctx
        allowed = exp.bad_fields | ({"request_id"} if shared_id else set())
        assert FIELD_PREFIX.match(out.details) and FIELD_PREFIX.match(out.details).group(0) in allowed, (
            f"message does not start with one of the bad fields {sorted(exp.bad_fields)}: {ctx}"
        )
        return
    elif out.code == grpc.StatusCode.INVALID_ARGUMENT and shared_id:
        assert out.details.startswith("request_id"), ctx
        return
    elif out.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert out.details.startswith("overloaded"), ctx  # documented shedding
        return
    else:
        assert out.code == OK, f"a valid request must succeed: {ctx}"

    # The stream itself: tokens, finish reason, usage, logprobs.
    resps = out.responses
    tokens = [t for r in resps for t in r.token_ids]
    assert all(t < VOCAB for t in tokens), ctx
    assert len(tokens) <= exp.max_tokens, ctx
    for r in resps:
        if req.request_id:
            assert r.request_id == req.request_id, ctx
        else:
            assert r.request_id, ctx
        if req.sampling.logprobs:
            assert [lp.token_id for lp in r.logprobs] == list(r.token_ids), ctx
            for lp in r.logprobs:
                assert len(lp.top_token_ids) == len(lp.top_logprobs) == req.sampling.logprobs, ctx
                assert lp.logprob <= 1e-4 and all(x <= 1e-4 for x in lp.top_logprobs), ctx
        else:
            assert not r.logprobs, ctx
    text = "".join(r.text for r in resps)
    assert not any(stop and stop in text for stop in req.sampling.stop), f"a stop string leaked into the text: {ctx}"
    # Whether we read the stream to its end (a cancel may lose the race to
    # the last response and still report OK).
    complete = out.code == OK and not out.cancelled_by_us
    if complete:
        assert resps, f"an OK stream must carry at least the final response: {ctx}"
        assert all(r.finish_reason == spb.FINISH_REASON_UNSPECIFIED for r in resps[:-1]), ctx
        last = resps[-1]
        s = req.sampling
        if last.finish_reason == spb.FINISH_REASON_ABORT:
            assert aborted_by_rpc, f"ended with ABORT though nobody aborted it: {ctx}"
        elif last.finish_reason == spb.FINISH_REASON_LENGTH:
            assert len(tokens) == exp.max_tokens or exp.prompt_len + len(tokens) == MAX_MODEL_LEN, ctx
        elif last.finish_reason == spb.FINISH_REASON_STOP:
            assert tokens, ctx
            assert (
                tokens[-1] in s.stop_token_ids or (tokens[-1] == EOS and not s.ignore_eos) or len(s.stop) > 0
            ), f"STOP without a stop condition: {ctx}"
        else:
            raise AssertionError(f"OK stream without a finish reason: {ctx}")
        assert last.usage.completion_tokens == len(tokens), ctx
        assert last.usage.prompt_tokens == exp.prompt_len, ctx
        assert last.usage.cached_prompt_tokens <= exp.prompt_len, ctx
    if exp.greedy and tokens and exp.prompt_len is not None:
        prompt_ids = tuple(tokenizer.encode(req.prompt).ids if req.prompt else req.prompt_token_ids)
        seen = GREEDY_SEEN.setdefault(prompt_ids, tokens)
        n = min(len(seen), len(tokens))
        assert seen[:n] == tokens[:n], f"greedy output differs between runs of the same prompt: {ctx}"
        if len(tokens) > len(seen):
            GREEDY_SEEN[prompt_ids] = tokens


def check_other(op, out: Outcome) -> None:
    ctx = f"{op!r} -> {out.code} {out.details[:300]!r}"
    if isinstance(op, AbortOp) and len(op.request_id.encode()) > MAX_MESSAGE_BYTES:
        assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ctx
    else:
        assert out.code == OK, ctx


# ----- the tests ---------------------------------------------------------


@settings(
    max_examples=100,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(batch=st.lists(ops, min_size=1, max_size=6))
def test_random_concurrent_calls_end_with_documented_statuses(env, batch):
    services, client, tokenizer = env.services, env.client, env.tokenizer
    expected = {i: expected_outcome(op.request, tokenizer) for i, op in enumerate(batch) if isinstance(op, GenerateOp)}
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        outcomes = list(pool.map(lambda op: run_op(client, op), batch))
    for i, (op, out) in enumerate(zip(batch, outcomes)):
        event(f"{type(op).__name__}: {out.code.name}")  # --hypothesis-show-statistics
        if isinstance(op, GenerateOp):
            check_generate(op, out, expected[i], batch, tokenizer)
        else:
            check_other(op, out)
    assert_alive(services, client)
    client.assert_no_leaked_blocks()


def test_pool_pressure_with_cancels_aborts_and_duplicates(env):
    """Fixed, heavier mix: 24 long requests over a 64-block pool (preemption
    for sure), a third cancelled mid-stream, some aborted by id, duplicates
    of live ids refused."""
    services, client, tokenizer = env.services, env.client, env.tokenizer
    before = client.info().num_preemptions
    long_ops = []
    for i in range(24):
        ids = [1] + [(11 * i + 3 * j) % VOCAB for j in range(60 + 5 * i)]
        mode = ("cancel", 1 + i % 5) if i % 3 == 0 else ("read",)
        req = spb.GenerateRequest(
            request_id=f"pressure-{i}", prompt_token_ids=ids, priority=(i * 7919) % 5 - 2,
            sampling=spb.SamplingParams(max_tokens=120, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True),
        )
        long_ops.append(GenerateOp(req, mode))
    aborts = [AbortOp(f"pressure-{i}") for i in range(1, 24, 4)]
    dups = [GenerateOp(spb.GenerateRequest(request_id=f"pressure-{i}", prompt="Hi"), ("read",)) for i in range(2, 24, 6)]
    batch = long_ops + dups
    with ThreadPoolExecutor(max_workers=len(batch) + len(aborts)) as pool:
        futures = [pool.submit(run_op, client, op) for op in batch]
        time.sleep(0.5)  # let them get going before the aborts land
        abort_futures = [pool.submit(run_op, client, op) for op in aborts]
        outcomes = [f.result(timeout=120) for f in futures]
        for op, f in zip(aborts, abort_futures):
            check_other(op, f.result(timeout=30))
    full = batch + aborts
    for op, out in zip(batch, outcomes):
        check_generate(op, out, expected_outcome(op.request, tokenizer), full, tokenizer)
    for op, out in zip(dups, outcomes[len(long_ops):]):
        # The long request with that id runs for seconds: the duplicate is
        # refused (or, if it came very late, runs after it).
        assert out.code in (OK, grpc.StatusCode.INVALID_ARGUMENT), out
    assert client.info().num_preemptions > before, "the pool was meant to be too small: no preemption happened"
    assert_alive(services, client)
    client.assert_no_leaked_blocks()


def test_logprobs_beyond_the_vocabulary_are_refused_by_name(env):
    """EXECUTOR_MAX_LOGPROBS (1024) exceeds the vocabulary (512): a request
    for 513 used to be accepted and then fail every step it was in."""
    services, client = env.services, env.client
    with pytest.raises(grpc.RpcError) as exc:
        client.generate(prompt="Once upon a time", sampling={"max_tokens": 2, "logprobs": VOCAB + 1})
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("sampling.logprobs")
    tokens, _, last, _ = client.generate(prompt="Once upon a time", sampling={"max_tokens": 2, "logprobs": VOCAB})
    assert len(tokens) == 2 and all(len(lp.top_token_ids) == VOCAB for lp in last.logprobs)
    assert_alive(services, client)


def test_server_still_serves_correctly_after_the_fuzzing(env):
    services, client = env.services, env.client
    assert_alive(services, client)
    tokens, text, last, _ = client.generate(prompt="Once upon a time", sampling={"max_tokens": 16, "temperature": 0})
    assert len(tokens) == 16 and last.finish_reason == spb.FINISH_REASON_LENGTH
    assert text.startswith(", there was a little girl")
    client.assert_no_leaked_blocks()


@pytest.mark.parametrize("temperature", [TINY_F32, 1e-38], ids=["smallest-denormal", "1e-38"])
def test_tiny_positive_temperature_behaves_like_greedy(env, temperature):
    """Temperature -> 0+ is greedy decoding in the limit; the server may also
    refuse such a value as INVALID_ARGUMENT, but must not emit garbage."""
    client = env.client
    greedy, *_ = client.generate(prompt="Once upon a time", sampling={"max_tokens": 12, "temperature": 0})
    try:
        tokens, *_ = client.generate(
            prompt="Once upon a time", sampling={"max_tokens": 12, "temperature": temperature, "seed": 1}
        )
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details().startswith("sampling.temperature")
        return
    assert tokens == greedy, f"temperature {temperature!r} sampled {tokens}, greedy is {greedy}"


# Alone: it times the gaps between a stream's tokens.
@pytest.mark.alone
def test_a_huge_text_prompt_does_not_stall_other_clients(env):
    client = env.client
    huge = "Once upon a time there was a cat. " * 90_000  # 3.06 MB, ~900k tokens
    outcome = {}

    def send_huge():
        try:
            client.generate(prompt=huge, timeout=60)
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    # A stream that runs for seconds; it is read until the huge request has
    # been answered, then cancelled.
    call = client.stub.Generate(spb.GenerateRequest(
        prompt="Once", sampling=spb.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)), timeout=60)
    next(call)
    sender = threading.Thread(target=send_huge)
    sender.start()
    gaps, last, after = [], time.perf_counter(), 0
    for _ in call:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        after += not sender.is_alive()
        if after >= 5:
            call.cancel()
            break
    sender.join(60)
    assert outcome.get("code") == grpc.StatusCode.INVALID_ARGUMENT
    client.assert_no_leaked_blocks()
    assert max(gaps) < 0.5, f"a running stream stalled for {max(gaps):.2f} s while another request was tokenized"
