"""bench/workloads.py: seeded generators, length clipping, JSONL parsing."""

from __future__ import annotations

import json

import pytest

from bench import workloads as wl
from bench.workloads import FIRST_REGULAR_ID, LengthDist, SharedPrefixSpec

VOCAB = 8192


def _ids(work):
    return [(r.prompt_token_ids, r.max_tokens) for r in work.requests]


def test_mixed_same_seed_same_requests():
    assert _ids(wl.mixed(16, VOCAB, seed=3)) == _ids(wl.mixed(16, VOCAB, seed=3))


def test_mixed_different_seed_different_requests():
    assert _ids(wl.mixed(16, VOCAB, seed=3)) != _ids(wl.mixed(16, VOCAB, seed=4))


def test_mixed_small_run_is_a_prefix_of_the_full_run():
    assert _ids(wl.mixed(8, VOCAB, seed=0)) == _ids(wl.mixed(64, VOCAB, seed=0))[:8]


def test_mixed_lengths_are_clipped_to_the_benchmark_bounds():
    work = wl.mixed(256, VOCAB, seed=0)
    prompt_lens = [r.prompt_len for r in work.requests]
    outputs = [r.max_tokens for r in work.requests]
    assert min(prompt_lens) >= 16 and max(prompt_lens) <= 1024
    assert min(outputs) >= 8 and max(outputs) <= 512
    # Log-normal around 128: the middle of the sample sits near the median.
    assert 90 <= sorted(prompt_lens)[128] <= 180 and 90 <= sorted(outputs)[128] <= 180


def test_tight_bounds_clip_every_draw():
    work = wl.mixed(64, VOCAB, seed=0, prompt=LengthDist(128, 20, 30), output=LengthDist(128, 5, 5))
    assert all(20 <= r.prompt_len <= 30 and r.max_tokens == 5 for r in work.requests)


def test_random_prompts_avoid_special_ids_and_stay_in_vocab():
    work = wl.mixed(64, 50, seed=0)
    tokens = [t for r in work.requests for t in r.prompt_token_ids]
    assert min(tokens) >= FIRST_REGULAR_ID and max(tokens) < 50
    assert len(set(tokens)) == 50 - FIRST_REGULAR_ID  # every regular id is reachable


def test_length_dist_rejects_inverted_bounds():
    with pytest.raises(ValueError, match="lo <= hi"):
        LengthDist(10, 20, 10)


def test_scaled_length_dist_shrinks_median_and_bounds():
    d = wl.MIXED_PROMPT.scaled(0.125)
    assert (d.median, d.lo, d.hi) == (16, 2, 128)
    tiny = wl.MIXED_OUTPUT.scaled(0.01)
    assert tiny.lo >= 1 and tiny.hi >= tiny.lo


def test_shared_prefix_requests_share_exactly_the_prefix():
    spec = SharedPrefixSpec(num_requests=6, prefix_len=20, suffix_len=5, output_len=7)
    work = wl.shared_prefix(VOCAB, seed=1, spec=spec)
    prefixes = {tuple(r.prompt_token_ids[:20]) for r in work.requests}
    suffixes = {tuple(r.prompt_token_ids[20:]) for r in work.requests}
    assert len(prefixes) == 1 and len(suffixes) == 6
    assert all(len(r.prompt_token_ids) == 25 and r.max_tokens == 7 for r in work.requests)


def test_shared_prefix_defaults_follow_benchmarks_md():
    work = wl.shared_prefix(VOCAB)
    assert len(work.requests) == 128
    assert {(r.prompt_len, r.max_tokens) for r in work.requests} == {(512 + 32, 64)}


def test_overload_arrivals_lie_within_the_duration_and_in_order():
    work = wl.overload(rate=20.0, duration_s=3.0, vocab_size=VOCAB, seed=0)
    arrivals = [r.arrival_s for r in work.requests]
    assert arrivals == sorted(arrivals) and all(0 < t < 3.0 for t in arrivals)
    assert 30 < len(arrivals) < 95  # 60 expected
    assert wl.overload(20.0, 3.0, VOCAB, seed=0).requests[5].arrival_s == arrivals[5]


