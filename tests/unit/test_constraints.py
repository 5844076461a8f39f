"""The executor's half of constrained decoding (executor_svc/step/constraints.py):
masks from llguidance matchers, applied to the logits before sampling,
greedy and sampled; EOS held back under ignore_eos; a re-sent request's
output replayed into a fresh matcher; failures reported per request; a
speculating row's drafts cut to what its grammar takes and a mask for each
position it verifies; and, through the model runner on stories260K,
unconstrained rows in the same batch still equal HF greedy."""

from __future__ import annotations

import json
import re

import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from executor_svc.step.constraints import MATCHERS, ConstraintMatchers
from executor_svc.step.runner import NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings
from tests.conftest import STORIES
from tests.oracle import hf_greedy
from tests.unit.test_runner_vs_hf import BLOCK, GREEDY, make_runner

EOS = 2
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return (STORIES / "tokenizer.json").read_text()


def lark(text: str) -> str:
    return LLMatcher.grammar_from_lark(text)


def allowed(masked: torch.Tensor, row: int = 0) -> set[int]:
    return set(torch.isfinite(masked[row]).nonzero().squeeze(1).tolist())


def step_masks(m: ConstraintMatchers, handles: list[int], logits: torch.Tensor):
    job = m.begin(handles)
    assert job is not None
    return m.apply(job, logits, in_place=False)


def test_the_mask_allows_exactly_the_tokens_that_continue_a_match_then_only_eos(tokenizer_json):
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    m.add(7, lark('start: "yes" | "no"'), ignore_eos=False, output_tokens=[])
    ref = LLMatcher(m.tokenizer, lark('start: "yes" | "no"'))
    logits = torch.randn(2, VOCAB)
    masked, errors = step_masks(m, [3, 7], logits)  # row 0 is unconstrained
    assert not errors
    assert torch.equal(masked[0], logits[0]), "an unconstrained row is untouched"
    first = allowed(masked, 1)
    want = {t for t in range(VOCAB) if ref.validate_tokens([t]) == 1}
    assert first == want and first
    for t in m.tokenizer.tokenize_str("yes"):
        assert not m.advance([7], [t])
    masked, _ = step_masks(m, [7], logits[:1])
    assert allowed(masked) == {EOS}, "a complete match leaves only EOS"
    assert torch.equal(masked[0, EOS], logits[0, EOS])


def test_under_ignore_eos_eos_waits_until_nothing_else_is_allowed(tokenizer_json):
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    m.add(0, LLMatcher.grammar_from_regex("a{1,3}"), ignore_eos=True, output_tokens=[])
    m.add(1, LLMatcher.grammar_from_regex("a{1,3}"), ignore_eos=False, output_tokens=[])
    a = m.tokenizer.tokenize_str("a")
    assert len(a) == 1
    for _ in range(2):  # two steps, each masked, then fed "a"
        step_masks(m, [0, 1], torch.zeros(2, VOCAB))
        assert not m.advance([0, 1], a * 2)
    masked, _ = step_masks(m, [0, 1], torch.zeros(2, VOCAB))
    assert EOS not in allowed(masked, 0) and a[0] in allowed(masked, 0)
    assert {EOS, a[0]} <= allowed(masked, 1), "without ignore_eos the grammar may end here"
    m.advance([0], a)
    masked, _ = step_masks(m, [0], torch.zeros(1, VOCAB))
    assert allowed(masked) == {EOS}


def test_a_resent_request_replays_its_output_into_a_fresh_matcher(tokenizer_json):
    grammar = LLMatcher.grammar_from_json_schema(json.dumps({"type": "array", "items": {"type": "integer"}}),
                                                 defaults={"whitespace_flexible": False})
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    prefix = m.tokenizer.tokenize_str("[12,3")
    m.add(0, grammar, ignore_eos=False, output_tokens=[])
    step_masks(m, [0], torch.zeros(1, VOCAB))
    for t in prefix:  # one token per step, as sampled
        assert not m.advance([0], [t])
    m.add(1, grammar, ignore_eos=False, output_tokens=prefix)  # recomputed after a preemption
    masked, errors = step_masks(m, [0, 1], torch.zeros(2, VOCAB))
    assert not errors and allowed(masked, 0) == allowed(masked, 1)
    assert m.tokenizer.tokenize_str("]")[0] in allowed(masked, 1)


