import math

import numpy as np
import pytest
import torch

from executor_svc.step import sampler as sampler_mod
from executor_svc.step.sampler import SamplingBatch, SamplingSettings, sample, seeded_uniform


def settings(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
    base.update(kw)
    return SamplingSettings(**base)


def draw(logits, rows_settings, positions=None):
    positions = positions if positions is not None else [0] * len(rows_settings)
    return sample(logits, SamplingBatch.from_settings(rows_settings, positions, vocab_size=logits.shape[-1]))


def reference_probs(logits_row: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """The distribution one row should be drawn from, computed the plain way:
    temperature, then top-k (ties kept), then top-p over a full sort."""
    x = logits_row.double() / s.temperature
    if 0 < s.top_k < x.numel():
        kth = torch.sort(x, descending=True).values[s.top_k - 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= s.top_p  # mass before the token already reaches top_p
        drop[0] = False
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), 0.0)
        probs = probs / probs.sum()
    return probs


def frequencies(logits_row: torch.Tensor, s: SamplingSettings, n: int) -> torch.Tensor:
    """Token frequencies over n seeded draws, all in one batch of n rows."""
    rows = [settings(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=i) for i in range(n)]
    ids = draw(logits_row.expand(n, -1).contiguous(), rows).token_ids
    return torch.bincount(torch.tensor(ids), minlength=logits_row.numel()).double() / n


def assert_matches(freq: torch.Tensor, probs: torch.Tensor, n: int, label: str):
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    drawn = set(torch.nonzero(freq > 0).flatten().tolist())
    assert drawn <= support, f"{label}: drew tokens {sorted(drawn - support)} outside the allowed set {sorted(support)}"
    # Pearson chi-square over the allowed tokens; the 1e-6 level for the
    # degrees of freedom here is well below 3 * dof.
    expected = probs[probs > 0] * n
    chi2 = float((((freq[probs > 0] * n) - expected) ** 2 / expected).sum())
    dof = max(len(support) - 1, 1)
    assert chi2 < 3 * dof + 30, f"{label}: chi-square {chi2:.1f} over {dof} degrees of freedom"


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert draw(logits, [settings(temperature=0.0)] * 2).token_ids == [1, 0]


def test_seeded_row_is_independent_of_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 64, generator=g)
    seeded = settings(seed=1234, top_p=0.8)
    alone = [draw(logits[2:3], [seeded], [5]).token_ids[0] for _ in range(3)]
    batch = [settings(), settings(temperature=0.0), seeded, settings(seed=9), settings(top_k=3), settings(top_p=0.2)]
    in_batch = draw(logits, batch, [0, 0, 5, 0, 7, 1])
    assert alone == [alone[0]] * 3 and in_batch.token_ids[2] == alone[0], (
        f"seeded row drew {alone} alone and {in_batch.token_ids[2]} in a mixed batch"
    )


def test_seeded_draws_repeat_for_every_row_of_a_large_batch():
    logits = torch.randn(300, 100, generator=torch.Generator().manual_seed(4)) * 2
    rows = [settings(seed=i * 7919, top_p=0.7 if i % 2 else 1.0, temperature=0.5 + (i % 3) / 2) for i in range(300)]
    first = draw(logits, rows, list(range(300))).token_ids
    again = draw(logits, rows, list(range(300))).token_ids
    reversed_batch = draw(logits.flip(0), rows[::-1], list(range(300))[::-1]).token_ids[::-1]
    assert first == again == reversed_batch


def test_seeded_stream_differs_by_position_and_by_seed():
    logits = torch.zeros(1, 1000)
    by_pos = {draw(logits, [settings(seed=1)], [pos]).token_ids[0] for pos in range(20)}
    by_seed = {draw(logits, [settings(seed=s)], [0]).token_ids[0] for s in range(20)}
    assert len(by_pos) > 10 and len(by_seed) > 10


def test_seed_hash_matches_a_plain_python_splitmix64():
    mask = (1 << 64) - 1

    def mix(z):
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds = [0, 1, 2**63 + 5, 2**64 - 1, 123456789]
    for seed in seeds:
        for pos, rnd in ((0, 0), (17, 0), (5, 3)):
            want = (mix(mix(mix(seed) ^ pos) ^ rnd) >> 41) * 2.0**-23
            signed = np.array([sampler_mod.signed_seed(seed)], dtype=np.int64)
            got = float(seeded_uniform(signed, np.array([pos], dtype=np.int64), rnd)[0])
            assert got == want, f"seed {seed} position {pos} round {rnd}: {got} != {want}"


def test_uniforms_stay_below_one():
    u = seeded_uniform(np.arange(100_000, dtype=np.int64), np.zeros(100_000, dtype=np.int64), 0)
    assert u.min() >= 0.0 and u.max() <= 1.0 - 2.0**-23


