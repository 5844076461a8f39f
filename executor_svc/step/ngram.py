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

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> np.ndarray:
    """num_drafts guesses for what follows tokens ([num_tokens] ints). With
    no match, or fewer tokens after it than asked, the rest repeat the last
    token: a draft the verifier will most likely reject, but the step's
    shape (1 + num_drafts positions, as the scheduler planned) holds."""
    out = np.full(num_drafts, tokens[-1], dtype=tokens.dtype)
    n_tokens = len(tokens)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        tail = tokens[n_tokens - n:]
        # Every earlier window of n tokens (the tail itself excluded).
        windows = sliding_window_view(tokens[:n_tokens - 1], n)  # [num_tokens - n, n]
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # what followed the latest match
            follow = tokens[start:start + num_drafts]
            out[:len(follow)] = follow
            return out
    return out
