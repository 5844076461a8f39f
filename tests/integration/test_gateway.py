"""The OpenAI-compatible gateway through the official `openai` client, in
front of real executor and scheduler processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from tokenizers import Tokenizer

from llmsched.launch import launch
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from tests.chat_templates import LLAMA3_STYLE
from tests.integration.conftest import Client
from tests.oracle import hf_greedy

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, there was a little dog named Max. He liked to"


def continuation(tok: Tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """Text of new_ids as it reads after the prompt (SentencePiece decodes a
    leading space only mid-text)."""
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    return tok.decode(prompt_ids + new_ids, skip_special_tokens=True)[len(before):]


def _deploy(model: str, executor_env=None, scheduler_env=None):
    services = launch(
        executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_NUM_THREADS": "1", **(executor_env or {})},
        scheduler_env=scheduler_env, with_gateway=True,
    ).start()
    channel = grpc.insecure_channel(services.scheduler_address)
    return services, Client(services.scheduler_address, model, channel, spb_grpc.SchedulerStub(channel))


@pytest.fixture(scope="module")
def chat_model(stories_path, tmp_path_factory):
    """stories260K with a Llama-3-style chat template (which writes its own
    BOS), laid out as a checkpoint of links to the shared files."""
    d = tmp_path_factory.mktemp("stories-chat")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(stories_path / name, d / name)
    config = json.loads((stories_path / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_STYLE}))
    return d


@pytest.fixture(scope="module")
def gw(chat_model):
    services, grpc_client = _deploy(str(chat_model))
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    yield services, grpc_client, client, model
    client.close()
    grpc_client.channel.close()
    services.stop()


def test_models_lists_the_served_model(gw, chat_model):
    _, _, client, model = gw
    assert model == chat_model.name


def test_greedy_completion_equals_the_hf_oracle(gw, chat_model):
    _, _, client, model = gw
    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    prompt_ids = tok.encode(PROMPT).ids  # with BOS, as a text prompt is sent
    expected = hf_greedy(str(chat_model), prompt_ids, 30)
    for prompt in (PROMPT, prompt_ids):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0)
        assert out.usage.prompt_tokens == len(prompt_ids)
        assert out.usage.completion_tokens == len(expected)
        assert out.choices[0].text == continuation(tok, prompt_ids, expected), f"prompt as {type(prompt)}"


def test_streamed_text_concatenates_to_the_non_streamed_text(gw):
    _, _, client, model = gw
    kwargs = {"model": model, "max_tokens": 40, "temperature": 0}
    full = client.completions.create(prompt=PROMPT, **kwargs)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(messages=messages, **kwargs)
    stream = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"


def test_chat_prompt_tokens_equal_transformers_apply_chat_template(gw, chat_model):
    from transformers import AutoTokenizer

    _, _, client, model = gw
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A cat."}]
    hf_ids = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert hf_ids.count(1) == 1, "the template writes the only BOS"
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    # Same count, and the same greedy continuation as HF fed exactly those ids.
    assert out.usage.prompt_tokens == len(hf_ids), "a second BOS or a different tokenization"
    expected = hf_greedy(str(chat_model), hf_ids, 20)
    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    assert out.choices[0].message.content == continuation(tok, hf_ids, expected)


def test_scheduler_add_special_tokens_false_adds_no_bos(gw, chat_model):
    _, grpc_client, _, _ = gw
    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    greedy = {"max_tokens": 8, "temperature": 0}
    with_bos = grpc_client.generate(prompt=PROMPT, sampling=greedy)[2].usage.prompt_tokens
    tokens, _, last, _ = grpc_client.generate(prompt=PROMPT, add_special_tokens=False, sampling=greedy)
    assert with_bos == len(tok.encode(PROMPT).ids) and last.usage.prompt_tokens == with_bos - 1
    assert tokens == hf_greedy(str(chat_model), tok.encode(PROMPT, add_special_tokens=False).ids, 8)


def test_usage_reports_cached_prompt_tokens(gw):
    _, _, client, model = gw
    prompt = PROMPT + " play in the park with his friends every single day after school."
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens >= 32, "the prompt must fill two 16-token blocks"
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens


def test_stop_string_ends_the_text_before_it(gw):
    _, _, client, model = gw
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[10:14]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_n_with_seed_is_reproducible_and_sample_i_uses_seed_plus_i(gw):
    _, _, client, model = gw
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0}
    a = client.completions.create(n=3, seed=7, **kwargs)
    b = client.completions.create(n=3, seed=7, **kwargs)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)], "same seed, same samples"
    assert len(set(texts)) > 1, "the n samples must differ"
    # As vLLM: sample i is sampled with seed + i.
    assert client.completions.create(n=1, seed=9, **kwargs).choices[0].text == texts[2]
    assert a.usage.completion_tokens == 60 and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_logprobs_for_completions_and_chat(gw):
    _, _, client, model = gw
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text, "token texts spell the completion"
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and value <= 0
        assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value), "greedy = top-1"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_penalties_logit_bias_and_min_tokens_over_both_endpoints(gw):
    _, _, client, model = gw
    greedy = dict(model=model, prompt="Once upon a time", max_tokens=40, temperature=0)
    plain = client.completions.create(**greedy).choices[0].text
    for penalty in ("frequency_penalty", "presence_penalty"):
        assert client.completions.create(**greedy, **{penalty: 2.0}).choices[0].text != plain, penalty
    assert client.completions.create(**greedy, extra_body={"repetition_penalty": 1.3}).choices[0].text != plain
    chat = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.9, seed=1)
    forced = client.chat.completions.create(**chat, logit_bias={"42": 100})
    assert forced.choices[0].message.content == "'" * 4
    # EOS (id 2) forced, yet held back for min_tokens tokens.
    held = client.chat.completions.create(**{**chat, "max_tokens": 10}, logit_bias={"2": 100},
                                          extra_body={"min_tokens": 3, "min_p": 0.1})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"


def test_max_tokens_bounds_the_completion(gw):
    _, _, client, model = gw
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                         max_completion_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, param", [
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"min_tokens": 3}}, "min_tokens"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"guided_decoding_backend": "xgrammar"}}, "guided_decoding_backend"),
    ({"extra_body": {"guided_json": {"type": "objectx"}}}, "guided_json"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),  # offered only with echo
    ({"n": 1000}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 10_000}, "logprobs"),
    ({"model": "gpt-4"}, "model"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_or_bad_fields_are_refused_by_name(gw, kwargs, param):
    _, grpc_client, client, model = gw
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**{"model": model, "prompt": "Hi", "max_tokens": 2, **kwargs})
    assert exc.value.status_code == (404 if param == "model" else 400), exc.value.body
    assert exc.value.body["param"] == param and exc.value.body["message"], exc.value.body
    grpc_client.assert_no_leaked_blocks()


def test_chat_refuses_tools_its_template_cannot_render_and_images_by_name(gw):
    _, _, client, model = gw
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], tools=[tool])
    assert exc.value.body["param"] == "tools" and "never reads `tools`" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert exc.value.body["param"] == "messages[0].content[1].type"


def test_router_style_defaults_are_accepted(gw):
    """sglang-router rebuilds requests with SGLang's fields at their
    defaults; those values change nothing and pass."""
    _, _, client, model = gw
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                         extra_body={"continue_final_message": False, "skip_special_tokens": True,
                                                     "separate_reasoning": True, "stream_reasoning": True,
                                                     "no_stop_trim": False, "return_hidden_states": False})
    assert out.usage.completion_tokens >= 1


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one plain HTTP call, errors included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_chat_template_controls_match_transformers_apply_chat_template(gw, chat_model):
    """chat_template_kwargs reach the template, add_generation_prompt=false
    leaves the assistant's turn unopened, and continue_final_message
    continues the last assistant message, each as transformers renders it
    (counted through /tokenize and by a chat request's usage)."""
    from transformers import AutoTokenizer

    services, _, client, model = gw
    hf = AutoTokenizer.from_pretrained(chat_model)
    messages = [{"role": "user", "content": "A cat."}, {"role": "assistant", "content": "Once upon a"}]
    for kwargs in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        status, got = _http("POST", f"{services.gateway_url}/tokenize", {"model": model, "messages": messages, **kwargs})
        if not kwargs.get("continue_final_message"):
            assert status == 200 and got["tokens"] == want, got
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                             extra_body=kwargs | {"chat_template_kwargs": {"unused_flag": True}})
        assert out.usage.prompt_tokens == len(want), kwargs
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert exc.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert exc.value.body["param"] == "chat_template_kwargs"
    out = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2, store=False)
    assert out.usage.completion_tokens >= 1


