"""The gateway's core: /v1/completions and /v1/chat/completions as clients
of the scheduler's public gRPC API (Gateway), and the jobs the APIs that
translate into a chat completion (anthropic_api.py, responses_api.py)
start, collect and stream. Each of `n` samples of each prompt is one
Generate call; a client that goes away cancels its calls, and the
scheduler aborts them at the next step boundary. app.py serves it all."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from gateway_svc import chat_template, constraints, metrics, tools
from gateway_svc.config import GatewaySettings
from gateway_svc.errors import error_body, from_rpc_error
from gateway_svc.openai_format import ChatFormat, CompletionFormat, Sample, usage
from gateway_svc.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError,
                                  TokenizeRequest, param_of)
from gateway_svc.reasoning import PARSERS as REASONING_PARSERS
from gateway_svc.request_log import RequestRecord, record_of
from gateway_svc.scheduler_client import ModelInfo, SchedulerClient
from gateway_svc.constraints import Constraint
from llmsched import metadata
from llmsched.v1 import scheduler_pb2 as spb

log = logging.getLogger("gateway_svc")
# OpenAI's chat default is "until the context ends", which needs the prompt
# length the gateway does not know before the scheduler tokenizes; this is
# the budget when a chat request sets neither max_tokens field.
DEFAULT_CHAT_MAX_TOKENS = 256
SEED_MODULUS = 2**64


@dataclass(slots=True)
class Job:
    """One HTTP request fanned out into Generate calls, answered in one
    endpoint's format."""

    id: str
    created: int
    model: str
    fmt: CompletionFormat | ChatFormat
    include_usage: bool
    record: RequestRecord
    constraint: Constraint | None = None
    samples: list[Sample] = field(default_factory=list)

    def cancel(self) -> None:
        for s in self.samples:
            s.call.cancel()

    def rpc_error(self, exc: grpc.aio.AioRpcError) -> RequestError:
        self.record.tenant = self.record.tenant or _tenant_of(exc.trailing_metadata())
        return from_rpc_error(exc, self.fmt.fields, self.constraint)

    async def note_outcome(self) -> None:
        """Tokens, finish reasons and tenant for the request log, once the
        calls have ended (or been cancelled)."""
        rec = self.record
        if any(s.usage is not None for s in self.samples):  # else no call got as far as its end
            counts = usage(self.samples)
            rec.prompt_tokens = counts["prompt_tokens"]
            rec.cached_tokens = counts["prompt_tokens_details"]["cached_tokens"]
        rec.output_tokens = sum(s.usage.completion_tokens if s.usage is not None else s.num_tokens
                                for s in self.samples)
        reasons = [s.finish_reason or "abort" for s in self.samples]
        rec.finish_reason = reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)
        if rec.tenant is None and self.samples and self.samples[0].call.done():
            try:
                rec.tenant = _tenant_of(await self.samples[0].call.trailing_metadata())
            except grpc.aio.AioRpcError:  # a call that never reached the scheduler
                pass


def _tenant_of(trailers) -> str | None:
    return dict(trailers or ()).get(metadata.TENANT)


def _call_ids(request_id: str, count: int) -> list[str]:
    """The scheduler's request id of each Generate call of one HTTP request."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def _auth_metadata(request: Request) -> tuple:
    # The client's bearer token is the scheduler's API key; Anthropic's
    # clients send it as x-api-key.
    header = request.headers.get("authorization")
    if not header and request.headers.get("x-api-key"):
        header = f"Bearer {request.headers['x-api-key']}"
    return (("authorization", header),) if header else ()


async def _validated(request: Request, model: type[BaseModel]):
    """The JSON body as `model`, or a 400 naming the first bad field."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(None, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(None, "the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_of(first["loc"])
        raise RequestError(param, f"{param}: {first['msg']}") from None


async def _parse(request: Request, model: type[BaseModel]):
    """A generating endpoint's body: validated, and its unimplemented fields
    refused unless at their "off" values."""
    parsed = await _validated(request, model)
    parsed.check_inert_fields()
    return parsed


def _check_model(requested: str | None, names: list[str], adapters: tuple[str, ...] = ()) -> str:
    """The LoRA adapter `requested` names ("" for the model itself);
    anything else served by neither is a 404."""
    if requested is not None and requested in adapters and requested not in names:
        return requested
    if requested is not None and requested not in names:
        served = ", ".join(repr(n) for n in [*names, *adapters])
        raise RequestError("model", f"the model {requested!r} does not exist; this server serves {served}",
                           status=404, code="model_not_found", type_="not_found_error")
    return ""


