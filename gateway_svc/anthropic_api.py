"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens)
as a translation into a chat completion: the request becomes a
ChatCompletionRequest that Gateway.chat_job renders and plans exactly as
/v1/chat/completions would, and the chat output (reasoning, content, tool
calls) comes back as Anthropic's content blocks, stop reasons, usage and
stream events. Errors take Anthropic's shape.

What is not implemented is refused by name, as on the OpenAI routes:
content blocks other than text, tool_use, tool_result and thinking (image,
document, redacted_thinking, ...), server tools, unknown fields.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway_svc import chat_template
from gateway_svc.gateway import Gateway, Job, _auth_metadata, _responses, _until_disconnect, _validated
from gateway_svc.chat_output import ChatDelta
from gateway_svc.openai_format import Sample, usage
from gateway_svc.protocol import UINT32, ChatCompletionRequest, ChatMessage, RequestError, param_of
from gateway_svc.request_log import record_of

log = logging.getLogger("gateway_svc")

# Anthropic's error type for each HTTP status we answer with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
# The chat finish reason as Anthropic's stop_reason ("stop" is end_turn or
# stop_sequence, told apart by the stop string the scheduler names).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ----- errors -----------------------------------------------------------------

def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(err: RequestError) -> JSONResponse:
    headers = {"retry-after": str(err.retry_after_s)} if err.retry_after_s is not None else {}
    return JSONResponse(error_body(err.status, err.message), status_code=err.status, headers=headers)


# ----- the request ---------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Metadata(_Strict):
    user_id: str | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]
    # Accepted, not enforced on its own: the thought and the answer share
    # max_tokens (docs/anthropic-api.md).
    budget_tokens: int | None = Field(default=None, ge=1, lt=UINT32)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """The fields that make the prompt: /v1/messages/count_tokens takes
    these, /v1/messages these and the sampling ones."""

    # Unknown fields are kept so that they can be refused by name.
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def check_extra_fields(self) -> None:
        for name in self.model_extra or {}:
            raise RequestError(name, f"{name}: unsupported field (docs/anthropic-api.md lists what is offered)")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, lt=UINT32)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, lt=UINT32)
    metadata: Metadata | None = None
    stream: bool = False


# Keys a block may carry beside its own; cache_control is accepted because
# the prefix cache is automatic (every request reuses cached prefixes).
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "thinking": {"type", "thinking", "signature"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "tool_use")}


def _block(block, where: str, allowed: tuple[str, ...]) -> dict:
    """A content block checked: its type among `allowed`, no unknown key,
    its fields of the right type."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise RequestError(where, f"{where}: a content block is an object with a `type`")
    kind = block["type"]
    if kind not in allowed:
        raise RequestError(f"{where}.type", f"{where}.type: content blocks of type {kind!r} are not supported "
                                            f"here (only {', '.join(allowed)})")
    # A null is a field left unset: the SDKs' own blocks, sent back as the
    # history, carry their newer fields that way (e.g. tool_use `caller`).
    unknown = sorted(k for k, v in block.items() if k not in _BLOCK_KEYS[kind] and v is not None)
    if unknown:
        raise RequestError(f"{where}.{unknown[0]}", f"{where}.{unknown[0]}: unsupported field of a {kind} block")
    if block.get("citations"):
        raise RequestError(f"{where}.citations", f"{where}.citations: citations are not supported")
    required = {"text": {"text": str}, "thinking": {"thinking": str}, "tool_use": {"id": str, "name": str, "input": dict},
                "tool_result": {"tool_use_id": str}}[kind]
    for key, type_ in required.items():
        if not isinstance(block.get(key), type_):
            raise RequestError(f"{where}.{key}", f"{where}.{key}: required, a{'n object' if type_ is dict else ' string'}")
    return block


def _text_of(content, where: str) -> str:
    """A string, or text blocks joined (as the chat path joins text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"{where}: a string or a list of text blocks")
    return "\n".join(_block(b, f"{where}[{j}]", ("text",))["text"] for j, b in enumerate(content))


class _Turn(ChatMessage):
    """An assistant turn with the thought it had (Anthropic `thinking`
    blocks), which templates that keep thoughts read as reasoning_content."""

    reasoning_content: str | None = None

    def for_template(self, index: int) -> dict:
        message = super().for_template(index)
        message["reasoning_content"] = self.reasoning_content
        return message


