"""The n-gram proposer and the executor's verification of drafts, greedy,
sampled and constrained (a constrained row's drafts cut to what its
grammar takes, every verified position masked), in process (issue 36);
through both services: tests/integration/test_speculative.py."""

from __future__ import annotations

import json
import re

import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher
from tokenizers import Tokenizer

from executor_svc.config import ExecutorSettings
from executor_svc.loading import check_speculative
from executor_svc.step.constraints import ConstraintMatchers
from executor_svc.step.ngram import NgramProposer, propose
from executor_svc.step.runner import NewRequestData, PlanError, StepPlan
from executor_svc.step.sampler import SamplingSettings
from gateway_svc import tools
from gateway_svc.protocol import ChatCompletionRequest
from gateway_svc.tool_parsers import hermes
from llmsched.errors import StartupError
from tests.constrained_cases import ADD, AGES, PET
from tests.oracle import hf_greedy
from tests.unit.test_runner_vs_hf import GREEDY, make_runner


@pytest.mark.parametrize("tokens, k, want", [
    ([5, 6, 7, 8, 5, 6], 3, [7, 8, 5]),  # the tail 5 6 was followed by 7 8 5
    ([2, 3, 9, 2, 3, 4, 2, 3], 2, [4, 2]),  # of two matches as long, the latest wins
    ([1, 2, 3, 4], 2, []),  # no match: nothing worth verifying
    ([5, 6, 7, 5, 6], 4, [7, 5, 6]),  # fewer tokens after the match than asked
], ids=["follow", "latest", "none", "short"])
def test_ngram_proposes_what_followed_the_latest_earlier_match_of_the_tail(tokens, k, want):
    assert propose(np.array(tokens), k, 2, 4).tolist() == want


def test_longer_matches_are_tried_first():
    # Tail 3 4: the 2-gram "3 4" was followed by 7, the 1-gram "4" last by 8.
    assert propose(np.array([3, 4, 7, 4, 8, 3, 4]), 1, 1, 2).tolist() == [7]


def test_greedy_verification_yields_the_tokens_plain_decoding_would(stories_path):
    """A request decoded by steps of 1 + 3 drafts produces HF's greedy
    tokens, however many drafts each step accepts."""
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(2, 4)
    prompt = [1, 403, 407, 261, 378]
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(32)), 0, len(prompt), GREEDY, 0)]))
    tokens, steps = list(out.sampled_token_ids), 1
    while len(tokens) < 60:
        out = runner.execute(StepPlan(steps, cached_handles=[0], cached_num_scheduled_tokens=[4], draft_handles=[0],
                                      draft_counts=[3]))
        assert set(out.sampled_handles) == {0} and 1 <= len(out.sampled_token_ids) <= 4
        tokens += out.sampled_token_ids
        steps += 1
    assert tokens[:60] == hf_greedy(str(stories_path), prompt, 60, ignore_eos=True)[:60]


def by_definition(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n (max_n down to min_n) whose last n tokens occur
    earlier; of those places the latest; the up to k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[len(tokens) - n:]
        places = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tail]
        if places:
            return tokens[places[-1] + n:places[-1] + n + k]
    return []


@settings(max_examples=500, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), k=st.integers(1, 6), min_n=st.integers(1, 3),
       extra=st.integers(0, 2))
def test_ngram_proposal_equals_its_definition(tokens, k, min_n, extra):
    got = propose(np.array(tokens, dtype=np.int32), k, min_n, min_n + extra).tolist()
    assert got == by_definition(tokens, k, min_n, min_n + extra)


def test_a_row_verifies_only_what_the_proposer_found(stories_path):
    """The plan allows 3 drafts; with no earlier match of its tail the row
    decodes its one next token, with a match shorter than 3 it verifies
    just those, and the drafted positions it did not use count as not
    computed."""
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(1, 1)
    prompt = [1, 403, 407, 261, 378]  # no token repeats: no match
    runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(32)), 0, len(prompt), GREEDY, 0)]))
    plan = dict(cached_handles=[0], cached_num_scheduled_tokens=[4], draft_handles=[0], draft_counts=[3])
    out = runner.execute(StepPlan(1, **plan))
    first = out.sampled_token_ids
    assert len(first) == 1 and runner.rows.num_computed[0] == len(prompt) + 1
    # Make the tail (the last sampled token) occur once before, one place
    # from the end: the proposer then has a single token to offer.
    rows = runner.rows
    n = int(rows.num_tokens[0])
    rows.token_ids[0, n - 3] = rows.token_ids[0, n - 1]
    out = runner.execute(StepPlan(2, **plan))
    assert 1 <= len(out.sampled_token_ids) <= 2, "one draft verified, plus one more token"
    assert runner.rows.num_computed[0] == runner.rows.num_tokens[0] - 1