def test_online_arrivals_leave_the_prompts_unchanged():
    offline = _ids(wl.mixed(10, VOCAB, seed=0))
    online = wl.with_poisson_arrivals(wl.mixed(10, VOCAB, seed=0), rate=4.0, seed=0)
    assert _ids(online) == offline
    assert all(r.arrival_s > 0 for r in online.requests)


def test_fit_to_context_shortens_only_what_cannot_fit():
    reqs = [wl.BenchRequest(0, 10, prompt_token_ids=[5] * 20), wl.BenchRequest(1, 50, prompt_token_ids=[5] * 20),
            wl.BenchRequest(2, 5, prompt_token_ids=[5] * 80), wl.BenchRequest(3, 99, prompt_text="hi")]
    assert wl.fit_to_context(reqs, 64) == 2
    assert (reqs[0].prompt_len, reqs[0].max_tokens) == (20, 10)
    assert (reqs[1].prompt_len, reqs[1].max_tokens) == (20, 44)
    assert (reqs[2].prompt_len, reqs[2].max_tokens) == (63, 1)
    assert reqs[3].max_tokens == 99


def test_warmup_prompts_share_no_prefix_with_the_workload():
    work = wl.mixed(4, VOCAB, seed=0)
    warm = wl.warmup_requests(work.requests, VOCAB, seed=0)
    for w, r in zip(warm, work.requests):
        assert w.prompt_len == r.prompt_len and w.max_tokens <= min(r.max_tokens, wl.WARMUP_MAX_TOKENS)
        assert w.prompt_token_ids[:4] != r.prompt_token_ids[:4]


# ----- JSONL -----------------------------------------------------------------


def test_jsonl_reads_text_and_token_prompts_and_skips_blank_lines():
    lines = [json.dumps({"prompt": "Once upon", "max_tokens": 12}), "", "  ",
             json.dumps({"prompt_token_ids": [4, 5, 6], "max_tokens": 3})]
    reqs = wl.parse_jsonl(lines)
    assert [(r.index, r.prompt_text, r.prompt_token_ids, r.max_tokens) for r in reqs] == [
        (0, "Once upon", None, 12), (1, None, [4, 5, 6], 3)]
    assert reqs[0].prompt_len is None and reqs[1].prompt_len == 3


@pytest.mark.parametrize("line, fragment", [
    ('{"prompt": "a", "max_tokens": 4', "not JSON"),
    ('[1, 2]', "expected an object"),
    ('{"prompt": "a", "prompt_token_ids": [3], "max_tokens": 4}', "exactly one"),
    ('{"max_tokens": 4}', "exactly one"),
    ('{"prompt": "a"}', "max_tokens"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "a", "max_tokens": true}', "max_tokens"),
    ('{"prompt": "a", "max_tokens": 2.5}', "max_tokens"),
    ('{"prompt": "", "max_tokens": 2}', "non-empty string"),
    ('{"prompt_token_ids": [], "max_tokens": 2}', "prompt_token_ids"),
    ('{"prompt_token_ids": [1, -2], "max_tokens": 2}', "prompt_token_ids"),
    ('{"prompt_token_ids": "123", "max_tokens": 2}', "prompt_token_ids"),
])
def test_jsonl_bad_line_raises_naming_the_line(line, fragment):
    good = json.dumps({"prompt": "ok", "max_tokens": 1})
    with pytest.raises(ValueError) as exc:
        wl.parse_jsonl([good, line], source="data.jsonl")
    assert "data.jsonl:2" in str(exc.value) and fragment in str(exc.value)


def test_jsonl_without_requests_is_an_error():
    with pytest.raises(ValueError, match="no requests"):
        wl.parse_jsonl(["", "\n"])


def test_from_jsonl_reads_a_file_and_honours_num_requests(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [3 + i], "max_tokens": 2}) + "\n" for i in range(5)))
    work = wl.from_jsonl(path, num_requests=3)
    assert work.name == "dataset" and [r.prompt_token_ids for r in work.requests] == [[3], [4], [5]]


