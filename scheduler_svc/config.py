"""Scheduler settings, read from SCHEDULER_* environment variables.

Each field's description is what docs/configuration.md shows for it: that
page is rendered from these classes (python -m devtools.docgen), and a test
fails when it is stale."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmsched.logs import LOG_LEVEL_HELP, LogFormat, LogLevel, log_format_help


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SCHEDULER_", extra="ignore")

    host: str = Field(default="0.0.0.0", description="Address the public `llmsched.v1.Scheduler` API binds to.")
    port: int = Field(default=50051, ge=0, le=65535, description="Port of the public API; 0 picks a free port.")
    metrics_port: int = Field(default=8000, ge=0, le=65535,
                              description="Port of the Prometheus `/metrics` endpoint; 0 turns it off.")
    executor_address: str = Field(default="localhost:50052", description="`host:port` of the executor's step channel.")
    executor_connect_timeout_s: float = Field(
        default=120.0, gt=0, description="How long to wait for the executor at start-up before giving up.")
    executor_reconnect_timeout_s: float = Field(
        default=30.0, gt=0, description="After the step channel breaks: how long to keep reconnecting before "
        "in-flight requests fail with UNAVAILABLE.")
    executor_step_socket: Literal["auto", "off"] = Field(
        default="auto", description="`auto`: when the executor offers its step stream on a Unix socket "
        "(`EXECUTOR_STEP_SOCKET`) and the socket is reachable from here, plans and results go over it; gRPC "
        "otherwise. `off`: always gRPC.")
    executor_keepalive_s: float = Field(
        default=10.0, gt=0, description="Keepalive ping interval to the executor, in seconds. An executor that dies "
        "or stops answering for as long again is noticed even when no step is in flight, and health turns "
        "NOT_SERVING.")
    # 2 hides the scheduler's own work (detokenizing, streaming, planning)
    # behind the executor's step; the rules that make it safe are in
    # scheduler.py and plan.py.
    max_plans_in_flight: int = Field(
        default=2, ge=1, le=8, description="Step plans sent ahead of their results. With 2 the scheduler plans step "
        "N+1 while the executor runs step N (overlapped steps); 1 = plan, run, update in turn.")
    step_timeout_s: float = Field(
        default=120.0, gt=0, description="A step whose result has not arrived within this long counts as a lost "
        "executor: the scheduler reconnects and recomputes.")
    stall_timeout_s: float = Field(
        default=60.0, gt=0, description="Health reports NOT_SERVING when work is pending and no step has completed "
        "for this long.")
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM: how long in-flight requests may run before they end with "
        "FINISH_REASON_ABORT. Closing connections afterwards gets 10 s more; should that hang, the process exits "
        "anyway and logs the pending tasks.")
    max_num_seqs: int = Field(default=256, ge=1, description="Most requests running in one step.")
    speculative_max_batch: int = Field(
        default=16, ge=0, description="With an executor that speculates (`EXECUTOR_SPECULATIVE_METHOD`): requests "
        "draft up to `EXECUTOR_SPECULATIVE_TOKENS` each while at most half this many run, half as many (at least "
        "one) up to this many, and none above it, so a loaded server does not pay for verifying drafts it cannot "
        "use. 0 = never speculate.")
    multi_step_decode: int = Field(
        default=8, ge=1, le=64, description="Multi-step decode: when nothing needs the scheduler between steps "
        "(no request waiting, every running request decoding, none constrained, room in the KV pool), one plan "
        "runs up to this many decode steps on the executor, which returns each step's tokens. With speculation "
        "(`EXECUTOR_SPECULATIVE_METHOD`), each step verifies drafts instead, and a request may take as many more "
        "tokens a plan as it may draft per step. "
        "A new request or a cancel arriving on the executor, or a stop token, ends the run early (a CPU executor "
        "running it on its event loop, where nothing arrives meanwhile, ends it after five milliseconds "
        "instead); tokens past a stop string are cut. Output is the same as one step per plan. 1 = off; the "
        "default, 8, is chosen by measurement (docs/performance.md, P12).")
    multi_step_max_batch: int = Field(
        default=8, ge=0, description="Multi-step decode (`SCHEDULER_MULTI_STEP_DECODE`) only while at most this "
        "many requests run: a larger batch already spreads each step's fixed cost over its rows.")
    lora_quantum_steps: int = Field(
        default=4, ge=1, le=100000, description="With more LoRA adapters wanted than the executor has device slots "
        "(`EXECUTOR_MAX_LORAS`): the steps an adapter keeps its slot while another waits for one. Then its running "
        "requests are parked (they keep their KV and resume when their adapter is back) and the slot passes to "
        "the first waiting adapter in policy order. Smaller: shorter waits for a slot, more loads.")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="Most tokens (prefill + decode) computed per step: the step token budget.")
    # Chunking lets long prompts share steps with running decodes instead of
    # stalling them for a whole prefill.
    max_prefill_chunk: int = Field(
        default=512, ge=1, description="Most prompt tokens of one request per step (chunked prefill). With an "
        "executor in batch-invariant mode (`EXECUTOR_BATCH_INVARIANT=on`, learned in the handshake) a prompt's "
        "chunks end at multiples of this, rounded down to whole blocks, and are never cut short by the step's "
        "budget: a chunk that does not fit waits a step.")
    policy: Literal["fcfs", "priority", "fair"] = Field(
        default="fcfs", description="`fcfs`: arrival order. `priority`: `GenerateRequest.priority` (lower = more "
        "urgent), then arrival. `fair`: the Virtual Token Counter across tenants (each tenant's share of the "
        "service follows its weight; a flood from one cannot starve another), priority then arrival within a "
        "tenant. Used both for admission and for choosing preemption victims.")
    tenant_weights: str = Field(
        default="", description="`fair`: tenants' weights, as `teamA=2,teamB=1`; a tenant not named weighs 1. A "
        "tenant's share of the service while backlogged is its weight over the sum of the backlogged tenants'.")
    prompt_token_weight: float = Field(
        default=1.0, gt=0, description="`fair`: the service one computed prompt token counts for (a prompt token "
        "served from the prefix cache counts nothing).")
    output_token_weight: float = Field(
        default=2.0, gt=0, description="`fair`: the service one generated token counts for.")
    prefix_cache_scope: Literal["global", "tenant"] = Field(
        default="global", description="`global`: every request may reuse any request's cached prefix. `tenant`: "
        "prefix-cache blocks are salted by tenant, so a tenant never hits (and cannot time) another tenant's "
        "prompts. A request's `cache_salt` overrides either: only requests with the same salt share.")
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV of full blocks shared with earlier requests.")
    preemption_mode: Literal["auto", "recompute", "swap"] = Field(
        default="auto", description="How a request preempted for lack of KV blocks leaves the device pool, when the "
        "executor has a host KV tier (`EXECUTOR_HOST_KV_CACHE_MEMORY_MB`): `swap` copies its blocks to the host tier "
        "and back when it resumes; `recompute` frees them and recomputes its tokens; `auto` swaps when the host tier "
        "has room and the copy, at the measured seconds per block, is cheaper than recomputing at the measured "
        "seconds per prefill token. Without room in the host tier, or without one, it recomputes.")
    max_queued_requests: int = Field(
        default=4096, ge=1, description="Backpressure: most requests waiting for admission; more are refused with "
        "RESOURCE_EXHAUSTED.")
    max_queued_requests_per_tenant: int = Field(
        default=0, ge=0, description="Backpressure per tenant: most requests one tenant may have waiting; more "
        "are refused with RESOURCE_EXHAUSTED (and `retry-after-ms`) before the global limits shed everyone. 0 = "
        "no per-tenant limit.")
    max_tenant_labels: int = Field(
        default=32, ge=1, description="Most tenants that get their own label in per-tenant metrics; later ones "
        "are counted under `other`, so the number of series stays bounded.")
    max_queued_tokens: int = Field(
        default=1_048_576, ge=1, description="Backpressure: most prompt tokens waiting for admission.")
    max_queue_delay_ms: float = Field(
        default=30_000.0, ge=0, description="Backpressure: refuse (RESOURCE_EXHAUSTED, with a `retry-after-ms` hint) "
        "a request whose predicted time to first token, from the measured step throughput and the work queued "
        "ahead of it, exceeds this; 0 turns the check off.")
    max_stop_strings: int = Field(default=16, ge=0, description="Longest accepted `stop` list.")
    max_stop_string_chars: int = Field(default=256, ge=1, description="Longest accepted stop string, in characters.")
    max_stop_token_ids: int = Field(default=64, ge=0, description="Longest accepted `stop_token_ids` list.")
    max_logit_bias: int = Field(default=1024, ge=0, description="Most `logit_bias` entries one request may set.")
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted or sent, in bytes; a bigger "
        "`GenerateRequest` is refused with RESOURCE_EXHAUSTED by gRPC itself.")
    constraint_compile_timeout_s: float = Field(
        default=10.0, gt=0, description="Longest a `structured` constraint may take to compile (on a worker "
        "thread, off the event loop); one that takes longer is refused with INVALID_ARGUMENT naming the field, "
        "before anything is queued.")
    constraint_cache_size: int = Field(
        default=1024, ge=1, description="Compiled constraints kept, by content (LRU): a schema sent again is not "
        "compiled again.")
    tls_cert: str = Field(default="", description="PEM certificate file: TLS on the public API (with `SCHEDULER_TLS_KEY`).")
    tls_key: str = Field(default="", description="PEM private key file of `SCHEDULER_TLS_CERT`.")
    tls_client_ca: str = Field(
        default="", description="With TLS: clients must present a certificate signed by this CA (mutual TLS).")
    executor_tls_ca: str = Field(
        default="", description="TLS to the executor: the CA that signed the executor's certificate. Empty = "
        "plaintext.")
    executor_tls_cert: str = Field(
        default="", description="Client certificate the scheduler presents to the executor (mutual TLS).")
    executor_tls_key: str = Field(default="", description="Private key of `SCHEDULER_EXECUTOR_TLS_CERT`.")
    # Health and reflection stay open so that probes and tooling work
    # without a key (llmsched/security.py).
    api_keys: str = Field(
        default="", description="Comma-separated API keys for the public API; clients send "
        "`authorization: Bearer <key>`, and a missing or wrong key gets UNAUTHENTICATED. An entry `tenant:key` "
        "gives its key's requests that tenant; a bare key is a tenant of its own, named `key-` and a digest that "
        "does not reveal the key. Empty here and in `SCHEDULER_API_KEYS_FILE` = no authentication, and requests "
        "belong to the tenant they name (trusted networks only). Health and reflection stay open.")
    api_keys_file: str = Field(
        default="", description="File of API keys (or `tenant:key` entries), one per line; adds to "
        "`SCHEDULER_API_KEYS`.")
    log_level: LogLevel = Field(default="INFO", description=LOG_LEVEL_HELP)
    log_format: LogFormat = Field(
        default="text", validation_alias=AliasChoices("SCHEDULER_LOG_FORMAT", "LOG_FORMAT"),
        description=log_format_help("scheduler"))
    request_log: bool = Field(
        default=False, description="One log line per `Generate` call when it ends: `request_id`, `tenant`, "
        "`route`, `status` (a gRPC code name), `latency_ms`, `prompt_tokens`, `cached_tokens`, `output_tokens`, "
        "`finish_reason`, and `reason` for a refusal. Logger `requests`, level INFO.")
