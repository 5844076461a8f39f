"""The Responses API's pure parts: the translation into a chat completion,
errors named by the Responses field, output items and stream events from
chat deltas, and the bounded store."""

from __future__ import annotations

import tracemalloc

import pytest

from gateway_svc.protocol import RequestError
from gateway_svc.response_store import ResponseStore, owner_of
from gateway_svc.responses_api import OutputBuilder, ResponsesRequest, responses_usage, to_chat, translate_error

ADD = {"type": "function", "name": "add", "description": "Adds.", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def make_request(**fields) -> ResponsesRequest:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    body.check_inert_fields()
    return body


def test_a_string_input_and_instructions_are_a_system_and_a_user_message():
    t = to_chat(make_request(instructions="Be brief.", max_output_tokens=7, temperature=0.5), [], frozenset())
    assert [(m.role, m.content) for m in t.chat.messages] == [("system", "Be brief."), ("user", "hi")]
    assert t.chat.max_completion_tokens == 7 and t.chat.temperature == 0.5 and t.warnings == []
    assert t.input_items == [{"type": "message", "role": "user", "content": "hi"}]


def test_items_become_messages_with_calls_joined_and_reasoning_dropped():
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]
    t = to_chat(make_request(input=items, tools=[ADD]), [], frozenset())
    roles = [m.role for m in t.chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert t.chat.messages[1].content == "a\nb"
    assistant = t.chat.messages[2]
    assert assistant.content == "Let me add." and [c.id for c in assistant.tool_calls] == ["c1", "c2"]
    assert [m.tool_call_id for m in t.chat.messages[3:]] == ["c1", "c2"] and t.chat.messages[4].content == "2"


def test_a_stored_conversation_comes_before_the_new_input():
    stored = [{"type": "message", "role": "user", "content": "first"},
              {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "answer", "annotations": [], "logprobs": []}]}]
    t = to_chat(make_request(input="second"), stored, frozenset())
    assert [m.content for m in t.chat.messages] == ["first", "answer", "second"]


def test_tools_in_the_flat_shape_and_tool_choice_by_name():
    t = to_chat(make_request(tools=[{"type": "web_search"}, ADD], tool_choice={"type": "function", "name": "add"},
                             parallel_tool_calls=False), [], frozenset())
    assert t.chat.tools[0].function.name == "add" and t.chat.tools[0].function.strict is True
    assert t.chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert t.chat.parallel_tool_calls is False and t.tool_index == [1] and t.tools == [ADD]
    assert len(t.warnings) == 1 and "tools[0]" in t.warnings[0] and "web_search" in t.warnings[0]


def test_text_format_becomes_response_format():
    schema = {"type": "object"}
    t = to_chat(make_request(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}),
                [], frozenset())
    assert t.chat.response_format.type == "json_schema" and t.chat.response_format.json_schema.schema_ == schema
    assert to_chat(make_request(text={"format": {"type": "json_object"}}), [], frozenset()).chat.response_format.type \
        == "json_object"
    assert to_chat(make_request(text={"format": {"type": "text"}}), [], frozenset()).chat.response_format is None


def test_reasoning_effort_goes_to_a_template_that_reads_it_else_a_warning():
    body = make_request(reasoning={"effort": "low"})
    assert to_chat(body, [], frozenset({"reasoning_effort"})).template_kwargs == {"reasoning_effort": "low"}
    t = to_chat(body, [], frozenset())
    assert t.template_kwargs == {} and "reasoning.effort" in t.warnings[0]


@pytest.mark.parametrize("fields, param", [
    ({"seed": 1}, "seed"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.input_image.image_url"]}, "include"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ({"tools": [{**ADD, "cache_control": {}}]}, "tools[0].cache_control"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": []}, "input"),
])
def test_refusals_name_the_responses_field(fields, param):
    with pytest.raises(RequestError) as err:
        to_chat(make_request(**fields), [], frozenset())
    assert err.value.param == param


def test_inert_values_sdks_send_are_accepted():
    make_request(include=["reasoning.encrypted_content"], truncation="disabled", prompt_cache_key="conv-1",
                 service_tier="auto", store=False, stream_options={"include_obfuscation": False},
                 text={"format": {"type": "text"}, "verbosity": "medium"}, reasoning={"effort": "high",
                                                                                      "summary": "auto"})