def test_multi_turn_sessions_fit_stories260k_and_hold_only_each_new_question():
    spec = wl.MultiTurnSpec()
    work = wl.multi_turn(512, seed=1, spec=spec)
    assert len(work.requests) == 32 * 4
    assert [r.turn for r in work.requests[:33]] == [0] * 32 + [1]
    assert {len(r.prompt_token_ids) for r in work.requests if r.turn == 0} == {spec.first_len}
    assert {len(r.prompt_token_ids) for r in work.requests if r.turn > 0} == {spec.question_len}
    # The fourth turn's prompt is three answered turns and its question.
    assert work.params["last_prompt_len"] == 432 and 432 + spec.answer_len <= 512
    assert _ids(work) == _ids(wl.multi_turn(512, seed=1, spec=spec))


def test_multi_turn_think_times_are_exponential_with_the_mean_asked_and_leave_the_questions_alone():
    paced = wl.multi_turn(512, seed=1, spec=wl.MultiTurnSpec(num_sessions=500, think_time_s=2.0))
    at_once = wl.multi_turn(512, seed=1, spec=wl.MultiTurnSpec(num_sessions=500))
    assert _ids(paced) == _ids(at_once), "a think time changed the questions of a seed"
    assert all(r.think_s == 0 for r in at_once.requests)
    assert all(r.think_s == 0 for r in paced.requests if r.turn == 0), "a first turn waited"
    later = [r.think_s for r in paced.requests if r.turn > 0]
    assert len(later) == 1500 and min(later) > 0
    # Exponential: the mean is the asked one (1,500 draws: standard error 0.05 s) and about 63% fall below it.
    assert abs(sum(later) / len(later) - 2.0) < 0.2
    assert 0.58 < sum(t < 2.0 for t in later) / len(later) < 0.68
    assert [r.think_s for r in paced.requests] == [
        r.think_s for r in wl.multi_turn(512, seed=1, spec=wl.MultiTurnSpec(num_sessions=500, think_time_s=2.0)).requests]
    assert paced.params["think_time_s"] == 2.0


class FakeModel:
    """Tokenize and generate as the copy prompts need them: BOS is 1, a
    text's tokens are its words' lengths + 10, and the continuation of a
    prompt counts up from its last token; it records what it generated."""

    def __init__(self):
        self.generated: list[list[int]] = []

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return [1] * add_special_tokens + [len(word) + 10 for word in text.split()]

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.generated.append(prompt)
        return [prompt[-1] + 1 + i for i in range(max_tokens)]


def test_copy_prompt_is_opening_story_opening_again_without_bos():
    model = FakeModel()
    [prompt] = wl.copy_prompts(["ab cde"], 3, model.tokenize, model.generate)
    assert prompt == [1, 12, 13] + [14, 15, 16] + [12, 13]


def test_copy_openings_cycle_and_each_distinct_one_is_generated_once():
    n = len(wl.COPY_OPENINGS) + 2
    openings = wl.copy_openings(n)
    assert openings[:len(wl.COPY_OPENINGS)] == list(wl.COPY_OPENINGS) and openings[-2:] == openings[:2]
    model = FakeModel()
    prompts = wl.copy_prompts(openings, 4, model.tokenize, model.generate)
    assert len(model.generated) == len(wl.COPY_OPENINGS)
    assert prompts[-2:] == prompts[:2] and prompts[0] is not prompts[-2]  # equal, not shared: fit may trim one
    work = wl.copy_workload(prompts, 4, 7)
    assert [r.max_tokens for r in work.requests] == [7] * n
    assert work.params["distinct_prompts"] == len(wl.COPY_OPENINGS) and "opening again" in work.params["prompts"]


def test_copy_prompts_past_the_room_are_refused_before_anything_is_generated():
    model = FakeModel()
    with pytest.raises(ValueError, match="would be 8 tokens, past 7"):
        wl.copy_prompts(["ab cde"], 3, model.tokenize, model.generate, max_prompt_len=7)
    assert model.generated == []
    assert wl.copy_prompts(["ab cde"], 3, model.tokenize, model.generate, max_prompt_len=8)