def test_small_endpoints_and_unknown_routes_answer_in_openais_shape(gw, chat_model):
    services, _, client, model = gw
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4")
    assert exc.value.body["code"] == "model_not_found"
    assert _http("GET", f"{services.gateway_url}/version")[1]["version"]
    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    _, got = _http("POST", f"{services.gateway_url}/tokenize", {"prompt": PROMPT})
    assert got["tokens"] == tok.encode(PROMPT).ids and got["count"] == len(got["tokens"]) and got["max_model_len"]
    status, missing = _http("GET", f"{services.gateway_url}/v1/nothing")
    assert status == 404 and missing["error"]["message"] == "no route GET /v1/nothing"
    status, wrong = _http("GET", f"{services.gateway_url}/v1/chat/completions")
    assert status == 405 and wrong["error"]["type"] == "invalid_request_error"


def test_embeddings_of_a_model_without_a_pooling_config_are_refused_with_the_reason(gw, chat_model):
    """The scheduler's FAILED_PRECONDITION, as a 400 that says why."""
    services, grpc_client, client, model = gw
    assert not grpc_client.info().pooling
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=model, input=["a story", "another"])
    assert exc.value.body["code"] == "model_not_supported", exc.value.body
    assert "cannot serve embeddings" in exc.value.body["message"] and "modules.json" in exc.value.body["message"]
    grpc_client.assert_no_leaked_blocks()


