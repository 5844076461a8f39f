"""logit_bias, min_tokens, penalties and min_p against plain references:
OpenAI's penalty formula, transformers' RepetitionPenaltyLogitsProcessor,
and min-p's definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from executor_svc.step.logits_processors import LogitsProcessors, TokenCounts
from executor_svc.step.request_rows import RequestRows
from executor_svc.step.sampler import SamplingBatch, SamplingSettings, sample
from tests.unit.test_sampler import assert_matches

VOCAB = 40
CPU = torch.device("cpu")


def settings(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
    return SamplingSettings(**{**base, **kw})


def penalised(logits, prompts, outputs, presence, frequency, repetition, record_from=None):
    """The processors' logits for rows with these prompts and outputs. With
    record_from, each row's slot starts with outputs[:record_from] and the
    rest are recorded one step at a time, as the runner does."""
    counts = TokenCounts(VOCAB, CPU, slots=1)  # grows while slots are taken
    split = [len(o) if record_from is None else record_from for o in outputs]
    slots = np.array([counts.add(p, o[:k]) for p, o, k in zip(prompts, outputs, split)], dtype=np.int64)
    for step in range(max(len(o) for o in outputs)):
        live = [i for i, (o, k) in enumerate(zip(outputs, split)) if k <= step < len(o)]
        counts.record(slots[live], np.array([outputs[i][step] for i in live], dtype=np.int64))
    n = len(prompts)
    p = LogitsProcessors.build([], [], np.arange(n), slots, np.full(n, presence, np.float32),
                               np.full(n, frequency, np.float32), np.full(n, repetition, np.float32), counts, CPU)
    return p.apply(logits.clone())


def openai_reference(logits_row, output, presence, frequency):
    # https://platform.openai.com/docs/advanced-usage/frequency-and-presence-penalties
    out = logits_row.clone()
    for token in set(output):
        c = output.count(token)
        out[token] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


PROMPTS = [[1, 2, 3, 3], [5], [7, 8, 9, 10, 11]]
OUTPUTS = [[4, 4, 4, 2, 9], [5, 5, 6], [0, 1, 1, 1, 1, 1, 39]]


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.3), (-2.0, 2.0)])
@pytest.mark.parametrize("record_from", [None, 0, 2])
def test_frequency_and_presence_match_openais_formula(presence, frequency, record_from):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    got = penalised(logits, PROMPTS, OUTPUTS, presence, frequency, 1.0, record_from)
    for i in range(3):
        want = openai_reference(logits[i], OUTPUTS[i], presence, frequency)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    # Prompt tokens that were never generated are not penalised.
    assert got[2, 7] == logits[2, 7]


@pytest.mark.parametrize("repetition", [1.3, 0.7, 2.0])
@pytest.mark.parametrize("record_from", [None, 1])
def test_repetition_matches_transformers_processor(repetition, record_from):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    got = penalised(logits, PROMPTS, OUTPUTS, 0.0, 0.0, repetition, record_from)
    hf = RepetitionPenaltyLogitsProcessor(penalty=repetition)
    for i in range(3):
        want = hf(torch.tensor([PROMPTS[i] + OUTPUTS[i]]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


def test_repetition_comes_before_frequency_and_presence():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    got = penalised(logits, PROMPTS[:1], OUTPUTS[:1], 0.4, 0.3, 1.3)
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.3)(torch.tensor([PROMPTS[0] + OUTPUTS[0]]), logits.clone())
    torch.testing.assert_close(got[0], openai_reference(hf[0], OUTPUTS[0], 0.4, 0.3), rtol=0, atol=1e-6)


def test_greedy_rows_are_penalised_and_logprobs_stay_the_models():
    logits = torch.full((2, VOCAB), -1.0)
    logits[:, 4] = 5.0
    logits[:, 6] = 4.0
    counts = TokenCounts(VOCAB, CPU)
    slots = np.array([counts.add([1], [4, 4])], dtype=np.int64)
    p = LogitsProcessors.build([], [], np.array([0]), slots, np.zeros(1, np.float32), np.ones(1, np.float32),
                               np.ones(1, np.float32), counts, CPU)
    b = SamplingBatch.from_arrays(np.zeros(2, np.float32), np.ones(2, np.float32), np.zeros(2, np.int64),
                                  np.zeros(2, np.int64), np.zeros(2, bool), np.zeros(2, np.int64),
                                  np.array([1, 1]), CPU, VOCAB, processors=p)
    out = sample(logits.clone(), b)
    assert out.token_ids == [6, 4], "row 0's two 4s cost 2.0 of its 1.0 lead"
    assert out.logprobs[0][1] == [4], "logprobs are the model's own, before penalties"


def test_logit_bias_of_100_forces_its_token_and_minus_100_bans_it():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    top = int(logits[2].argmax())
    rows = [settings(seed=1, logit_bias=((17, 100.0),)), settings(temperature=0.0, logit_bias=((17, 100.0),)),
            settings(temperature=0.0, logit_bias=((top, -100.0),)), settings(temperature=0.0)]
    out = sample(logits.clone(), SamplingBatch.from_settings(rows, [0] * 4, vocab_size=VOCAB)).token_ids
    assert out[:2] == [17, 17]
    assert out[2] == int(logits[2].masked_fill(torch.arange(VOCAB) == top, -1e9).argmax())
    assert out[3] == int(logits[3].argmax()), "an unbiased row in the same batch is untouched"


def test_logit_bias_adds_to_the_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 2.0
    rows = [settings(temperature=0.0, logit_bias=((5, 2.5), (3, -1.0)))]
    assert sample(logits, SamplingBatch.from_settings(rows, [0], vocab_size=VOCAB)).token_ids == [5]


def test_min_tokens_masks_the_held_ids_until_enough_were_generated():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 50.0  # the "EOS"
    logits[:, 9] = 40.0  # a stop token id
    row = settings(temperature=0.0, min_tokens=3, min_tokens_held_ids=(2, 9))
    out = sample(logits, SamplingBatch.from_settings([row] * 3, [0, 2, 3], vocab_size=VOCAB)).token_ids
    assert out[0] not in (2, 9) and out[1] not in (2, 9)
    assert out[2] == 2, "the 4th token may be EOS"


def reference_min_p(logits_row, temperature, min_p):
    probs = (logits_row.double() / temperature).softmax(-1)
    probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("min_p, top_k", [(0.05, 0), (0.3, 0), (0.1, 5)])
def test_min_p_draws_match_the_reference(min_p, top_k):
    n = 4000
    logits_row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    rows = [settings(temperature=0.8, top_k=top_k, min_p=min_p, seed=i) for i in range(n)]
    batch = SamplingBatch.from_settings(rows, [0] * n, vocab_size=VOCAB)
    ids = sample(logits_row.expand(n, -1).contiguous(), batch).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=VOCAB).double() / n
    want = reference_min_p(logits_row, 0.8, min_p)
    if top_k:
        kth = logits_row.sort(descending=True).values[top_k - 1]
        want = want.masked_fill(logits_row < kth, 0.0)
        want = want / want.sum()
    assert_matches(freq, want, n, f"min_p={min_p}")


def test_rows_keep_counts_only_for_penalised_requests_and_rebuild_them_on_recompute():
    rows = RequestRows(64, 4, CPU, rows=2, vocab_size=VOCAB)
    plain = settings()
    pen = settings(frequency_penalty=1.0)
    r0, _ = rows.add(0, [1, 2, 3], [0], 0, plain, 0)
    assert rows.penalty_slot[r0] == -1
    # A recomputed request: its last two tokens are outputs.
    r1, _ = rows.add(1, [1, 2, 3, 7, 7], [1, 2], 0, pen, 2)
    slot = rows.penalty_slot[r1]
    assert slot >= 0 and rows.counts.output_counts[slot, 7] == 2 and rows.counts.output_counts[slot].sum() == 2
    assert rows.counts.prompt_seen[slot].nonzero().flatten().tolist() == [1, 2, 3]
    rows.finish(1)
    assert rows.penalty_slot[r1] == -1
    r2, _ = rows.add(2, [5], [3], 0, pen, 0)  # takes the freed slot, cleared
    assert rows.penalty_slot[r2] == slot and rows.counts.output_counts[slot].sum() == 0
    assert rows.counts.prompt_seen[slot].nonzero().flatten().tolist() == [5]
