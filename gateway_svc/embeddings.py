"""POST /v1/embeddings (OpenAI's shape, as vLLM serves it): each input is
one Embed call to the scheduler, all started at once so that they are
computed in the same steps, as prefill-only rows beside the generating
ones. The scheduler pools (and truncates to `dimensions`); the gateway
only fans out and formats."""

from __future__ import annotations

import asyncio
import base64
import struct

import grpc
from fastapi import Request
from fastapi.responses import Response

from gateway_svc.errors import from_rpc_error
from gateway_svc.gateway import Gateway, _auth_metadata, _call_ids, _check_model, _tenant_of, _until_disconnect, \
    _validated
from gateway_svc.protocol import EmbeddingRequest, RequestError
from gateway_svc.request_log import record_of
from llmsched.v1 import scheduler_pb2 as spb


def encoded(vector, encoding_format: str | None):
    """A vector as JSON floats, or as base64 of its little-endian float32
    bytes (what the `openai` client decodes with array("f"))."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


async def embeddings(gw: Gateway, request: Request) -> Response | dict:
    body = await _validated(request, EmbeddingRequest)
    body.check_fields()
    inputs = body.inputs()
    if len(inputs) > gw.settings.max_embedding_inputs:
        raise RequestError("input", f"input: {len(inputs)} inputs exceed the most one request may embed "
                                    f"({gw.settings.max_embedding_inputs})")
    metadata = _auth_metadata(request)
    info = await gw._info(metadata)
    if _check_model(body.model, gw.served_names(info), info.lora_adapters):
        raise RequestError("model", f"{body.model!r} is a LoRA adapter; adapters serve generation only "
                                    f"(/v1/completions, /v1/chat/completions), embeddings come from "
                                    f"{gw.served_names(info)[0]!r}")
    record = record_of(request)
    calls = []
    for request_id, (_, one) in zip(_call_ids(record.request_id, len(inputs)), inputs):
        r = spb.EmbedRequest(request_id=request_id, add_special_tokens=body.add_special_tokens,
                             priority=body.priority)
        if isinstance(one, str):
            r.prompt = one
        else:
            r.prompt_token_ids.extend(one)
        if body.dimensions is not None:
            r.dimensions = body.dimensions
        calls.append(gw.client.embed(r, metadata))
    results = await _until_disconnect(request, _gather(calls, [name for name, _ in inputs]), None)
    if results is None:
        return Response(status_code=499)
    record.tenant = _tenant_of(await calls[0].trailing_metadata())
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    record.prompt_tokens, record.output_tokens = prompt_tokens, 0
    record.cached_tokens = sum(r.usage.cached_prompt_tokens for r in results)
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encoded(r.embedding, body.encoding_format)}
                     for i, r in enumerate(results)],
            "model": gw.served_names(info)[0],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


async def _gather(calls: list, names: list[str]) -> list[spb.EmbedResponse]:
    """Every call's response; the first failure is answered naming its
    input (`input[2]`), and the calls still running are cancelled."""
    async def one(call, name: str) -> spb.EmbedResponse:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc, {"prompt": name, "prompt_token_ids": name})
            if err.param == name and not err.message.startswith(name):
                err.message = f"{name}: {err.message}"
            raise err from None

    try:
        return list(await asyncio.gather(*(one(c, n) for c, n in zip(calls, names))))
    finally:
        for call in calls:
            call.cancel()
