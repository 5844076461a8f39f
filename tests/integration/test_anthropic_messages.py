"""Anthropic's Messages API through the official `anthropic` client, in
front of real executor, scheduler and gateway processes on loopback:
stories260K under a short template that renders tools, tool calls, tool
results, kept thoughts and the `enable_thinking` switch (Qwen's templates
do not fit its 512 positions), behind an API key sent as x-api-key."""

from __future__ import annotations

import json
import os
import uuid

import anthropic
import jsonschema
import pytest

from llmsched.launch import launch

pytestmark = pytest.mark.slow

KEY = "sesame"
# Hermes calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>), as
# the gateway's default tool parser reads them.
TEMPLATE = """{{ bos_token }}
{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'tool' -%}<tool_response>{{ m.content }}</tool_response>
{% elif m.tool_calls is defined -%}
{{ m.role }}: {% if m.reasoning_content is defined %}({{ m.reasoning_content }}) {% endif %}
{%- for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}
{% else -%}{{ m.role }}: {{ m.content }}
{% endif -%}
{%- endfor -%}
{%- if enable_thinking is defined and not enable_thinking %}/no_think
{% endif -%}
{%- if add_generation_prompt %}assistant:{% endif -%}"""
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"name": "get_time", "description": "The time in a zone.", "input_schema": CLOCK}]
ASK = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def gw(stories_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("stories-messages")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(stories_path / name, d / name)
    config = json.loads((stories_path / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    services = launch(executor_env={"EXECUTOR_MODEL": str(d), "EXECUTOR_NUM_THREADS": "1"},
                      scheduler_env={"SCHEDULER_API_KEYS": KEY},
                      gateway_env={"GATEWAY_REASONING_PARSER": "qwen3"}, with_gateway=True).start()
    client = anthropic.Anthropic(base_url=services.gateway_url, api_key=KEY, max_retries=0, timeout=60)
    yield services, client, d.name
    client.close()
    services.stop()


# Recent SDKs take temperature, top_p and top_k only in the body.
GREEDY = {"extra_body": {"temperature": 0}}


def _create(gw, temperature: float = 0, **kwargs):
    _, client, model = gw
    return client.messages.create(**{"model": model, "max_tokens": 40, "messages": ASK,
                                     "extra_body": {"temperature": temperature}, **kwargs})


def test_create_parses_into_the_sdks_types(gw):
    out = _create(gw, system="You tell stories.", metadata={"user_id": "u-1"})
    assert isinstance(out, anthropic.types.Message)
    assert out.id.startswith("msg_") and out.role == "assistant" and out.model == gw[2]
    assert [b.type for b in out.content] == ["text"] and out.content[0].text
    assert out.stop_reason in ("end_turn", "max_tokens") and out.stop_sequence is None
    assert out.usage.input_tokens > 0 and 0 < out.usage.output_tokens <= 40
    assert out.usage.cache_creation_input_tokens == 0 and out.usage.cache_read_input_tokens is not None


def test_stream_events_add_up_to_the_created_message(gw):
    _, client, model = gw
    whole = _create(gw, max_tokens=30)
    with client.messages.stream(model=model, max_tokens=30, messages=ASK, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_count_tokens_equals_the_requests_input_tokens(gw):
    _, client, model = gw
    # A prompt no earlier request shared, so no token comes from the cache.
    messages = [{"role": "user", "content": f"Tom and {uuid.uuid4().hex[:8]} went to the park."}]
    kwargs = {"model": model, "messages": messages, "system": "Be kind.", "tools": TOOLS}
    counted = client.messages.count_tokens(**kwargs).input_tokens
    used = client.messages.create(max_tokens=5, **kwargs, **GREEDY).usage
    assert used.cache_read_input_tokens == 0 and counted == used.input_tokens
    # `thinking` off is the template's switch: it renders, and counts.
    off = client.messages.count_tokens(thinking={"type": "disabled"}, **kwargs).input_tokens
    assert off > counted


def test_tool_use_then_tool_result_round_trip_with_tool_choice_any(gw):
    out = _create(gw, max_tokens=200, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  temperature=1.0)
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert len(uses) == 1 and all(u.name == "get_time" and u.id.startswith("toolu_") for u in uses)
    for u in uses:
        jsonschema.validate(u.input, CLOCK)
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in out.content]},
               {"role": "user", "content": [
                   *({"type": "tool_result", "tool_use_id": u.id, "content": "12:00"} for u in uses),
                   {"type": "text", "text": "And then?"}]}]
    answer = _create(gw, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    # The streamed forced call is the same call.
    _, client, model = gw
    with client.messages.stream(model=model, max_tokens=200, messages=ASK, tools=TOOLS, **GREEDY,
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        final = stream.get_final_message()
    whole = _create(gw, max_tokens=200, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]


def test_stop_reasons_max_tokens_and_stop_sequence(gw):
    long = _create(gw, max_tokens=3)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 3
    text = _create(gw, max_tokens=30).content[0].text
    word = text.split()[2]
    stopped = _create(gw, max_tokens=30, stop_sequences=["zzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert "".join(b.text for b in stopped.content) == text[: text.index(word)]


def test_an_image_block_is_refused_by_name_in_anthropics_shape(gw):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        _create(gw, messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    assert exc.value.status_code == 400
    body = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "'image'" in body["error"]["message"] and "messages[0].content[0].type" in body["error"]["message"]


def test_api_key_as_x_api_key_or_bearer_and_a_wrong_one_gets_401(gw):
    services, _, model = gw
    bearer = anthropic.Anthropic(base_url=services.gateway_url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=model, messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=services.gateway_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model=model, max_tokens=5, messages=ASK)
    assert exc.value.body["error"]["type"] == "authentication_error"


def test_an_unknown_model_is_a_404_not_found_error(gw):
    with pytest.raises(anthropic.NotFoundError) as exc:
        _create(gw, model="claude-sonnet-4-5")
    assert exc.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in exc.value.body["error"]["message"]
