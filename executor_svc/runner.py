"""Runs one step plan: mirrors request state, builds the flattened batch,
runs the model and samples.

The executor mirrors just enough of each request to turn a diff-only plan
into tensors: its token ids (the scheduler sends them once; the executor
appends the tokens it samples itself), its block table (append-only) and
how many of its tokens have KV in the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.kv_cache import KVCachePool
from executor_svc.model import CausalLM
from executor_svc.sampler import SamplingSettings, sample


@dataclass(slots=True)
class NewRequestData:
    handle: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingSettings
    num_output_tokens: int


@dataclass(slots=True)
class StepInput:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_handles: list[int] = field(default_factory=list)
    cached_num_scheduled_tokens: list[int] = field(default_factory=list)
    new_block_handles: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    finished_handles: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    step_id: int
    sampled_handles: list[int]
    sampled_token_ids: list[int]
    logprobs: list[tuple[float, list[int], list[float]]] | None
    prepare_ns: int
    forward_ns: int
    sample_ns: int


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingSettings
    num_output_tokens: int


class PlanError(ValueError):
    """The plan contradicts the executor's mirror of request state."""


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVCachePool, backend: AttentionBackend, device: torch.device,
                 fail_on_token: int = -1):
        self.model, self.pool, self.backend, self.device = model, pool, backend, device
        self.fail_on_token = fail_on_token  # fault injection for tests; -1 = off
        self.kv_caches = pool.layer_caches()
        self.requests: dict[int, RequestState] = {}

    def reset(self) -> None:
        """Forgets every request, e.g. when a new scheduler connects."""
        self.requests.clear()

    def _apply_diffs(self, step: StepInput) -> list[tuple[int, int]]:
        for h in step.finished_handles:
            self.requests.pop(h, None)
        scheduled: list[tuple[int, int]] = []
        for new in step.new_requests:
            self.requests[new.handle] = RequestState(
                token_ids=list(new.token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                num_output_tokens=new.num_output_tokens,
            )
            scheduled.append((new.handle, new.num_scheduled_tokens))
        for h, b in zip(step.new_block_handles, step.new_block_ids):
            self._get(h).block_ids.append(b)
        scheduled.extend(zip(step.cached_handles, step.cached_num_scheduled_tokens))
        return scheduled

    def _get(self, handle: int) -> RequestState:
        try:
            return self.requests[handle]
        except KeyError:
            raise PlanError(f"plan names request handle {handle}, which the executor does not hold") from None

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        t0 = time.perf_counter_ns()
        scheduled = self._apply_diffs(step)
        if not scheduled:
            return StepOutput(step.step_id, [], [], None, time.perf_counter_ns() - t0, 0, 0)

        block_size = self.pool.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        req_index: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[tuple[int, RequestState]] = []
        for r, (handle, n) in enumerate(scheduled):
            st = self._get(handle)
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if n <= 0 or end > len(st.token_ids):
                raise PlanError(
                    f"handle {handle}: {n} tokens scheduled after {start} computed, but it has {len(st.token_ids)}"
                )
            if -(-end // block_size) > len(st.block_ids):
                raise PlanError(f"handle {handle}: block table of {len(st.block_ids)} blocks cannot hold {end} tokens")
            input_ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            req_index.extend([r] * n)
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(st.block_ids)
            if end == len(st.token_ids):  # prompt fully computed: this row samples
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append((handle, st))

        if self.fail_on_token >= 0 and self.fail_on_token in input_ids:
            raise RuntimeError(f"injected fault: batch holds token {self.fail_on_token}")
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.long)
        req_index_t = torch.tensor(req_index, dtype=torch.long)
        # slot = block_table[req, pos // block_size] * block_size + pos % block_size
        slot_mapping = block_tables[req_index_t, positions_t // block_size].long() * block_size + positions_t % block_size
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            cu_query_lens=cu.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        t1 = time.perf_counter_ns()

        hidden = self.model(ids_t, positions_t.to(dev), self.kv_caches, meta, self.backend)  # [num_tokens, hidden]
        logits = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])  # [num_sampled, vocab]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter_ns()

        for st, (_, n) in zip((self.requests[h] for h, _ in scheduled), scheduled):
            st.num_computed_tokens += n
        handles: list[int] = []
        tokens: list[int] = []
        logprobs = None
        if logits is not None:
            out = sample(logits, [st.sampling for _, st in sample_reqs], [st.num_output_tokens for _, st in sample_reqs])
            for (handle, st), tok in zip(sample_reqs, out.token_ids):
                st.token_ids.append(tok)
                st.num_output_tokens += 1
                handles.append(handle)
                tokens.append(tok)
            logprobs = out.logprobs
        t3 = time.perf_counter_ns()
        return StepOutput(step.step_id, handles, tokens, logprobs, t1 - t0, t2 - t1, t3 - t2)
