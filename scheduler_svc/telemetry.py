"""Per-request and per-step observability: Prometheus metrics and the
OpenTelemetry request span's events, attributes and links.

One RequestTelemetry per live request records its timeline (arrival, first
scheduled, first token, last token); the engine calls it at each event.
"""

from __future__ import annotations

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from scheduler_svc.core.clock import SYSTEM_CLOCK, Clock
from scheduler_svc.core.scheduler import Load

# Link a request span to its first steps, then to steps whose index is a
# power of two: a 2,000-token generation gets ~19 links, not 2,000.
NUM_LINKED_FIRST_STEPS = 8

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

TIME_TO_FIRST_TOKEN = Histogram("llmsched_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("llmsched_inter_token_latency_seconds", "Time between a request's consecutive tokens",
                                buckets=_LATENCY_BUCKETS)
E2E_LATENCY = Histogram("llmsched_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS)
QUEUE_TIME = Histogram("llmsched_request_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = Histogram("llmsched_request_prompt_tokens", "Prompt tokens per request", buckets=_TOKEN_BUCKETS)
GENERATION_TOKENS = Histogram("llmsched_request_generation_tokens", "Generated tokens per request", buckets=_TOKEN_BUCKETS)
STEP_DURATION = Histogram("llmsched_step_duration_seconds",
                          "From when the executor could start a step (plan sent, previous step done) to its result",
                          buckets=_LATENCY_BUCKETS)
DROPPED_TOKENS = Counter("llmsched_dropped_tokens",
                         "Tokens sampled by a step in flight for a request that had finished, been preempted or "
                         "reset meanwhile; never streamed")
SPEC_DRAFT_TOKENS = Counter("llmsched_spec_decode_draft_tokens",
                            "Speculative drafts verified (EXECUTOR_SPECULATIVE_METHOD), over applied results")
SPEC_ACCEPTED_TOKENS = Counter("llmsched_spec_decode_accepted_tokens", "Speculative drafts accepted")
SPEC_ACCEPTED_LENGTH = Histogram("llmsched_spec_decode_accepted_length",
                                 "Drafts accepted per speculative step of one request",
                                 buckets=[0, 1, 2, 3, 4, 6, 8, 12, 16])
SPEC_MEAN_ACCEPTANCE = Gauge("llmsched_spec_decode_mean_acceptance_length",
                             "Tokens a speculative step of one request yields on average since start: 1 + the mean "
                             "of drafts accepted")
LOOKAHEAD_STEPS = Counter("llmsched_multi_step_lookahead_steps",
                          "Multi-step decode (SCHEDULER_MULTI_STEP_DECODE): lookahead slots past each request's "
                          "first token that plans granted (each a decode step, or with speculation a token its "
                          "steps may yield), by whether a token filled them or not (the run ended early at a stop "
                          "token, an arrival or a cancel, drafts were rejected, or the request finished first)",
                          ["outcome"])
STEP_SOCKET = Gauge("llmsched_executor_step_socket",
                    "1 while the step stream runs on the executor's Unix socket (same host), 0 on gRPC "
                    "(SCHEDULER_EXECUTOR_STEP_SOCKET)")
NUM_RUNNING = Gauge("llmsched_num_requests_running", "Requests in the running set")
NUM_WAITING = Gauge("llmsched_num_requests_waiting", "Requests waiting for admission")
KV_USAGE = Gauge("llmsched_kv_cache_usage_ratio", "Share of KV blocks held by live requests")
PREEMPTIONS = Counter("llmsched_num_preemptions",
                      "Requests preempted, by mode: swap (KV copied to the host tier) or recompute", ["mode"])
RECOMPUTED_TOKENS = Counter("llmsched_recomputed_tokens",
                            "Tokens computed a second time because their KV was lost, by cause: recompute "
                            "(preempted by recompute), swap (a swapped-out copy lost or failed), reset (a failed "
                            "step or a lost executor)", ["cause"])
PREFIX_QUERIES = Counter("llmsched_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("llmsched_prefix_cache_hits", "Prompt tokens found in the prefix cache, by tier (device, host)",
                      ["tier"])
HOST_KV_USAGE = Gauge("llmsched_host_kv_cache_usage_ratio",
                      "Share of host KV tier blocks held by swapped-out requests or being written")
SWAPPED_BLOCKS = Counter("llmsched_kv_swapped_blocks",
                         "KV blocks planned to copy between the tiers, by direction (out, in) and reason (spill: an "
                         "evicted prefix block; preemption; prefix_hit; resume)", ["direction", "reason"])
SWAP_FAILURES = Counter("llmsched_kv_swap_failures", "Block copies between the tiers the executor reported failed")
KV_TOKENS_HELD = Counter("llmsched_kv_tokens_held", "Tokens with KV in running requests' blocks, summed over steps")
KV_SLOTS_ALLOCATED = Counter("llmsched_kv_slots_allocated",
                             "Token slots in running requests' blocks, summed over steps (P6 = held / allocated)")
FINISHED = Counter("llmsched_request_success", "Requests finished, by reason", ["finished_reason"])
LORA_SLOTS_IN_USE = Gauge("llmsched_lora_slots_in_use", "LoRA device slots holding an adapter")
LORA_WAITING = Gauge("llmsched_lora_requests_waiting_for_slot",
                     "Requests whose LoRA adapter is in no device slot: waiting, or running and parked")
LORA_LOADS = Counter("llmsched_lora_loads", "LoRA adapters loaded into a device slot, by where the executor read "
                     "them from (host: its host cache; disk)", ["source"])
LORA_EVICTIONS = Counter("llmsched_lora_evictions", "LoRA adapters evicted from a device slot")
LORA_RUNTIME_CHANGES = Counter("llmsched_lora_runtime_changes", "Runtime LoRA adapter loads and unloads "
                               "(LoadLoraAdapter, UnloadLoraAdapter), by what was done: load, load_refused, unload, "
                               "or freed (its last request ended and the executor forgot it)", ["change"])
LORA_LOAD_SECONDS = Counter("llmsched_lora_load_seconds", "Time the executor spent on LoRA evictions and loads")
REJECTED = Counter("llmsched_request_rejected", "Requests refused at admission, by reason", ["reason"])

FINISH_LABELS = {2: "stop", 3: "length", 4: "abort", 5: "error"}

# Every label value exported from the start, at 0, so that dashboards and
# rate() see the series before the first event.
for _mode in ("swap", "recompute"):
    PREEMPTIONS.labels(_mode)
for _cause in ("recompute", "swap", "reset"):
    RECOMPUTED_TOKENS.labels(_cause)
for _tier in ("device", "host"):
    PREFIX_HITS.labels(_tier)
for _source in ("host", "disk"):
    LORA_LOADS.labels(_source)
for _change in ("load", "load_refused", "unload", "freed"):
    LORA_RUNTIME_CHANGES.labels(_change)
for _direction, _reason in (("out", "spill"), ("out", "preemption"), ("in", "prefix_hit"), ("in", "resume")):
    SWAPPED_BLOCKS.labels(_direction, _reason)

# Per tenant; the label is TenantLabels'.
TENANT_SERVED = Counter("llmsched_tenant_served_tokens", "Tokens served per tenant: prompt tokens computed, "
                        "output tokens generated", ["tenant", "kind"])
TENANT_WAITING = Gauge("llmsched_tenant_requests_waiting", "Requests waiting for admission, per tenant", ["tenant"])
TENANT_RUNNING = Gauge("llmsched_tenant_requests_running", "Requests in the running set, per tenant", ["tenant"])
TENANT_TTFT = Histogram("llmsched_tenant_time_to_first_token_seconds", "Arrival to first token, per tenant",
                        ["tenant"], buckets=_LATENCY_BUCKETS)
TENANT_SHED = Counter("llmsched_tenant_requests_shed", "Requests refused with RESOURCE_EXHAUSTED, per tenant",
                      ["tenant"])
TENANT_COUNTER = Gauge("llmsched_tenant_virtual_token_counter",
                       "SCHEDULER_POLICY=fair: each tenant's virtual token counter (weighted service)", ["tenant"])
OTHER_TENANTS = "other"


class TenantLabels:
    """Bounds the per-tenant series: the first `limit` tenants seen get a
    label of their own, the rest share `other`."""

    limit = 32
    _named: set[str] = set()

    @classmethod
    def of(cls, tenant: str) -> str:
        if tenant in cls._named:
            return tenant
        if len(cls._named) < cls.limit:
            cls._named.add(tenant)
            return tenant
        return OTHER_TENANTS


def record_shed(tenant: str) -> None:
    TENANT_SHED.labels(TenantLabels.of(tenant)).inc()


def record_tenants(served: dict[str, list[int]], last_served: dict[str, tuple[int, int]],
                   waiting: dict[str, int], running: dict[str, int], counters: dict[str, float]) -> None:
    """After a step: the service each tenant got since the last call, and
    its load now. Tenants no longer waiting or running read 0."""
    for tenant, (prompt, output) in served.items():
        before = last_served.get(tenant, (0, 0))
        label = TenantLabels.of(tenant)
        if prompt > before[0]:
            TENANT_SERVED.labels(label, "prompt").inc(prompt - before[0])
        if output > before[1]:
            TENANT_SERVED.labels(label, "output").inc(output - before[1])
        last_served[tenant] = (prompt, output)
    waiting_by, running_by, counter_by = {}, {}, {}
    for tenant in set(served) | set(waiting) | set(running) | set(counters):
        label = TenantLabels.of(tenant)
        waiting_by[label] = waiting_by.get(label, 0) + waiting.get(tenant, 0)
        running_by[label] = running_by.get(label, 0) + running.get(tenant, 0)
        if tenant in counters:
            counter_by[label] = max(counter_by.get(label, 0.0), counters[tenant])
    for label, n in waiting_by.items():
        TENANT_WAITING.labels(label).set(n)
    for label, n in running_by.items():
        TENANT_RUNNING.labels(label).set(n)
    for label, c in counter_by.items():
        TENANT_COUNTER.labels(label).set(c)


def is_linked_step(index: int) -> bool:
    return index < NUM_LINKED_FIRST_STEPS or (index & (index - 1)) == 0


class RequestTelemetry:
    def __init__(self, span: trace.Span, tracing: bool, tenant: str = "default", clock: Clock = SYSTEM_CLOCK):
        self.span = span
        self.tracing = tracing
        self.tenant = tenant
        self.clock = clock
        self.arrival = clock.monotonic()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_steps = 0

    def on_queued(self, num_prompt_tokens: int) -> None:
        if self.tracing:
            self.span.add_event("queued", {"prompt_tokens": num_prompt_tokens})

    def on_scheduled(self, step_span: trace.Span | None) -> None:
        now = self.clock.monotonic()
        if self.first_scheduled is None:
            self.first_scheduled = now
            QUEUE_TIME.observe(now - self.arrival)
            if self.tracing:
                self.span.add_event("first_scheduled")
        if self.tracing and step_span is not None and is_linked_step(self.num_steps):
            self.span.add_link(step_span.get_span_context(), {"step_index": self.num_steps})
        self.num_steps += 1

    def on_preempted(self, mode: str) -> None:
        PREEMPTIONS.labels(mode).inc()
        if self.tracing:
            self.span.add_event("preempted", {"steps_so_far": self.num_steps, "mode": mode})

    def on_tokens(self, num_tokens: int) -> None:
        now = self.clock.monotonic()
        if self.first_token is None:
            self.first_token = now
            TIME_TO_FIRST_TOKEN.observe(now - self.arrival)
            TENANT_TTFT.labels(TenantLabels.of(self.tenant)).observe(now - self.arrival)
            if self.tracing:
                self.span.add_event("first_token")
        elif self.last_token is not None and num_tokens:
            gap = (now - self.last_token) / num_tokens
            for _ in range(num_tokens):
                INTER_TOKEN_LATENCY.observe(gap)
        self.last_token = now

    def on_finished(self, status: int, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        now = self.clock.monotonic()
        reason = FINISH_LABELS.get(status, "unknown")
        FINISHED.labels(reason).inc()
        E2E_LATENCY.observe(now - self.arrival)
        PROMPT_TOKENS.observe(prompt_tokens)
        GENERATION_TOKENS.observe(output_tokens)
        if not self.tracing:
            return
        attrs = {
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "llmsched.cached_prompt_tokens": cached_tokens,
            "llmsched.finish_reason": reason,
            "llmsched.num_steps": self.num_steps,
        }
        if self.first_scheduled is not None:
            attrs["llmsched.queue_time_s"] = self.first_scheduled - self.arrival
        if self.first_token is not None:
            attrs["llmsched.time_to_first_token_s"] = self.first_token - self.arrival
            attrs["llmsched.prefill_time_s"] = self.first_token - (self.first_scheduled or self.arrival)
            attrs["llmsched.decode_time_s"] = now - self.first_token
        self.span.set_attributes(attrs)
        self.span.add_event("finished", {"reason": reason})


def record_rejected(span: trace.Span, tracing: bool, reason: str, message: str) -> None:
    REJECTED.labels(reason).inc()
    if tracing:
        span.add_event("rejected", {"reason": reason, "message": message})


def record_swaps(swaps, num_failed: int) -> None:
    """A plan's copies (host_tier.SwapPlan), once its result is back."""
    spilled = sum(1 for w in swaps.out_for if isinstance(w, bytes))
    hits = sum(1 for _, h in swaps.in_for if h is not None)
    SWAPPED_BLOCKS.labels("out", "spill").inc(spilled)
    SWAPPED_BLOCKS.labels("out", "preemption").inc(len(swaps.out_for) - spilled)
    SWAPPED_BLOCKS.labels("in", "prefix_hit").inc(hits)
    SWAPPED_BLOCKS.labels("in", "resume").inc(len(swaps.in_for) - hits)
    SWAP_FAILURES.inc(num_failed)


def record_lora(lora, out, outcome) -> None:
    """The LoRA slots after a step's result (lora_slots.py), and that
    step's evictions and loads."""
    LORA_SLOTS_IN_USE.set(lora.num_in_use)
    LORA_WAITING.set(lora.num_waiting_for_slot)
    if out.lora_loads:
        LORA_LOADS.labels("disk").inc(outcome.lora_disk_reads)
        LORA_LOADS.labels("host").inc(len(out.lora_loads) - outcome.lora_disk_reads)
        LORA_LOAD_SECONDS.inc(outcome.lora_load_ns / 1e9)
    LORA_EVICTIONS.inc(len(out.lora_evicts))


def record_load(load: Load, num_blocks: int) -> None:
    KV_TOKENS_HELD.inc(load.tokens_held)
    KV_SLOTS_ALLOCATED.inc(load.slots_allocated)
    NUM_RUNNING.set(load.num_running)
    NUM_WAITING.set(load.num_waiting)
    KV_USAGE.set(1.0 - load.num_free_blocks / num_blocks if num_blocks else 0.0)
