"""Speculative drafts from a second, smaller model with the target's
tokenizer (EXECUTOR_SPECULATIVE_METHOD=draft, EXECUTOR_SPECULATIVE_DRAFT_MODEL).

Its KV lives in a pool of its own with the target pool's block count and
block size, addressed through the same block tables: the scheduler's
blocks cover both models, and it never learns that a draft model exists.
A row's draft KV holds positions [0, num_draft_computed) and lags the
target's. A proposal first catches the draft model up over the row's
tokens since then (the whole prompt the first time; after that the last
accepted draft and the token the target added after it), which gives the
first draft, then decodes the rest one position at a time, every
speculating row batched at each. A re-sent request starts again from 0
(RequestRows.add), and after a step no row's draft KV runs past its target
KV (ModelRunner.execute): the positions past its last accepted draft held
rejected ones.

Blocks shared through the prefix cache get the same draft KV from every
row that catches up over them (the same tokens at the same positions).
Nothing the draft model computes can change an output: the target verifies
every draft, drawing each position as plain decoding would
(ModelRunner._verify), so stale or wrong draft KV costs acceptance only.

A draft is the draft model's own choice at its position: its argmax for a
greedy request; for a seeded sampled one, a draw with the uniforms the
target's draw at that position will use (sampler.py), so that where the two
models' distributions agree the draws coincide and sampled requests accept
about as often as greedy ones. With speculation on, the scheduler gives
every unseeded request a random seed of its own (Scheduler.add_request),
so this holds for all sampled requests; a row without one (a plan from
another scheduler) drafts the argmax.

Where the target replays CUDA graphs, so does the draft model (use_graphs,
unless its experts run the torch loop): its one-token steps replay decode
graphs, and its catch-up steps of up to 1 + K tokens a row verify-shaped
graphs (cuda_graphs.py), up to 32 rows. Eager, each of its K forwards a
step paid every kernel's launch, which at small batches is most of a
small model's time.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from tokenizers import Tokenizer

from executor_svc.attention import AttentionBackend
from executor_svc.model.model import CausalLM
from executor_svc.model.moe import experts_on_torch_loop
from executor_svc.step.batch import StepInputs, step_inputs
from executor_svc.step.cuda_graphs import MAX_VERIFY_BATCH, DecodeGraphs, VerifyGraphs
from executor_svc.step.host_memory import to_device
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.request_rows import RequestRows
from executor_svc.step.sampler import SamplingBatch, sample

log = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, model: CausalLM, pool: KVCachePool, backend: AttentionBackend, device: torch.device,
                 target_vocab_size: int):
        self.model, self.pool, self.backend, self.device = model, pool, backend, device
        self.kv_caches = pool.layer_caches()
        # A padded draft vocabulary may hold ids the target has no logit for.
        self.target_vocab_size = target_vocab_size
        # Captured steps (use_graphs), or None: eager.
        self.graphs: DecodeGraphs | None = None
        self.catch_up: VerifyGraphs | None = None

    def use_graphs(self, max_blocks_per_seq: int, q_len: int, pool=None, capture: bool = True) -> None:
        """Captures the draft model's decode steps and its catch-up steps of
        up to q_len tokens a row, sharing the target's graph pool. A draft
        model whose experts run the torch loop (which syncs with the host),
        or a failed capture, stays eager."""
        if experts_on_torch_loop(self.model):
            log.info("the draft model runs eagerly: its experts run the torch loop, which no CUDA graph can hold")
            return
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.device, max_blocks_per_seq,
                                       MAX_VERIFY_BATCH, pool, capture)
            self.catch_up = VerifyGraphs(self.model, self.kv_caches, self.backend, self.device, max_blocks_per_seq,
                                         self.pool.block_size, q_len, self.graphs.pool, capture)
        except Exception:
            log.exception("capturing the draft model's CUDA graphs failed; it runs eagerly")
            self.graphs = self.catch_up = None

    @torch.inference_mode()
    def propose(self, r: RequestRows, rows: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
        """counts[i] drafts for each rows[i] (ascending rows of r), written
        to r.token_ids after its known tokens as they are drawn (each is the
        next one's input)."""
        known = r.num_tokens[rows]
        drawn = np.zeros((len(rows), int(counts.max())), dtype=np.int64)
        sel = np.arange(len(rows))  # the rows still drafting, as indices into rows
        start = np.minimum(r.num_draft_computed[rows], known - 1)  # at least the last known token
        q = known - start
        for j in range(drawn.shape[1]):
            at = rows[sel]
            batch = step_inputs(r, at, start, q, self.device)
            tokens = choose_drafts(self._last_logits(batch, q), r, at, j, self.device)
            drawn[sel, j] = tokens
            r.token_ids[at, known[sel] + j] = tokens
            r.num_draft_computed[at] = start + q
            sel = sel[counts[sel] > j + 1]
            start, q = known[sel] + j, np.ones(len(sel), dtype=np.int64)
        out = []
        for i, k in enumerate(counts.tolist()):
            d = drawn[i, :k]
            beyond = np.flatnonzero(d >= self.target_vocab_size)
            out.append(d[:beyond[0]] if len(beyond) else d)
        return out

    def _last_logits(self, batch: StepInputs, q: np.ndarray) -> torch.Tensor:
        """The logits [n, vocab] at each row's last token of the step: a
        replayed graph's (a view of its buffer, read before the next
        replay) where one fits, else the eager forward's."""
        n = len(q)
        last = None if batch.num_tokens == n else to_device(batch.cu[1:] - 1, self.device)
        if self.graphs is not None and last is None and n <= self.graphs.max_batch:
            return self.graphs.run(batch.ids, batch.positions, batch.meta)[0]
        if self.catch_up is not None and self.catch_up.fits(q):
            logits = self.catch_up.run(batch.ids, batch.positions, batch.meta, q)[0]
            return logits if last is None else logits[last]
        hidden = self.model(batch.ids, batch.positions, self.kv_caches, batch.meta, self.backend)
        return self.model.compute_logits(hidden if last is None else hidden[last])


def choose_drafts(logits: torch.Tensor, r: RequestRows, rows: np.ndarray, offset: int,
                  device: torch.device) -> np.ndarray:
    """Each row's draft at output index num_output + offset, from a
    proposer's logits: the argmax, or for a seeded sampled row the draw the
    target's own draw there would make from the same logits."""
    temperature = np.where(r.seeded[rows], r.temperature[rows], 0).astype(np.float32)
    if not temperature.any():
        return logits.argmax(dim=-1).cpu().numpy()
    batch = SamplingBatch.from_arrays(temperature, r.top_p[rows], r.top_k[rows], r.seed[rows], r.seeded[rows],
                                      r.num_output[rows] + offset, np.zeros(len(rows), dtype=np.int64), device,
                                      logits.shape[-1], min_p=r.min_p[rows])
    return np.array(sample(logits, batch).token_ids, dtype=np.int64)


def vocabulary_mismatch(target_tokenizer_json: str, draft_tokenizer_json: str) -> str | None:
    """Why a draft model's tokenizer cannot draft for the target's (an id
    meaning another string in each), or None: the two map every token
    string, added tokens included, to the same id."""
    target = Tokenizer.from_str(target_tokenizer_json).get_vocab(with_added_tokens=True)
    draft = Tokenizer.from_str(draft_tokenizer_json).get_vocab(with_added_tokens=True)
    if target == draft:
        return None
    differ = sum(draft.get(token) != i for token, i in target.items()) + len(draft.keys() - target.keys())
    return (f"its tokenizer differs from the target's ({differ} of {len(target)} target tokens missing or at "
            "another id); a draft model must share the target's tokenizer")
