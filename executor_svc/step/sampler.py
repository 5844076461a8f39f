"""Token sampling for a whole step at once: greedy, temperature, top-k,
top-p, seeded, logprobs, as batched tensor operations.

Each row draws by inverse CDF with one uniform number per round: the first
token whose cumulative probability passes u * total. Top-p is exact
rejection sampling around that draw: a drawn token is kept when the mass of
the tokens more likely than it is below top_p (it lies in the nucleus);
otherwise every token at most as likely is out of the nucleus too, so the
next round draws only among the more likely ones. Accepted draws follow the
nucleus distribution exactly, and no step sorts the vocabulary (a sort of
256 x vocab rows costs milliseconds on a CPU). Most rows finish in the
first round.

A seeded row's uniforms come from an integer hash of (seed, index of the
token being generated, round), so its tokens depend on nothing else in the
batch, nor on whether the request was recomputed after a preemption or an
executor restart. Unseeded rows use torch's global generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.step.host_memory import to_device
from executor_svc.step.logits_processors import LogitsProcessors

# Temperatures below this are greedy: dividing logits by a tinier positive
# number overflows to inf and softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5

# Rejection rounds run on the whole batch without looking at the results on
# a GPU, so the step needs no device sync before the one copy of the
# sampled ids. Rows still drawing after these (rare: each round raises the
# bar) finish in a loop that syncs once per round.
SYNC_FREE_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    temperature: float  # 0 = greedy
    top_p: float  # 1 = off
    top_k: int  # 0 = off
    seed: int | None
    logprobs: int  # top logprobs wanted
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    min_tokens: int = 0
    min_tokens_held_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # Top alternatives per prompt token's logprob (StepSampling.prompt_logprobs);
    # None = no prompt logprobs.
    prompt_logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether the request needs its token counts kept (TokenCounts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    # Per row when any row asked for logprobs: (logprob, top ids, top logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None


def signed_seed(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, on the logits' device, plus
    host-side summaries so the sampler picks its path without a device sync."""

    temperature: torch.Tensor  # [n] float32
    top_p: torch.Tensor  # [n] float32, 1 = off
    top_k: torch.Tensor  # [n] int64, 0 = off
    # On the host: the uniforms are hashed there, once per round.
    seed: np.ndarray  # [n] int64, the seed's bits (ignored where not seeded)
    seeded: np.ndarray  # [n] bool
    output_pos: np.ndarray  # [n] int64: index of the token the row generates
    num_logprobs: list[int]  # [n]
    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    max_top_k: int  # 0 = no row filters by top-k
    any_unseeded: bool
    min_p: torch.Tensor | None = None  # [n] float32, 0 = off; None: no sampled row sets it
    # logit_bias, min_tokens and penalties (logits_processors.py); None: no row sets any.
    processors: LogitsProcessors | None = None

    @classmethod
    def from_arrays(cls, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, seed: np.ndarray,
                    seeded: np.ndarray, output_pos: np.ndarray, num_logprobs: np.ndarray,
                    device: torch.device, vocab_size: int, min_p: np.ndarray | None = None,
                    processors: LogitsProcessors | None = None) -> SamplingBatch:
        random = temperature >= GREEDY_BELOW_TEMPERATURE
        filtering_k = random & (top_k > 0) & (top_k < vocab_size)
        any_min_p = min_p is not None and bool((random & (min_p > 0)).any())
        return cls(
            temperature=to_device(temperature, device), top_p=to_device(top_p, device), top_k=to_device(top_k, device),
            seed=seed, seeded=seeded, output_pos=output_pos,
            num_logprobs=num_logprobs.tolist(),
            all_greedy=not random.any(),
            any_greedy=not random.all(),
            any_top_p=bool((random & (top_p < 1.0)).any()),
            max_top_k=int(top_k[filtering_k].max()) if filtering_k.any() else 0,
            any_unseeded=bool((random & ~seeded).any()),
            min_p=to_device(min_p, device) if any_min_p else None,
            processors=processors if processors is not None and not processors.is_empty else None,
        )

    @classmethod
    def from_settings(cls, settings: list[SamplingSettings], output_positions: list[int],
                      device: torch.device | str = "cpu", vocab_size: int = 1 << 62) -> SamplingBatch:
        """A batch from each row's settings: logit_bias, min_tokens (with
        output_positions as each row's generated-token count) and min_p;
        penalties need token counts, which the runner's rows keep."""
        device = torch.device(device)
        bias = [(i, np.array([t for t, _ in s.logit_bias], np.int64),
                 np.array([b for _, b in s.logit_bias], np.float32))
                for i, s in enumerate(settings) if s.logit_bias]
        held = [(i, np.array(s.min_tokens_held_ids, np.int64))
                for i, (s, pos) in enumerate(zip(settings, output_positions))
                if pos < s.min_tokens and s.min_tokens_held_ids]
        none = np.zeros(0, np.int64)
        processors = LogitsProcessors.build(bias, held, none, none, none, none, none, None, device)
        return cls.from_arrays(
            np.array([s.temperature for s in settings], dtype=np.float32),
            np.array([s.top_p for s in settings], dtype=np.float32),
            np.array([s.top_k for s in settings], dtype=np.int64),
            np.array([signed_seed(s.seed or 0) for s in settings], dtype=np.int64),
            np.array([s.seed is not None for s in settings], dtype=bool),
            np.array(output_positions, dtype=np.int64),
            np.array([s.logprobs for s in settings], dtype=np.int64),
            device, vocab_size,
            min_p=np.array([s.min_p for s in settings], dtype=np.float32),
            processors=processors,
        )