def _sampling(body, max_tokens: int, num_logprobs: int | None, sub: int,
              num_prompt_logprobs: int | None = None) -> spb.SamplingParams:
    s = spb.SamplingParams(max_tokens=max_tokens, stop=body.stop_list(), stop_token_ids=body.stop_token_ids or [],
                           ignore_eos=body.ignore_eos, top_k=max(body.top_k or 0, 0))
    if body.temperature is not None:
        s.temperature = body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.seed is not None:
        # Sample i of n gets seed + i, as vLLM does: reproducible, yet the n
        # samples differ.
        s.seed = (body.seed + sub) % SEED_MODULUS
    if num_logprobs is not None:
        # The scheduler returns the sampled token's logprob only alongside
        # at least one alternative.
        s.logprobs = max(num_logprobs, 1)
    if num_prompt_logprobs is not None:
        s.prompt_logprobs = num_prompt_logprobs
    s.presence_penalty = body.presence_penalty or 0.0
    s.frequency_penalty = body.frequency_penalty or 0.0
    if body.repetition_penalty is not None:
        s.repetition_penalty = body.repetition_penalty
    s.min_p = body.min_p or 0.0
    s.min_tokens = body.min_tokens
    for token, bias in body.logit_bias_ids().items():
        s.logit_bias[token] = bias
    return s


