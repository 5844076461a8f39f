"""Renders chat messages with the model's Jinja template exactly as
transformers' `apply_chat_template` does, so a model sees the prompt it was
trained on: the same sandbox, the same environment options, the same globals
and filters, the same variables.

Chat templates come from model repositories and are untrusted code, hence
the immutable sandbox (no attribute writes, no unsafe calls).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template failed to compile or raised while rendering."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _DictFactory:
    """`dict(...)` inside templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, which could otherwise
    reach interpreter internals."""

    def __init__(*args, **kwargs):  # noqa: N805 -- Jinja's signature trick keeps `self=` usable as a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names are not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for
    training masks in transformers; when serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = _environment()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the model's chat template does not compile: {exc}") from exc


@functools.lru_cache(maxsize=8)
def names_read(source: str) -> frozenset[str]:
    """Every variable, attribute and constant key the template reads
    (`tools`, `message.tool_calls`, `message['content']`, ...): enough to
    tell that a template never renders something it is given."""
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the model's chat template does not compile: {exc}") from exc
    names = {n.name for n in ast.find_all(jinja2.nodes.Name)}
    names |= {n.attr for n in ast.find_all(jinja2.nodes.Getattr)}
    names |= {n.arg.value for n in ast.find_all(jinja2.nodes.Getitem)
              if isinstance(n.arg, jinja2.nodes.Const) and isinstance(n.arg.value, str)}
    return frozenset(names)


def render(source: str, messages: list[dict], *, bos_token: str, eos_token: str,
           add_generation_prompt: bool = True, tools: list[dict] | None = None,
           template_kwargs: dict | None = None) -> str:
    """The prompt text; tokenize it without adding special tokens, as
    apply_chat_template(tokenize=True) does. `tools` are OpenAI tool
    objects, passed to the template as transformers passes them;
    `template_kwargs` are extra variables (e.g. `enable_thinking`), as
    transformers passes apply_chat_template's keyword arguments."""
    # transformers drops keys whose value is None: templates test presence.
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {"bos_token": bos_token, "eos_token": eos_token}
    try:
        return compile_template(source).render(
            **(template_kwargs or {}), messages=messages, tools=tools or None, documents=None,
            add_generation_prompt=add_generation_prompt, **{k: v for k, v in variables.items() if v},
        )
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the chat template refused these messages: {exc}") from exc


def continue_final(prompt: str, final_content: str) -> str:
    """The rendered prompt cut right after the final message's text, so the
    model continues it, as transformers' continue_final_message does (the
    template renders the turn closed; its end is dropped)."""
    end = prompt.rfind(final_content.strip()) if final_content.strip() else -1
    if end < 0:
        raise TemplateError("continue_final_message: the final message's text does not appear in the rendered "
                            "prompt, so there is no place to continue it from")
    return prompt[: end + len(final_content.strip())]
