"""Gateway settings, read from GATEWAY_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    # Address the HTTP API binds to. All interfaces, like the scheduler's
    # public API: the gateway is a front door that routers and clients in
    # other containers or pods reach, and inside a container loopback would
    # be unreachable. Compose publishes it on 127.0.0.1 only.
    host: str = "0.0.0.0"
    # Port of the OpenAI-compatible HTTP API (and its /metrics).
    port: int = Field(default=8080, ge=0, le=65535)
    # host:port of the scheduler's public llmsched.v1.Scheduler API.
    scheduler_address: str = "localhost:50051"
    # TLS to the scheduler: the CA that signed its certificate; with
    # scheduler_tls_cert/key the gateway presents a client certificate
    # (mutual TLS). Empty = plaintext.
    scheduler_tls_ca: str = ""
    scheduler_tls_cert: str = ""
    scheduler_tls_key: str = ""
    # Most completions one request may ask for with `n`; each is one
    # Generate call.
    max_n: int = Field(default=16, ge=1)
    # Largest gRPC message sent or accepted, in bytes; match the scheduler's
    # SCHEDULER_MAX_MESSAGE_BYTES.
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    log_level: str = "INFO"