def test_drafts_for_an_executor_that_does_not_speculate_fail_the_plan(stories_path):
    runner = make_runner(str(stories_path))
    runner.execute(StepPlan(0, [NewRequestData(0, [1, 2, 3], list(range(4)), 0, 3, GREEDY, 0)]))
    with pytest.raises(PlanError, match="does not speculate"):
        runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[3], draft_handles=[0],
                                draft_counts=[2]))


@pytest.mark.parametrize("env, message", [
    ({"speculative_method": "eagle3"}, "EXECUTOR_SPECULATIVE_METHOD=eagle3 needs EXECUTOR_SPECULATIVE_DRAFT_MODEL"),
    ({"speculative_method": "ngram", "speculative_ngram_min": 5, "speculative_ngram_max": 3},
     "EXECUTOR_SPECULATIVE_NGRAM_MIN=5 exceeds"),
    ({"speculative_method": "draft"}, "EXECUTOR_SPECULATIVE_METHOD=draft needs EXECUTOR_SPECULATIVE_DRAFT_MODEL"),
    ({"speculative_method": "ngram", "speculative_draft_model": "x"},
     "EXECUTOR_SPECULATIVE_DRAFT_MODEL is set, but EXECUTOR_SPECULATIVE_METHOD=ngram does not use it"),
], ids=["eagle3-without-head", "window-upside-down", "draft-without-model", "draft-model-without-draft"])
def test_a_speculative_setting_not_implemented_is_refused_by_name(env, message):
    with pytest.raises(StartupError, match=message):
        check_speculative(ExecutorSettings(**env), True)
    check_speculative(ExecutorSettings(), True)
    with pytest.raises(StartupError, match="no lm_head"):
        check_speculative(ExecutorSettings(speculative_method="ngram"), False)


SAMPLED = SamplingSettings(temperature=1.0, top_p=0.9, top_k=0, seed=1234, logprobs=2)


def decode(runner, prompt: list[int], sampling: SamplingSettings, num_tokens: int, drafts: int) -> tuple[list, list]:
    """One request, its tokens and logprobs, decoded by steps of 1 + drafts
    (0: plain decoding)."""
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(64)), 0, len(prompt), sampling, 0)]))
    tokens, logprobs, steps = list(out.sampled_token_ids), list(out.logprobs or []), 1
    while len(tokens) < num_tokens:
        kw = dict(draft_handles=[0], draft_counts=[drafts]) if drafts else {}
        out = runner.execute(StepPlan(steps, cached_handles=[0], cached_num_scheduled_tokens=[1 + drafts], **kw))
        tokens += out.sampled_token_ids
        logprobs += out.logprobs or []
        steps += 1
    runner.execute(StepPlan(steps, finished_handles=[0]))
    return tokens[:num_tokens], logprobs[:num_tokens]


def test_a_seeded_sampled_request_yields_the_same_tokens_and_logprobs_with_drafts_as_without(stories_path):
    """Each verified position draws with the uniform plain decoding would
    use there (seed, output position), so drafts change how many tokens a
    step yields, never which."""
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(1, 3)
    prompt = [1, 403, 407, 261, 378, 403, 407, 261]  # a repeat: the proposer drafts from the start
    plain, plain_lps = decode(runner, prompt, SAMPLED, 48, drafts=0)
    spec, spec_lps = decode(runner, prompt, SAMPLED, 48, drafts=3)
    assert spec == plain
    for (lp, ids, top), (lp2, ids2, top2) in zip(spec_lps, plain_lps):
        assert ids == ids2 and lp == pytest.approx(lp2, abs=1e-4) and top == pytest.approx(top2, abs=1e-4)
    other, _ = decode(runner, prompt, SamplingSettings(1.0, 0.9, 0, seed=99, logprobs=0), 48, drafts=3)
    assert other != plain, "another seed draws other tokens (else the test could not fail)"