def test_chat_errors_are_renamed_to_the_responses_fields():
    def renamed(param, tool_index=(0,)):
        return translate_error(RequestError(param, f"{param}: bad"), list(tool_index))

    assert renamed("tools[0].function.parameters", (3,)).param == "tools[3].parameters"
    assert renamed("tools[0].function.parameters", (3,)).message == "tools[3].parameters: bad"
    assert renamed("tool_choice.function.name").param == "tool_choice.name"
    assert renamed("messages[2].tool_calls[0].function.arguments").param == "input"
    assert renamed("max_tokens").param == "max_output_tokens"
    assert renamed("response_format.json_schema.schema").param == "text.format.schema"
    assert renamed("stop").param == "stop"


def _deltas_of(builder, deltas):
    return [e for d in deltas for e in builder.feed(d)]


def test_output_items_and_events_from_chat_deltas():
    b = OutputBuilder()
    events = _deltas_of(b, [
        {"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "Hi"}, {"content": " there"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "add",
                                                                                     "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ]) + b.close("completed")
    reasoning, message, call = b.items
    assert reasoning["type"] == "reasoning" and reasoning["content"][0] == {"type": "reasoning_text", "text": "hmm"}
    assert message["content"][0]["text"] == "Hi there" and message["status"] == "completed"
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "add", "arguments": '{"a": 1}'}
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    # Events carry snapshots: the added item is empty, whatever came after.
    assert events[7]["item"]["content"] == [] and events[8]["part"]["text"] == ""


def test_a_cut_short_message_is_incomplete():
    b = OutputBuilder()
    b.feed({"content": "Once"})
    assert b.close("incomplete")[-1]["item"]["status"] == "incomplete" and b.close("completed") == []


def test_usage_in_the_responses_shape():
    chat = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 8}}
    u = responses_usage(chat, 2)
    assert u["input_tokens"] == 10 and u["input_tokens_details"]["cached_tokens"] == 8
    assert u["output_tokens"] == 5 and u["output_tokens_details"] == {"reasoning_tokens": 2} and u["total_tokens"] == 15


def _response(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": f"answer {i:06d} " * 4}]}]}


def test_10000_responses_under_a_cap_of_1000_keep_the_store_at_its_caps():
    store = ResponseStore(max_entries=1000, max_bytes=10**9, ttl_s=3600)
    for i in range(10_000):
        store.put("t", f"resp_{i}", _response(i), [{"type": "message", "role": "user", "content": "q"}])
    entries, num_bytes = store.usage("t")
    assert entries == 1000 and store.get("t", "resp_8999") is None and store.get("t", "resp_9999") is not None
    # The byte cap: about 400 bytes each, a cap of 100 responses' worth.
    one = store.get("t", "resp_9999").num_bytes
    by_bytes = ResponseStore(max_entries=1000, max_bytes=100 * one, ttl_s=3600)
    for i in range(10_000):
        by_bytes.put("t", f"resp_{i}", _response(i), [{"type": "message", "role": "user", "content": "q"}])
    entries, num_bytes = by_bytes.usage("t")
    assert num_bytes <= 100 * one and entries >= 99


def test_the_store_memory_stays_flat_past_the_cap():
    store = ResponseStore(max_entries=1000, max_bytes=10**9, ttl_s=3600)
    tracemalloc.start()
    try:
        for i in range(1000):
            store.put("t", f"resp_{i}", _response(i), [])
        at_cap = tracemalloc.get_traced_memory()[0]
        for i in range(1000, 10_000):
            store.put("t", f"resp_{i}", _response(i), [])
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert abs(after - at_cap) <= 0.1 * at_cap, (at_cap, after)


def test_entries_expire_and_owners_are_apart():
    now = [0.0]
    store = ResponseStore(max_entries=10, max_bytes=10**6, ttl_s=60, clock=lambda: now[0])
    store.put("a", "resp_1", _response(1), [])
    assert store.get("b", "resp_1") is None and store.get("a", "resp_1") is not None
    now[0] = 61
    assert store.get("a", "resp_1") is None and store.usage("a") == (0, 0)
    assert not store.put("a", "big", {"text": "x" * 2_000_000}, [])
    assert store.delete("a", "big") is False


def test_owner_is_a_hash_of_the_key():
    assert owner_of(None) == "anonymous" and owner_of("Bearer k1") != owner_of("Bearer k2")
    assert "k1" not in owner_of("Bearer k1")
