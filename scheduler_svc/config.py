"""Scheduler settings, read from SCHEDULER_* environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SCHEDULER_", extra="ignore")

    # Address the public llmsched.v1.Scheduler API binds to.
    host: str = "0.0.0.0"
    # Port of the public API; 0 picks a free port.
    port: int = Field(default=50051, ge=0, le=65535)
    # Port of the Prometheus /metrics endpoint; 0 turns it off.
    metrics_port: int = Field(default=8000, ge=0, le=65535)
    # host:port of the executor's step channel.
    executor_address: str = "localhost:50052"
    # How long to wait for the executor at start-up before giving up.
    executor_connect_timeout_s: float = Field(default=120.0, gt=0)
    # After the step channel breaks: how long to keep reconnecting before
    # in-flight requests fail with UNAVAILABLE.
    executor_reconnect_timeout_s: float = Field(default=30.0, gt=0)
    # Keepalive ping interval to the executor, in seconds: an executor that
    # dies or stops answering for as long again is noticed even when no
    # step is in flight, and health turns NOT_SERVING.
    executor_keepalive_s: float = Field(default=10.0, gt=0)
    # Step plans sent ahead of their results: with 2, the scheduler plans
    # step N+1 while the executor runs step N. 1 = plan, run, update in turn.
    max_plans_in_flight: int = Field(default=2, ge=1, le=8)
    # A step whose result does not arrive within this long counts as a lost
    # executor: the scheduler reconnects and recomputes.
    step_timeout_s: float = Field(default=120.0, gt=0)
    # Health reports NOT_SERVING when work is pending and no step has
    # completed for this long.
    stall_timeout_s: float = Field(default=60.0, gt=0)
    # On SIGTERM: how long in-flight requests may run before they are
    # aborted (FINISH_REASON_ABORT).
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # At most this many requests run in one step.
    max_num_seqs: int = Field(default=256, ge=1)
    # At most this many tokens (prefill + decode) are computed per step.
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # At most this many prompt tokens of one request per step (chunked
    # prefill), so long prompts share steps with running decodes.
    max_prefill_chunk: int = Field(default=512, ge=1)
    # fcfs: arrival order. priority: GenerateRequest.priority (lower = more
    # urgent), then arrival, for both admission and preemption.
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Reuse the KV of full blocks shared with earlier requests.
    enable_prefix_caching: bool = True
    # Backpressure: most requests waiting for admission; more are refused
    # with RESOURCE_EXHAUSTED.
    max_queued_requests: int = Field(default=4096, ge=1)
    # Backpressure: most prompt tokens waiting for admission.
    max_queued_tokens: int = Field(default=1_048_576, ge=1)
    # Backpressure: refuse a request whose predicted time to first token
    # (from measured step throughput and the work queued ahead of it)
    # exceeds this; 0 turns the check off.
    max_queue_delay_ms: float = Field(default=30_000.0, ge=0)
    # Largest accepted stop-string list, and longest stop string.
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_string_chars: int = Field(default=256, ge=1)
    # Largest accepted stop_token_ids list.
    max_stop_token_ids: int = Field(default=64, ge=0)
    # Largest gRPC message accepted or sent, in bytes; a bigger
    # GenerateRequest is refused with RESOURCE_EXHAUSTED by gRPC itself.
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # TLS for the public API: PEM certificate and key. With tls_client_ca,
    # clients must present a certificate signed by that CA (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # TLS to the executor: the CA that signed its certificate; with
    # executor_tls_cert/key, the scheduler presents a client certificate.
    executor_tls_ca: str = ""
    executor_tls_cert: str = ""
    executor_tls_key: str = ""
    # API keys for the public API, sent as `authorization: Bearer <key>`:
    # comma-separated, and/or a file of one key per line. Both empty = no
    # authentication. Health and reflection stay open.
    api_keys: str = ""
    api_keys_file: str = ""
    log_level: str = "INFO"