class Gateway:
    def __init__(self, settings: GatewaySettings, client: SchedulerClient):
        self.settings = settings
        self.client = client

    async def _info(self, metadata, model: str | None = None) -> ModelInfo:
        """The model facts; read again when they do not list `model`, which
        may be a LoRA adapter loaded at runtime since they were cached
        (through another gateway: the scheduler holds the list)."""
        try:
            info = await self.client.model_info(metadata)
            if model is not None and model not in info.lora_adapters and model not in self.served_names(info):
                info = await self.client.model_info(metadata, fresh=True)
            return info
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    def served_names(self, info: ModelInfo | spb.ServerInfo) -> list[str]:
        """GATEWAY_SERVED_MODEL_NAME, else the scheduler's model name; the
        first is the one responses carry."""
        return self.settings.served_model_names or [info.model]

    async def _prepare(self, request: Request, model: type[BaseModel], body: BaseModel | None = None):
        """What every endpoint does first: the body parsed (unless an API
        that translates into this one built it) and checked, the model
        facts, the caller's metadata, the LoRA adapter `model` names."""
        body = body if body is not None else await _parse(request, model)
        if body.n > self.settings.max_n:
            raise RequestError("n", f"n={body.n} exceeds the most this server allows ({self.settings.max_n})")
        constraint = constraints.from_request(body)
        metadata = _auth_metadata(request)
        info = await self._info(metadata, body.model)
        # A LoRA adapter's name as `model` selects it ("" = the model itself).
        adapter = _check_model(body.model, self.served_names(info), info.lora_adapters)
        return body, constraint, metadata, info, adapter

    async def _start(self, job: Job, requests: list[tuple[int, spb.GenerateRequest]], metadata) -> list:
        """Starts every call and waits for each one's first response, so that
        a refusal (400, 429, 503) is still an HTTP status, not a stream."""
        for (_, r), request_id in zip(requests, _call_ids(job.record.request_id, len(requests))):
            r.request_id = request_id
        job.samples = [Sample(i, sub, self.client.generate(r, metadata)) for i, (sub, r) in enumerate(requests)]
        for sample in job.samples:
            job.fmt.start(sample)
        try:
            firsts = await asyncio.gather(*(s.call.read() for s in job.samples))
        except grpc.aio.AioRpcError as exc:
            job.cancel()
            raise job.rpc_error(exc) from None
        except BaseException:
            job.cancel()
            raise
        if job.constraint is not None:
            metrics.CONSTRAINED_REQUESTS.labels(job.constraint.kind).inc()
        return firsts

    async def completions(self, request: Request) -> Response:
        body, constraint, metadata, info, adapter = await self._prepare(request, CompletionRequest)
        prompts = body.prompts()
        # echo with max_tokens 0 still generates one token (the scheduler
        # computes a prompt on the way to a token) and drops it.
        max_tokens = 1 if body.prompt_only() else body.max_tokens
        num_prompt_logprobs = body.num_prompt_logprobs()
        requests = []
        for prompt in prompts:
            for sub in range(body.n):
                r = spb.GenerateRequest(sampling=_sampling(body, max_tokens, body.logprobs, sub, num_prompt_logprobs),
                                        priority=body.priority, cache_salt=body.cache_salt, adapter=adapter)
                if isinstance(prompt, str):
                    r.prompt = prompt
                else:
                    r.prompt_token_ids.extend(prompt)
                if constraint is not None:
                    r.structured.CopyFrom(constraint.structured)
                requests.append((sub, r))
        echo = await self._prompt_texts(prompts, metadata) if body.echo else None
        record = record_of(request)
        fmt = CompletionFormat(body.logprobs, echo, body.n, body.prompt_only(), body.prompt_logprobs)
        job = Job(f"cmpl-{record.request_id}", int(time.time()), adapter or self.served_names(info)[0], fmt,
                  bool(body.stream_options and body.stream_options.include_usage), record, constraint)
        return await self._respond(request, job, requests, body.stream, metadata)

    async def _prompt_texts(self, prompts: list[str | list[int]], metadata) -> list[str]:
        """Each prompt's text, as echo returns it: a text prompt as sent, a
        token-id prompt decoded by the scheduler with its special tokens
        spelled out (as vLLM echoes one)."""
        async def text(prompt: str | list[int]) -> str:
            return prompt if isinstance(prompt, str) else await self.client.detokenize(prompt, False, metadata)

        try:
            return list(await asyncio.gather(*(text(p) for p in prompts)))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, {"token_ids": "prompt"}) from None

    async def chat(self, request: Request) -> Response:
        job, requests, body, metadata = await self.chat_job(request)
        return await self._respond(request, job, requests, body.stream, metadata)

    async def chat_job(self, request: Request, body: ChatCompletionRequest | None = None,
                       template_kwargs: dict | None = None):
        """A chat completion made ready to start: (the job, its Generate
        requests, the body, the caller's metadata). `body` is given by the
        APIs that translate into a chat completion (Responses, Messages)
        and answer in their own format; else it is parsed from the request.
        `template_kwargs` are extra chat template variables (Messages'
        `thinking` -> `enable_thinking`)."""
        body, constraint, metadata, info, adapter = await self._prepare(request, ChatCompletionRequest, body)
        if body.top_logprobs and not body.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs=true")
        plan = tools.plan(body, self.settings.tool_call_parser)
        if plan.constraint is not None:
            if constraint is not None:
                raise RequestError(constraint.param, f"{constraint.param}: a forced tool_choice is a constraint "
                                                     "of its own; use one or the other")
            constraint = plan.constraint
        if not info.chat_template:
            raise RequestError("messages", f"the model {info.model!r} has no chat template; use /v1/completions")
        body.check_template_controls()
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        try:
            tools.check_template(chat_template.names_read(info.chat_template), plan, messages)
            prompt = chat_template.render(info.chat_template, messages, bos_token=info.bos_token,
                                          eos_token=info.eos_token, tools=plan.tools,
                                          add_generation_prompt=body.add_generation_prompt,
                                          template_kwargs=(body.chat_template_kwargs or {}) | (template_kwargs or {}))
            if body.continue_final_message:
                prompt = chat_template.continue_final(prompt, messages[-1].get("content") or "")
        except chat_template.TemplateError as exc:
            raise RequestError("messages", str(exc)) from None
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.resolved_max_tokens() or DEFAULT_CHAT_MAX_TOKENS
        # The rendered template already spells out BOS and friends.
        requests = [(sub, spb.GenerateRequest(prompt=prompt, add_special_tokens=False, priority=body.priority,
                                              cache_salt=body.cache_salt, adapter=adapter,
                                              sampling=_sampling(body, max_tokens, num_logprobs, sub,
                                                                 body.prompt_logprobs),
                                              structured=constraint.structured if constraint else None))
                    for sub in range(body.n)]
        # A constraint covers the whole output, so there is no thought to
        # split off it.
        reasoning = REASONING_PARSERS.get(self.settings.reasoning_parser) if constraint is None else None
        fmt = ChatFormat(num_logprobs, plan.parser, reasoning, plan.parallel, self.settings.tool_call_parser,
                         body.prompt_logprobs)
        record = record_of(request)
        job = Job(f"chatcmpl-{record.request_id}", int(time.time()), adapter or self.served_names(info)[0], fmt,
                  bool(body.stream_options and body.stream_options.include_usage), record, constraint)
        return job, requests, body, metadata

    async def tokenize(self, request: Request) -> dict:
        """POST /tokenize: a prompt's token ids, or chat messages' as
        rendered by the chat template (vLLM's shape)."""
        body = await _validated(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("prompt", "give exactly one of prompt and messages")
        metadata = _auth_metadata(request)
        info = await self._info(metadata)
        _check_model(body.model, self.served_names(info), info.lora_adapters)  # an adapter shares the tokenizer
        prompt, special = body.prompt, body.add_special_tokens
        if body.messages is not None:
            if not info.chat_template:
                raise RequestError("messages", f"the model {info.model!r} has no chat template")
            messages = [m.for_template(i) for i, m in enumerate(body.messages)]
            try:
                prompt = chat_template.render(info.chat_template, messages, bos_token=info.bos_token,
                                              eos_token=info.eos_token,
                                              add_generation_prompt=body.add_generation_prompt)
            except chat_template.TemplateError as exc:
                raise RequestError("messages", str(exc)) from None
            special = False  # the rendered template spells out its special tokens
        try:
            tokens = await self.client.tokenize(prompt, special, metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}

    async def detokenize(self, request: Request) -> dict:
        """POST /detokenize: token ids to their text, special tokens spelled
        out (vLLM's shape)."""
        body = await _validated(request, DetokenizeRequest)
        token_ids = body.token_ids()
        metadata = _auth_metadata(request)
        info = await self._info(metadata)
        _check_model(body.model, self.served_names(info), info.lora_adapters)
        try:
            return {"prompt": await self.client.detokenize(token_ids, False, metadata)}
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, {"token_ids": "tokens"}) from None

    async def _respond(self, request: Request, job: Job, requests, stream: bool, metadata) -> Response:
        firsts = await _until_disconnect(request, self._start(job, requests, metadata), job)
        if firsts is None:
            return Response(status_code=499)
        if stream:
            return StreamingResponse(self._stream(job, firsts), media_type="text/event-stream")
        body = await _until_disconnect(request, self._collect(job, firsts), job)
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body)

    async def _collect(self, job: Job, firsts: list) -> dict:
        async def read_all(sample: Sample, resp) -> None:
            while resp is not grpc.aio.EOF:
                sample.add(resp)
                resp = await sample.call.read()

        try:
            await asyncio.gather(*(read_all(s, f) for s, f in zip(job.samples, firsts)))
        except grpc.aio.AioRpcError as exc:
            job.cancel()
            raise job.rpc_error(exc) from None
        await job.note_outcome()
        return {"id": job.id, "object": job.fmt.object, "created": job.created, "model": job.model,
                "choices": [job.fmt.choice(s) for s in job.samples], "usage": usage(job.samples),
                **job.fmt.response_fields(job.samples)}

    def _chunk(self, job: Job, choices: list[dict], **extra) -> str:
        obj = {"id": job.id, "object": job.fmt.chunk_object, "created": job.created, "model": job.model,
               "choices": choices, **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _stream(self, job: Job, firsts: list) -> AsyncIterator[str]:
        try:
            for s in job.samples:
                for choice in job.fmt.opening_choices(s):
                    yield self._chunk(job, [choice])
            failed = False
            async with aclosing(_responses(job, firsts)) as responses:
                async for sample, item in responses:
                    if isinstance(item, grpc.aio.AioRpcError):
                        err = job.rpc_error(item)
                        job.record.reason = err.message
                        yield f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"
                        failed = True
                        break
                    sample.add(item)
                    for choice in job.fmt.delta_choices(sample, item):
                        yield self._chunk(job, [choice])
            if job.include_usage and not failed:
                yield self._chunk(job, [], usage=usage(job.samples))
            yield "data: [DONE]\n\n"
        finally:
            # Normal end, an error, or the client went away: the calls still
            # running are cancelled and the scheduler frees their blocks.
            job.cancel()
            await job.note_outcome()


async def _responses(job: Job, firsts: list) -> AsyncIterator[tuple[Sample, object]]:
    """Every call's responses as they arrive, as (sample, response), or
    (sample, AioRpcError) once for a call that fails. One call is read
    directly; several are merged through a queue, one reader task each."""
    if len(job.samples) == 1:
        sample, resp = job.samples[0], firsts[0]
        try:
            while resp is not grpc.aio.EOF:
                yield sample, resp
                resp = await sample.call.read()
        except grpc.aio.AioRpcError as exc:
            yield sample, exc
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(sample: Sample, resp) -> None:
        try:
            while resp is not grpc.aio.EOF:
                await queue.put((sample, resp))
                resp = await sample.call.read()
            await queue.put((sample, None))
        except grpc.aio.AioRpcError as exc:
            await queue.put((sample, exc))

    pumps = [asyncio.create_task(pump(s, f)) for s, f in zip(job.samples, firsts)]
    try:
        live = len(pumps)
        while live:
            sample, item = await queue.get()
            if item is None:
                live -= 1
            else:
                yield sample, item
    finally:
        for p in pumps:
            p.cancel()


async def _until_disconnect(request: Request, coro, job: Job | None):
    """Runs coro unless the client disconnects first; then cancels it and
    the job's calls (a coro that owns its calls cancels them itself) and
    returns None."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    if job is not None:
        job.cancel()
    return None
