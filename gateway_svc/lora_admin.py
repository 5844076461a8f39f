"""vLLM's runtime LoRA routes, /v1/load_lora_adapter and
/v1/unload_lora_adapter, with vLLM's bodies and answers (a plain-text
success line; the errors in OpenAI's shape). Off unless
GATEWAY_ALLOW_RUNTIME_LORA=on. The scheduler holds the adapter list and the
executor decides which paths may be read (EXECUTOR_RUNTIME_LORA_DIR): the
gateway only passes the request on (scheduler.proto LoadLoraAdapter)."""

from __future__ import annotations

import grpc
from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from gateway_svc.errors import from_rpc_error
from gateway_svc.gateway import Gateway, _auth_metadata, _validated
from gateway_svc.protocol import RequestError
from llmsched import metadata
from llmsched.v1 import scheduler_pb2 as spb

# The executor reads and checks the adapter before the scheduler answers.
LOAD_TIMEOUT_S = 150.0


class LoadLoraAdapterRequest(BaseModel):
    # An unknown field (vLLM's load_inplace among them) is refused by name.
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str


def _check_enabled(gw: Gateway, request: Request) -> None:
    if not gw.settings.allow_runtime_lora:
        raise RequestError(None, f"POST {request.url.path} is off: runtime LoRA loading needs "
                                 "GATEWAY_ALLOW_RUNTIME_LORA=on (and the executor's EXECUTOR_RUNTIME_LORA_DIR)",
                           status=404, type_="not_found_error", code="runtime_lora_disabled")


def _refusal(exc: grpc.aio.AioRpcError) -> RequestError:
    """The scheduler's refusal as vLLM answers it: a name already loaded is
    a 400, an unknown one a 404; a path outside the allowed directory a 403."""
    code, message = exc.code(), exc.details() or ""
    param = dict(exc.trailing_metadata() or ()).get(metadata.FIELD)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return RequestError("lora_name", message, code="lora_adapter_already_loaded")
    if code == grpc.StatusCode.NOT_FOUND:
        return RequestError(param, message, status=404, type_="not_found_error",
                            code="lora_adapter_not_found" if param == "lora_name" else "lora_path_not_found")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return RequestError(param, message, status=403, type_="permission_error", code="lora_path_not_allowed")
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
        return RequestError(param, message)
    return from_rpc_error(exc)


async def load(gw: Gateway, request: Request) -> PlainTextResponse:
    _check_enabled(gw, request)
    body = await _validated(request, LoadLoraAdapterRequest)
    try:
        await gw.client.stub.LoadLoraAdapter(spb.LoadLoraAdapterRequest(lora_name=body.lora_name,
                                                                        lora_path=body.lora_path),
                                             metadata=_auth_metadata(request), timeout=LOAD_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise _refusal(exc) from None
    gw.client.forget_model_info()  # this gateway's /v1/models lists it at once
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload(gw: Gateway, request: Request) -> PlainTextResponse:
    _check_enabled(gw, request)
    body = await _validated(request, UnloadLoraAdapterRequest)
    try:
        await gw.client.stub.UnloadLoraAdapter(spb.UnloadLoraAdapterRequest(lora_name=body.lora_name),
                                               metadata=_auth_metadata(request), timeout=10.0)
    except grpc.aio.AioRpcError as exc:
        raise _refusal(exc) from None
    gw.client.forget_model_info()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
