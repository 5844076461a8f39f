"""The model's chat template and its BOS/EOS strings, as the executor hands
them to the scheduler (and the scheduler to HTTP front ends) in the
handshake. Rendering happens in the gateway; this module only finds them.

Sources, in Hugging Face's order: tokenizer_config.json `chat_template`
(a string, or a list of named templates of which "default" is used), else
a chat_template.jinja file beside it. The token strings come from
`bos_token` / `eos_token`, which are either plain strings or AddedToken
dicts ({"content": ..., ...}).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# For the built-in models, which have no tokenizer_config.json: ChatML, the
# plainest widely used format, with Hermes-style tools as Qwen2.5's template
# has them: the tools listed in the system turn, an assistant's calls as
# <tool_call> blocks, tool results as <tool_response> blocks in a user turn.
# Without tools or calls it renders plain ChatML, byte for byte. Their
# byte-level tokenizer spells the markers out byte by byte, which is fine
# for models that are random anyway.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + call['arguments'] | tojson"
    " + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    template: str  # empty when the model has none
    bos_token: str
    eos_token: str


def _token_string(value) -> str:
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return value if isinstance(value, str) else ""


def _pick_template(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template", "") for t in value if isinstance(t, dict)}
        return named.get("default", "")
    return ""


def read_chat_template(model_dir: Path) -> ChatTemplate:
    """Everything empty when the checkpoint carries no tokenizer config."""
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = _pick_template(config.get("chat_template"))
    jinja_file = model_dir / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text()
    return ChatTemplate(template, _token_string(config.get("bos_token")), _token_string(config.get("eos_token")))


def load_chat_template(model: str) -> ChatTemplate:
    """`model` as EXECUTOR_MODEL has it: a built-in name or a directory."""
    from executor_svc.model.builtin import BUILTIN_MODELS

    if model in BUILTIN_MODELS:
        return ChatTemplate(CHATML_TEMPLATE, "<s>", "</s>")
    return read_chat_template(Path(model))