def test_a_refused_token_and_a_refused_replay_are_reported_per_request(tokenizer_json):
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    yes = m.tokenizer.tokenize_str("yes")
    m.add(0, lark('start: "no"'), ignore_eos=False, output_tokens=[])
    m.add(1, lark('start: "no"'), ignore_eos=False, output_tokens=yes)  # a replay the grammar refuses
    masked, errors = step_masks(m, [0, 1], torch.zeros(2, VOCAB))
    assert [h for h, _ in errors] == [1] and "replaying" in errors[0][1]
    assert allowed(masked, 1) == {EOS}, "a failed row samples EOS, which the scheduler drops"
    errors = m.advance([0], yes[:1])
    assert [h for h, _ in errors] == [0] and f"token {yes[0]} refused" in errors[0][1]


def test_matchers_are_dropped_with_their_requests(tokenizer_json):
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    m.add(0, lark('start: "a"'), False, [])
    m.add(1, lark('start: "a"'), False, [])
    assert len(m) == 2 and MATCHERS._value.get() == 2
    m.remove(0)
    m.remove(0)
    assert len(m) == 1 and MATCHERS._value.get() == 1
    m.reset()
    assert len(m) == 0 and MATCHERS._value.get() == 0
    assert m.begin([0, 1]) is None


# ----- through the model runner ------------------------------------------------

@pytest.fixture(scope="module")
def runner(stories_path):
    r = make_runner(str(stories_path))
    r.constraints = ConstraintMatchers((stories_path / "tokenizer.json").read_text(), VOCAB, [EOS])
    return r


def run(runner, requests: dict[int, tuple[list[int], str | None, SamplingSettings]], max_new: int,
        preempt_at: int | None = None):
    """Drives the runner like the scheduler: whole prompts, then decodes,
    until each request has max_new tokens or sampled EOS. With preempt_at,
    request 0 is forgotten after that many tokens and re-sent in full (its
    output included), as after a preemption."""
    out: dict[int, list[int]] = {h: [] for h in requests}
    logprobs: dict[int, list] = {h: [] for h in requests}
    blocks = {h: list(range(24 * h, 24 * h + 24)) for h in requests}  # 96 tokens each, of 128 blocks
    live, step = set(requests), 0
    while live:
        inp = StepPlan(step_id=step)
        for h in sorted(live):
            prompt, grammar, sampling = requests[h]
            resend = preempt_at is not None and h == 0 and len(out[0]) == preempt_at and step > 0
            if step == 0 or resend:
                if resend:
                    inp.finished_handles.append(h)
                tokens = prompt + out[h]
                inp.new_requests.append(NewRequestData(h, tokens, blocks[h], 0, len(tokens), sampling, len(out[h]),
                                                       grammar))
            else:
                inp.cached_handles.append(h)
                inp.cached_num_scheduled_tokens.append(1)
        result = runner.execute(inp)
        assert not result.request_errors, result.request_errors
        for i, (h, t) in enumerate(zip(result.sampled_handles, result.sampled_token_ids)):
            out[h].append(t)
            if result.logprobs is not None:
                logprobs[h].append(result.logprobs[i])
            if len(out[h]) >= max_new or (t == EOS and requests[h][1] is not None):
                live.discard(h)
        step += 1
    return out, logprobs


def text_of(runner, tokens: list[int]) -> str:
    return runner.constraints.tokenizer.decode_str([t for t in tokens if t != EOS])


def test_constrained_and_free_rows_share_steps_and_the_free_ones_still_equal_hf(runner, stories_path):
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 1, "maximum": 99},
                                               "pet": {"enum": ["cat", "dog"]}},
              "required": ["age", "pet"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    sampled = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, seed=5, logprobs=0)
    prompts = [[1, 403, 407, 261, 378], [1, 300, 301, 302], [1, 403, 407], [1, 50]]
    requests = {0: (prompts[0], grammar, GREEDY), 1: (prompts[1], None, GREEDY),
                2: (prompts[2], LLMatcher.grammar_from_regex(r"[A-Z][a-z]+ [0-9]{2}"), sampled),
                3: (prompts[3], None, GREEDY)}
    out, _ = run(runner, requests, max_new=40)
    assert out[0][-1] == EOS and json.loads(text_of(runner, out[0])).keys() == {"age", "pet"}
    assert out[2][-1] == EOS and re.fullmatch(r"[A-Z][a-z]+ [0-9]{2}", text_of(runner, out[2]))
    for h in (1, 3):
        assert out[h] == hf_greedy(str(stories_path), prompts[h], 40, ignore_eos=True)


