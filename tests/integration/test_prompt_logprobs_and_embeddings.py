"""Prompt logprobs and embeddings through the scheduler's gRPC API, against
HF transformers on the same weights (issue 35, parts 5 and 6): computed in
chunked prefill, untouched by the prefix cache, batched with generation,
and refused by name where they cannot be served. The OpenAI shapes
(/v1/embeddings, echo) are tested with the gateway."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from executor_svc.model.pooling import Pooling
from llmsched.v1 import scheduler_pb2 as spb
from tests.embeddings import hf_pooled, hf_prompt_logprobs
from tests.oracle import STORY_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow
# 35 tokens: three chunks of 16 on the embedder stack.
LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her dog."
MEAN = Pooling("mean", normalize=True)


def tokenize(client, prompt: str) -> list[int]:
    return list(client.stub.Tokenize(spb.TokenizeRequest(prompt=prompt), timeout=10).token_ids)


def prompt_logprobs(client, top: int, **fields) -> tuple[list[spb.TokenLogprobs], spb.GenerateResponse, list[int]]:
    tokens, last, entries = [], None, []
    req = spb.GenerateRequest(sampling=spb.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=top), **fields)
    for resp in client.stub.Generate(req, timeout=60):
        entries += resp.prompt_logprobs
        tokens += resp.token_ids
        last = resp
    return entries, last, tokens


def assert_equal_to_hf(model: str, ids: list[int], entries: list[spb.TokenLogprobs], top: int) -> None:
    assert [e.token_id for e in entries] == ids, "one entry per prompt token, in order"
    assert math.isnan(entries[0].logprob) and not entries[0].top_token_ids, "the first token has no logprob"
    want = hf_prompt_logprobs(model, ids)
    got = torch.tensor([e.logprob for e in entries[1:]])
    assert (got - want).abs().max().item() < 1e-4
    assert all(len(e.top_token_ids) == len(e.top_logprobs) == len(e.top_tokens) == top for e in entries[1:])


@pytest.mark.parametrize("top", [0, 2])
def test_prompt_logprobs_over_chunked_prefill_equal_hf_and_the_output_is_unchanged(embedder, top):
    client = embedder.grpc
    ids = tokenize(client, LONG)
    entries, last, tokens = prompt_logprobs(client, top, prompt=LONG)
    assert_equal_to_hf(client.model, ids, entries, top)
    assert tokens == hf_greedy(client.model, ids, 3)
    assert entries[1].token == " Once" or entries[1].token.strip(), "entries carry the token's text"
    client.assert_no_leaked_blocks()


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(embedder):
    client = embedder.grpc
    prompt = LONG + " One day"
    ids = tokenize(client, prompt)
    client.generate(prompt=prompt, sampling={"max_tokens": 2, "temperature": 0})
    again = client.generate(prompt=prompt, sampling={"max_tokens": 2, "temperature": 0})[2]
    assert again.usage.cached_prompt_tokens == 32, "the prefix is cached"
    entries, last, _ = prompt_logprobs(client, 1, prompt=prompt)
    assert last.usage.cached_prompt_tokens == 0, "a prompt-logprobs request takes nothing from the prefix cache"
    assert_equal_to_hf(client.model, ids, entries, 1)


def test_embeddings_equal_hf_mean_pooled_hidden_states_alone_batched_and_beside_generation(embedder):
    client = embedder.grpc
    assert client.info().pooling == "mean+normalize"
    prompts = [LONG, *STORY_PROMPTS[:5]]

    def embed(prompt):
        return client.stub.Embed(spb.EmbedRequest(prompt=prompt), timeout=60)

    alone = embed(LONG)
    ids = tokenize(client, LONG)
    assert alone.usage.prompt_tokens == len(ids) and alone.usage.completion_tokens == 0
    assert (torch.tensor(list(alone.embedding)) - hf_pooled(client.model, ids, MEAN)).abs().max() < 1e-5
    # A long generation in flight, and every embedding at once beside it.
    with ThreadPoolExecutor(8) as pool:
        generating = pool.submit(client.generate, prompt_token_ids=ids, sampling={"max_tokens": 60,
                                                                                  "temperature": 0})
        batch = list(pool.map(embed, prompts * 2))
        generated = generating.result()[0]
    for prompt, got in zip(prompts * 2, batch):
        want = hf_pooled(client.model, tokenize(client, prompt), MEAN)
        assert (torch.tensor(list(got.embedding)) - want).abs().max() < 1e-5, f"embedding of {prompt!r}"
    assert generated == hf_greedy(client.model, ids, 60)
    client.assert_no_leaked_blocks()


def test_dimensions_truncates_and_renormalises_the_embedding(embedder):
    client = embedder.grpc
    full = list(client.stub.Embed(spb.EmbedRequest(prompt="Mom said"), timeout=60).embedding)
    short = list(client.stub.Embed(spb.EmbedRequest(prompt="Mom said", dimensions=16), timeout=60).embedding)
    head = torch.tensor(full[:16])
    assert len(full) == 64 and len(short) == 16
    assert (torch.tensor(short) - head / head.norm()).abs().max() < 1e-6
    assert abs(torch.tensor(short).norm().item() - 1) < 1e-6


@pytest.mark.parametrize("fields, field", [
    ({"prompt": "Hi", "dimensions": 0}, "dimensions"), ({"prompt": "Hi", "dimensions": 65}, "dimensions"),
    ({}, "prompt"), ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids[1]"),
], ids=["zero-dimensions", "more-dimensions-than-hidden", "no-prompt", "token-outside-vocabulary"])
def test_a_bad_embed_request_is_refused_naming_the_field(embedder, fields, field):
    with pytest.raises(grpc.RpcError) as exc:
        embedder.grpc.stub.Embed(spb.EmbedRequest(**fields), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith(f"{field}:")


def test_a_model_without_a_pooling_config_refuses_embeddings_saying_why(stories):
    assert stories.info().pooling == ""
    with pytest.raises(grpc.RpcError) as exc:
        stories.stub.Embed(spb.EmbedRequest(prompt="Hi"), timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pooling config" in exc.value.details()


def test_more_prompt_logprobs_than_the_executor_returns_are_refused(stories):
    with pytest.raises(grpc.RpcError) as exc:
        stories.generate(prompt="Hi", sampling={"prompt_logprobs": 10**6})
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("sampling.prompt_logprobs:")


def test_detokenize_spells_out_special_tokens_unless_asked_not_to(stories):
    ids = tokenize(stories, "Once upon a time")
    assert ids[0] == 1
    text = stories.stub.Detokenize(spb.DetokenizeRequest(token_ids=ids), timeout=10).text
    assert text == "<s> Once upon a time"
    assert stories.stub.Detokenize(spb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True),
                                   timeout=10).text == "Once upon a time"
    with pytest.raises(grpc.RpcError) as exc:
        stories.stub.Detokenize(spb.DetokenizeRequest(token_ids=[10**6]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("token_ids[0]:")


def test_a_checkpoint_without_its_head_embeds_and_refuses_to_generate(stories_path, tmp_path):
    """Qwen3-Embedding-8B's layout (flat keys, untied, no lm_head.weight)."""
    from tests.embeddings import headless_checkpoint
    from tests.integration.conftest import start_services

    services, client = start_services(str(headless_checkpoint(stories_path, tmp_path / "headless")))
    try:
        assert client.info().embedding_only and client.info().pooling == "mean+normalize"
        got = client.stub.Embed(spb.EmbedRequest(prompt=LONG), timeout=60).embedding
        want = hf_pooled(str(stories_path), tokenize(client, LONG), MEAN)
        assert (torch.tensor(list(got)) - want).abs().max() < 1e-5
        with pytest.raises(grpc.RpcError) as exc:
            client.generate(prompt="Hi")
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "embeddings only" in exc.value.details()
    finally:
        client.channel.close()
        services.stop()
