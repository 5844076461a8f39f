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
# plainest widely used format. Their byte-level tokenizer spells the markers
# out byte by byte, which is fine for models that are random anyway.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
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
    from executor_svc.builtin import BUILTIN_MODELS

    if model in BUILTIN_MODELS:
        return ChatTemplate(CHATML_TEMPLATE, "<s>", "</s>")
    return read_chat_template(Path(model))