def test_the_first_token_of_a_verify_step_is_drawn_from_the_model_s_distribution(stories_path):
    """20,000 seeded requests with one prompt, temperature 1: the token each
    samples first, in a step verifying a draft, is distributed as the
    model's softmax (total variation under 0.02). Plain decoding's draws
    are the sampler's, tested in test_sampler.py."""
    rows, rounds = 5000, 4
    runner = make_runner(str(stories_path), num_blocks=2 + rows)
    runner.proposer = NgramProposer(1, 4)
    # "Lily liked to play. Lily": its last token occurs earlier, so a draft
    # follows, and what comes next is far from certain (top token at 0.2).
    prompt = [1] + Tokenizer.from_file(str(stories_path / "tokenizer.json")).encode("Lily liked to play. Lily").ids
    assert len(prompt) == 9
    # Positions 0-6 are computed once into blocks 0 and 1, which every
    # request then shares (position 7, which each writes there, holds the
    # same KV for all); each has a block of its own for 8 and 9.
    runner.execute(StepPlan(0, [NewRequestData(0, prompt, [0, 1], 0, 7, GREEDY, 0)]))
    runner.execute(StepPlan(1, finished_handles=[0]))
    counts = np.zeros(runner.vocab_size)
    step = 2
    for rnd in range(rounds):
        # Position 7, sampling nothing; then one step from the prompt's last
        # token with a draft after it.
        news = [NewRequestData(h, prompt, [0, 1, 2 + h], 7, 1,
                               SamplingSettings(1.0, 1.0, 0, seed=rnd * rows + h, logprobs=0), 0)
                for h in range(rows)]
        runner.execute(StepPlan(step, news))
        out = runner.execute(StepPlan(step + 1, cached_handles=list(range(rows)), cached_num_scheduled_tokens=[2] * rows,
                                      draft_handles=list(range(rows)), draft_counts=[1] * rows))
        assert {(h, v) for h, v, _ in out.verified_drafts} == {(h, 1) for h in range(rows)}, "every request verified its draft"
        first = {}
        for h, t in zip(out.sampled_handles, out.sampled_token_ids):
            first.setdefault(h, t)
        np.add.at(counts, list(first.values()), 1)
        runner.execute(StepPlan(step + 2, finished_handles=list(range(rows))))
        step += 3
    assert counts.sum() == rows * rounds
    ref = make_runner(str(stories_path))
    out = ref.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(4)), 0, len(prompt),
                                                  SamplingSettings(0.0, 1.0, 0, None, logprobs=20), 0)]))
    _, ids, top = out.logprobs[0]
    probs = np.zeros(runner.vocab_size)
    probs[ids] = np.exp(top)
    tail = np.ones(runner.vocab_size, bool)
    tail[ids] = False
    observed = counts / counts.sum()
    # The tokens past the model's top 20 are compared as one bucket.
    tv = 0.5 * (np.abs(observed[ids] - probs[ids]).sum() + abs(observed[tail].sum() - (1 - probs[ids].sum())))
    assert tv < 0.02, f"total variation {tv:.4f} from the model's softmax"


# ----- constrained rows ---------------------------------------------------------

EOS = 2


def forced_call_grammar() -> str:
    """The grammar the gateway sends for tool_choice required (hermes calls)."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Add 2 and 3."}],
                                                 "tools": [ADD], "tool_choice": "required",
                                                 "parallel_tool_calls": False})
    return LLMatcher.grammar_from_lark(tools.plan(body, "hermes").constraint.structured.grammar)


def one_add_call(text: str) -> bool:
    scan = hermes.scan(text, final=True)
    return (scan.content == "" and len(scan.calls) == 1 and scan.calls[0].name == "add"
            and json.loads(scan.calls[0].arguments).keys() == {"a", "b"})


# A grammar, a check of a whole output's text, and a prompt holding text the
# grammar takes, for the proposer to draft from.
CONSTRAINED = {
    "json": (LLMatcher.grammar_from_json_schema(json.dumps(PET), defaults={"whitespace_flexible": False}),
             lambda text: json.loads(text).keys() == {"age", "pet"}, 'Lily said {"age":7,"pet":"dog"} and Tom said '),
    "regex": (LLMatcher.grammar_from_regex(AGES), lambda text: re.fullmatch(AGES, text) is not None,
              "Lily is 12. Tom is 34. Then "),
    "tool_call": (forced_call_grammar(), one_add_call,
                  'Sum: <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 8}}\n</tool_call> Now: '),
}


@pytest.fixture(scope="module")
def constrained_runner(stories_path):
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(1, 3)
    runner.constraints = ConstraintMatchers((stories_path / "tokenizer.json").read_text(), 512, [EOS])
    return runner


def allowed_next(runner, matcher: LLMatcher | None = None) -> set[int]:
    """The tokens request 0's next mask allows in the runner, or those a
    reference matcher's own mask allows."""
    c = runner.constraints
    if matcher is None:
        masked, errors = c.apply(c.begin([0]), torch.zeros(1, runner.vocab_size), in_place=True)
        assert not errors
        return set(torch.isfinite(masked[0]).nonzero().squeeze(1).tolist())
    bitmask = llg_numpy.allocate_token_bitmask(1, c.vocab_size)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask)
    return set(np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:runner.vocab_size]).tolist())


