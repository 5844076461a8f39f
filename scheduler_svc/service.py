"""The public llmsched.v1.Scheduler gRPC service: validation, tokenization
and streaming at the edge; all scheduling happens in the engine."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from llmsched import metadata
from llmsched.logs import REQUESTS, log_request
from llmsched.security import api_key_owner
from llmsched.tracing import Tracing, context_from_metadata
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc
from scheduler_svc import convert, telemetry
from scheduler_svc.core.backpressure import Overloaded
from scheduler_svc.core.clock import SYSTEM_CLOCK
from scheduler_svc.core.lora_registry import AdapterRefused
from scheduler_svc.core.request import Request, SamplingParams
from scheduler_svc.detokenizer import token_text_decoder
from scheduler_svc.engine import Engine, Unavailable
from scheduler_svc.streams import RequestStream
from scheduler_svc.output_processor import RequestDelta
from scheduler_svc.tenants import DEFAULT_TENANT, MAX_CACHE_SALT_CHARS, TENANT_NAME, ApiKeys, prefix_salt
from scheduler_svc.validation import InvalidRequest, Limits, sampling_from_proto, spec_from_proto, validate_prompt

log = logging.getLogger(__name__)
request_logger = logging.getLogger(REQUESTS)

# Prompts up to this many characters are tokenized inline (a few hundred
# microseconds); longer ones in a worker thread.
INLINE_TOKENIZE_CHARS = 4096


@dataclass(slots=True)
class CallOutcome:
    """How one Generate call ended, for its request-log line."""

    request_id: str
    started: float
    route: str = "Generate"
    tenant: str | None = None
    status: str = "OK"  # a grpc.StatusCode name
    reason: str | None = None  # why it was refused or failed
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None

    def fields(self, now: float) -> dict[str, object]:
        return {"request_id": self.request_id, "tenant": self.tenant, "route": self.route, "status": self.status,
                "latency_ms": round((now - self.started) * 1000, 1), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
                "finish_reason": self.finish_reason, "reason": self.reason}


class SchedulerService(spb_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, tracing: Tracing, api_keys: ApiKeys | None = None,
                 request_log: bool = False):
        self.engine = engine
        self.tracing = tracing
        # With API keys on, a request belongs to the key that created it and
        # only that key can Abort it; its tenant is the key's.
        self.api_keys = api_keys
        self.request_log = request_log

    def _owner(self, context: grpc.aio.ServicerContext) -> str | None:
        return api_key_owner(context.invocation_metadata()) if self.api_keys else None

    def _tenant(self, msg: spb.GenerateRequest | spb.EmbedRequest, context: grpc.aio.ServicerContext) -> str:
        if self.api_keys is not None:
            # The interceptor let the call in, so the key is one of ours.
            tenant = self.api_keys.tenant_of(context.invocation_metadata()) or DEFAULT_TENANT
            if msg.tenant and msg.tenant != tenant:
                raise PermissionDenied(f"tenant: this API key's requests belong to its own tenant, not {msg.tenant!r}")
            return tenant
        if msg.tenant and not TENANT_NAME.fullmatch(msg.tenant):
            raise InvalidRequest("tenant", "1-64 characters of [A-Za-z0-9_.-], starting with a letter or digit")
        return msg.tenant or DEFAULT_TENANT

    def _limits(self) -> Limits:
        info, s = self.engine.link.facts, self.engine.settings
        return Limits(
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            max_logprobs=info.max_logprobs,
            max_stop_strings=s.max_stop_strings,
            max_stop_string_chars=s.max_stop_string_chars,
            max_stop_token_ids=s.max_stop_token_ids,
            max_logit_bias=s.max_logit_bias,
        )

    async def _build_request(self, msg: spb.GenerateRequest, tenant: str, request_id: str) -> Request:
        engine = self.engine
        if engine.link.facts is None or engine.link.tokenizer is None:
            raise Unavailable("no executor is connected")
        if engine.link.facts.embedding_only:
            raise NotServed(f"model {engine.link.facts.model!r} serves embeddings only: its checkpoint ships no "
                            "lm_head.weight (tie_word_embeddings is false), so it cannot generate")
        # The adapter's key, not its name: a runtime one's is new at each
        # load, and the prefix cache and slots know it by that (lora_registry.py).
        adapter = self._adapter_key(msg.adapter) if msg.adapter else ""
        limits = self._limits()
        validate_prompt(msg, limits)
        cache_salt = msg.cache_salt if msg.HasField("cache_salt") else None
        if cache_salt is not None and not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise InvalidRequest("cache_salt", f"1-{MAX_CACHE_SALT_CHARS} characters when set, got {len(cache_salt)}")
        sampling = sampling_from_proto(msg.sampling, limits)
        constraint = None
        if msg.HasField("structured"):
            if sampling.min_tokens:
                # The grammar decides where a constrained output may end
                # (EOS is its only token there), so nothing can hold it back.
                raise InvalidRequest("sampling.min_tokens", "not supported with structured (a constrained output "
                                                            "ends where its grammar allows)")
            spec = spec_from_proto(msg.structured)
            if not engine.link.facts.supports_constraints:
                raise Unavailable("the connected executor does not enforce constraints (structured)")
            constraint = await engine.link.constraints.compile(spec)
        return Request(
            request_id=request_id,
            prompt_token_ids=await self._prompt_ids(msg, limits, request_id),
            sampling=sampling,
            eos_token_ids=frozenset(engine.link.facts.eos_token_ids),
            priority=msg.priority,
            constraint=constraint,
            tenant=tenant,
            prefix_salt=prefix_salt(tenant, cache_salt, engine.settings.prefix_cache_scope),
            adapter=adapter,
            skip_prefix_cache=sampling.prompt_logprobs is not None,
        )

    async def _build_embed_request(self, msg: spb.EmbedRequest, tenant: str, request_id: str) -> Request:
        engine = self.engine
        facts = engine.link.facts
        if facts is None or engine.link.tokenizer is None:
            raise Unavailable("no executor is connected")
        if not facts.pooling:
            raise NotServed(f"model {facts.model!r} cannot serve embeddings: its checkpoint has no "
                               "sentence-transformers pooling config this server applies (modules.json and "
                               "1_Pooling/config.json; the executor's log says why)")
        if msg.HasField("dimensions") and not 0 < msg.dimensions <= facts.hidden_size:
            raise InvalidRequest("dimensions", f"must be in [1, {facts.hidden_size}] (the model's hidden size), "
                                               f"got {msg.dimensions}")
        limits = self._limits()
        validate_prompt(msg, limits)
        return Request(
            request_id=request_id,
            prompt_token_ids=await self._prompt_ids(msg, limits, request_id),
            sampling=SamplingParams(max_tokens=0),
            eos_token_ids=frozenset(),
            priority=msg.priority,
            tenant=tenant,
            prefix_salt=prefix_salt(tenant, None, engine.settings.prefix_cache_scope),
            embed=True,
            # Last-token pooling reads only the last position, which is always computed.
            skip_prefix_cache=not facts.pooling.startswith("last"),
        )

    def _adapter_key(self, name: str) -> str:
        key = self.engine.adapter_key(name)
        if key is None:
            served = ", ".join(self.engine.lora_registry.names()) or "none"
            raise NotFound(f"adapter {name!r} is not served (LoRA adapters served: {served})")
        return key

    async def _prompt_ids(self, msg: spb.GenerateRequest | spb.EmbedRequest, limits: Limits,
                          request_id: str) -> list[int]:
        prompt_ids = await self._encode(msg, limits) if msg.prompt else list(msg.prompt_token_ids)
        if not prompt_ids:
            raise InvalidRequest("prompt", "tokenizes to no tokens")
        if self.engine.is_live(request_id):
            raise InvalidRequest("request_id", f"{request_id!r} is already live")
        return prompt_ids

    async def _encode(self, msg: spb.GenerateRequest | spb.EmbedRequest | spb.TokenizeRequest,
                      limits: Limits) -> list[int]:
        """A text prompt's token ids, as Generate and Tokenize both take them."""
        engine = self.engine
        # No token is longer than the tokenizer's longest vocabulary
        # entry, so a longer text cannot fit and is refused untokenized.
        max_chars = limits.max_model_len * engine.link.max_token_chars
        if len(msg.prompt) > max_chars:
            raise InvalidRequest("prompt", f"{len(msg.prompt)} characters cannot fit max_model_len "
                                           f"{limits.max_model_len} (at most {max_chars} characters)")
        # Unset = true; a rendered chat prompt already holds its BOS.
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
        if len(msg.prompt) > INLINE_TOKENIZE_CHARS:
            # The Rust tokenizer releases the GIL: long texts are encoded
            # off the event loop, so running streams do not stall.
            encoding = await asyncio.to_thread(engine.link.tokenizer.encode, msg.prompt,
                                               add_special_tokens=add_special)
            return encoding.ids
        return engine.link.tokenizer.encode(msg.prompt, add_special_tokens=add_special).ids

    async def Generate(self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext):
        span = self.tracing.tracer.start_span(
            "Generate", context=context_from_metadata(context.invocation_metadata()), kind=trace.SpanKind.SERVER
        )
        outcome = CallOutcome(request.request_id or uuid.uuid4().hex, SYSTEM_CLOCK.monotonic())
        try:
            async for response in self._generate(request, context, span, outcome):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled, went away or ran out of its deadline.
            outcome.status, outcome.finish_reason = "CANCELLED", outcome.finish_reason or "abort"
            raise
        except grpc.aio.AbortError:  # context.abort: the status is already noted
            raise
        except Exception as exc:  # a bug: gRPC answers UNKNOWN
            outcome.status, outcome.reason = "UNKNOWN", f"internal error: {type(exc).__name__}"
            raise
        finally:
            span.end()
            if self.request_log:
                log_request(request_logger, outcome.fields(SYSTEM_CLOCK.monotonic()))

    async def _reject(self, context, span, outcome: CallOutcome, code: grpc.StatusCode, reason: str,
                      message: str) -> None:
        telemetry.record_rejected(span, self.tracing.enabled, reason, message)
        span.set_status(trace.Status(trace.StatusCode.ERROR, message))
        outcome.status, outcome.reason = code.name, message
        await context.abort(code, message)

    async def _admit(self, request: spb.GenerateRequest | spb.EmbedRequest, context: grpc.aio.ServicerContext,
                     span: trace.Span, outcome: CallOutcome, build) -> tuple[Request, RequestStream, str | None]:
        """Builds the request (build: _build_request or _build_embed_request)
        and queues it; a refusal aborts the call with its status."""
        req_tenant = request.tenant or DEFAULT_TENANT
        trailers: tuple = ()
        try:
            req_tenant = outcome.tenant = self._tenant(request, context)
            trailers = ((metadata.TENANT, req_tenant),)
            context.set_trailing_metadata(trailers)
            req = await build(request, req_tenant, outcome.request_id)
            outcome.prompt_tokens = req.num_prompt_tokens
            if req.adapter and req.adapter != self._adapter_key(request.adapter):
                # Unloaded while the prompt was tokenized: submit (no await
                # between) is where an unload would see the request.
                raise NotFound(f"adapter {request.adapter!r} was unloaded")
            owner = self._owner(context)
            return req, self.engine.submit(req, span, owner), owner
        except InvalidRequest as exc:
            details = ((metadata.FIELD, exc.field),)
            if exc.grammar_line is not None:
                details += ((metadata.GRAMMAR_LINE, str(exc.grammar_line)),)
            context.set_trailing_metadata((*trailers, *details))
            await self._reject(context, span, outcome, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
        except PermissionDenied as exc:
            await self._reject(context, span, outcome, grpc.StatusCode.PERMISSION_DENIED, "permission_denied",
                               str(exc))
        except NotFound as exc:
            await self._reject(context, span, outcome, grpc.StatusCode.NOT_FOUND, "not_found", str(exc))
        except NotServed as exc:
            await self._reject(context, span, outcome, grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition",
                               str(exc))
        except Unavailable as exc:
            await self._reject(context, span, outcome, grpc.StatusCode.UNAVAILABLE, "unavailable", str(exc))
        except Overloaded as exc:
            context.set_trailing_metadata((*trailers, (metadata.RETRY_AFTER_MS, str(exc.retry_after_ms))))
            telemetry.record_shed(req_tenant)
            await self._reject(context, span, outcome, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded",
                               f"overloaded: {exc}")
        except ValueError as exc:  # can never fit, or a duplicate id
            await self._reject(context, span, outcome, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
        raise AssertionError("unreachable: every refusal aborts the call")

    async def _generate(self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext, span: trace.Span,
                        outcome: CallOutcome):
        req, stream, owner = await self._admit(request, context, span, outcome, self._build_request)
        if self.tracing.enabled:
            span.set_attributes({
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": self.engine.link.facts.model,
                "gen_ai.request.max_tokens": req.sampling.max_tokens,
                "gen_ai.request.temperature": req.sampling.temperature,
                "gen_ai.request.top_p": req.sampling.top_p,
                "gen_ai.request.top_k": req.sampling.top_k,
                "llmsched.request_id": req.request_id,
                "llmsched.priority": req.priority,
                "llmsched.constraint": req.constraint.kind if req.constraint else "",
                "llmsched.tenant": req.tenant,
            })
        want_logprobs = req.sampling.logprobs > 0
        # Logprob entries carry token text, for HTTP front ends without a tokenizer.
        decode = token_text_decoder(self.engine.link.tokenizer) \
            if want_logprobs or req.sampling.prompt_logprobs is not None else None
        finished = False
        try:
            while not finished:
                delta = await stream.queue.get()
                # A slow reader gets what piled up as one response.
                while not stream.queue.empty():
                    delta.merge(stream.queue.get_nowait())
                finished = delta.finish_status is not None
                outcome.output_tokens = (outcome.output_tokens or 0) + len(delta.token_ids)
                if delta.usage is not None:
                    outcome.cached_tokens = delta.usage.cached_prompt_tokens
                    outcome.output_tokens = delta.usage.completion_tokens
                if finished:
                    outcome.finish_reason = convert.finish_reason_name(delta.finish_status)
                if delta.error is not None:
                    if delta.token_ids or delta.text:
                        yield convert.delta_to_response(req.request_id, _without_finish(delta), want_logprobs, decode)
                    code, message = delta.error
                    span.set_status(trace.Status(trace.StatusCode.ERROR, message))
                    outcome.status, outcome.reason = code, message
                    await context.abort(getattr(grpc.StatusCode, code), message)
                yield convert.delta_to_response(req.request_id, delta, want_logprobs, decode)
        finally:
            # Client cancel, disconnect or deadline: free the request at the
            # next step boundary. A no-op when it already finished.
            if not finished:
                self.engine.abort(req.request_id, owner)

    async def Embed(self, request: spb.EmbedRequest, context: grpc.aio.ServicerContext):
        span = self.tracing.tracer.start_span(
            "Embed", context=context_from_metadata(context.invocation_metadata()), kind=trace.SpanKind.SERVER
        )
        outcome = CallOutcome(request.request_id or uuid.uuid4().hex, SYSTEM_CLOCK.monotonic(), route="Embed")
        finished = False
        req = owner = None
        try:
            req, stream, owner = await self._admit(request, context, span, outcome, self._build_embed_request)
            delta = await stream.queue.get()  # an embedding request's stream carries its one last delta
            finished = True
            if delta.error is not None:
                code, message = delta.error
                span.set_status(trace.Status(trace.StatusCode.ERROR, message))
                outcome.status, outcome.reason = code, message
                await context.abort(getattr(grpc.StatusCode, code), message)
            if delta.embedding is None:  # aborted (a drain, Abort by id) before its prompt was computed
                outcome.status, outcome.reason = "ABORTED", "aborted before its embedding was computed"
                await context.abort(grpc.StatusCode.ABORTED, outcome.reason)
            outcome.cached_tokens, outcome.output_tokens = delta.usage.cached_prompt_tokens, 0
            outcome.finish_reason = "stop"
            vector = delta.embedding
            if request.HasField("dimensions"):
                vector = truncate_embedding(vector, request.dimensions)
            return spb.EmbedResponse(request_id=req.request_id, embedding=vector, usage=spb.Usage(
                prompt_tokens=delta.usage.prompt_tokens, cached_prompt_tokens=delta.usage.cached_prompt_tokens))
        except (asyncio.CancelledError, GeneratorExit):
            outcome.status, outcome.finish_reason = "CANCELLED", "abort"
            raise
        finally:
            if req is not None and not finished:
                self.engine.abort(req.request_id, owner)
            span.end()
            if self.request_log:
                log_request(request_logger, outcome.fields(SYSTEM_CLOCK.monotonic()))

    async def Detokenize(self, request: spb.DetokenizeRequest, context: grpc.aio.ServicerContext):
        facts, tokenizer = self.engine.link.facts, self.engine.link.tokenizer
        if facts is None or tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is connected")
        for i, t in enumerate(request.token_ids):
            if t >= facts.vocab_size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids[{i}]: token id {t} is outside "
                                    f"the vocabulary (size {facts.vocab_size})",
                                    trailing_metadata=((metadata.FIELD, f"token_ids[{i}]"),))
        return spb.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids),
                                                            skip_special_tokens=request.skip_special_tokens))

    async def Abort(self, request: spb.AbortRequest, context):
        return spb.AbortResponse(found=self.engine.abort(request.request_id, self._owner(context)))

    async def Tokenize(self, request: spb.TokenizeRequest, context: grpc.aio.ServicerContext):
        # Counting only: nothing is queued, no KV block is touched.
        if self.engine.link.facts is None or self.engine.link.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is connected")
        try:
            return spb.TokenizeResponse(token_ids=await self._encode(request, self._limits()))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                                trailing_metadata=((metadata.FIELD, exc.field),))

    async def GetServerInfo(self, request, context):
        sched, facts, core = self.engine.scheduler, self.engine.link.facts, self.engine.core
        if sched is None or facts is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is connected")
        return spb.ServerInfo(
            model=facts.model,
            max_model_len=facts.max_model_len,
            block_size=facts.block_size,
            num_kv_blocks=facts.num_kv_blocks,
            num_free_kv_blocks=sched.num_free_blocks,
            num_host_kv_blocks=facts.num_host_kv_blocks,
            num_free_host_kv_blocks=sched.num_free_host_blocks,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + core.num_pending_adds,
            executor_instance_id=facts.instance_id,
            num_preemptions=sched.num_preemptions,
            chat_template=facts.chat_template,
            bos_token=facts.bos_token,
            eos_token=facts.eos_token,
            architecture=facts.architecture,
            rope_type=facts.rope_type,
            tensor_parallel_size=facts.tensor_parallel_size or 1,  # 0: an executor older than the field
            weight_bytes=facts.weight_bytes,
            quantization=facts.quantization,
            pooling=facts.pooling,
            embedding_only=facts.embedding_only,
            lora_adapters=self.engine.lora_registry.names(),
            max_loras=(facts.max_loras or len(facts.lora_adapters))
            if facts.lora_adapters or facts.runtime_lora_dir else 0,
            runtime_lora=bool(facts.runtime_lora_dir),
        )

    async def LoadLoraAdapter(self, request: spb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        try:
            adapter = await self.engine.load_lora(request.lora_name, request.lora_path)
        except AdapterRefused as exc:
            await _abort_refused(context, exc)
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return spb.LoadLoraAdapterResponse(resolved_path=adapter.resolved_path, rank=adapter.rank)

    async def UnloadLoraAdapter(self, request: spb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        try:
            num_live = self.engine.unload_lora(request.lora_name)
        except AdapterRefused as exc:
            await _abort_refused(context, exc)
        return spb.UnloadLoraAdapterResponse(num_live_requests=num_live)


async def _abort_refused(context: grpc.aio.ServicerContext, exc: AdapterRefused) -> None:
    """A refused load or unload, with the field at fault as Generate names one."""
    trailers = ((metadata.FIELD, exc.field),) if exc.field else ()
    await context.abort(getattr(grpc.StatusCode, exc.code), str(exc), trailing_metadata=trailers)


class PermissionDenied(Exception):
    """The request asks for what its API key may not: another tenant."""


class NotFound(Exception):
    """The request names what is not served (NOT_FOUND): an unknown LoRA adapter."""


class NotServed(Exception):
    """What the model cannot do (FAILED_PRECONDITION): embeddings of a model
    that cannot pool, generation by one that has no lm_head."""


def truncate_embedding(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` values at unit length (Matryoshka truncation,
    as OpenAI's `dimensions` does); a zero vector stays zero."""
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(v * v for v in head))
    return [v / norm for v in head] if norm > 0 else head


def _without_finish(delta: RequestDelta) -> RequestDelta:
    return RequestDelta(token_ids=delta.token_ids, text=delta.text, logprobs=delta.logprobs)
