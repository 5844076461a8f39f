"""OpenAI's Responses API (`POST /v1/responses` and its `GET`, `DELETE` and
`cancel`) as a translation layer over the chat completion: a request's
input items become chat messages (`to_chat`), the chat job runs as
/v1/chat/completions runs it (`Gateway.chat_job`, `_start`), and its chat
deltas become Responses output items and stream events (`OutputBuilder`).
A streamed, a non-streamed and a background response are the same loop
over the scheduler's responses; only what is done with the events differs.

Refused by name like the chat endpoint's fields, with one documented
exception: tools of types other than `function` (Codex sends `web_search`,
`local_shell`, ...) are dropped and named in the response's `warnings`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway_svc import gateway as gateway_app
from gateway_svc import chat_template
from gateway_svc.config import GatewaySettings
from gateway_svc.openai_format import usage as chat_usage
from gateway_svc.protocol import UINT32, ChatCompletionRequest, RequestError, param_of
from gateway_svc.response_store import ResponseStore, owner_of

log = logging.getLogger("gateway_svc")
# Item fields a client may send back as it got them; they change nothing.
_ECHOED_ITEM_KEYS = {"id", "status"}
_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
# `include` values accepted though we return nothing for them (Codex asks
# for encrypted reasoning; ours is returned in plain text).
_INCLUDE_IGNORED = {"reasoning.encrypted_content"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; others change the output


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    # Unknown fields are kept so that they can be refused by name.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, lt=UINT32)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False

    def check_inert_fields(self) -> None:
        """Unknown fields are refused by name; a few that SDKs and Codex
        send are accepted at values that change nothing."""
        for name, value in (self.model_extra or {}).items():
            if name in ("prompt_cache_key", "safety_identifier") and (value is None or isinstance(value, str)):
                continue  # hints: the prefix cache needs no key; an end-user id like `user`
            if name == "include" and (value is None or isinstance(value, list)):
                unknown = [v for v in value or [] if v not in _INCLUDE_IGNORED]
                if unknown:
                    raise RequestError("include", f"include={unknown[0]!r} is not supported")
                continue
            if name == "stream_options" and (value is None or (isinstance(value, dict)
                                                               and set(value) <= {"include_obfuscation"})):
                continue  # no obfuscation padding is sent either way
            allowed = {"truncation": (None, "disabled"), "service_tier": (None, "auto", "default"),
                       "top_logprobs": (None, 0), "max_tool_calls": (None,),
                       "prompt_cache_retention": (None, "in_memory")}.get(name)
            if allowed is None:
                raise RequestError(name, f"unsupported field {name!r}")
            if value not in allowed:
                shown = ", ".join("null" if v is None else repr(v) for v in allowed)
                raise RequestError(name, f"{name}={value!r} is not supported (only {shown})")


@dataclass(slots=True)
class Translation:
    """A Responses request as a chat completion, and what maps back."""

    chat: ChatCompletionRequest
    input_items: list[dict]  # this request's input, as items, for the stored conversation
    tools: list[dict]  # the function tools kept, in the Responses shape
    tool_index: list[int]  # chat tools[k] is the request's tools[tool_index[k]]
    template_kwargs: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _text_of(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(param, f"{param}: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{param}[{j}].type", f"unsupported content part type {kind!r} "
                                                     "(only input_text and output_text)")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_keys(item: dict, allowed: set[str], param: str) -> None:
    for key in item:
        if key not in allowed and key not in _ECHOED_ITEM_KEYS:
            raise RequestError(f"{param}.{key}", f"unsupported field {key!r} in a {item.get('type')} item")


def _required_str(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{param}.{key}", f"{param}.{key}: a string is required")
    return value


def to_messages(items: list[tuple[str, dict]]) -> list[dict]:
    """Chat messages of (param, item) pairs: messages as they are, a run of
    function_call items as one assistant message with tool_calls (joined to
    the assistant text before it), function_call_output as a tool message.
    Reasoning items are not rendered: chat templates drop earlier turns'
    thoughts."""
    messages: list[dict] = []
    for param, item in items:
        if not isinstance(item, dict):
            raise RequestError(param, f"{param}: an item is a JSON object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _check_keys(item, {"type", "role", "content"}, param)
            role = _MESSAGE_ROLES.get(item.get("role"))
            if role is None:
                raise RequestError(f"{param}.role", f"role {item.get('role')!r} is not one of "
                                                    f"{', '.join(_MESSAGE_ROLES)}")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            _check_keys(item, {"type", "call_id", "name", "arguments"}, param)
            call = {"id": _required_str(item, "call_id", param), "type": "function",
                    "function": {"name": _required_str(item, "name", param),
                                 "arguments": _required_str(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_keys(item, {"type", "call_id", "output"}, param)
            messages.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", param),
                             "content": _text_of(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(f"{param}.type", f"unsupported input item type {kind!r} (only message, "
                                                "function_call, function_call_output and reasoning)")
    return messages


def _tools(body: ResponsesRequest, warnings: list[str]) -> tuple[list[dict], list[int]]:
    kept, index = [], []
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind != "function":
            warnings.append(f"tools[{i}]: a {kind!r} tool is not supported by this server and was dropped "
                            "(only function tools are)")
            continue
        _check_keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]")
        _required_str(tool, "name", f"tools[{i}]")
        kept.append(tool)
        index.append(i)
    return kept, index


def _tool_choice(value):
    """Responses' tool_choice in the chat endpoint's shape."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        return {"type": "function", "function": {"name": value["name"]}}
    raise RequestError("tool_choice", 'tool_choice is none, auto, required or {"type": "function", "name": ...}')


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise RequestError("text.format.name", "text.format.name is required for json_schema")
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def input_items(body: ResponsesRequest) -> list[dict]:
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def to_chat(body: ResponsesRequest, conversation: list[dict], template_reads: frozenset[str]) -> Translation:
    """The chat completion that answers `body`, continuing the stored
    `conversation` (previous_response_id's items); `template_reads` are the
    variables the model's chat template reads."""
    warnings: list[str] = []
    items = input_items(body)
    pairs = [("previous_response_id", item) for item in conversation]
    pairs += [(f"input[{i}]" if not isinstance(body.input, str) else "input", item) for i, item in enumerate(items)]
    messages = to_messages(pairs)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise RequestError("input", "input is required (a string or a list of items)")
    tools, tool_index = _tools(body, warnings)
    template_kwargs = {}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        if "reasoning_effort" in template_reads:
            template_kwargs["reasoning_effort"] = effort
        else:
            warnings.append(f"reasoning.effort={effort!r} was ignored: the model's chat template takes no "
                            "reasoning_effort")
    if body.reasoning is not None and body.reasoning.summary is not None:
        warnings.append("reasoning.summary: no summaries are written; the reasoning parser's text is returned "
                        "as reasoning_text content")
    fields = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
        "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
        or None,
        "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise translate_error(RequestError(param_of(first["loc"]), first["msg"]), tool_index) from None
    return Translation(chat, items, tools, tool_index, template_kwargs, warnings)