def test_mid_stream_disconnect_frees_every_kv_block(gw):
    services, grpc_client, client, model = gw
    for kind in ("completions", "chat"):
        if kind == "chat":
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        else:
            stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, stream=True, n=2,
                                               extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert grpc_client.info().num_running >= 1, "the request must still be running when the client leaves"
        stream.close()
        grpc_client.assert_no_leaked_blocks()


def test_non_streamed_request_is_cancelled_when_the_client_times_out(gw):
    services, grpc_client, client, model = gw
    # 480 decode steps cannot finish in 0.1 s: each costs more than 0.2 ms
    # through the two gRPC hops alone.
    impatient = client.with_options(timeout=0.1)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=model, prompt=PROMPT, max_tokens=480, extra_body={"ignore_eos": True})
    grpc_client.assert_no_leaked_blocks()


def test_gateway_metrics_count_requests(gw):
    services, _, client, model = gw
    client.completions.create(model=model, prompt="Hi", max_tokens=2)
    with urllib.request.urlopen(services.gateway_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'llmsched_gateway_requests_total{code="200",endpoint="/v1/completions"}' in text
    assert 'llmsched_gateway_request_duration_seconds_count{endpoint="/v1/completions"}' in text


# ----- overload, API keys, no executor: a small deployment of its own -------

@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """One running request and one queued at most: a third is shed. JSON
    logs with both request logs on, written to the file `services.stdout`;
    the model is served under two names."""
    log = tmp_path_factory.mktemp("strict") / "services.log"
    json_logs = {"LOG_FORMAT": "json"}
    services = launch(
        executor_env={"EXECUTOR_MODEL": "tiny-random", "EXECUTOR_NUM_THREADS": "1", **json_logs},
        scheduler_env={"SCHEDULER_MAX_NUM_SEQS": "1", "SCHEDULER_MAX_QUEUED_REQUESTS": "1",
                       "SCHEDULER_API_KEYS": "sesame", "SCHEDULER_EXECUTOR_RECONNECT_TIMEOUT_S": "2",
                       "SCHEDULER_REQUEST_LOG": "on", **json_logs},
        gateway_env={"GATEWAY_REQUEST_LOG": "on", "GATEWAY_SERVED_MODEL_NAME": "tiny-random, org/tiny",
                     **json_logs},
        with_gateway=True)
    with open(log, "w") as out:
        services.stdout = out
        services.start()
        channel = grpc.insecure_channel(services.scheduler_address)
        yield services, Client(services.scheduler_address, "tiny-random", channel, spb_grpc.SchedulerStub(channel))
        channel.close()
        services.stop()


def request_lines(services, request_id: str, count: int, timeout_s: float = 10.0) -> list[dict]:
    """The request-log lines (both services) whose id is request_id or one
    of its calls' (`<id>-<i>`), once count of them are in the log."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in map(json.loads, Path(services.stdout.name).read_text().splitlines())
                 if line.get("logger") == "requests"
                 and (line["request_id"] == request_id or line["request_id"].startswith(f"{request_id}-"))]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_served_names_are_listed_and_each_is_served(strict):
    services, _ = strict
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-random", "org/tiny"]
    for name in ("tiny-random", "org/tiny"):
        # Greedy: sampled at the API's default temperature of 1, the random
        # model sometimes drew its end-of-sequence token first (a flaky
        # completion_tokens == 1).
        out = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2 and out.model == "tiny-random"  # responses carry the first name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)


def test_the_request_log_has_one_line_per_request_in_each_service_with_the_header_id(strict):
    services, _ = strict
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="sesame", max_retries=0)
    # Greedy: sampled at the API's default temperature of 1, the random
    # model sometimes drew its end-of-sequence token within 3 tokens.
    raw = client.chat.completions.with_raw_response.create(
        model="org/tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    chat, rid = raw.parse(), raw.headers["x-request-id"]
    assert chat.id == f"chatcmpl-{rid}"
    gateway, scheduler = sorted(request_lines(services, rid, 2), key=lambda line: line["service"])
    assert (gateway["service"], scheduler["service"]) == ("gateway", "scheduler")
    assert gateway["request_id"] == scheduler["request_id"] == rid
    assert gateway["route"] == "POST /v1/chat/completions" and scheduler["route"] == "Generate"
    assert (gateway["status"], scheduler["status"]) == (200, "OK")
    for line in (gateway, scheduler):
        assert line["tenant"].startswith("key-"), line  # a bare API key is a tenant of its own
        assert line["prompt_tokens"] == chat.usage.prompt_tokens and line["output_tokens"] == 3
        assert line["cached_tokens"] == 0 and line["finish_reason"] == "length" and line["latency_ms"] > 0
    # A client's own id is kept; a refusal by the scheduler (a token id
    # outside the vocabulary) is one line in each, with its reason.
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-random", prompt=[10**6], max_tokens=2,
                                  extra_headers={"X-Request-Id": "client-id-1"})
    assert exc.value.response.headers["x-request-id"] == "client-id-1"
    gateway, scheduler = sorted(request_lines(services, "client-id-1", 2), key=lambda line: line["service"])
    assert (gateway["status"], scheduler["status"]) == (400, "INVALID_ARGUMENT")
    assert gateway["reason"] == exc.value.body["message"] and "prompt" in scheduler["reason"]
    # Refused by the gateway itself: one line, there.
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=2, temperature=-1)
    [line] = request_lines(services, exc.value.response.headers["x-request-id"], 1)
    assert line["status"] == 400 and "temperature" in line["reason"]
    # Not an id the gateway can pass on: a fresh one instead.
    bad = urllib.request.Request(services.gateway_url + "/v1/models", headers={"X-Request-Id": "a b",
                                                                               "Authorization": "Bearer sesame"})
    with urllib.request.urlopen(bad) as resp:
        assert resp.headers["x-request-id"] not in ("", "a b")


def test_every_line_the_services_print_with_json_logs_is_json(strict):
    services, _ = strict
    lines = Path(services.stdout.name).read_text().splitlines()
    assert len(lines) > 10
    not_json = []
    for line in lines:
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            not_json.append(line)
    assert not not_json, f"lines that are not JSON objects: {not_json[:5]}"
    services_seen = {json.loads(line)["service"] for line in lines}
    assert services_seen == {"gateway", "scheduler", "executor"}


def test_api_key_is_forwarded_and_a_wrong_one_gets_401(strict):
    services, _ = strict
    good = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="sesame", max_retries=0)
    greedy = good.completions.create(model="tiny-random", prompt="Hi", max_tokens=2, temperature=0)  # no early EOS
    assert greedy.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model="tiny-random", prompt="Hi", max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_overload_gives_429_with_retry_after(strict):
    services, grpc_client = strict
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="sesame", max_retries=0)
    long = {"model": "tiny-random", "prompt": "Hi", "max_tokens": 1500, "stream": True,
            "extra_body": {"ignore_eos": True}}
    running = client.completions.create(**long)
    next(iter(running))
    # The queued one answers only once it starts, so it is sent from a thread.
    queued = threading.Thread(target=lambda: client.completions.create(**long).close(), daemon=True)
    queued.start()
    key = (("authorization", "Bearer sesame"),)
    deadline = time.monotonic() + 10
    while grpc_client.stub.GetServerInfo(spb.GetServerInfoRequest(), metadata=key).num_waiting < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)
    try:
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model="tiny-random", prompt="Hi", max_tokens=2)
    finally:
        running.close()
    assert exc.value.status_code == 429 and int(exc.value.response.headers["retry-after"]) >= 1
    assert exc.value.body["type"] == "rate_limit_error"
    gateway, scheduler = sorted(request_lines(services, exc.value.response.headers["x-request-id"], 2),
                                key=lambda line: line["service"])
    assert (gateway["status"], scheduler["status"]) == (429, "RESOURCE_EXHAUSTED")
    assert gateway["tenant"] == scheduler["tenant"] and gateway["tenant"].startswith("key-")
    assert "overloaded" in gateway["reason"] and "overloaded" in scheduler["reason"]
    # The stream the client closed: cancelled in the scheduler, cut short in the gateway.
    gateway, scheduler = sorted(request_lines(services, running.response.headers["x-request-id"], 2),
                                key=lambda line: line["service"])
    assert (gateway["status"], scheduler["status"]) == (200, "CANCELLED")
    assert gateway["finish_reason"] == scheduler["finish_reason"] == "abort"
    assert 0 < gateway["output_tokens"] <= scheduler["output_tokens"] < 1500  # what reached each before the close
    assert gateway["prompt_tokens"] is None  # the usage comes with the last response, which never came


def test_without_an_executor_requests_and_health_answer_503(strict):
    services, _ = strict
    client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="sesame", max_retries=0)
    services.executor.send_signal(signal.SIGKILL)
    services.executor.wait()
    # An idle scheduler learns of the loss at its next step: this request's.
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.body["type"] == "service_unavailable_error"
    deadline = time.monotonic() + 20
    status = 200
    while status == 200 and time.monotonic() < deadline:
        try:
            status = urllib.request.urlopen(services.gateway_url + "/health", timeout=5).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        time.sleep(0.1)
    assert status == 503, "health must follow the scheduler's"
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=2)
    assert exc.value.status_code == 503
