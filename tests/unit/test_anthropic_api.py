"""The Messages API's translation, without a server: requests into chat
requests, chat output into Anthropic's blocks, stop reasons, usage and
stream events."""

from __future__ import annotations

import json

import pytest

from gateway_svc import anthropic_api as a
from gateway_svc.chat_output import ChatDelta
from gateway_svc.protocol import RequestError
from gateway_svc.tool_parsers import ToolCall


def _request(**overrides) -> a.MessagesRequest:
    return a.MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "hi"}], **overrides})


def test_history_blocks_become_chat_messages_in_order():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}, "caller": None}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "boom"}],
             "is_error": True},
            {"type": "text", "text": "go on"}]},
    ]
    got = [m.for_template(i) for i, m in enumerate(a.chat_messages([{"type": "text", "text": "sys"}], history))]
    assert [(m["role"], m["content"]) for m in got] == [
        ("system", "sys"), ("user", "a\nb"), ("assistant", "calling"), ("tool", "Error: boom"), ("user", "go on")]
    assert got[2]["reasoning_content"] == "hmm"
    assert got[2]["tool_calls"] == [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert got[3]["tool_call_id"] == "t1"


@pytest.mark.parametrize("content, param, named", [
    ([{"type": "image", "source": {}}], "messages[0].content[0].type", "'image'"),
    ([{"type": "document", "source": {}}], "messages[0].content[0].type", "'document'"),
    ([{"type": "thinking", "thinking": "x"}], "messages[0].content[0].type", "'thinking'"),  # not in a user turn
    ([{"type": "text", "text": "x", "foo": 1}], "messages[0].content[0].foo", "foo"),
    ([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}],
     "messages[0].content[0].content[0].type", "'image'"),
])
def test_unsupported_blocks_are_refused_by_name(content, param, named):
    with pytest.raises(RequestError) as exc:
        a.chat_messages(None, [{"role": "user", "content": content}])
    assert exc.value.param == param and named in exc.value.message


def test_redacted_thinking_and_system_role_are_refused():
    with pytest.raises(RequestError, match="redacted_thinking"):
        a.chat_messages(None, [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}])
    with pytest.raises(RequestError, match="top-level `system`"):
        a.chat_messages(None, [{"role": "system", "content": "x"}])


def test_tools_and_tool_choice_map_to_functions():
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}, "cache_control": None}]
    assert a.function_tools(tools) == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                         "description": "d"}}]
    with pytest.raises(RequestError, match="web_search_20250305"):
        a.function_tools([{"type": "web_search_20250305", "name": "web_search"}])
    assert a.openai_tool_choice(None) == (None, None)
    assert a.openai_tool_choice(a.ToolChoice(type="any", disable_parallel_tool_use=True)) == ("required", False)
    assert a.openai_tool_choice(a.ToolChoice(type="auto")) == ("auto", None)
    assert a.openai_tool_choice(a.ToolChoice(type="none")) == ("none", None)
    assert a.openai_tool_choice(a.ToolChoice(type="tool", name="f")) == (
        {"type": "function", "function": {"name": "f"}}, None)
    with pytest.raises(RequestError, match="tool_choice.name"):
        a.openai_tool_choice(a.ToolChoice(type="tool"))


def test_sampling_fields_reach_the_chat_request_and_unknown_ones_are_refused():
    chat = a.chat_request(_request(stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=5,
                                   metadata={"user_id": "u"}, stream=True))
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.user, chat.stream) == (
        8, ["END"], 0.5, 0.9, 5, "u", True)
    with pytest.raises(RequestError, match="container"):
        a.chat_request(_request(container="c"))
    with pytest.raises(RequestError, match="budget_tokens"):
        a.chat_request(_request(thinking={"type": "enabled", "budget_tokens": 8}))


def test_thinking_maps_to_enable_thinking_where_it_can():
    on, off = a.Thinking(type="enabled", budget_tokens=1024), a.Thinking(type="disabled")
    assert a.template_kwargs(None, "qwen3", frozenset()) == {}
    assert a.template_kwargs(on, "qwen3", frozenset()) == {"enable_thinking": True}
    assert a.template_kwargs(off, "qwen3", frozenset({"enable_thinking"})) == {"enable_thinking": False}
    assert a.template_kwargs(off, "", frozenset()) == {"enable_thinking": False}  # never thinks anyway
    with pytest.raises(RequestError, match="GATEWAY_REASONING_PARSER"):
        a.template_kwargs(on, "", frozenset())
    with pytest.raises(RequestError, match="enable_thinking"):
        a.template_kwargs(off, "deepseek_r1", frozenset())


def test_stop_reasons_and_usage():
    assert a.stop_reason("stop", "") == ("end_turn", None)
    assert a.stop_reason("stop", "END") == ("stop_sequence", "END")
    assert a.stop_reason("length", "") == ("max_tokens", None)
    assert a.stop_reason("tool_calls", "") == ("tool_use", None)
    with pytest.raises(RequestError):
        a.stop_reason("abort", "")
    counts = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    assert a.usage_of(counts) == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4,
                                  "cache_creation_input_tokens": 0}


def test_a_chat_completion_becomes_a_message():
    chat = {"model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {
        "cached_tokens": 0}}, "choices": [{"finish_reason": "tool_calls", "message": {
            "content": "ok", "reasoning_content": "think",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}}]}
    msg = a.message_of(chat, "", "msg_1")
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][2]["input"] == {"x": 1} and msg["content"][2]["id"].startswith("toolu_")
    assert (msg["id"], msg["stop_reason"], msg["usage"]["input_tokens"]) == ("msg_1", "tool_use", 5)


def _events(chunks: list[str]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        name, data = chunk.strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_event_writer_opens_one_block_per_kind_and_closes_it():
    w = a.EventWriter()
    chunks = w.feed(ChatDelta(reasoning="r")) + w.feed(ChatDelta(reasoning="s", content="t"))
    chunks += w.feed(ChatDelta(calls=[ToolCall("f", '{"x": 1}')])) + w.close()
    events = _events(chunks)
    assert [(n, d.get("index")) for n, d in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2)]
    assert [d["delta"] for n, d in events if n == "content_block_delta"] == [
        {"type": "thinking_delta", "thinking": "r"}, {"type": "thinking_delta", "thinking": "s"},
        {"type": "text_delta", "text": "t"}, {"type": "input_json_delta", "partial_json": '{"x": 1}'}]
    assert events[7][1]["content_block"]["name"] == "f" and all(d["type"] == n for n, d in events)


def test_errors_take_anthropics_shape():
    assert a.error_body(400, "m") == {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}
    assert a.error_body(503, "m")["error"]["type"] == "overloaded_error"
    assert a.error_body(500, "m")["error"]["type"] == "api_error"
    resp = a.error_response(RequestError(None, "slow down", status=429, retry_after_s=2))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
