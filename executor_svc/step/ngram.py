"""The n-gram proposer of speculative decoding (EXECUTOR_SPECULATIVE_METHOD=
ngram, "prompt lookup"): a request's next tokens are guessed from its own
prompt and output. Its last n tokens are looked up among its earlier ones,
longest n first and latest place first, and the tokens that followed that
place are the drafts. Answers that repeat their input (code edits,
summaries quoting it, structured rewrites) draft well; the verifier keeps
only what the model itself would have produced, so a bad guess costs the
verification, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """The n-gram window: runs of min_n to max_n last tokens."""

    min_n: int
    max_n: int

    def propose(self, r, rows: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
        """Up to counts[i] drafts for each of rows[i] (rows of r, the
        RequestRows), from its own known tokens."""
        return [propose(r.token_ids[row, :r.num_tokens[row]], int(k), self.min_n, self.max_n)
                for row, k in zip(rows.tolist(), counts.tolist())]


def propose(tokens: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to num_drafts guesses for what follows tokens ([num_tokens] ints):
    the tokens after the latest earlier place where its last n tokens
    occur, for the longest n that occurs. Fewer when that place is near
    the end, none without a match: a guess is worth verifying only where
    the request repeats itself, and the step then verifies only what was
    proposed."""
    n_tokens = len(tokens)
    if n_tokens < min_n + 1:
        return tokens[:0]
    # Where the last token occurs earlier: every n-gram match ends at one
    # of these, so one pass over the tokens narrows the search to them.
    ends = np.flatnonzero(tokens[:n_tokens - 1] == tokens[-1])  # ascending
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        tail = tokens[n_tokens - n:]
        cand = ends[ends >= n - 1]
        if not len(cand):
            continue
        # cand[j] - n + 1 .. cand[j]: the n tokens ending at each candidate.
        windows = tokens[cand[:, None] + np.arange(1 - n, 1)]  # [candidates, n]
        hits = cand[(windows == tail).all(axis=1)]
        if len(hits):
            start = int(hits[-1]) + 1  # what followed the latest match
            return tokens[start:start + num_drafts]
    return tokens[:0]
