"""Token sampling: greedy, temperature, top-k, top-p, seeded, logprobs.

All rows use the same draw, argmax(probs / E) with E ~ Exp(1), which picks
token i with probability probs[i]. A seeded request draws its E from a
generator seeded by (seed, index of the token being generated), so its
tokens depend on nothing else in the batch, nor on whether the request was
recomputed after a preemption or a restart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Temperatures below this are greedy: dividing logits by a tinier positive
# number overflows to inf and softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    temperature: float  # 0 = greedy
    top_p: float  # 1 = off
    top_k: int  # 0 = off
    seed: int | None
    logprobs: int  # top logprobs wanted


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    # Per row when any row asked for logprobs: (logprob, top ids, top logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None


def _seeded_stream(seed: int, position: int) -> torch.Generator:
    # Mix seed and position into one 63-bit value (splitmix-style constants).
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [vocab] fp32, already divided by temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the
        # most likely token always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, settings: list[SamplingSettings], output_positions: list[int]) -> SampleOutput:
    """logits: [num_rows, vocab] fp32; output_positions[i] is the index of
    the token row i generates (0 for the first generated token)."""
    greedy = logits.argmax(dim=-1)  # [num_rows]
    token_ids = greedy.tolist()
    for i, s in enumerate(settings):
        if s.temperature < GREEDY_BELOW_TEMPERATURE:
            continue
        row = _filter_top_k_top_p(logits[i] / s.temperature, s.top_k, s.top_p)
        probs = row.softmax(-1).cpu()  # [vocab]
        gen = _seeded_stream(s.seed, output_positions[i]) if s.seed is not None else None
        noise = torch.empty_like(probs).exponential_(generator=gen)
        token_ids[i] = int((probs / noise).argmax())

    logprobs = None
    if any(s.logprobs > 0 for s in settings):
        # Logprobs of the model's own distribution, before temperature and
        # filtering, as OpenAI-style APIs report them.
        all_lp = logits.log_softmax(-1)  # [num_rows, vocab]
        k = max(s.logprobs for s in settings)
        top_lp, top_ids = all_lp.topk(k, dim=-1)
        chosen = all_lp.gather(1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(1)
        logprobs = []
        for i, s in enumerate(settings):
            n = s.logprobs
            logprobs.append((float(chosen[i]), top_ids[i, :n].tolist(), top_lp[i, :n].tolist()))
    return SampleOutput(token_ids=token_ids, logprobs=logprobs)
