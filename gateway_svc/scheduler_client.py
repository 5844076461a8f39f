"""The gateway's side of the scheduler's public gRPC API: one channel, the
model facts (cached briefly), health, prompt token counts and texts, one
Generate call per sample, and one Embed call per embedding input."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.config import GatewaySettings
from llmsched.security import channel_credentials
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

SCHEDULER_SERVICE = spb.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Model facts change only when a different executor connects; re-reading
# them every couple of seconds bounds how long a swap goes unnoticed
# without one extra round trip per request.
MODEL_INFO_TTL_S = 2.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model: str
    chat_template: str
    bos_token: str
    eos_token: str
    max_model_len: int = 0
    # LoRA adapters served beside the model: a request's `model` may name one.
    lora_adapters: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, info: spb.ServerInfo) -> "ModelInfo":
        return cls(info.model, info.chat_template, info.bos_token, info.eos_token, info.max_model_len,
                   tuple(info.lora_adapters))


class SchedulerClient:
    def __init__(self, settings: GatewaySettings, interceptors: list | None = None):
        options = [
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.max_receive_message_length", settings.max_message_bytes),
        ]
        creds = channel_credentials(settings.scheduler_tls_ca, settings.scheduler_tls_cert,
                                    settings.scheduler_tls_key)
        address = settings.scheduler_address
        if creds is None:
            self.channel = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        else:
            self.channel = grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
        self.stub = spb_grpc.SchedulerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._info: ModelInfo | None = None
        self._info_at = 0.0

    async def close(self) -> None:
        await self.channel.close()

    async def serving(self) -> bool:
        """The scheduler's own health, open without an API key."""
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=2.0)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def server_info(self, metadata) -> spb.ServerInfo:
        return await self.stub.GetServerInfo(spb.GetServerInfoRequest(), metadata=metadata, timeout=10.0)

    async def model_info(self, metadata, fresh: bool = False) -> ModelInfo:
        """Raises grpc.aio.AioRpcError (UNAVAILABLE without executor,
        UNAUTHENTICATED with a wrong key). fresh: not from the cache (a
        `model` it does not list may be a LoRA adapter loaded since)."""
        now = time.monotonic()
        if fresh or self._info is None or now - self._info_at > MODEL_INFO_TTL_S:
            self._info = ModelInfo.from_proto(await self.server_info(metadata))
            self._info_at = now
        return self._info

    def forget_model_info(self) -> None:
        """The LoRA adapters changed (runtime load or unload): read the facts again."""
        self._info = None

    async def count_tokens(self, prompt: str, metadata) -> int:
        """Tokens of a rendered chat prompt (no special tokens added), as a
        Generate call with that prompt counts them."""
        return len(await self.tokenize(prompt, False, metadata))

    async def tokenize(self, prompt: str, add_special_tokens: bool, metadata) -> list[int]:
        """The prompt's token ids, as a Generate call with it would have them."""
        resp = await self.stub.Tokenize(spb.TokenizeRequest(prompt=prompt, add_special_tokens=add_special_tokens),
                                        metadata=metadata, timeout=10.0)
        return list(resp.token_ids)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool, metadata) -> str:
        resp = await self.stub.Detokenize(spb.DetokenizeRequest(token_ids=token_ids,
                                                                skip_special_tokens=skip_special_tokens),
                                          metadata=metadata, timeout=10.0)
        return resp.text

    def generate(self, request: spb.GenerateRequest, metadata):
        return self.stub.Generate(request, metadata=metadata)

    def embed(self, request: spb.EmbedRequest, metadata):
        """The call, to await for its EmbedResponse; its trailers carry the
        tenant."""
        return self.stub.Embed(request, metadata=metadata)