def decode_constrained(runner, prompt: list[int], grammar: str, sampling: SamplingSettings,
                       drafts: int) -> tuple[list, list, int]:
    """One constrained request decoded by steps of 1 + drafts (0: plain
    decoding) until it samples EOS, where the scheduler would end it.
    After every step its matcher masks as a matcher fed its output one
    token at a time does. Returns its tokens, their logprobs, and how
    many drafts it accepted."""
    ref = LLMatcher(runner.constraints.tokenizer, grammar)
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(64)), 0, len(prompt), sampling, 0,
                                                     grammar)]))
    tokens, logprobs, accepted, steps = [], [], 0, 1
    while True:
        assert not out.request_errors, out.request_errors
        tokens += out.sampled_token_ids
        logprobs += out.logprobs or []
        accepted += len(out.sampled_token_ids) - 1
        if tokens[-1] == EOS or len(tokens) >= 80:
            break
        assert ref.consume_tokens(out.sampled_token_ids)
        assert allowed_next(runner) == allowed_next(runner, ref), f"matcher state after {len(tokens)} tokens"
        kw = dict(draft_handles=[0], draft_counts=[drafts]) if drafts else {}
        out = runner.execute(StepPlan(steps, cached_handles=[0], cached_num_scheduled_tokens=[1 + drafts], **kw))
        steps += 1
    runner.execute(StepPlan(steps, finished_handles=[0]))
    return tokens, logprobs, accepted


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", CONSTRAINED)
def test_a_constrained_request_yields_the_same_tokens_with_drafts_as_without(constrained_runner, kind, sampling):
    """Each verified position is drawn under the grammar's mask after the
    drafts before it, so drafts change how many tokens a step yields, never
    which; the output is whole and valid."""
    runner = constrained_runner
    grammar, valid, text = CONSTRAINED[kind]
    prompt = [1] + runner.constraints.tokenizer.tokenize_str(text)
    plain, plain_lps, _ = decode_constrained(runner, prompt, grammar, sampling, drafts=0)
    spec, spec_lps, accepted = decode_constrained(runner, prompt, grammar, sampling, drafts=4)
    assert spec == plain
    assert spec[-1] == EOS and valid(runner.constraints.tokenizer.decode_str(spec[:-1]))
    assert accepted > 0, "no draft was accepted: the masks of drafted positions went untested"
    for (lp, ids, top), (lp2, ids2, top2) in zip(spec_lps, plain_lps, strict=True):
        assert ids == ids2 and lp == pytest.approx(lp2, abs=1e-4) and top == pytest.approx(top2, abs=1e-4)


def test_drafts_the_grammar_refuses_are_cut_before_the_forward(constrained_runner):
    """The prompt drafts " went home" after "Lily"; the grammar takes
    " went" and not " home": the row verifies only the drafts before it."""
    runner = constrained_runner
    tokenizer = runner.constraints.tokenizer
    prompt = [1] + tokenizer.tokenize_str("Lily went home. Lily")
    grammar = LLMatcher.grammar_from_regex(r" went away\.")
    runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(64)), 0, len(prompt), GREEDY, 0, grammar)]))
    n = int(runner.rows.num_tokens[0])
    first = runner.rows.token_ids[0, n - 1]
    proposal = propose(runner.rows.token_ids[0, :n], 4, runner.proposer.min_n, runner.proposer.max_n)
    ref = LLMatcher(tokenizer, grammar)
    assert ref.consume_token(int(first))
    takes = ref.validate_tokens(proposal.tolist())
    assert 0 < takes < len(proposal), f"the proposal {proposal} should hold a token the grammar refuses"
    out = runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[5], draft_handles=[0],
                                  draft_counts=[4]))
    assert [(h, v) for h, v, _ in out.verified_drafts] == [(0, takes)] and not out.request_errors
    runner.execute(StepPlan(2, finished_handles=[0]))


