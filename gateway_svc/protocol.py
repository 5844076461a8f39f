"""OpenAI request bodies: what we implement, what we accept only at its
default value, and everything else refused by name.

Routers rebuild requests rather than pass them through: the SGLang Model
Gateway (sglang-router) adds SGLang's own fields at their defaults
(`continue_final_message`, `skip_special_tokens`, ...). Those are accepted
while they hold a value that matches what we do anyway, and refused by name
otherwise, like every field we do not implement.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

UINT32 = 2**32  # token ids, counts and top_k travel as uint32
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class RequestError(ValueError):
    """A 400 in OpenAI's shape, naming the offending field (`param`)."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error", retry_after_s: int | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.code, self.type = param, message, status, code, type_
        self.retry_after_s = retry_after_s  # 429 only: the Retry-After header


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def param_of(loc: tuple) -> str | None:
    """A pydantic error location as the field path a client wrote:
    ('messages', 0, 'content') -> messages[0].content. Union member tags
    (`str`, `list[int]`, ...) are not fields and are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _TYPE_TAGS or not part.isidentifier():
            continue
        else:
            out += f".{part}" if out else part
    return out or None


# Fields we do not implement, with the values that mean "off" (OpenAI's
# defaults, or what a router fills in), accepted because they change nothing.
_INERT_VALUES: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    # Chat's (vLLM's echo of the last message); /v1/completions implements echo.
    "echo": (None, False),
    # Added by sglang-router 0.3.2 at SGLang's defaults (seen on the wire).
    # skip_special_tokens=true is what our detokenizer does; the others are off.
    "skip_special_tokens": (None, True),
    "separate_reasoning": (None, True),
    "stream_reasoning": (None, True),
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    # OpenAI's SDKs send store=false on chat; stored chat completions are not kept.
    "store": (None, False),
}
# The variables a chat template gets from the request itself, which
# chat_template_kwargs may not replace.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                         "eos_token"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Strict(BaseModel):
    # A nested object we read field by field: an unknown key is refused by
    # name (e.g. `response_format.json_schema.foo`).
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # `schema` would shadow BaseModel.schema.
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    # Always enforced; accepted either way, as vLLM does.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` body extra; one key at most."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _Common(BaseModel):
    # Unknown fields are kept so that they can be refused by name.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=UINT32)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # End-user id, for the caller's own abuse tracking; changes no output.
    user: str | None = None
    # OpenAI's penalties over generated tokens, and its logit_bias: token
    # id (a string in JSON) -> bias; the scheduler checks ids and biases.
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # vLLM's extras, as it accepts them in the body.
    top_k: int | None = Field(default=None, ge=-1, lt=UINT32)  # -1 or 0: off
    repetition_penalty: float | None = Field(default=None, gt=0)  # HF's, over prompt and output
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: int = Field(default=0, ge=0, lt=UINT32)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    # Only requests with the same salt share prefix-cache blocks; checked by
    # the scheduler (GenerateRequest.cache_salt).
    cache_salt: str | None = None
    # Constraints (gateway_svc/constraints.py): OpenAI's response_format,
    # and vLLM's structured_outputs and older guided_* extras.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extra: each prompt token's logprob, with this many top
    # alternatives (openai_format.vllm_prompt_logprobs); not with stream.
    prompt_logprobs: int | None = Field(default=None, ge=0, lt=UINT32)

    def check_inert_fields(self) -> None:
        """Unknown fields and non-default values of unimplemented ones are
        refused by name."""
        for name, value in (self.model_extra or {}).items():
            allowed = _INERT_VALUES.get(name)
            if allowed is None:
                raise RequestError(name, f"unsupported field {name!r}")
            if value not in allowed:
                shown = ", ".join("null" if v is None else repr(v) for v in allowed)
                raise RequestError(name, f"{name}={value!r} is not supported (only {shown})")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs", "prompt_logprobs are not returned when streaming (as vLLM); "
                                                  "use stream=false")
        if self.stop_token_ids and any(not 0 <= t < UINT32 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", "token ids must be in [0, 2^32)")
        self.logit_bias_ids()

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with its keys read as token ids."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError("logit_bias", f"logit_bias keys are token ids, got {key!r}") from None
            if not 0 <= token < UINT32:
                raise RequestError("logit_bias", f"logit_bias: token id {token} must be in [0, 2^32)")
            out[token] = bias
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for completions; 0 only with echo (the prompt alone).
    max_tokens: int | None = Field(default=16, ge=0, lt=UINT32)
    # Top alternatives per token; 0 = only the sampled token's logprob.
    logprobs: int | None = Field(default=None, ge=0, lt=UINT32)
    # The prompt before the completion in `text`, and with `logprobs` the
    # prompt tokens' logprobs first (OpenAI's legacy API, as vLLM does).
    echo: bool = False

    def check_inert_fields(self) -> None:
        super().check_inert_fields()
        if self.max_tokens == 0:
            if not self.echo:
                raise RequestError("max_tokens", "max_tokens=0 generates nothing; it is offered with echo=true, "
                                                 "which returns the prompt (and its logprobs) alone")
            if self.min_tokens:
                raise RequestError("min_tokens", f"min_tokens={self.min_tokens} exceeds max_tokens=0")

    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt is returned and nothing is
        generated (one token is, to compute the prompt, and dropped)."""
        return self.echo and self.max_tokens == 0

    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives the scheduler computes at each prompt position:
        for echo with logprobs and for the prompt_logprobs extra alike."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids used as they are."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt", "empty prompt list")
        if all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            prompts = list(p)
        else:
            raise RequestError("prompt", "a string, a list of strings, a list of token ids, or a list of such lists")
        for prompt in prompts:
            if isinstance(prompt, list) and any(not 0 <= t < UINT32 for t in prompt):
                raise RequestError("prompt", "token ids must be in [0, 2^32)")
        return prompts


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers

    def for_template(self, index: int) -> dict:
        if self.model_extra:
            name = next(iter(self.model_extra))
            raise RequestError(f"messages[{index}].{name}", f"unsupported message field {name!r}")
        content = self.content
        if isinstance(content, list):
            # Text parts are joined, as vLLM does for templates that expect a
            # string; anything else (images, audio) is refused.
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{index}].content[{j}].type",
                                       f"unsupported content part type {part.get('type')!r} (only 'text')")
                texts.append(part["text"])
            content = "\n".join(texts)
        message = {"role": self.role, "content": content, "name": self.name, "tool_call_id": self.tool_call_id}
        if self.tool_calls:
            message["tool_calls"] = [self._call_for_template(index, j, call) for j, call in enumerate(self.tool_calls)]
        return message

    @staticmethod
    def _call_for_template(index: int, j: int, call: ToolCallMessage) -> dict:
        # Templates write the arguments with `| tojson`, so they get the
        # object, not OpenAI's JSON string (as vLLM passes them).
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as exc:
            raise RequestError(f"messages[{index}].tool_calls[{j}].function.arguments",
                               f"not valid JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"messages[{index}].tool_calls[{j}].function.arguments", "must be a JSON object")
        return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=UINT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, lt=UINT32)
    # Tool calling (gateway_svc/tools.py). tool_choice is checked there, so
    # that each wrong shape gets its own message.
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Chat template controls (vLLM's extras): variables for the template
    # (e.g. Qwen3's enable_thinking), whether to open the assistant's turn,
    # or to continue the final assistant message where it stops.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_template_controls(self) -> None:
        taken = sorted(RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs or {}))
        if taken:
            raise RequestError("chat_template_kwargs", f"chat_template_kwargs may not set {taken}: the request "
                                                       "itself gives the template those")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise RequestError("continue_final_message", "continue_final_message=true needs "
                                                             "add_generation_prompt=false: the final message is "
                                                             "continued, not answered")
            if self.messages[-1].role != "assistant":
                raise RequestError("continue_final_message", "continue_final_message=true needs the last message "
                                                             f"to be the assistant's, not {self.messages[-1].role!r}")

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the
    model's chat template, tokenized as a completion or chat request would be."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids to their text, special tokens
    spelled out as vLLM's does."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]

    def token_ids(self) -> list[int]:
        for i, t in enumerate(self.tokens):
            if not 0 <= t < UINT32:
                raise RequestError(f"tokens[{i}]", f"tokens[{i}]: token ids must be in [0, 2^32), got {t}")
        return self.tokens


