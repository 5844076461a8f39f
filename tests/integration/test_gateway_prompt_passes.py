"""What the gateway serves from a prompt's own forward pass (issue 35,
parts 5 to 7): /v1/embeddings, echo with logprobs on /v1/completions (what
lm-eval's log-likelihood tasks send), vLLM's prompt_logprobs extra, and
/detokenize. One stack on stories260K given a sentence-transformers
pipeline (mean pooling, then Normalize) and a chat template; HF
transformers on the same fp32 weights is the oracle."""

from __future__ import annotations

import base64
import json
import math
import struct
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from executor_svc.model.pooling import Pooling
from tests.embeddings import hf_log_softmax, hf_pooled
from tests.oracle import hf_greedy

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, there was a little dog named Max. He liked to"
MEAN_NORMALIZED = Pooling("mean", normalize=True)
MAX_INPUTS = 4  # GATEWAY_MAX_EMBEDDING_INPUTS of the embedder stack


@pytest.fixture(scope="module")
def stack(embedder):
    """The shared embedding stack (tests/integration/conftest.py)."""
    return embedder


@pytest.fixture(scope="module")
def tok(embedder) -> Tokenizer:
    return Tokenizer.from_file(str(Path(embedder.grpc.model) / "tokenizer.json"))


def _post(stack, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of one plain POST, errors included."""
    req = urllib.request.Request(stack.services.gateway_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _assert_close(got, want: torch.Tensor, tol: float, what: str) -> None:
    diff = (torch.tensor(got, dtype=torch.float32) - want).abs().max().item()
    assert diff < tol, f"{what}: differs from HF by {diff}"


# --- /v1/embeddings -------------------------------------------------------------

def test_openai_client_embeddings_in_base64_equal_hf_mean_pooled_hidden_states(stack, tok):
    """The SDK asks for base64 unless told otherwise and decodes the
    little-endian float32 bytes itself; token ids (a batch of three) and a
    text (BOS added) alike equal HF's normalised mean of the final hidden
    states."""
    ids = [tok.encode(PROMPT).ids, [1, 403, 407, 261, 378], tok.encode("The little dog", add_special_tokens=False).ids]
    out = stack.openai.embeddings.create(model=stack.model, input=ids)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == stack.model
    for i, (d, prompt_ids) in enumerate(zip(out.data, ids)):
        assert len(d.embedding) == 64
        _assert_close(d.embedding, hf_pooled(stack.grpc.model, prompt_ids, MEAN_NORMALIZED), 1e-5, f"input[{i}]")
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    text = stack.openai.embeddings.create(model=stack.model, input="The little dog")
    _assert_close(text.data[0].embedding, hf_pooled(stack.grpc.model, tok.encode("The little dog").ids,
                                                    MEAN_NORMALIZED), 1e-5, "a text")


def test_float_format_and_dimensions_truncate_and_renormalise(stack, tok):
    ids = tok.encode(PROMPT).ids
    want = hf_pooled(stack.grpc.model, ids, MEAN_NORMALIZED)
    status, body = _post(stack, "/v1/embeddings", {"input": PROMPT, "encoding_format": "float", "user": "u"})
    assert status == 200, body
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert all(isinstance(v, float) for v in body["data"][0]["embedding"])
    _assert_close(body["data"][0]["embedding"], want, 1e-5, "float format")
    assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}

    status, body = _post(stack, "/v1/embeddings", {"input": [ids], "dimensions": 16, "encoding_format": "base64"})
    assert status == 200, body
    vector = struct.unpack("<16f", base64.b64decode(body["data"][0]["embedding"]))
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-5), "truncated but not renormalised"
    _assert_close(vector, torch.nn.functional.normalize(want[:16], dim=-1), 1e-5, "dimensions=16")


def test_embeddings_beside_a_long_generation_equal_hf(stack, tok):
    """Embed rows are prefill-only rows in the same steps as a decoding
    one: the vectors stay HF's, and the generation runs on."""
    stream = stack.openai.completions.create(model=stack.model, prompt=PROMPT, max_tokens=440, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # decoding has started
        texts = ["Lily and Tom went to the park. They", "Sam had a red ball.", "Mom said"]
        out = stack.openai.embeddings.create(model=stack.model, input=texts, encoding_format="float")
        assert stack.grpc.info().num_running >= 1, "the generation ended before the embeddings: nothing overlapped"
        for text, d in zip(texts, out.data):
            _assert_close(d.embedding, hf_pooled(stack.grpc.model, tok.encode(text).ids, MEAN_NORMALIZED), 1e-5, text)
    finally:
        stream.close()
    stack.grpc.assert_no_leaked_blocks()


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [[1, 2], [1, 9999]]}, "input[1]"),  # outside the vocabulary: the scheduler's refusal
    ({"input": [1, "a"]}, "input"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": "a", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "a", "dimensions": 65}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "normalize": False}, "normalize"),
    ({"input": "a", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v)
def test_bad_embedding_requests_are_refused_naming_the_field(stack, body, param):
    status, got = _post(stack, "/v1/embeddings", {"model": stack.model, **body})
    assert status == 400 and got["error"]["param"] == param, got
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]


def test_embeddings_for_another_model_are_404(stack):
    status, got = _post(stack, "/v1/embeddings", {"model": "text-embedding-3-small", "input": "a"})
    assert status == 404 and got["error"]["code"] == "model_not_found"


# --- echo and prompt logprobs on /v1/completions ---------------------------------

def _top(log_softmax_row: torch.Tensor, k: int) -> list[float]:
    return log_softmax_row.topk(k).values.tolist()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_equals_hf_log_softmax_of_each_prompt_token(stack, tok, max_tokens):
    """lm-eval's log-likelihood request: the prompt's tokens come first,
    the first with null logprob and alternatives, each other one its HF
    log_softmax given those before it; max_tokens 0 generates nothing."""
    ids = tok.encode(PROMPT).ids
    logp = hf_log_softmax(stack.grpc.model, ids)  # [n, vocab]
    out = stack.openai.completions.create(model=stack.model, prompt=PROMPT, echo=True, logprobs=3,
                                          max_tokens=max_tokens, temperature=0)
    choice, lp = out.choices[0], out.choices[0].logprobs
    generated = hf_greedy(stack.grpc.model, ids, 1)[:max_tokens]
    n = len(ids)
    assert len(lp.tokens) == n + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    _assert_close(lp.token_logprobs[1:n], logp[torch.arange(n - 1), torch.tensor(ids[1:])], 1e-4, "prompt logprobs")
    for i in range(1, n):
        _assert_close(sorted(lp.top_logprobs[i].values(), reverse=True), torch.tensor(_top(logp[i - 1], 3)), 1e-4,
                      f"top alternatives at {i}")
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"
    else:
        assert choice.text == PROMPT + tok.decode(ids + generated)[len(tok.decode(ids)):]
        _assert_close(lp.token_logprobs[n:], logp[-1, generated], 1e-4, "the generated token")
        # Offsets add up token texts, as vLLM's (the BOS `<s>` included).
        assert lp.text_offset[n] == lp.text_offset[n - 1] + len(lp.tokens[n - 1])


def test_echo_of_token_ids_spells_the_prompt_and_streams_it_first(stack, tok):
    ids = tok.encode("The little dog").ids
    kwargs = {"model": stack.model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0}
    full = stack.openai.completions.create(**kwargs).choices[0]
    assert full.text.startswith(tok.decode(ids, skip_special_tokens=False)), "token ids echoed as vLLM decodes them"
    chunks = [c.choices[0] for c in stack.openai.completions.create(stream=True, **kwargs)]
    assert chunks[0].text.startswith(tok.decode(ids, skip_special_tokens=False))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.logprobs.tokens] == full.logprobs.tokens
    assert [x for c in chunks for x in c.logprobs.token_logprobs] == full.logprobs.token_logprobs
    assert [x for c in chunks for x in c.logprobs.text_offset] == full.logprobs.text_offset
    assert len(chunks[0].logprobs.tokens) >= len(ids), "the prompt's logprobs ride on the first chunk"

    plain = stack.openai.completions.create(model=stack.model, prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_extra_on_completions_and_chat(stack, tok):
    """Each prompt token after the first: {id: {logprob, rank,
    decoded_token}} with its top alternatives, ranked 1..k; the prompt
    token's rank only when it is among them. Completions carry them per
    choice, chat on the response (as vLLM)."""
    ids = tok.encode(PROMPT).ids
    status, body = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, body
    _assert_vllm_prompt_logprobs(body["choices"][0]["prompt_logprobs"], ids, hf_log_softmax(stack.grpc.model, ids), 2)

    messages = [{"role": "user", "content": "Tell me a story."}]
    chat_ids = _post(stack, "/tokenize", {"messages": messages})[1]["tokens"]
    status, body = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 3})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(chat_ids) and "prompt_logprobs" not in body["choices"][0]
    _assert_vllm_prompt_logprobs(body["prompt_logprobs"], chat_ids, hf_log_softmax(stack.grpc.model, chat_ids), 3)

    status, body = _post(stack, "/v1/chat/completions", {"messages": messages, "stream": True, "prompt_logprobs": 1})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


