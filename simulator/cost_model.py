"""The step-cost model: how long the executor takes for one step plan.

A step's time is linear in a few features of its plan, with non-negative
coefficients (a feature can only add time):

    step_s = c_step
           + c_prefill_token   * prefill tokens        (rows computing > 1 token)
           + c_prefill_attn    * sum over chunks of chunk x context
           + c_decode_row      * decode rows           (rows computing 1 token)
           + c_decode_context  * sum of decode rows' contexts
           + c_swap_block      * blocks swapped in or out

`context` is the number of positions a row attends to after the step (its
computed tokens before the step plus those it computes). The linear terms
follow a transformer's cost: every token passes the weights (prefill
tokens, decode rows), a chunk's attention grows with chunk x context, a
decode row's with the KV it reads; the constant holds the per-step host
work and, on a GPU, reading the weights once.

The issue's model (BASE_FEATURES) stops there. The extended model adds
`prefill_rows`, a cost per row that computes more than one token: on the
CPU executor a prefill row costs a fixed time of its own (the new
request's state, its sampling setup, a varlen attention segment) that no
other feature carries. Calibration fits both and keeps the extended one
only where it is better on the held-out steps (calibrate.py); a profile
with the base model has prefill_rows 0, and a profile written before the
feature existed reads it as 0.

The coefficients are fitted by non-negative least squares on relative
errors (each row divided by its measured time), so a 1 ms step counts as
much as a 100 ms one. Lawson and Hanson's active-set algorithm is written
out below with numpy, to keep scipy out of the dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BASE_FEATURES = ("step", "prefill_tokens", "prefill_attention", "decode_rows", "decode_context", "swapped_blocks")
FEATURES = (*BASE_FEATURES, "prefill_rows")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, row by row: (tokens computed, tokens computed
    before). Enough to cost a plan without knowing what is in it."""

    rows: tuple[tuple[int, int], ...]
    swapped_blocks: int = 0

    @classmethod
    def of_plan(cls, out) -> "StepShape":
        """From a scheduler_svc StepPlan: each entry's scheduled
        tokens and where they start, and the blocks its swaps copy (out to
        the host tier and in from it)."""
        swaps = out.swaps
        return cls(tuple((e.num_tokens, e.start) for e in out.entries.values()),
                   len(swaps.out_host) + len(swaps.in_host) if swaps is not None else 0)

    def features(self) -> tuple[float, ...]:
        prefill = attn = decode = decode_ctx = prefill_rows = 0
        for n, start in self.rows:
            if n > 1:
                prefill_rows += 1
                prefill += n
                attn += n * (start + n)
            else:
                decode += 1
                decode_ctx += start + 1
        return (1.0, float(prefill), float(attn), float(decode), float(decode_ctx), float(self.swapped_blocks),
                float(prefill_rows))


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    # Seconds per unit of each of FEATURES; a tuple of BASE_FEATURES'
    # length leaves the extended features at 0.
    coefficients: tuple[float, ...]

    def __post_init__(self):
        if len(self.coefficients) == len(BASE_FEATURES):
            object.__setattr__(self, "coefficients",
                               (*self.coefficients, *(0.0,) * (len(FEATURES) - len(BASE_FEATURES))))
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"expected {len(FEATURES)} coefficients ({', '.join(FEATURES)}), "
                             f"got {len(self.coefficients)}")
        if any(c < 0 for c in self.coefficients):
            raise ValueError(f"cost coefficients must be non-negative, got {self.coefficients}")

    def predict(self, features: Sequence[float]) -> float:
        return sum(c * f for c, f in zip(self.coefficients, features))

    def step_seconds(self, shape: StepShape) -> float:
        return self.predict(shape.features())

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients))

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> "LinearCostModel":
        unknown = set(d) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        return cls(tuple(float(d.get(name, 0.0)) for name in FEATURES))


def nnls(a, b, max_iter: int | None = None, tol: float | None = None):
    """min ||a x - b|| subject to x >= 0 (Lawson & Hanson 1974, ch. 23).

    Active-set: start with every variable held at zero; repeatedly free the
    one whose gradient most wants to grow, solve least squares on the free
    set, and step back towards the previous point whenever that solution
    would make a free variable negative. Returns x as a numpy array."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    if b.shape != (m,):
        raise ValueError(f"b has shape {b.shape}, expected ({m},)")
    if tol is None:
        tol = 10 * max(m, n) * np.finfo(float).eps * max(1.0, np.abs(a).max(initial=0.0))
    max_iter = max_iter or 3 * n
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if free.all() or w[~free].max(initial=-np.inf) <= tol:
            break
        j = np.argmax(np.where(free, -np.inf, w))
        free[j] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > tol).all():
                break
            # Step from x towards z until the first free variable hits zero.
            neg = free & (z <= tol)
            denom = x[neg] - z[neg]
            alpha = np.min(np.where(denom > 0, x[neg] / np.where(denom > 0, denom, 1.0), 0.0))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
        x = z
        w = a.T @ (b - a @ x)
    return np.maximum(x, 0.0)


def fit(features: Iterable[Sequence[float]], seconds: Iterable[float], names: Sequence[str] = FEATURES
        ) -> LinearCostModel:
    """NNLS on relative errors: row i is scaled by 1 / seconds[i]. Only the
    features in names are fitted; the others stay at 0."""
    import numpy as np

    x = np.asarray(list(features), dtype=float)
    y = np.asarray(list(seconds), dtype=float)
    if len(y) == 0 or (y <= 0).any():
        raise ValueError("fitting needs at least one step, every one with a positive time")
    weights = 1.0 / y
    a = x * weights[:, None]
    # Columns that never vary from zero (no swaps measured) stay at zero;
    # scaling the rest to unit norm keeps the active set well conditioned.
    norms = np.linalg.norm(a, axis=0)
    used = (norms > 0) & np.array([name in names for name in FEATURES[:x.shape[1]]])
    coef = np.zeros(x.shape[1])
    coef[used] = nnls(a[:, used] / norms[used], y * weights) / norms[used]
    return LinearCostModel(tuple(float(c) for c in coef))


def mape(model: LinearCostModel, features: Iterable[Sequence[float]], seconds: Iterable[float]) -> float:
    """Mean absolute percentage error, in percent."""
    errors = [abs(model.predict(f) - s) / s for f, s in zip(features, seconds)]
    if not errors:
        raise ValueError("no steps to score")
    return 100.0 * sum(errors) / len(errors)