def chat_messages(system, messages: list[dict]) -> list[ChatMessage]:
    """Anthropic's system and messages as chat messages: a user turn's
    tool_result blocks become `tool` messages, in order with its text; an
    assistant turn's tool_use blocks become tool_calls and its thinking
    blocks reasoning_content."""
    out: list[ChatMessage] = []
    if system is not None:
        out.append(ChatMessage(role="system", content=_text_of(system, "system")))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role, content = message.get("role"), message.get("content")
        if role not in _ROLE_BLOCKS:
            raise RequestError(f"{where}.role", f"{where}.role: 'user' or 'assistant', not {role!r} "
                                                "(the system prompt is the top-level `system`)")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", f"{where}.{unknown[0]}: unsupported message field")
        if isinstance(content, str):
            out.append(ChatMessage(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content", f"{where}.content: a string or a list of content blocks")
        blocks = [_block(b, f"{where}.content[{j}]", _ROLE_BLOCKS[role]) for j, b in enumerate(content)]
        if role == "assistant":
            texts = [b["text"] for b in blocks if b["type"] == "text"]
            thoughts = [b["thinking"] for b in blocks if b["type"] == "thinking"]
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                     for b in blocks if b["type"] == "tool_use"]
            out.append(_Turn(role="assistant", content="\n".join(texts) if texts else None,
                             tool_calls=calls or None, reasoning_content="\n".join(thoughts) if thoughts else None))
            continue
        texts: list[str] = []
        for j, b in enumerate(blocks):
            if b["type"] == "text":
                texts.append(b["text"])
                continue
            if texts:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            result = _text_of(b.get("content", ""), f"{where}.content[{j}].content")
            # Chat templates have no error flag; the model reads it instead.
            if b.get("is_error"):
                result = f"Error: {result}"
            out.append(ChatMessage(role="tool", tool_call_id=b["tool_use_id"], content=result))
        if texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def function_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's client tools as OpenAI function tools; server tools
    (web_search_..., bash_..., ...) are refused by name."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(where, f"{where}: a tool is an object")
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise RequestError(f"{where}.type", f"{where}.type: {kind!r} tools are not supported (only custom tools: "
                                                "name, description, input_schema)")
        unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", f"{where}.{unknown[0]}: unsupported tool field")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise RequestError(where, f"{where}: a tool has a `name` and an `input_schema` object")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def openai_tool_choice(choice: ToolChoice | None) -> tuple[Any, bool | None]:
    """(tool_choice, parallel_tool_calls) of the chat request."""
    if choice is None:
        return None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise RequestError("tool_choice.name", "tool_choice.name: required when tool_choice.type is 'tool'")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if choice.name is not None:
        raise RequestError("tool_choice.name", "tool_choice.name: only with tool_choice.type 'tool'")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def template_kwargs(thinking: Thinking | None, reasoning_parser: str, template_reads: frozenset[str]) -> dict:
    """`thinking` as the chat template's `enable_thinking` (Qwen3's switch).
    Thinking on needs a reasoning parser to split the thought off; off
    needs a template that can turn it off, unless the model never thinks
    (no reasoning parser)."""
    if thinking is None:
        return {}
    if thinking.type == "enabled":
        if not reasoning_parser:
            raise RequestError("thinking", "thinking: this server has no reasoning parser to return thoughts with "
                                           "(GATEWAY_REASONING_PARSER); leave thinking out or disable it")
        return {"enable_thinking": True}
    if reasoning_parser and "enable_thinking" not in template_reads:
        raise RequestError("thinking", "thinking: the model's chat template cannot turn thinking off "
                                       "(it never reads `enable_thinking`)")
    return {"enable_thinking": False}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion the Messages request stands for."""
    body.check_extra_fields()
    tool_choice, parallel = openai_tool_choice(body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model, "messages": chat_messages(body.system, body.messages),
        "tools": function_tools(body.tools), "tool_choice": tool_choice, "parallel_tool_calls": parallel,
    }
    if isinstance(body, MessagesRequest):
        if body.thinking and body.thinking.budget_tokens is not None and body.thinking.budget_tokens >= body.max_tokens:
            raise RequestError("thinking.budget_tokens", "thinking.budget_tokens: must be less than max_tokens")
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream,
                      user=body.metadata.user_id if body.metadata else None)
    else:
        fields["max_tokens"] = 1  # unused: nothing is generated
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_of(first["loc"])
        raise RequestError(param, f"{param}: {first['msg']}") from None


# ----- the response --------------------------------------------------------------

def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: str | None, stop_string: str) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished chat sample."""
    if finish == "stop" and stop_string:
        return "stop_sequence", stop_string
    if finish not in STOP_REASONS:
        # Aborted by the server (shutdown, a lost executor).
        raise RequestError(None, f"the request ended without an answer ({finish})", status=500)
    return STOP_REASONS[finish], None


def usage_of(counts: dict) -> dict:
    """The chat usage in Anthropic's terms: input_tokens are the prompt's
    tokens not read from the prefix cache, as Anthropic counts them beside
    cache_read_input_tokens."""
    cached = counts["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": counts["prompt_tokens"] - cached, "output_tokens": counts["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_of(chat: dict, stop_string: str, message_id: str) -> dict:
    """A non-streamed chat completion (one choice) as a Message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": tool_use_id(), "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], stop_string)
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_of(chat["usage"])}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class EventWriter:
    """A chat output's deltas as Anthropic's content block events: one
    block open at a time, a new one whenever the kind changes (thinking,
    text, each tool call)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the kind of the open block

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def feed(self, delta: ChatDelta) -> list[str]:
        events = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.calls:
            # The parser returns a call once it is complete: its whole input
            # in one delta.
            events += self._start({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            events += self.close()
        return events


# ----- the routes ------------------------------------------------------------------

async def _chat_job(gw: Gateway, request: Request, model: type[CountTokensRequest]):
    body = await _validated(request, model)
    chat = chat_request(body)
    info = await gw._info(_auth_metadata(request))
    try:
        reads = chat_template.names_read(info.chat_template) if info.chat_template else frozenset()
    except chat_template.TemplateError as exc:
        raise RequestError("messages", str(exc)) from None
    kwargs = template_kwargs(body.thinking, gw.settings.reasoning_parser, reads)
    job, requests, chat, metadata = await gw.chat_job(request, chat, kwargs)
    if body.thinking is not None and body.thinking.type == "disabled":
        # The template was told not to think: the output is all answer.
        job.fmt.reasoning_parser = None
    job.id = f"msg_{job.record.request_id}"
    return body, job, requests, metadata


async def messages(gw: Gateway, request: Request) -> Response:
    body, job, requests, metadata = await _chat_job(gw, request, MessagesRequest)
    firsts = await _until_disconnect(request, gw._start(job, requests, metadata), job)
    if firsts is None:
        return Response(status_code=499)
    if body.stream:
        try:
            prompt_tokens = await gw.client.count_tokens(requests[0][1].prompt, metadata)
        except BaseException:
            job.cancel()
            raise
        return StreamingResponse(_stream(job, firsts, prompt_tokens), media_type="text/event-stream")
    chat = await _until_disconnect(request, gw._collect(job, firsts), job)
    if chat is None:
        return Response(status_code=499)
    return JSONResponse(message_of(chat, job.samples[0].stop_string, job.id))


async def _stream(job: Job, firsts: list, prompt_tokens: int) -> AsyncIterator[str]:
    sample: Sample = job.samples[0]
    writer = EventWriter()
    try:
        yield event("message_start", {"message": {
            "id": job.id, "type": "message", "role": "assistant", "model": job.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}}})
        yield event("ping", {})
        async for _, item in _responses(job, firsts):
            if isinstance(item, grpc.aio.AioRpcError):
                err = job.rpc_error(item)
                job.record.reason = err.message
                yield event("error", error_body(err.status, err.message))
                return
            sample.add(item)
            finish = item.finish_reason != 0
            if not (item.text or finish):
                continue
            for e in writer.feed(sample.output.update(item.text, final=finish)):
                yield e
        for e in writer.close():
            yield e
        finish = "tool_calls" if sample.finish_reason == "stop" and sample.output.calls else sample.finish_reason
        try:
            reason, sequence = stop_reason(finish, sample.stop_string)
        except RequestError as err:
            job.record.reason = err.message
            yield event("error", error_body(err.status, err.message))
            return
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage_of(usage(job.samples))})
        yield event("message_stop", {})
    finally:
        job.cancel()
        await job.note_outcome()


async def count_tokens(gw: Gateway, request: Request) -> dict:
    _, job, requests, metadata = await _chat_job(gw, request, CountTokensRequest)
    try:
        return {"input_tokens": await gw.client.count_tokens(requests[0][1].prompt, metadata)}
    except grpc.aio.AioRpcError as exc:
        raise job.rpc_error(exc) from None


def add_routes(app: FastAPI, gateway) -> None:
    """POST /v1/messages and /v1/messages/count_tokens; `gateway()` is the
    app's Gateway, made when it starts."""

    async def answer(request: Request, handler) -> Response:
        # Errors in Anthropic's shape, not the app's OpenAI one.
        try:
            result = await handler(gateway(), request)
        except RequestError as exc:
            err = exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- answered as api_error, and logged
            log.exception("unexpected error on %s", request.url.path)
            err = RequestError(None, f"internal error: {type(exc).__name__}", status=500)
        else:
            return result if isinstance(result, Response) else JSONResponse(result)
        record = record_of(request)
        if record is not None:
            record.reason = err.message
        return error_response(err)

    @app.post("/v1/messages")
    async def create_message(request: Request):
        return await answer(request, messages)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        return await answer(request, count_tokens)
