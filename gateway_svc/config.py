"""Gateway settings, read from GATEWAY_* environment variables.

Each field's description is what docs/configuration.md shows for it: that
page is rendered from these classes (python -m devtools.docgen), and a test
fails when it is stale."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmsched.logs import LOG_LEVEL_HELP, LogFormat, LogLevel, log_format_help


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    # All interfaces, like the scheduler's public API: the gateway is a front
    # door that routers and clients in other containers or pods reach, and
    # inside a container loopback would be unreachable. Compose publishes it
    # on the host's port 8080, like the scheduler's 50051.
    host: str = Field(
        default="0.0.0.0", description="Address the HTTP API binds to: all interfaces, because routers and clients "
        "in other containers or pods reach it. The test launcher binds `127.0.0.1`.")
    port: int = Field(
        default=8080, ge=0, le=65535, description="Port of the OpenAI-compatible HTTP API, `/health` and "
        "`/metrics`. Under `make serve`, 0 picks a free port, named in the serving line.")
    scheduler_address: str = Field(
        default="localhost:50051", description="`host:port` of the scheduler's public `llmsched.v1.Scheduler` API.")
    scheduler_tls_ca: str = Field(
        default="", description="TLS to the scheduler: the CA that signed its certificate. Empty = plaintext.")
    scheduler_tls_cert: str = Field(
        default="", description="Client certificate the gateway presents to a scheduler that requires mutual TLS.")
    scheduler_tls_key: str = Field(default="", description="Private key of `GATEWAY_SCHEDULER_TLS_CERT`.")
    served_model_name: str = Field(
        default="", description="The names clients use for the model, comma-separated (e.g. "
        "`meta-llama/Llama-3.1-8B-Instruct,llama-8b`): `/v1/models` lists each, a request naming any of them is "
        "served, and responses carry the first. Empty = the scheduler's model name: the checkpoint directory's "
        "name (`EXECUTOR_MODEL`'s last path component), or the built-in model's name (`tiny-random`).")
    max_n: int = Field(
        default=16, ge=1, description="Most completions one request may ask for with `n` (each is one `Generate` "
        "call); more is a 400 naming `n`.")
    max_embedding_inputs: int = Field(
        default=2048, ge=1, description="Most inputs one `/v1/embeddings` request may embed (each is one `Embed` "
        "call, all sent at once); more is a 400 naming `input`. 2048, as OpenAI's.")
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="Largest gRPC message sent to or accepted from the "
        "scheduler, in bytes; match `SCHEDULER_MAX_MESSAGE_BYTES`.")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] = Field(
        default="hermes", description="Tool-call format of the served model: how calls are read from its output "
        "under `tool_choice: auto`, and the format a grammar enforces under `required` or a named function. "
        "`hermes`: `<tool_call>{...}</tool_call>` (Qwen2.5, Qwen3, Hermes and the built-in models' ChatML); "
        "`llama3_json`: Llama 3.x JSON calls; `mistral`: `[TOOL_CALLS]`.")
    reasoning_parser: Literal["", "qwen3", "deepseek_r1"] = Field(
        default="", description="Returns a reasoning model's thinking (`<think>`...`</think>`) as "
        "`reasoning_content` on chat responses. `qwen3`: only an output that opens with `<think>` thinks; "
        "`deepseek_r1`: the output starts inside the thought (the template opened it), up to `</think>`. "
        "Empty = off: the text is returned as the model wrote it.")
    responses_store_max_entries: int = Field(
        default=1000, ge=1, description="Most responses the Responses API keeps (`store: true`, the default) for "
        "one API key, for `GET /v1/responses/{id}` and `previous_response_id`; the oldest is dropped first. The "
        "store is in this gateway's memory: behind a router keep a conversation on one gateway "
        "([Deployment](deployment.md)).")
    responses_store_max_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Most bytes (as JSON) of stored responses and their "
        "conversations for one API key; the oldest are dropped first, and one response bigger than this is not "
        "kept.")
    responses_store_ttl_s: float = Field(
        default=3600.0, gt=0, description="Seconds a stored response is kept; then `GET` and "
        "`previous_response_id` answer 404 for it.")
    allow_runtime_lora: bool = Field(
        default=False, description="Serves vLLM's runtime LoRA routes, `POST /v1/load_lora_adapter` "
        "(`{\"lora_name\", \"lora_path\"}`) and `POST /v1/unload_lora_adapter` (`{\"lora_name\"}`). Off: both "
        "answer 404 naming this setting. Anyone who can reach the gateway (with an API key, any key) can then "
        "load and unload adapters for every tenant; the files they may load are limited by the executor's "
        "`EXECUTOR_RUNTIME_LORA_DIR`, which must be set too.")
    log_level: LogLevel = Field(default="INFO", description=LOG_LEVEL_HELP)
    log_format: LogFormat = Field(
        default="text", validation_alias=AliasChoices("GATEWAY_LOG_FORMAT", "LOG_FORMAT"),
        description=log_format_help("gateway"))
    request_log: bool = Field(
        default=False, description="One log line per HTTP request when its response ends: `request_id` (the "
        "`X-Request-Id` response header), `tenant`, `route`, `status` (the HTTP status), `latency_ms`, "
        "`prompt_tokens`, `cached_tokens`, `output_tokens`, `finish_reason`, and `reason` for a refusal. Logger "
        "`requests`, level INFO; `/health` and `/metrics` are not logged.")

    @property
    def served_model_names(self) -> list[str]:
        """GATEWAY_SERVED_MODEL_NAME as a list; empty = the scheduler's name."""
        return [name.strip() for name in self.served_model_name.split(",") if name.strip()]