def _mix64(z: np.ndarray) -> np.ndarray:
    # splitmix64's finalizer; numpy's uint64 arithmetic wraps modulo 2^64.
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seed: np.ndarray, output_pos: np.ndarray, rnd: int | np.ndarray) -> np.ndarray:
    """float32 in [0, 1 - 2^-23]: a hash of (seed, output position, round),
    broadcast over the three.

    seed holds the uint64 bits as int64. 23 bits, so u * total < total for
    any float32 total: a draw never lands past the last likely token."""
    z = _mix64(_mix64(_mix64(seed.view(np.uint64)) ^ output_pos.astype(np.uint64)) ^ np.asarray(rnd, np.uint64))
    return (z >> np.uint64(41)).astype(np.float32) * np.float32(2.0**-23)


# Rounds whose uniforms are hashed up front, in one go.
PRECOMPUTED_ROUNDS = max(SYNC_FREE_ROUNDS, 4)


class _Uniforms:
    """Each row's uniform for each round: seeded rows hashed, the others
    from torch's global generator."""

    def __init__(self, b: SamplingBatch, device: torch.device):
        self.b, self.device = b, device
        self.first = self._make(None, np.arange(PRECOMPUTED_ROUNDS)[:, None])  # [rounds, n]

    def _make(self, rows: np.ndarray | None, rnd: int | np.ndarray) -> np.ndarray:
        seed, seeded, pos = self.b.seed, self.b.seeded, self.b.output_pos
        if rows is not None:
            seed, seeded, pos = seed[rows], seeded[rows], pos[rows]
        u = seeded_uniform(seed, pos, rnd)
        if self.b.any_unseeded:
            u = np.where(seeded, u, torch.rand(u.shape).mul_(1.0 - 2.0**-23).numpy())
        return u

    def get(self, rnd: int, rows: np.ndarray | None = None) -> torch.Tensor:
        """[m] on the device: round rnd's uniforms for rows (all when None)."""
        if rnd < PRECOMPUTED_ROUNDS:
            u = self.first[rnd] if rows is None else self.first[rnd, rows]
        else:
            u = self._make(rows, rnd)
        return to_device(np.ascontiguousarray(u), self.device)


