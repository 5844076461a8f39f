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
    # bytes.rfind is a C search from the end, one call per n, where numpy
    # paid a dispatch per array op: 14-19 -> 1.5-2.4 µs a row of the copy
    # workload's 250-350 tokens (a stories260K decode step is about 280 µs).
    # A hit must start at a token boundary.
    data, width = tokens.tobytes(), tokens.itemsize
    searched = (n_tokens - 1) * width  # a match ends before the last token
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        tail = data[(n_tokens - n) * width:]
        stop = searched
        while (at := data.rfind(tail, 0, stop)) >= 0 and at % width:
            stop = at + len(tail) - 1  # misaligned: look further back
        if at >= 0:
            start = at // width + n  # what followed the latest match
            return tokens[start:start + num_drafts]
    return tokens[:0]