# What /v1/embeddings takes besides OpenAI's fields; vLLM's other extras
# (truncate_prompt_tokens, normalize, embed_dtype, ...) are refused by name.
EMBEDDING_EXTRAS = ("add_special_tokens", "priority")


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields, and the vLLM extras the
    scheduler's Embed implements."""

    # Unknown fields are kept so that they can be refused by name.
    model_config = ConfigDict(extra="allow")

    # Checked by inputs(), so that a wrong element is named (`input[2]`).
    input: Any
    model: str | None = None
    # base64: the little-endian float32 bytes, which the `openai` client
    # asks for unless told otherwise and decodes itself.
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1, lt=UINT32)
    user: str | None = None  # changes no output
    add_special_tokens: bool = True
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)

    def check_fields(self) -> None:
        for name in self.model_extra or {}:
            raise RequestError(name, f"unsupported field {name!r}: /v1/embeddings takes input, model, "
                                     f"encoding_format, dimensions, user and {', '.join(EMBEDDING_EXTRAS)}")

    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """One (field name, input) per embedding: text, or token ids used as
        they are. A lone string or token list is `input`; the others
        `input[i]`."""
        given = self.input
        if isinstance(given, str) or isinstance(given, list) and given and all(_is_id(x) for x in given):
            inputs = [("input", given)]
        elif isinstance(given, list) and given and (all(isinstance(x, str) for x in given)
                                                    or all(isinstance(x, list) for x in given)):
            inputs = [(f"input[{i}]", one) for i, one in enumerate(given)]
        elif given == []:
            raise RequestError("input", "input: an empty list has no embedding")
        else:
            raise RequestError("input", f"input: {EMBEDDING_INPUTS}")
        for name, one in inputs:
            if not one:
                raise RequestError(name, f"{name}: an empty {'string' if isinstance(one, str) else 'list'} has "
                                         "no embedding")
            if isinstance(one, list) and not all(_is_id(t) and 0 <= t < UINT32 for t in one):
                raise RequestError(name, f"{name}: token ids are integers in [0, 2^32)")
        return inputs


EMBEDDING_INPUTS = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