def _above(probs: torch.Tensor, bar: torch.Tensor) -> torch.Tensor:
    """probs where probs > bar, else 0; probs [m, vocab], bar [m, 1]. (The
    sign trick costs half of a compare-and-multiply on CPU.)"""
    return (probs - bar).sign_().clamp_(min=0).mul_(probs)


def _draw_round(probs: torch.Tensor, pivot: torch.Tensor | None, top_p: torch.Tensor, u: torch.Tensor):
    """One rejection round over rows of probs [m, vocab], restricted to
    tokens more likely than pivot [m] (None = no restriction). Returns the
    drawn ids [m], whether each lies in its row's nucleus [m] and its
    probability [m]."""
    vocab = probs.shape[-1]
    cdf = (probs if pivot is None else _above(probs, pivot[:, None])).cumsum(-1)  # [m, vocab]
    target = (u * cdf[:, -1])[:, None]  # [m, 1]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)  # [m]
    p_drawn = probs.gather(1, ids[:, None])  # [m, 1]
    mass_above = _above(probs, p_drawn).sum(-1)  # [m]
    in_nucleus = (mass_above < top_p) | (top_p >= 1.0)
    return ids, in_nucleus, p_drawn.squeeze(1)


def _draw(probs: torch.Tensor, b: SamplingBatch):
    """Token ids [n] drawn from probs [n, vocab] within each row's nucleus.

    Returns (ids, done, pivot, uniforms). On CPU every row is finished and
    done is None. On CUDA the first rounds run without a sync; done [n]
    bool says which rows finished, and the caller, which copies it to the
    host with the tokens anyway, finishes the rest with _finish_draws."""
    n, vocab = probs.shape
    uniforms = _Uniforms(b, probs.device)
    if not b.any_top_p:
        cdf = probs.cumsum(-1)
        u = uniforms.get(0)
        ids = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
        return ids, None, None, uniforms
    ids, done, pivot = _draw_round(probs, None, b.top_p, uniforms.get(0))
    if probs.is_cuda:
        for rnd in range(1, SYNC_FREE_ROUNDS):
            drawn, ok, p_drawn = _draw_round(probs, pivot, b.top_p, uniforms.get(rnd))
            ids = torch.where(done, ids, drawn)
            pivot = torch.where(done | ok, pivot, p_drawn)
            done = done | ok
        return ids, done, pivot, uniforms
    pending = (~done).nonzero().squeeze(1).numpy()
    return _finish_draws(probs, b, ids, pivot, pending, 1, uniforms), None, None, uniforms


def _finish_draws(probs: torch.Tensor, b: SamplingBatch, ids: torch.Tensor, pivot: torch.Tensor,
                  pending: np.ndarray, rnd: int, uniforms: _Uniforms) -> torch.Tensor:
    """Draws again for the pending rows, from round rnd on, until each lands
    in its nucleus. Each rejection raises the row's pivot to a token outside
    the nucleus, so a row needs at most vocab rounds and usually one."""
    while len(pending):
        rows = to_device(pending, probs.device)
        drawn, ok, p_drawn = _draw_round(probs[rows], pivot[rows], b.top_p[rows], uniforms.get(rnd, pending))
        ids[rows[ok]] = drawn[ok]
        pivot[rows[~ok]] = p_drawn[~ok]
        pending = pending[~ok.cpu().numpy()]
        rnd += 1
    return ids


def argmax(logits: torch.Tensor) -> torch.Tensor:
    # [n, vocab] -> [n]. numpy's argmax is several times faster than
    # torch's on CPU; both return the first maximum.
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(dim=-1)


def _apply_top_k(scaled: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # scaled: [n, vocab]. Keeps every token at least as likely as the k-th
    # (ties included); rows with k = 0 or k >= vocab keep all.
    vocab = scaled.shape[-1]
    kth = scaled.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(1, max_top_k) - 1)[:, None])  # [n, 1]
    active = ((top_k > 0) & (top_k < vocab))[:, None]
    return scaled.masked_fill(active & (scaled < kth), float("-inf"))


