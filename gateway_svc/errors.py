"""Errors in OpenAI's shape, and the one map from scheduler gRPC statuses to
HTTP statuses."""

from __future__ import annotations

import math
from collections.abc import Mapping

import grpc
from fastapi.responses import JSONResponse

from gateway_svc.protocol import RequestError
from llmsched import metadata

# The scheduler names the GenerateRequest field; clients know the OpenAI one.
_FIELD_NAMES = {"prompt_token_ids": "prompt", "request_id": None}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: RequestError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=headers)


def _param_of(field: str | None, fields: Mapping[str, str | None]) -> str | None:
    """The scheduler's refused field as the endpoint's: `sampling.stop[0]` -> `stop`."""
    if not field:
        return None
    field = field.removeprefix("sampling.").split("[", 1)[0]
    if field in fields:
        return fields[field]
    return _FIELD_NAMES.get(field, field)


def from_rpc_error(exc: grpc.aio.AioRpcError, fields: Mapping[str, str | None] | None = None,
                   constraint=None) -> RequestError:
    """`fields` renames GenerateRequest fields to the endpoint's own
    (chat: `prompt` -> `messages`); a refused `structured.*` names the
    request field the constraint came from (`constraint.param_for`)."""
    code, message = exc.code(), exc.details() or ""
    trailers = dict(exc.trailing_metadata() or ())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = trailers.get(metadata.FIELD)
        if constraint is not None and field and field.split(".", 1)[0] == "structured":
            line = trailers.get(metadata.GRAMMAR_LINE)
            param = constraint.param_for(int(line) if line else None)
            # The message is "<field>: <detail>"; the client sees its own field.
            return RequestError(param, f"{param}: {message.removeprefix(f'{field}: ')}")
        return RequestError(_param_of(field, fields or {}), message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_ms = trailers.get(metadata.RETRY_AFTER_MS)
        if retry_ms is None:
            # gRPC's own message-size limit: the request itself is too big.
            return RequestError((fields or {}).get("prompt", "prompt"), message, status=413)
        # Retry-After is in whole seconds; round up so a client never comes back early.
        return RequestError(None, message, status=429, code="overloaded", type_="rate_limit_error",
                            retry_after_s=max(1, math.ceil(int(retry_ms) / 1000)))
    if code == grpc.StatusCode.UNAVAILABLE:
        return RequestError(None, message or "the scheduler is unavailable", status=503,
                            type_="service_unavailable_error")
    if code == grpc.StatusCode.NOT_FOUND:
        # A LoRA adapter the executor does not serve (it may have restarted
        # without one the gateway still listed).
        return RequestError("model", message, status=404, code="model_not_found", type_="not_found_error")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        # The served model cannot do what was asked (Embed on a model
        # without a pooling config); the scheduler's message says why.
        return RequestError(None, message, status=400, code="model_not_supported")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return RequestError(None, message, status=401, code="invalid_api_key", type_="authentication_error")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return RequestError(None, message, status=403, type_="permission_error")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestError(None, message, status=504, type_="timeout_error")
    return RequestError(None, f"{code.name}: {message}", status=500, type_="internal_error")
