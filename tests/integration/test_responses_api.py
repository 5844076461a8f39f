"""The Responses API (`/v1/responses`) through the official `openai` client
and the OpenAI Agents SDK, against one started stack: stories260K under a
compact Hermes-style chat template (its 512-token context has no room for
Qwen2.5's tool preamble). stories260K writes stories, never EOS, so an
answer runs to `max_output_tokens` and ends `incomplete`; tool calls are
forced with `tool_choice: required`."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Annotated

import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field

from tests.integration.conftest import start_gateway_stack

pytestmark = pytest.mark.slow

# Reads `tools` and `tool_calls` (the gateway refuses a template that would
# drop them), in few tokens.
COMPACT_TOOLS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<r>{{ m.content }}</r>\n"
    "{%- elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n'
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)
ADD = {"type": "function", "name": "add", "description": "Adds two numbers.", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def stack(stories_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("stories-tools")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(stories_path / name, d / name)
    config = json.loads((stories_path / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": COMPACT_TOOLS}))
    stack = start_gateway_stack(str(d), gateway_env={"GATEWAY_RESPONSES_STORE_MAX_ENTRIES": "20"})
    yield stack
    stack.stop()


def test_create_returns_the_sdk_response_type(stack):
    r = stack.openai.responses.create(model=stack.model, input="Tell me a story.", instructions="Be brief.",
                                      max_output_tokens=12, temperature=0, metadata={"k": "v"})
    assert isinstance(r, Response) and r.id.startswith("resp_") and r.object == "response"
    # stories260K never writes EOS: the budget ends it.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text and r.output_text
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief." and r.max_output_tokens == 12
    # Round-tripped through the SDK's own model with validation.
    Response.model_validate(r.model_dump())


def test_stream_parses_every_event_and_equals_the_non_streamed_answer(stack):
    kwargs = {"model": stack.model, "input": [{"role": "user", "content": [{"type": "input_text",
                                                                            "text": "Tell me a story."}]}],
              "max_output_tokens": 20, "temperature": 0}
    full = stack.openai.responses.create(**kwargs)
    with stack.openai.responses.stream(**kwargs) as stream:
        events = list(stream)
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    raw = stack.openai.responses.create(stream=True, **kwargs)
    for event in raw:
        # The SDK's union parses each event into its own class.
        assert type(event).__name__.startswith("Response") and event.type in types
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text
    assert events[-1].response.output[0].content[0].text == full.output_text
    assert events[-1].response.usage.output_tokens == 20


def test_required_tool_choice_forces_a_function_call(stack):
    r = stack.openai.responses.create(model=stack.model, input="What is 2 plus 3?", tools=[ADD],
                                      tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                      temperature=0)
    assert r.status == "completed", r
    [call] = r.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"a", "b"} and all(0 <= v <= 9 for v in args.values())
    # The same streamed: the arguments' deltas and done event, then completed.
    with stack.openai.responses.stream(model=stack.model, input="What is 2 plus 3?", tools=[ADD],
                                       tool_choice={"type": "function", "name": "add"}, max_output_tokens=60,
                                       temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert final.output[0].arguments == done.arguments and json.loads(done.arguments).keys() == {"a", "b"}


def test_a_function_call_output_continues_the_conversation(stack):
    r = stack.openai.responses.create(model=stack.model, input="Add 2 and 3.", tools=[ADD], tool_choice="required",
                                      parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    call = r.output[0]
    follow = stack.openai.responses.create(
        model=stack.model, previous_response_id=r.id, tools=[ADD], max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert follow.previous_response_id == r.id and follow.output[0].type == "message"
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_a_previous_response_id_chain_reads_ever_more_from_the_prefix_cache(stack):
    previous, cached = None, []
    for turn in range(10):
        r = stack.openai.responses.create(model=stack.model, input=f"Turn {turn}: go on.", max_output_tokens=6,
                                          temperature=0, previous_response_id=previous)
        cached.append(r.usage.input_tokens_details.cached_tokens)
        previous = r.id
    # Each turn re-sends the conversation so far, which the earlier turns
    # left in the cache (in whole blocks).
    assert cached[-1] > cached[1] > 0 and cached == sorted(cached), cached
    assert stack.openai.responses.retrieve(previous).previous_response_id is not None


def test_get_delete_and_unknown_ids(stack):
    r = stack.openai.responses.create(model=stack.model, input="Hi.", max_output_tokens=4, temperature=0)
    got = stack.openai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    stack.openai.responses.delete(r.id)
    for call in (lambda: stack.openai.responses.retrieve(r.id), lambda: stack.openai.responses.delete(r.id),
                 lambda: stack.openai.responses.cancel(r.id),
                 lambda: stack.openai.responses.create(model=stack.model, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert r.id in err.value.body["message"]
    unstored = stack.openai.responses.create(model=stack.model, input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        stack.openai.responses.retrieve(unstored.id)


def test_refusals_name_the_field_and_other_tool_types_are_dropped(stack):
    for kwargs, param in (({"seed": 1}, "seed"), ({"include": ["file_search_call.results"]}, "include"),
                          ({"conversation": "c"}, "conversation"),
                          ({"input": [{"type": "message", "role": "user",
                                       "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input[0].content[0].type"),
                          ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                          ({"tools": [{**ADD, "parameters": {"type": "string"}}]}, "tools[0].parameters"),
                          ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [ADD]}, "tool_choice.name"),
                          ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name")):
        body = {"input": "x", **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            stack.openai.responses.create(model=stack.model, extra_body=body) if "seed" in kwargs or \
                "conversation" in kwargs else stack.openai.responses.create(model=stack.model, **body)
        assert err.value.body["param"] == param, err.value.body
    r = stack.openai.responses.create(model=stack.model, input="Hi.", max_output_tokens=2,
                                      tools=[{"type": "web_search"}, ADD], tool_choice="auto",
                                      reasoning={"effort": "high"})
    assert [t.name for t in r.tools] == ["add"]
    warnings = r.model_extra["warnings"]
    assert any("tools[0]" in w and "web_search" in w for w in warnings)
    assert any("reasoning.effort" in w for w in warnings)


def test_json_schema_text_format(stack):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = stack.openai.responses.create(model=stack.model, input="A number.", max_output_tokens=20, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"n"}
    assert r.text.format.type == "json_schema"


def test_background_response_runs_on_and_cancel_aborts_it(stack):
    r = stack.openai.responses.create(model=stack.model, input="Tell me a long story.", max_output_tokens=400,
                                      background=True, temperature=0)
    assert r.status == "in_progress" and r.background
    cancelled = stack.openai.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert stack.openai.responses.retrieve(r.id).status == "cancelled"
    stack.grpc.assert_no_leaked_blocks()
    # One left to run: GET shows it in progress, then complete.
    r = stack.openai.responses.create(model=stack.model, input="Hi.", max_output_tokens=30, background=True)
    deadline = time.monotonic() + 30
    while (got := stack.openai.responses.retrieve(r.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage.output_tokens == 30 and got.output_text
    # A finished response: cancel returns it as it is.
    assert stack.openai.responses.cancel(r.id).status == "incomplete"


def _agent_tool_loop(stack, model_class):
    """Three model turns: two forced calls of the tool, then the answer.
    stories260K neither chooses tools nor ever stops, so the test scripts
    what a capable model would choose: tool_choice required for two turns,
    then none, with the answer held to a small JSON schema (the agent's
    output_type) so that it ends. The Runner passes its arguments by
    keyword."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls, turns = [], []

    class Answer(BaseModel):
        total: int = Field(ge=0, le=99)

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=9)], b: Annotated[int, Field(ge=0, le=9)]) -> int:
        """Adds two numbers."""
        calls.append((a, b))
        return a + b

    class Scripted(model_class):
        async def get_response(self, **kwargs):
            answering = len(turns) == 2
            kwargs["model_settings"] = kwargs["model_settings"].resolve(
                ModelSettings(tool_choice="none" if answering else "required"))
            if not answering:
                kwargs["output_schema"] = None  # a forced call is a constraint of its own
            response = await super().get_response(**kwargs)
            turns.append(response)
            return response

    async def run():
        async with openai.AsyncOpenAI(base_url=stack.openai.base_url, api_key="unused", max_retries=0) as client:
            agent = Agent(name="adder", instructions="Add.", tools=[add], output_type=Answer,
                          reset_tool_choice=False, model=Scripted(model=stack.model, openai_client=client),
                          model_settings=ModelSettings(max_tokens=60, temperature=0, parallel_tool_calls=False))
            return await Runner.run(agent, "What is 2 plus 3?", max_turns=3)

    result = asyncio.run(run())
    assert len(turns) == 3 and len(calls) == 2, (turns, calls)
    assert isinstance(result.final_output, Answer)
    return result


def test_agents_sdk_tool_loop_with_the_responses_model(stack):
    from agents import OpenAIResponsesModel

    _agent_tool_loop(stack, OpenAIResponsesModel)


def test_agents_sdk_tool_loop_with_the_chat_completions_model(stack):
    from agents import OpenAIChatCompletionsModel

    _agent_tool_loop(stack, OpenAIChatCompletionsModel)


def test_the_store_keeps_its_cap_in_the_gateway(stack):
    # The stack's gateway keeps 20 responses per key: the 21st drops the first.
    ids = [stack.openai.responses.create(model=stack.model, input=f"{i}", max_output_tokens=1).id
           for i in range(21)]
    with pytest.raises(openai.NotFoundError):
        stack.openai.responses.retrieve(ids[0])
    assert all(stack.openai.responses.retrieve(i).id == i for i in ids[1:])