def _apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # scaled: [n, vocab]. p < min_p * p_max  <=>  scaled < max + log(min_p);
    # rows with min_p = 0 compare against -inf and keep all.
    bar = scaled.max(dim=-1, keepdim=True).values + min_p.log()[:, None]  # [n, 1]
    return scaled.masked_fill(scaled < bar, float("-inf"))


def sample(logits: torch.Tensor, b: SamplingBatch, logprob_logits: torch.Tensor | None = None) -> SampleOutput:
    """logits: [n, vocab] float32, one row per sampled request. Copies to
    the host once (twice in the rare step where a CUDA row is still drawing
    after the sync-free rounds). Logprobs are taken from logprob_logits
    when given (the model's logits before a constraint's mask), else from
    logits, before logit_bias and penalties either way.

    Order, as vLLM's: logit_bias and the min_tokens mask, penalties (greedy
    rows too), temperature, then top-k and min-p, then top-p."""
    if b.processors is not None:
        wants_logprobs = max(b.num_logprobs, default=0) > 0
        if wants_logprobs and logprob_logits is None:
            logprob_logits = logits
            logits = logits.clone()
        logits = b.processors.apply(logits)
    done = None
    if b.all_greedy:
        tokens = argmax(logits)  # [n]
    else:
        is_greedy = b.temperature < GREEDY_BELOW_TEMPERATURE
        scaled = logits / torch.where(is_greedy, 1.0, b.temperature)[:, None]
        if b.max_top_k:
            scaled = _apply_top_k(scaled, b.top_k, b.max_top_k)
        if b.min_p is not None:
            scaled = _apply_min_p(scaled, b.min_p)
        probs = scaled.softmax(-1)  # [n, vocab]
        tokens, done, pivot, uniforms = _draw(probs, b)
        if b.any_greedy:
            tokens = torch.where(is_greedy, argmax(logits), tokens)
            if done is not None:
                done = done | is_greedy
    max_lp = min(max(b.num_logprobs, default=0), logits.shape[-1])
    if done is None and max_lp <= 0:
        return SampleOutput(token_ids=tokens.tolist(), logprobs=None)
    while True:
        host = _to_host(logits if logprob_logits is None else logprob_logits, tokens, done, max_lp)
        if done is None or all(row[1] for row in host):
            break
        pending = np.array([i for i, row in enumerate(host) if not row[1]], dtype=np.int64)
        tokens = _finish_draws(probs, b, tokens.clone(), pivot.clone(), pending, SYNC_FREE_ROUNDS, uniforms)
        done = None
    token_ids = [int(row[0]) for row in host]
    if max_lp <= 0:
        return SampleOutput(token_ids=token_ids, logprobs=None)
    logprobs = [
        (row[2], [int(i) for i in row[3 : 3 + k]], row[3 + max_lp : 3 + max_lp + k])
        for row, k in zip(host, b.num_logprobs)
    ]
    return SampleOutput(token_ids=token_ids, logprobs=logprobs)


def _to_host(logits: torch.Tensor, tokens: torch.Tensor, done: torch.Tensor | None, max_lp: int) -> list[list[float]]:
    """One host copy of what the result needs, a row per request: token id,
    done flag, and with logprobs the chosen token's logprob, the top ids and
    the top logprobs (ids are exact in float32 below 2^24)."""
    cols = [tokens[:, None].to(torch.float32), (done if done is not None else tokens >= 0)[:, None].to(torch.float32)]
    if max_lp > 0:
        # Logprobs of the model's own distribution, before temperature and
        # filtering, as OpenAI-style APIs report them.
        all_lp = logits.log_softmax(-1)  # [n, vocab]
        top_lp, top_ids = all_lp.topk(max_lp, dim=-1)  # [n, max_lp]
        cols += [all_lp.gather(1, tokens[:, None]), top_ids.to(torch.float32), top_lp]
    return torch.cat(cols, 1).tolist()
