"""Speculative drafts from a head that reads the target's hidden states:
DeepSeek-V3's multi-token-prediction layer (EXECUTOR_SPECULATIVE_METHOD=mtp;
executor_svc/model/mtp.py) or an EAGLE-3 head (eagle3; model/eagle3.py).

Such a head reads the target's hidden states, so it runs beside the target
rather than on its own. After every step (observe) it computes its layer
over the positions each row's step left verified, position i with token
i + 1 (known by then: the prompt's, or the token the step sampled or
accepted) and the target's features at i (its final normed hidden state
for MTP, three layers' states fused for EAGLE-3), writing its own KV: a
one-layer pool with the target pool's block count, addressed through the
same block tables. For each row whose last known token it reached it keeps
the first draft (read at the last position) and that position's output. A
proposal (propose) starts from those and runs the layer once per further
draft, one position ahead each time, on its own previous output in place
of the target's features, which the target computes only when it
verifies; the next observe rewrites those positions' KV from the target's.

A position the head never computed (a prefix-cache hit on blocks that an
embedding request or a swap filled, say) leaves stale KV behind: that
costs acceptance only, since the target verifies every draft
(ModelRunner._verify). Drafts are chosen as a draft model's are
(draft_model.choose_drafts), from the head's logits in the target's
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention import AttentionBackend
from executor_svc.step.batch import step_inputs
from executor_svc.step.draft_model import choose_drafts
from executor_svc.step.host_memory import to_device
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.request_rows import RequestRows


@dataclass(slots=True)
class FirstDraft:
    """What observe left for a row's next proposal."""

    num_tokens: int  # the row's known tokens then: stale once it has more
    draft: int
    hidden: torch.Tensor  # [hidden]: the head's output at the row's second-to-last token


class HeadProposer:
    """head: features(hidden) -> what observe feeds it per position, from
    the target forward's final hidden states (and what the target captured
    on the way); predict(next_ids, positions, previous, cache, meta,
    backend) -> its output per position; compute_logits(output) -> logits
    over the target's vocabulary (None on tensor-parallel ranks other than 0)."""

    # The runner hands every step's features to observe: from its CUDA
    # graphs, which compute them, or eagerly (the compiled CPU decode step
    # returns logits only, so it stands aside).
    observes = True

    def __init__(self, head, pool: KVCachePool, backend: AttentionBackend, device: torch.device, tp=None):
        self.head, self.pool, self.backend, self.device = head, pool, backend, device
        # Under tensor parallelism every rank runs the head (an MTP layer is
        # sharded as the target's layers are; an EAGLE-3 head is whole on
        # each) on the same inputs; rank 0 draws, and shares each draw so
        # the next input is everyone's.
        self.tp = tp
        self.cache = pool.layer_caches()[0]
        self.first: dict[int, FirstDraft] = {}  # by row

    def forget(self, row: int) -> None:
        """A request (re-)sent into row: what was kept there is another's."""
        self.first.pop(row, None)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What observe reads of a target forward: its final hidden states
        (or the layers' states it kept on the way), per token. The runner
        calls it right after the forward, or inside its CUDA graphs."""
        return self.head.features(hidden)

    @torch.inference_mode()
    def observe(self, r: RequestRows, features: torch.Tensor, rows: np.ndarray, cu: np.ndarray,
                start: np.ndarray) -> None:
        """features[cu[i]:cu[i + 1]] (features()): rows[i]'s positions from
        start[i], as this step computed them."""
        verified_end = np.minimum(r.num_computed[rows], r.num_tokens[rows] - 1)
        q = verified_end - start
        keep = np.flatnonzero(q > 0)
        if not len(keep):
            return
        at, q = rows[keep], q[keep]
        batch = step_inputs(r, at, start[keep], q, self.device, shift=1)
        index = np.repeat(cu[:-1][keep] - batch.cu[:-1], q) + np.arange(batch.num_tokens)
        previous = features if len(index) == len(features) else features[to_device(index, self.device)]
        out = self.head.predict(batch.ids, batch.positions, previous, self.cache, batch.meta, self.backend)
        # Rows it brought to their last known token: their first draft.
        ready = np.flatnonzero(verified_end[keep] == r.num_tokens[at] - 1)
        if not len(ready):
            return
        last = out[to_device(batch.cu[1:][ready] - 1, self.device)]
        drafts = self._choose(self.head.compute_logits(last), r, at[ready], 0)
        for i, row in enumerate(at[ready].tolist()):
            self.first[row] = FirstDraft(int(r.num_tokens[row]), int(drafts[i]), last[i])

    @torch.inference_mode()
    def propose(self, r: RequestRows, rows: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
        """Up to counts[i] drafts for each rows[i]: none for a row with no
        first draft for its current tokens (its last step did not reach
        them, or it was re-sent since)."""
        known = r.num_tokens[rows]
        out = [np.zeros(0, dtype=np.int64)] * len(rows)
        have = np.array([(f := self.first.get(row)) is not None and f.num_tokens == n
                         for row, n in zip(rows.tolist(), known.tolist())], dtype=bool)
        sel = np.flatnonzero(have)
        if not len(sel):
            return out
        at, n, k = rows[sel], known[sel], counts[sel]
        drawn = np.zeros((len(sel), int(k.max())), dtype=np.int64)
        drawn[:, 0] = [self.first[row].draft for row in at.tolist()]
        r.token_ids[at, n] = drawn[:, 0]
        previous = torch.stack([self.first[row].hidden for row in at.tolist()])
        for j in range(1, drawn.shape[1]):
            sub = np.flatnonzero(k > j)
            # Position n - 2 + j reads token n - 1 + j, the draft before.
            batch = step_inputs(r, at[sub], n[sub] - 2 + j, np.ones(len(sub), dtype=np.int64), self.device, shift=1)
            sub_t = to_device(sub, self.device)
            h = self.head.predict(batch.ids, batch.positions, previous[sub_t], self.cache, batch.meta, self.backend)
            drawn[sub, j] = self._choose(self.head.compute_logits(h), r, at[sub], j)
            r.token_ids[at[sub], n[sub] + j] = drawn[sub, j]
            previous[sub_t] = h
        for j, (i, kk) in enumerate(zip(sel.tolist(), k.tolist())):
            out[i] = drawn[j, :kk]
        return out

    def _choose(self, logits: torch.Tensor | None, r: RequestRows, rows: np.ndarray, offset: int) -> np.ndarray:
        if self.tp is None:
            return choose_drafts(logits, r, rows, offset, self.device)
        if self.tp.rank != 0:
            return np.array(self.tp.share_tokens(None, len(rows)), dtype=np.int64)
        try:
            drafts = choose_drafts(logits, r, rows, offset, self.device)
        except Exception:
            self.tp.share_tokens(None, len(rows))  # the other ranks fail this step too
            raise
        self.tp.share_tokens(drafts.tolist(), len(rows))
        return drafts