_CHAT_PARAMS = [
    (re.compile(r"^messages(\[\d+\])?.*"), lambda m, _: "input"),
    (re.compile(r"^tools\[(\d+)\]\.function(.*)"), lambda m, ix: f"tools[{ix[int(m[1])]}]{m[2]}"),
    (re.compile(r"^tool_choice\.function\.name$"), lambda m, _: "tool_choice.name"),
    (re.compile(r"^(max_tokens|max_completion_tokens)$"), lambda m, _: "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?(.*)"), lambda m, _: f"text.format{m[2]}"),
]


def translate_error(err: RequestError, tool_index: list[int]) -> RequestError:
    """A chat-completion error naming the Responses field the client wrote."""
    if err.param is None:
        return err
    for pattern, rename in _CHAT_PARAMS:
        m = pattern.match(err.param)
        if m is not None:
            if pattern.pattern.startswith("^tools") and int(m[1]) >= len(tool_index):
                break
            param = rename(m, tool_index)
            message = err.message.replace(err.param, param, 1)
            return RequestError(param, message, err.status, err.code, err.type, err.retry_after_s)
    return err


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Output items built from a chat sample's deltas (`delta` objects of
    ChatFormat.delta_choices), with the stream events that say so. The open
    item (a message or a reasoning item) is the last; a function call is
    complete in the two deltas the chat format sends it in."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # the first of a call's two deltas: its id and name
                events += self.close("completed")
                item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
                self.items.append(item)
                events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                               "item": dict(item)})
            else:
                item, index = self.items[-1], len(self.items) - 1
                args = call["function"]["arguments"]
                item["arguments"] += args
                item["status"] = "completed"
                events += [
                    {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                     "delta": args},
                    {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                     "name": item["name"], "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
                ]
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close("completed")
            if kind == "message":
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self.items.append(item)
            self._open = item
            index = len(self.items) - 1
            events += [{"type": "response.output_item.added", "output_index": index, "item": dict(item, content=[])},
                       {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
            item["content"].append(part)
        item = self._open
        item["content"][0]["text"] += text
        event = {"type": "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta",
                 "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def close(self, status: str) -> list[dict]:
        """Ends the open item (`completed`, or `incomplete` when the output
        was cut short)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index, part = len(self.items) - 1, item["content"][0]
        done = {"type": "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done",
                "item_id": item["id"], "output_index": index, "content_index": 0, "text": part["text"]}
        if item["type"] == "message":
            done["logprobs"] = []
        return [done,
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index,
                 "item": dict(item, content=[dict(part)])}]


def responses_usage(chat: dict, reasoning_tokens: int) -> dict:
    """The chat usage in the Responses shape."""
    return {"input_tokens": chat["prompt_tokens"],
            # Cache writes are not counted apart: the prefix cache keeps every
            # full block it computes.
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat["total_tokens"]}


@dataclass(slots=True)
class Run:
    """One response as it is generated: what GET shows while it runs, and
    what is stored when it ends."""

    id: str
    owner: str
    created_at: int
    echo: dict  # the request's settings, as the response repeats them
    warnings: list[str]
    conversation: list[dict]  # the stored conversation this continues, then this request's input
    store: bool
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    status: str = "in_progress"
    usage: dict | None = None
    error: dict | None = None
    incomplete_details: dict | None = None
    completed_at: int | None = None
    num_reasoning_tokens: int = 0
    cancelled: bool = False
    job: Any = None  # the chat Job (gateway_svc.gateway.Job)
    task: asyncio.Task | None = None  # a background run's

    def response(self) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
               "completed_at": self.completed_at, "error": self.error, "incomplete_details": self.incomplete_details,
               **self.echo, "output": self.builder.items, "usage": self.usage}
        if self.warnings:
            out["warnings"] = self.warnings  # llmsched's own: what the request asked for and did not get
        return out


def _echo(body: ResponsesRequest, translation: Translation, model: str) -> dict:
    tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if translation.tools else "none")
    text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)} \
        if body.text is not None and body.text.format is not None else {"format": {"type": "text"}}
    return {"model": model, "instructions": body.instructions, "metadata": body.metadata or {},
            "tools": translation.tools, "tool_choice": tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "text": text,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "previous_response_id": body.previous_response_id, "store": body.store, "background": body.background,
            "user": body.user, "truncation": "disabled"}


def _not_found(response_id: str, param: str = "response_id") -> RequestError:
    return RequestError(param, f"no response with id {response_id!r} (responses are kept on the gateway "
                               "that made them, for the API key that made them, until evicted or expired)",
                        status=404, code="not_found", type_="invalid_request_error")


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponsesService:
    def __init__(self, settings: GatewaySettings, gateway: Callable[[], Any]):
        self.gateway = gateway  # the app's Gateway, made in its lifespan
        self.store = ResponseStore(settings.responses_store_max_entries, settings.responses_store_max_bytes,
                                   settings.responses_store_ttl_s)
        self._running: dict[str, Run] = {}  # background responses still generating

    async def create(self, request: Request) -> Response:
        gw = self.gateway()
        body = await gateway_app._parse(request, ResponsesRequest)
        owner = owner_of(request.headers.get("authorization"))
        if body.background and body.stream:
            raise RequestError("background", "background with stream is not supported; poll GET "
                                             "/v1/responses/{id} instead")
        if body.background and not body.store:
            raise RequestError("background", "background needs store=true")
        conversation = []
        if body.previous_response_id is not None:
            if self._live(owner, body.previous_response_id) is not None:
                raise RequestError("previous_response_id", f"{body.previous_response_id!r} is still in progress")
            entry = self.store.get(owner, body.previous_response_id)
            if entry is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            conversation = entry.conversation
        info = await gw._info(gateway_app._auth_metadata(request))
        reads = chat_template.names_read(info.chat_template) if info.chat_template else frozenset()
        translation = to_chat(body, conversation, reads)
        try:
            job, requests, _, metadata = await gw.chat_job(request, translation.chat, translation.template_kwargs)
        except RequestError as err:
            raise translate_error(err, translation.tool_index) from None
        run = Run(_new_id("resp"), owner, int(time.time()), _echo(body, translation, job.model),
                  translation.warnings, conversation + translation.input_items, body.store)
        job.id, run.job = run.id, job
        try:
            firsts = await gateway_app._until_disconnect(request, gw._start(job, requests, metadata), job)
        except RequestError as err:
            raise translate_error(err, translation.tool_index) from None
        if firsts is None:
            return Response(status_code=499)
        if body.background:
            self._running[run.id] = run
            run.task = asyncio.create_task(self._background(run, job, firsts))
            return JSONResponse(run.response())
        if body.stream:
            return StreamingResponse(self._stream(run, job, firsts), media_type="text/event-stream")
        try:
            done = await gateway_app._until_disconnect(request, self._drain(run, job, firsts, raise_errors=True), job)
        except RequestError as err:
            raise translate_error(err, translation.tool_index) from None
        if done is None:
            return Response(status_code=499)
        return JSONResponse(run.response())

    async def _events(self, run: Run, job, firsts, raise_errors: bool) -> AsyncIterator[dict]:
        """The output events of the job's one sample; the run's status,
        usage and error are set when it ends."""
        try:
            async with aclosing(gateway_app._responses(job, firsts)) as responses:
                async for sample, item in responses:
                    if isinstance(item, grpc.aio.AioRpcError):
                        err = job.rpc_error(item)
                        if raise_errors:
                            raise err
                        if not run.cancelled:
                            run.error = {"code": "server_error", "message": err.message}
                        break
                    sample.add(item)
                    for choice in job.fmt.delta_choices(sample, item):
                        if choice["delta"].get("reasoning_content"):
                            run.num_reasoning_tokens += len(item.token_ids)
                        for event in run.builder.feed(choice["delta"]):
                            yield event
        except asyncio.CancelledError:
            if not run.cancelled:  # a cancelled call reads as this; the cancel endpoint expects it
                raise
        finish = job.samples[0].finish_reason
        if run.cancelled:
            run.status = "cancelled"
        elif finish == "stop":
            run.status = "completed"
        elif finish == "length":
            run.status = "incomplete"
            run.incomplete_details = {"reason": "max_output_tokens"}
        else:
            run.status = "failed"
            run.error = run.error or {"code": "server_error", "message": "the server aborted the request"}
        for event in run.builder.close("completed" if run.status == "completed" else "incomplete"):
            yield event
        await job.note_outcome()
        if job.samples[0].usage is not None:
            run.usage = responses_usage(chat_usage(job.samples), run.num_reasoning_tokens)
        run.completed_at = int(time.time()) if run.status == "completed" else None
        if run.store:
            self.store.put(run.owner, run.id, run.response(), run.conversation + run.builder.items)

    async def _drain(self, run: Run, job, firsts, raise_errors: bool) -> bool:
        """Runs the job to its end; True (a disconnect reads as None)."""
        async with aclosing(self._events(run, job, firsts, raise_errors)) as events:
            async for _ in events:
                pass
        return True

    async def _background(self, run: Run, job, firsts) -> None:
        try:
            await self._drain(run, job, firsts, raise_errors=False)
        except Exception as exc:  # nobody awaits this task: the response says what went wrong
            log.exception("background response %s failed", run.id)
            run.status = "failed"
            run.error = {"code": "server_error", "message": f"internal error: {type(exc).__name__}"}
            if run.store:
                self.store.put(run.owner, run.id, run.response(), run.conversation + run.builder.items)
        finally:
            job.cancel()
            self._running.pop(run.id, None)

    async def _stream(self, run: Run, job, firsts) -> AsyncIterator[str]:
        sequence = 0

        def numbered(event: dict) -> str:
            nonlocal sequence
            event["sequence_number"] = sequence
            sequence += 1
            return _sse(event)

        try:
            yield numbered({"type": "response.created", "response": run.response()})
            yield numbered({"type": "response.in_progress", "response": run.response()})
            async with aclosing(self._events(run, job, firsts, raise_errors=False)) as events:
                async for event in events:
                    yield numbered(event)
            end = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(run.status,
                                                                                                "response.failed")
            yield numbered({"type": end, "response": run.response()})
        finally:
            # Normal end, or the client went away: the call still running is
            # cancelled and the scheduler frees its blocks.
            job.cancel()

    def _live(self, owner: str, response_id: str) -> Run | None:
        run = self._running.get(response_id)
        return run if run is not None and run.owner == owner else None

    def get(self, request: Request, response_id: str) -> dict:
        if request.query_params.get("stream") in ("true", "1"):
            raise RequestError("stream", "GET with stream=true is not supported")
        owner = owner_of(request.headers.get("authorization"))
        run = self._live(owner, response_id)
        if run is not None:
            return run.response()
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    async def delete(self, request: Request, response_id: str) -> dict:
        owner = owner_of(request.headers.get("authorization"))
        run = self._live(owner, response_id)
        if run is not None:
            await self._cancel_run(run)
        if not self.store.delete(owner, response_id) and run is None:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, request: Request, response_id: str) -> dict:
        owner = owner_of(request.headers.get("authorization"))
        run = self._live(owner, response_id)
        if run is not None:
            await self._cancel_run(run)
            return run.response()
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise _not_found(response_id)
        if not entry.response.get("background"):
            raise RequestError("response_id", "only a background response can be cancelled")
        return entry.response  # already over: cancelling changes nothing

    async def _cancel_run(self, run: Run) -> None:
        """Cancels the Generate call (the scheduler aborts the request at
        its next step) and waits for the run to record it."""
        run.cancelled = True
        run.job.cancel()
        await asyncio.wait({run.task}, timeout=10)


def register(app: FastAPI, settings: GatewaySettings, gateway: Callable[[], Any]) -> ResponsesService:
    service = ResponsesService(settings, gateway)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await service.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str):
        return service.get(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        return await service.delete(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        return await service.cancel(request, response_id)

    return service