def test_logit_bias_and_min_tokens_apply_at_every_verified_position(stories_path):
    """A seeded request with a logit_bias and min_tokens holding back a
    token its output would otherwise contain: with 3 drafts per step it
    yields what plain decoding does, so both apply at each verified
    position as at that output index."""
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(1, 3)
    prompt = [1, 403, 407, 261, 378, 403, 407, 261]
    free, _ = decode(runner, prompt, SamplingSettings(0.8, 1.0, 0, seed=7, logprobs=0), 48, drafts=0)
    held = max(set(free), key=free.count)  # its most frequent token
    settings = SamplingSettings(0.8, 1.0, 0, seed=7, logprobs=0, logit_bias=((free[5], 2.5),), min_tokens=40,
                                min_tokens_held_ids=(held,))
    plain, _ = decode(runner, prompt, settings, 48, drafts=0)
    assert held not in plain[:40] and plain != free, "the settings change the output (else the test could not fail)"
    spec, _ = decode(runner, prompt, settings, 48, drafts=3)
    assert spec == plain


def test_penalties_count_the_drafts_before_each_verified_position(stories_path):
    """Penalties count the tokens generated: at a verified position, the
    drafts before it count as generated (the position stands only if they
    are accepted), and a step's accepted tokens join the request's counts."""
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(1, 3)
    penalised = SamplingSettings(0.0, 1.0, 0, None, logprobs=0, frequency_penalty=1.0)
    out = runner.execute(StepPlan(0, [NewRequestData(0, [1, 403, 407], list(range(8)), 0, 3, penalised, 0)]))
    [first] = out.sampled_token_ids
    r, row = runner.rows, runner.rows.row_of(0)
    n = int(r.num_tokens[row])
    r.token_ids[row, n:n + 3] = [7, 7, 9]  # drafts after the known tokens
    at, offset = np.full(4, row), np.arange(4)
    logits = torch.zeros(4, runner.vocab_size)
    runner._processors(at, r.num_output[at] + offset, offset).apply(logits)
    counts = np.zeros((4, runner.vocab_size), dtype=np.float32)
    for j in range(4):
        np.add.at(counts[j], [first] + [7, 7, 9][:j], 1)
    assert torch.equal(logits, torch.from_numpy(-counts)), "position j counts the j drafts before it"
    # A verify step hands each position its drafts before it, and the
    # tokens it yields, and only those, join the counts. (Its last known
    # token, whose KV the step computes, made 403 so the proposer drafts
    # what followed 403 in the prompt; the counts keep the sampled one.)
    r.token_ids[row, n - 1] = 403
    calls = []
    real = runner._processors
    runner._processors = lambda *args: calls.append(args) or real(*args)
    out = runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[3], draft_handles=[0],
                                  draft_counts=[2]))
    [(rows, output_pos, drafts_before)] = [c for c in calls if len(c) == 3]
    verified = 1 + {h: v for h, v, _ in out.verified_drafts}[0]
    assert drafts_before.tolist() == list(range(verified)) and output_pos.tolist() == list(range(1, 1 + verified))
    generated = np.zeros(runner.vocab_size)
    np.add.at(generated, [first] + out.sampled_token_ids, 1)
    assert np.array_equal(r.counts.output_counts[r.penalty_slot[row]].numpy(), generated)


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=0.1, presence_penalty=0.1), dict(repetition_penalty=1.05)],
                         ids=["frequency-presence", "repetition"])
def test_a_penalised_request_yields_plain_decoding_s_tokens_with_drafts(stories_path, penalties):
    """Seeded and penalised, with 3 drafts per step: the output is plain
    decoding's. (On stories260K penalties leave few drafts accepted, so this
    is the exactness check; test_penalties_count_the_drafts_before_each_
    verified_position is the one that sees the drafts counted.)"""
    runner = make_runner(str(stories_path))
    runner.proposer = NgramProposer(1, 3)
    prompt = [1, 403, 407, 261, 378, 403, 407, 261]
    settings = SamplingSettings(0.8, 1.0, 0, seed=11, logprobs=0, **penalties)
    plain, _ = decode(runner, prompt, settings, 48, drafts=0)
    spec, _ = decode(runner, prompt, settings, 48, drafts=3)
    assert spec == plain
