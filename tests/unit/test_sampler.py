import torch

from executor_svc.sampler import SamplingSettings, sample


def settings(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
    base.update(kw)
    return SamplingSettings(**base)


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert sample(logits, [settings(temperature=0.0)] * 2, [0, 0]).token_ids == [1, 0]


def test_seeded_row_is_independent_of_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g)
    seeded = settings(seed=1234)
    alone = [sample(logits[2:3], [seeded], [5]).token_ids[0] for _ in range(3)]
    in_batch = sample(logits, [settings(), settings(temperature=0.0), seeded, settings(seed=9)], [0, 0, 5, 0])
    assert alone == [alone[0]] * 3 and in_batch.token_ids[2] == alone[0]


def test_seeded_stream_differs_by_position():
    logits = torch.zeros(1, 1000)
    draws = {sample(logits, [settings(seed=1)], [pos]).token_ids[0] for pos in range(20)}
    assert len(draws) > 10


def test_top_k_one_is_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [settings(top_k=1)] * 3, [0, 0, 0]).token_ids
    assert out == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    # probs ~ [0.6, 0.3, 0.1 spread]: top_p=0.5 leaves only the first token
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    assert {sample(logits, [settings(top_p=0.5)], [0]).token_ids[0] for _ in range(50)} == {0}
    seen = {sample(logits, [settings(top_p=0.85)], [0]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.25, 0.75]]))
    picks = [sample(logits, [settings(seed=s)], [0]).token_ids[0] for s in range(2000)]
    assert 0.70 < sum(picks) / len(picks) < 0.80


def test_logprobs_report_the_chosen_token_and_the_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sample(logits, [settings(temperature=0.0, logprobs=2)], [0])
    lp, top_ids, top_lps = out.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert top_ids == [1, 2]
    assert abs(lp - float(expected[1])) < 1e-6 and abs(top_lps[1] - float(expected[2])) < 1e-6


def test_tiny_positive_temperature_is_greedy_not_nan():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    for t in (1e-38, 1e-45, 1e-6):
        assert sample(logits, [settings(temperature=t, seed=1)] * 2, [0, 0]).token_ids == logits.argmax(-1).tolist()
