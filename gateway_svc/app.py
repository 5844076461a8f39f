"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions,
/v1/embeddings, /v1/models, /tokenize, /detokenize, /health and /metrics,
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
Anthropic's /v1/messages and OpenAI's /v1/responses, all served by
gateway.py's Gateway."""

from __future__ import annotations

import importlib.metadata
import logging
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway_svc import anthropic_api, embeddings, lora_admin, metrics, responses_api
from gateway_svc.config import GatewaySettings
from gateway_svc.errors import error_body, error_response, from_rpc_error
from gateway_svc.gateway import Gateway, _auth_metadata
from gateway_svc.protocol import RequestError
from gateway_svc.request_log import RequestLogMiddleware, record_of
from gateway_svc.scheduler_client import SchedulerClient

log = logging.getLogger("gateway_svc")
LLMSCHED_VERSION = importlib.metadata.version("llmsched")


def create_app(settings: GatewaySettings, client_interceptors: list | None = None) -> FastAPI:
    state: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = SchedulerClient(settings, client_interceptors)
        state["gw"] = Gateway(settings, client)
        yield
        await client.close()

    app = FastAPI(title="llmsched OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(metrics.MetricsMiddleware)
    # Added last, so it runs first: every response, metrics' included, has its id.
    app.add_middleware(RequestLogMiddleware, enabled=settings.request_log)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        record = record_of(request)
        if record is not None:
            record.reason = exc.message
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # Unknown routes and methods in OpenAI's error shape, not FastAPI's.
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, "not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        record = record_of(request)
        if record is not None:
            record.reason = f"internal error: {type(exc).__name__}"
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        ok = await state["gw"].client.serving()
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            info = await state["gw"].client.server_info(_auth_metadata(request))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        # `root` is the model the names stand for, as vLLM reports it; a
        # LoRA adapter's `parent` is the model it runs on.
        names = state["gw"].served_names(info)
        return {"object": "list", "data": [
            *({"id": name, "object": "model", "created": 0, "owned_by": "llmsched", "root": info.model,
               "parent": None, "max_model_len": info.max_model_len} for name in names),
            *({"id": name, "object": "model", "created": 0, "owned_by": "llmsched", "root": name,
               "parent": names[0], "max_model_len": info.max_model_len} for name in info.lora_adapters)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        listed = await models(request)
        for entry in listed["data"]:
            if entry["id"] == model_id:
                return entry
        raise RequestError("model", f"The model {model_id!r} does not exist; served: "
                                    f"{[e['id'] for e in listed['data']]}", status=404, type_="not_found_error",
                           code="model_not_found")

    @app.get("/version")
    async def version():
        return {"version": LLMSCHED_VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await state["gw"].tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await state["gw"].detokenize(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state["gw"].completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state["gw"].chat(request)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request):
        return await embeddings.embeddings(state["gw"], request)

    # vLLM's runtime LoRA routes: 404 naming GATEWAY_ALLOW_RUNTIME_LORA while it is off.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await lora_admin.load(state["gw"], request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await lora_admin.unload(state["gw"], request)

    anthropic_api.add_routes(app, lambda: state["gw"])
    responses_api.register(app, settings, lambda: state["gw"])

    return app