def _assert_vllm_prompt_logprobs(got: list, ids: list[int], logp: torch.Tensor, k: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for i, entry in enumerate(got[1:], start=1):
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - logp[i - 1, ids[i]].item()) < 1e-4, f"prompt token {i}"
        top = logp[i - 1].topk(k)
        alternatives = {int(t): e for t, e in entry.items() if e["rank"] is not None}
        assert sorted(alternatives) == sorted(top.indices.tolist()), f"top {k} at {i}"
        assert sorted(e["rank"] for e in alternatives.values()) == list(range(1, k + 1))
        assert own["rank"] == (top.indices.tolist().index(ids[i]) + 1 if ids[i] in top.indices.tolist() else None)
        assert isinstance(own["decoded_token"], str)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 10_000}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 10_000}, "logprobs"),
    ({"prompt": [1, 9999], "echo": True}, "prompt"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v)
def test_bad_echo_and_prompt_logprobs_requests_are_refused_naming_the_field(stack, body, param):
    status, got = _post(stack, "/v1/completions", {"prompt": "Hi", **body})
    assert status == 400 and got["error"]["param"] == param, got
    stack.grpc.assert_no_leaked_blocks()


# --- /detokenize ---------------------------------------------------------------

def test_detokenize_round_trips_tokenize(stack, tok):
    status, got = _post(stack, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200
    assert _post(stack, "/detokenize", {"tokens": got["tokens"]}) == (200, {"prompt": PROMPT})
    ids = _post(stack, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    # Special tokens spelled out, as vLLM's /detokenize.
    assert _post(stack, "/detokenize", {"model": stack.model, "tokens": ids})[1] == {
        "prompt": tok.decode(ids, skip_special_tokens=False)}
    status, bad = _post(stack, "/detokenize", {"tokens": [1, 9999]})
    assert status == 400 and bad["error"]["param"] == "tokens", bad
    status, bad = _post(stack, "/detokenize", {"tokens": [1], "skip_special_tokens": True})
    assert status == 400 and bad["error"]["param"] == "skip_special_tokens", bad
