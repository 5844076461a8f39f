"""Tool calling through the gateway with the official `openai` client,
against real processes: tiny-random with its built-in ChatML (Hermes tools
out of the box) and the same weights under a Qwen2.5-style template.
`required` and a named function always call, with arguments valid against
the function's schema; a stream's tool-call deltas add up to the
non-streamed calls; `none` never calls; `auto` reads calls the model
wrote; a conversation with tool results is the prompt transformers renders.
Other parsers (llama3_json) and the reasoning parser on a stack of their own."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from safetensors.torch import save_file
from tokenizers import Tokenizer

from executor_svc.model import builtin
from executor_svc.chat_template import CHATML_TEMPLATE
from tests.chat_templates import QWEN25_TOOLS
from tests.integration.conftest import num_admitted, start_gateway_stack
from tests.oracle import hf_greedy

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city for some days.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": CLOCK,
                                      "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
# Two turns: the calls, their results, the answer, a second question.
CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "JST"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "18:00"},
    {"role": "assistant", "content": "Sunny and 21 C; it is 18:00 in Tokyo."},
    {"role": "user", "content": "And in Rome tomorrow?"},
]


def _tiny_random_checkpoint(directory, template: str) -> str:
    """tiny-random's weights and tokenizer as a checkpoint directory with
    `template` as its chat template."""
    spec = builtin.BUILTIN_MODELS["tiny-random"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(builtin.hf_config("tiny-random", spec)))
    save_file({k: v.contiguous() for k, v in builtin.random_state_dict(spec).items()},
              str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text(builtin.byte_level_tokenizer_json(spec.vocab_size))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": template}))
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """For the transformers comparison both ways are directories: the
    built-in ChatML and the Qwen2.5-style template, on tiny-random."""
    root = tmp_path_factory.mktemp("tools")
    return {"tiny-random": _tiny_random_checkpoint(root / "builtin-chatml", CHATML_TEMPLATE),
            "qwen2.5-template": _tiny_random_checkpoint(root / "qwen2.5-template", QWEN25_TOOLS)}


@pytest.fixture(scope="module", params=["tiny-random", "qwen2.5-template"])
def stack(request, checkpoints):
    # tiny-random itself, as `make serve` runs it; the other a directory.
    stack = start_gateway_stack("tiny-random" if request.param == "tiny-random" else checkpoints[request.param])
    stack.checkpoint = checkpoints[request.param]
    yield stack
    stack.stop()


def _chat(stack, **kwargs):
    return stack.openai.chat.completions.create(model=stack.model, **{
        "messages": ASK, "tools": TOOLS, "temperature": 1.0, "max_tokens": 300, **kwargs})


def _many(stack, num_requests: int, n: int, **kwargs) -> list:
    def one(i: int):
        return _chat(stack, n=n, seed=100 * i, **kwargs).choices

    with ThreadPoolExecutor(max_workers=num_requests) as pool:
        return [c for choices in pool.map(one, range(num_requests)) for c in choices]


def _assert_valid_calls(choice, names: set[str]) -> None:
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls, (choice.finish_reason, choice.message)
    assert choice.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


# Room for about a dozen calls: a random model under `required` with
# parallel calls stops after each call with a fair coin (measured on
# tiny-random: 1 to 11 calls over 100 samples), and the prompt with the
# tools listed is about 1,150 of tiny-random's 2,048 positions.
PARALLEL_MAX_TOKENS = 850


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_with_valid_arguments(stack, parallel):
    choices = _many(stack, 10, 10, tool_choice="required", parallel_tool_calls=parallel,
                    max_tokens=PARALLEL_MAX_TOKENS)
    assert len(choices) == 100
    ended = Counter(c.finish_reason for c in choices)
    for choice in choices:
        if choice.finish_reason == "length":
            # Only parallel calls are unbounded: the calls completed within
            # max_tokens are returned, the one cut short stays in content.
            assert parallel and len(choice.message.tool_calls) > 1 and "<tool_call>" in choice.message.content
            choice = choice.model_copy(update={"finish_reason": "tool_calls", "message": choice.message.model_copy(
                update={"content": None})})
        _assert_valid_calls(choice, set(SCHEMAS))
    counts = Counter(len(c.message.tool_calls) for c in choices)
    if parallel:
        assert max(counts) > 1, f"parallel calls allowed, yet 100 samples never made two: {counts}"
        assert ended["length"] <= 5, f"{ended}: calls per sample {sorted(counts.items())}"
    else:
        assert set(counts) == {1} and ended == {"tool_calls": 100}, (counts, ended)
    stack.grpc.assert_no_leaked_blocks()


def test_named_function_always_calls_that_function(stack):
    choices = _many(stack, 5, 10, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in choices:
        _assert_valid_calls(choice, {"get_time"})
        assert len(choice.message.tool_calls) == 1


def test_streamed_tool_call_deltas_add_up_to_the_non_streamed_calls(stack):
    for seed in (1, 2, 3):
        kwargs = {"tool_choice": "required", "seed": seed, "max_tokens": PARALLEL_MAX_TOKENS}
        whole = _chat(stack, **kwargs).choices[0]
        chunks = list(_chat(stack, stream=True, **kwargs))
        calls: dict[int, dict] = {}
        content, finish = "", None
        for chunk in chunks:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            for part in delta.tool_calls or []:
                if part.index not in calls:
                    # The first chunk of a call carries its id, type and name.
                    assert part.id.startswith("call_") and part.type == "function" and part.function.name
                    calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                else:
                    assert part.id is None and part.function.name is None
                calls[part.index]["arguments"] += part.function.arguments or ""
        assert sorted(calls) == list(range(len(calls)))
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert content == "" and whole.message.content is None
        assert finish == whole.finish_reason == "tool_calls"


def test_none_never_calls(stack):
    for choice in _many(stack, 2, 8, tool_choice="none", max_tokens=60):
        assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        assert isinstance(choice.message.content, str)


def test_auto_reads_the_calls_the_model_writes(stack):
    """A random model never writes a call by itself, so a regex makes it
    write one in Hermes form between two sentences; tool_choice auto reads
    it out, and the rest is the content."""
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    regex = rf"Let me see\.\n{call}\nDone\."
    out = _chat(stack, n=4, seed=7, extra_body={"structured_outputs": {"regex": regex}})
    for choice in out.choices:
        calls = choice.message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")
        assert choice.message.content == "Let me see.\n\nDone." and choice.finish_reason == "tool_calls"
    # Free output on a random model: no call, the text as written.
    free = _chat(stack, seed=7, max_tokens=40)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


def test_a_conversation_with_tool_results_is_the_prompt_transformers_renders(stack):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(stack.checkpoint)
    # transformers takes the arguments as objects; OpenAI sends JSON strings.
    hf_messages = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                          "arguments": json.loads(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]} if m.get("tool_calls") else m
                   for m in CONVERSATION]
    hf_ids = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                    return_dict=False)
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"arguments": {"city": "Paris"' in text
    out = stack.openai.chat.completions.create(model=stack.model, messages=CONVERSATION, tools=TOOLS,
                                               tool_choice="none", temperature=0, max_tokens=12)
    assert out.usage.prompt_tokens == len(hf_ids)
    # The same greedy continuation as HF fed exactly those ids.
    expected = hf_greedy(stack.checkpoint, hf_ids, 12)
    tok = Tokenizer.from_file(f"{stack.checkpoint}/tokenizer.json")
    assert out.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)


def test_gateway_metrics_count_constrained_requests_and_calls(stack):
    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(stack.services.gateway_url + "/metrics", timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("llmsched_")}

    before = scrape()
    out = _chat(stack, n=3, seed=9, tool_choice="required", parallel_tool_calls=False)
    stack.openai.completions.create(model=stack.model, prompt="x", max_tokens=4, extra_body={"guided_regex": "ab"})
    after = scrape()

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('llmsched_gateway_constrained_requests_total{kind="tool_call"}') == 1
    assert moved('llmsched_gateway_constrained_requests_total{kind="regex"}') == 1
    assert moved('llmsched_gateway_tool_calls_total{parser="hermes"}') == sum(
        len(c.message.tool_calls) for c in out.choices) == 3


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),  # refused by the scheduler's compile
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{broken"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_tools_get_a_400_naming_the_field_and_nothing_is_queued(stack, kwargs, param):
    admitted = num_admitted(stack.services)
    with pytest.raises(openai.BadRequestError) as exc:
        stack.openai.chat.completions.create(model=stack.model, **{"messages": ASK, "max_tokens": 8, **kwargs})
    assert exc.value.body["param"] == param, exc.value.body
    assert num_admitted(stack.services) == admitted
    stack.grpc.assert_no_leaked_blocks()


# ----- another parser, and reasoning: a stack of their own -------------------

@pytest.fixture(scope="module")
def llama_r1():
    stack = start_gateway_stack("tiny-random", gateway_env={"GATEWAY_TOOL_CALL_PARSER": "llama3_json",
                                                            "GATEWAY_REASONING_PARSER": "deepseek_r1"})
    yield stack
    stack.stop()


def test_llama3_json_parser_forces_and_reads_its_own_format(llama_r1):
    for choice in _many(llama_r1, 2, 10, tool_choice="required", max_tokens=PARALLEL_MAX_TOKENS):
        _assert_valid_calls(choice, set(SCHEMAS))
    regex = r'\{"name": "get_time", "parameters": \{"zone": "JST"\}\}'
    out = _chat(llama_r1, seed=1, extra_body={"guided_regex": regex})
    assert [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls] == [
        ("get_time", '{"zone": "JST"}')]


def test_reasoning_content_streamed_and_not(llama_r1):
    """deepseek_r1 reads the output as starting inside the thought; a random
    model never closes it, so all of it is reasoning and there is no
    content, in both forms."""
    kwargs = {"model": llama_r1.model, "messages": ASK, "seed": 4, "temperature": 1.0, "max_tokens": 30}
    whole = llama_r1.openai.chat.completions.create(**kwargs).choices[0]
    assert whole.message.reasoning_content and whole.message.content is None
    chunks = list(llama_r1.openai.chat.completions.create(stream=True, **kwargs))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning == whole.message.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
