"""Chat templates render exactly as transformers' apply_chat_template does,
down to the token ids; the executor finds the template and BOS/EOS strings
in every shape checkpoints ship them."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer

from executor_svc.chat_template import CHATML_TEMPLATE, load_chat_template, read_chat_template
from gateway_svc import chat_template
from tests.chat_templates import ALL, QWEN25_TOOLS

CONVERSATIONS = [
    [{"role": "user", "content": "Once upon a time"}],
    [{"role": "system", "content": "Tell \"short\" <stories>."},
     {"role": "user", "content": "  A dog and a cat  ", "name": "Tim"},
     {"role": "assistant", "content": "They played."},
     {"role": "user", "content": "Then?"}],
]


@pytest.fixture(scope="module")
def hf_dir(stories_path, tmp_path_factory):
    """stories260K's tokenizer with a tokenizer_config.json per template."""
    dirs = {}
    for name, template in ALL.items():
        d = tmp_path_factory.mktemp(name)
        shutil.copy(stories_path / "tokenizer.json", d / "tokenizer.json")
        config = json.loads((stories_path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_token_ids_equal_transformers(hf_dir, name, conv, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir[name])
    messages = CONVERSATIONS[conv]
    found = read_chat_template(hf_dir[name])
    ours = chat_template.render(found.template, messages, bos_token=found.bos_token, eos_token=found.eos_token,
                                add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs, f"{name}: rendered text differs from transformers"
    # What the scheduler does with add_special_tokens=false.
    ids = Tokenizer.from_file(str(hf_dir[name] / "tokenizer.json")).encode(ours, add_special_tokens=False).ids
    hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert ids == hf_ids, f"{name}: prompt token ids differ from apply_chat_template(tokenize=True)"
    if name == "llama3":
        assert ids.count(1) == 1, "exactly one BOS: the template's, none added by the tokenizer"


def test_raise_exception_in_a_template_is_a_template_error():
    with pytest.raises(chat_template.TemplateError, match="unknown role tool"):
        chat_template.render(ALL["features"], [{"role": "tool", "content": "x"}], bos_token="<s>", eos_token="</s>")


def test_sandbox_refuses_reaching_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(chat_template.TemplateError):
        chat_template.render(evil, [{"role": "user", "content": "x"}], bos_token="", eos_token="")
    with pytest.raises(chat_template.TemplateError):
        chat_template.render("{% set ns = namespace(_x=1) %}", [], bos_token="", eos_token="")


def test_builtin_models_get_chatml():
    found = load_chat_template("tiny-random")
    assert found.template == CHATML_TEMPLATE and (found.bos_token, found.eos_token) == ("<s>", "</s>")
    text = chat_template.render(found.template, [{"role": "user", "content": "hi"}], bos_token="<s>", eos_token="</s>")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sources_and_token_shapes(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "<|begin|>", "lstrip": False, "__type": "AddedToken"},
        "eos_token": "<|end|>",
    }))
    assert read_chat_template(tmp_path) == type(read_chat_template(tmp_path))("D", "<|begin|>", "<|end|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    (tmp_path / "chat_template.jinja").write_text("J")
    found = read_chat_template(tmp_path)
    assert (found.template, found.bos_token, found.eos_token) == ("J", "", "")


def test_a_checkpoint_without_tokenizer_config_has_no_template(tmp_path):
    found = read_chat_template(tmp_path)
    assert (found.template, found.bos_token, found.eos_token) == ("", "", "")


# ----- tools ------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, today or later.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. \"Paris\""},
            "days": {"type": "integer", "minimum": 0}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
# Two turns: a question answered with two calls, their results, the
# assistant's answer, then a second question.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 0}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"clear\", \"c\": 21}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "Clear, 21 C, noon."},
    {"role": "user", "content": "And in Rome?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "rain"},
]
# The built-in template before it learned tools: without them it must
# render exactly this.
PLAIN_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tool_dirs(stories_path, tmp_path_factory):
    dirs = {}
    for name, template in {"qwen2.5": QWEN25_TOOLS, "builtin-chatml": CHATML_TEMPLATE}.items():
        d = tmp_path_factory.mktemp(name)
        shutil.copy(stories_path / "tokenizer.json", d / "tokenizer.json")
        config = json.loads((stories_path / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("name", ["qwen2.5", "builtin-chatml"])
@pytest.mark.parametrize("turns", [2, 5, 7, 9], ids=lambda n: f"{n}-messages")
def test_tool_conversations_render_as_transformers_renders_them(tool_dirs, name, turns):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tool_dirs[name])
    messages = TOOL_CONVERSATION[:turns]
    found = read_chat_template(tool_dirs[name])
    ours = chat_template.render(found.template, messages, bos_token=found.bos_token, eos_token=found.eos_token,
                                tools=TOOLS)
    theirs = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "get_weather" in ours and ("<tool_response>" in ours) == (turns > 3)
    ids = Tokenizer.from_file(str(tool_dirs[name] / "tokenizer.json")).encode(ours, add_special_tokens=False).ids
    hf_ids = hf.apply_chat_template(messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    assert ids == (hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids)


def test_builtin_chatml_without_tools_is_unchanged():
    for messages in CONVERSATIONS:
        for add in (True, False):
            kwargs = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": add}
            assert (chat_template.render(CHATML_TEMPLATE, messages, **kwargs)
                    == chat_template.render(PLAIN_CHATML, messages, **kwargs))


def test_builtin_chatml_writes_calls_as_the_hermes_parser_reads_them():
    from gateway_svc.tool_parsers import hermes

    text = chat_template.render(CHATML_TEMPLATE, TOOL_CONVERSATION[:3], bos_token="<s>", eos_token="</s>",
                                tools=TOOLS, add_generation_prompt=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    scan = hermes.scan(turn, final=True)
    assert scan.content == "Checking.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == [
        ("get_weather", {"city": "Paris", "days": 0}), ("get_time", {})]