def test_top_k_one_is_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert draw(logits, [settings(top_k=1, seed=i) for i in range(3)]).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    # probs [0.6, 0.3, 0.05, 0.05]: top_p=0.5 leaves only the first token
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    assert {draw(logits, [settings(top_p=0.5)]).token_ids[0] for _ in range(50)} == {0}
    seen = {draw(logits, [settings(top_p=0.85)]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_p=0.5),
        dict(temperature=1.0, top_p=0.05),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.8, top_k=12, top_p=0.8),
        dict(temperature=2.0, top_k=40, top_p=0.95),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_draws_follow_the_reference_distribution(case):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(11)) * 2
    s = settings(**case)
    n = 8000
    assert_matches(frequencies(logits, s, n), reference_probs(logits, s), n, str(case))


def test_top_k_keeps_tokens_tied_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    n = 3000
    freq = frequencies(logits[0], settings(top_k=2), n)
    assert freq[4] == 0 and all(freq[i] > 0 for i in range(4)), f"top_k=2 with a three-way tie drew {freq.tolist()}"


def test_mixed_rows_each_follow_their_own_settings():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 2
    cases = [settings(temperature=0.0), settings(top_p=0.6), settings(top_k=4), settings(temperature=1.5)]
    n = 3000
    rows = [settings(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, seed=i) for i in range(n) for c in cases]
    ids = torch.tensor(draw(logits.expand(len(rows), -1).contiguous(), rows).token_ids).view(n, len(cases))
    assert set(ids[:, 0].tolist()) == {int(logits.argmax())}, "the greedy row left the argmax"
    for j, c in enumerate(cases[1:], start=1):
        freq = torch.bincount(ids[:, j], minlength=64).double() / n
        assert_matches(freq, reference_probs(logits, c), n, f"row with {c}")


@pytest.mark.parametrize("sync_free_rounds", [1, 3])
def test_sync_free_rounds_draw_the_same_tokens(monkeypatch, sync_free_rounds):
    """The GPU path (fixed rejection rounds, then one host copy, then the
    loop for rows still drawing), run here on CPU tensors that claim to be
    on CUDA, picks exactly the CPU path's tokens and logprobs."""
    monkeypatch.setattr(sampler_mod, "SYNC_FREE_ROUNDS", sync_free_rounds)
    logits = torch.randn(500, 64, generator=torch.Generator().manual_seed(2)) * 3
    rows = [settings(seed=i, top_p=0.3 + 0.6 * (i % 3) / 2, temperature=0.0 if i % 7 == 0 else 1.0,
                     logprobs=i % 3) for i in range(500)]
    batch = SamplingBatch.from_settings(rows, list(range(500)), vocab_size=64)
    want = sample(logits, batch)

    class CudaLike(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    got = sample(logits.as_subclass(CudaLike), batch)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.25, 0.75]]))
    picks = [draw(logits, [settings(seed=s)]).token_ids[0] for s in range(2000)]
    assert 0.70 < sum(picks) / len(picks) < 0.80


def test_unseeded_rows_use_the_global_generator():
    logits = torch.zeros(50, 1000)
    torch.manual_seed(7)
    a = draw(logits, [settings()] * 50).token_ids
    torch.manual_seed(7)
    b = draw(logits, [settings()] * 50).token_ids
    assert a == b and len(set(a)) > 30


def test_logprobs_report_the_chosen_token_and_the_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    out = draw(logits, [settings(temperature=0.0, logprobs=2), settings(temperature=0.0, logprobs=0)])
    expected = torch.log_softmax(logits, -1)
    lp, top_ids, top_lps = out.logprobs[0]
    assert top_ids == [1, 2]
    assert abs(lp - float(expected[0, 1])) < 1e-6 and abs(top_lps[1] - float(expected[0, 2])) < 1e-6
    lp1, ids1, lps1 = out.logprobs[1]
    assert ids1 == [] and lps1 == [] and abs(lp1 - float(expected[1, 2])) < 1e-6


def test_logprobs_are_the_models_own_not_the_filtered_ones():
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(8))
    out = draw(logits, [settings(temperature=0.5, top_k=3, seed=1, logprobs=5)])
    lp, top_ids, top_lps = out.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert math.isclose(lp, float(expected[out.token_ids[0]]), abs_tol=1e-6)
    assert top_ids == expected.topk(5).indices.tolist()
    assert np.allclose(top_lps, expected.topk(5).values.tolist(), atol=1e-6)


def test_no_logprobs_when_no_row_asks():
    assert draw(torch.randn(2, 8), [settings(seed=1), settings(temperature=0.0)]).logprobs is None


def test_tiny_positive_temperature_is_greedy_not_nan():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    for t in (1e-38, 1e-45, 1e-6):
        assert draw(logits, [settings(temperature=t, seed=1)] * 2).token_ids == logits.argmax(-1).tolist()
