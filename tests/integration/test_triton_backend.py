"""The executor on EXECUTOR_ATTENTION_BACKEND=triton, through both services:
greedy output equals HF transformers' and the torch backend's, alone and
with requests whose steps mix prefill chunks and decodes.

Without CUDA the kernels run under Triton's CPU interpreter
(TRITON_INTERPRET=1), which is slow: generations here are short.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from executor_svc.model.checkpoint import load_checkpoint
from llmsched.v1 import scheduler_pb2 as spb
from tests.conftest import HAS_CUDA
from tests.integration.conftest import start_services
from tests.oracle import hf_greedy

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

# Small blocks and prefill chunks, so a request's context spans several
# blocks and prompts longer than 6 tokens are computed in chunks that share
# steps with the other requests' decodes. float32 even on CUDA, so both
# backends can be held to HF's float32 tokens exactly.
EXECUTOR_ENV = {"EXECUTOR_BLOCK_SIZE": "4", "EXECUTOR_NUM_KV_BLOCKS": "256", "EXECUTOR_DTYPE": "float32"}
SCHEDULER_ENV = {"SCHEDULER_MAX_PREFILL_CHUNK": "6"}
# Without CUDA the kernels run under Triton's CPU interpreter; with it, for real.
TRITON_ENV = {
    **EXECUTOR_ENV, "EXECUTOR_ATTENTION_BACKEND": "triton", **({} if HAS_CUDA else {"TRITON_INTERPRET": "1"}),
}
TORCH_ENV = {**EXECUTOR_ENV, "EXECUTOR_ATTENTION_BACKEND": "torch"}

PROMPT = "Once upon a time"
# (prompt, max_tokens): the first one is decoding when the others arrive.
CONCURRENT = [
    ("The little dog", 8),
    ("Lily and Tom went to the park. They", 5),  # 14 prompt tokens: chunks of 6, 6, 2
    ("Tim wanted to play with his friend, but", 5),  # 11 prompt tokens: chunks of 6, 5
]


def _start(model: Path, executor_env):
    return start_services(str(model), executor_env=executor_env, scheduler_env=SCHEDULER_ENV)


@pytest.fixture(scope="module")
def pairs(stories_path):
    """(triton client, torch client, triton executor pid), started side by side."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_start, stories_path, env) for env in (TRITON_ENV, TORCH_ENV)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            f.result()  # re-raises a failed start, after the other one is in `started`
        (triton_services, triton_client), (_, torch_client) = started
        yield triton_client, torch_client, triton_services.executor.pid
    finally:
        for _, client in started:
            client.channel.close()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda sc: sc[0].stop(), started))


def encode(model: str, text: str) -> list[int]:
    return Tokenizer.from_str(load_checkpoint(model).tokenizer_json).encode(text).ids


def greedy(client, prompt: str, max_tokens: int) -> list[int]:
    return client.generate(prompt=prompt, sampling={"max_tokens": max_tokens, "temperature": 0})[0]


def test_triton_executor_really_runs_triton(pairs):
    _, _, pid = pairs
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc to look into the executor process")
    assert "libtriton" in maps.read_text(), "the executor never loaded triton: is the backend setting ignored?"


def test_greedy_matches_hf_and_torch_backend(pairs):
    triton_client, torch_client, _ = pairs
    got = greedy(triton_client, PROMPT, 8)
    assert got == hf_greedy(triton_client.model, encode(triton_client.model, PROMPT), 8)
    assert got == greedy(torch_client, PROMPT, 8)
    triton_client.assert_no_leaked_blocks()


def _mixed_load(client) -> list[list[int]]:
    """CONCURRENT[0] starts alone; the others are sent once its first token
    is back, so their prefill chunks land in steps that decode it."""
    (p0, n0), *rest = CONCURRENT
    stream = client.stub.Generate(
        spb.GenerateRequest(prompt=p0, sampling=spb.SamplingParams(max_tokens=n0, temperature=0)), timeout=60
    )
    tokens = list(next(stream).token_ids)
    with ThreadPoolExecutor(len(rest)) as pool:
        others = [pool.submit(greedy, client, prompt, n) for prompt, n in rest]
        for resp in stream:
            tokens += resp.token_ids
        return [tokens, *(f.result(timeout=60) for f in others)]


def test_concurrent_mixed_prefill_and_decode_match_hf_and_torch_backend(pairs):
    triton_client, torch_client, _ = pairs
    got = _mixed_load(triton_client)
    want_torch = _mixed_load(torch_client)
    for (prompt, max_tokens), g, t in zip(CONCURRENT, got, want_torch):
        want = hf_greedy(triton_client.model, encode(triton_client.model, prompt), max_tokens)
        assert g == want, f"triton vs HF on {prompt!r}"
        assert t == want, f"torch vs HF on {prompt!r}"
    triton_client.assert_no_leaked_blocks()
    torch_client.assert_no_leaked_blocks()
