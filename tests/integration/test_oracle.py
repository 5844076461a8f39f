"""Greedy output through both services equals HF transformers' greedy
output on the same weights, token for token, alone and under load."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from executor_svc.model.checkpoint import load_checkpoint
from tests.integration.conftest import assert_32_concurrent_mixed_requests_match_hf, start_services
from tests.integration.test_observability import metric, scrape
from tests.oracle import STORY_PROMPTS, hf_greedy

PROMPTS = STORY_PROMPTS


@pytest.fixture(params=["stories", "tiny"])
def client(request):
    return request.getfixturevalue(request.param)


def encode(client, text):
    return Tokenizer.from_str(load_checkpoint(client.model).tokenizer_json).encode(text).ids


def test_readme_prompt_matches_hf_greedy(stories):
    tokens, text, last, _ = stories.generate(prompt="Once upon a time", sampling={"max_tokens": 40, "temperature": 0})
    assert encode(stories, "Once upon a time") == [1, 403, 407, 261, 378]
    assert tokens == hf_greedy(stories.model, [1, 403, 407, 261, 378], 40)
    assert text.startswith(", there was a little girl named Lily.")
    assert last.usage.prompt_tokens == 5 and last.usage.completion_tokens == len(tokens)
    stories.assert_no_leaked_blocks()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_matches_hf_greedy(client, prompt):
    tokens, _, last, _ = client.generate(prompt=prompt, sampling={"max_tokens": 40, "temperature": 0})
    want = hf_greedy(client.model, encode(client, prompt), 40)
    assert tokens == want
    assert last.finish_reason in (1, 2)
    client.assert_no_leaked_blocks()


def test_32_concurrent_mixed_requests_each_match_their_solo_hf_output(client):
    assert_32_concurrent_mixed_requests_match_hf(client, encode(client, " ".join(PROMPTS)))


@pytest.mark.slow  # the executor compiles its decode step at start-up
def test_compiled_cpu_decode_steps_match_hf_greedy_alone_and_32_concurrent(stories_path):
    services, client = start_services(str(stories_path), executor_env={"EXECUTOR_TORCH_COMPILE": "on"})
    try:
        tokens, _, _, _ = client.generate(prompt="Once upon a time", sampling={"max_tokens": 40, "temperature": 0})
        assert tokens == hf_greedy(client.model, [1, 403, 407, 261, 378], 40)
        assert_32_concurrent_mixed_requests_match_hf(client, encode(client, " ".join(PROMPTS)))
        compiled = metric(scrape(services.executor_metrics_port), "llmsched_executor_compiled_decode_steps_total")
        assert compiled >= 39, f"only {compiled} decode steps ran compiled"
    finally:
        client.channel.close()
        services.stop()