def test_logprobs_are_the_models_own_taken_before_the_mask(runner):
    with_lp = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=3)
    prompt = [1, 403, 407, 261, 378]
    free, free_lp = run(runner, {0: (prompt, None, with_lp)}, max_new=1)
    forced, forced_lp = run(runner, {0: (prompt, lark('start: "x"'), with_lp)}, max_new=1)
    x = runner.constraints.tokenizer.tokenize_str("x")[0]
    assert forced[0][0] == x != free[0][0]
    (lp, top_ids, top_lps), (free_chosen, free_top_ids, free_top_lps) = forced_lp[0][0], free_lp[0][0]
    assert top_ids == free_top_ids and top_lps == pytest.approx(free_top_lps), "the top-k is the unmasked model's"
    assert lp < free_chosen, "the forced token's logprob is its unmasked one, not 0"


def test_a_constrained_request_resent_after_a_preemption_continues_as_if_never_interrupted(runner):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    prompt = [1, 403, 407, 261, 378]
    straight, _ = run(runner, {0: (prompt, grammar, GREEDY)}, max_new=30)
    resent, _ = run(runner, {0: (prompt, grammar, GREEDY)}, max_new=30, preempt_at=3)
    assert resent[0] == straight[0] and straight[0][-1] == EOS
    assert isinstance(json.loads(text_of(runner, straight[0])), list)


# ----- speculating rows (issue 36) ---------------------------------------------

def test_a_row_verifies_the_drafts_its_grammar_takes_short_of_eos(tokenizer_json):
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    digits = m.tokenizer.tokenize_str("12")
    refused = m.tokenizer.tokenize_str("a")
    m.add(0, LLMatcher.grammar_from_regex("[0-9]+"), ignore_eos=False, output_tokens=[])
    assert m.num_valid_drafts(0, np.array(digits)) == 0, "no matcher built yet: no drafts"
    step_masks(m, [0], torch.zeros(1, VOCAB))  # builds it
    assert m.num_valid_drafts(0, np.array(digits + refused + digits)) == len(digits)
    assert m.num_valid_drafts(0, np.array(digits + [EOS] + digits)) == len(digits), (
        "a draft EOS would end the request: the drafts stop before it")
    assert m.num_valid_drafts(5, np.array(refused)) == 1, "an unconstrained row verifies every draft"
    assert m.advance([0], refused), "refused: the matcher fails"
    assert m.num_valid_drafts(0, np.array(digits)) == 0, "a failed matcher verifies none"


def next_mask(m: ConstraintMatchers, matcher: LLMatcher) -> set[int]:
    """The tokens a matcher's own next mask allows (the model's ids only)."""
    bitmask = llg_numpy.allocate_token_bitmask(1, m.vocab_size)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_each_verified_position_gets_the_mask_after_the_drafts_before_it(tokenizer_json):
    """Rows in logits order: a free row with 2 drafts, a regex row with 3,
    a free row with none and a regex row with 1. Each constrained position
    is masked as a matcher fed the drafts before it masks its next token;
    free positions are untouched; the matchers are where they were."""
    m = ConstraintMatchers(tokenizer_json, VOCAB, [EOS])
    grammar = LLMatcher.grammar_from_regex("[A-Z][a-z]+ is [0-9]{2}")
    for h in (1, 3):
        m.add(h, grammar, ignore_eos=False, output_tokens=[])
    step_masks(m, [1, 3], torch.zeros(2, VOCAB))  # builds the matchers
    drafts = {0: [5, 6], 1: m.tokenizer.tokenize_str("Lily is")[:3], 2: [], 3: m.tokenizer.tokenize_str("T")}
    assert len(drafts[1]) == 3 and len(drafts[3]) == 1
    logits = torch.randn(3 + 4 + 1 + 2, VOCAB)
    job = m.begin([0, 1, 2, 3], [drafts[h] for h in range(4)])
    masked, errors = m.apply(job, logits, in_place=False)
    assert not errors
    for at in (0, 1, 2, 7):  # the free rows' positions
        assert torch.equal(masked[at], logits[at])
    start = next_mask(m, LLMatcher(m.tokenizer, grammar))
    for h, first in ((1, 3), (3, 8)):
        ref = LLMatcher(m.tokenizer, grammar)
        for j in range(len(drafts[h]) + 1):
            assert allowed(masked, first + j) == next_mask(m, ref), f"handle {h}, position {j}"
            if j < len(drafts[h]):
                assert ref.consume_token(drafts[h][j])
        assert next_mask(m, ref) != start
    after = step_masks(m, [1, 3], torch.zeros(2, VOCAB))[0]
    assert allowed(after, 0) == allowed(after, 1) == start, "the drafts were rolled back"
