"""Multi-step decode on the scheduler's side (SCHEDULER_MULTI_STEP_DECODE):
when it grants decode rows lookahead slots, and how a result that ran
fewer steps than granted rolls back, with a later plan already in flight.
The executor's side: tests/unit/test_multi_step_runner.py."""

from __future__ import annotations

from scheduler_svc.core.request import CompiledConstraint, RequestStatus
from tests.factories import EOS, make_request, make_requests, make_scheduler, run_step


def decoding(num_requests: int = 3, max_tokens: int = 40, **overrides):
    """A scheduler with multi_step_decode=4 whose requests are all decoding."""
    sched = make_scheduler(multi_step_decode=4, **overrides)
    reqs = make_requests(num_requests, prompt_len=6, max_tokens=max_tokens)
    for req in reqs:
        sched.add_request(req)
    run_step(sched)  # the prompts
    return sched, reqs


def yields(out, counts: dict[int, int], token=lambda req, i: 100 + i):
    """A multi-step result: counts[handle] tokens for each sampling row (1 if not named)."""
    return [(h, token(out.entries[h].request, i), None) for h in out.sampling_handles()
            for i in range(counts.get(h, 1))]


def test_decode_rows_get_lookahead_slots_when_nothing_needs_the_scheduler():
    sched, reqs = decoding()
    out = sched.schedule()
    assert out.multi_step
    assert sorted(out.lookahead_handles) == sorted(r.handle for r in reqs) and out.lookahead_counts == [3] * 3
    assert out.cached_num_scheduled_tokens == [4] * 3
    assert out.stop_token_ids == [EOS]
    for req in reqs:
        # Blocks for all four positions, as for a speculative step's drafts.
        assert len(sched.kv.block_tables[req.request_id]) * 4 >= req.num_computed_tokens == 6 + 4
        assert req.num_output_placeholders == 4


def test_off_by_default_and_one_step_per_plan():
    sched = make_scheduler()
    sched.add_request(make_request(prompt_len=6, max_tokens=40))
    run_step(sched)
    out = sched.schedule()
    assert not out.multi_step and out.lookahead_handles == [] and out.cached_num_scheduled_tokens == [1]


def test_a_waiting_request_a_prompt_chunk_or_a_constraint_means_one_step():
    sched, reqs = decoding()
    sched.add_request(make_request(prompt_len=6, max_tokens=4))
    out = sched.schedule()  # admits it: a prompt in the batch
    assert not out.multi_step and not out.lookahead_handles
    out = sched.schedule()  # its first token is in flight, not yet known
    assert out.multi_step
    sched, reqs = decoding()
    reqs[1].constraint = CompiledConstraint("regex", "a+")
    out = sched.schedule()
    assert not out.multi_step and not out.lookahead_handles


def test_a_batch_above_multi_step_max_batch_steps_one_token_per_plan():
    sched, reqs = decoding(num_requests=3, multi_step_max_batch=2)
    assert not sched.schedule().multi_step
    sched.finish_request(reqs[0].request_id, RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().multi_step


def test_speculating_rows_get_the_steps_slots_plus_their_drafts():
    sched, reqs = decoding(speculative_tokens=2, speculative_max_batch=16)
    out = sched.schedule()
    assert out.multi_step and out.multi_step_drafts == 2 and out.lookahead_counts == [3 + 2] * 3
    sched, reqs = decoding(speculative_tokens=4, speculative_max_batch=4)  # 3 running: above half, half the drafts
    out = sched.schedule()
    assert out.multi_step and out.multi_step_drafts == 2 and out.lookahead_counts == [3 + 2] * 3
    sched, reqs = decoding(speculative_tokens=2, speculative_max_batch=2)  # 3 running: nobody drafts
    out = sched.schedule()
    assert out.multi_step and out.multi_step_drafts == 0 and out.lookahead_counts == [3] * 3


def test_a_constrained_request_speculates_one_step_per_plan():
    sched, reqs = decoding(speculative_tokens=2, speculative_max_batch=16)
    reqs[1].constraint = CompiledConstraint("regex", "a+")
    out = sched.schedule()
    assert not out.multi_step and out.multi_step_drafts == 0 and out.lookahead_counts == [2] * 3


def test_a_speculating_run_counts_each_verifying_step_for_the_acceptance_figures():
    sched, (req,) = decoding(num_requests=1, speculative_tokens=2, speculative_max_batch=16)
    out = sched.schedule()
    # Its 5 slots filled by four steps yielding 1 + 3 + 1 + 1 tokens: no
    # draft found, 2 drafts both accepted, 1 (the slots left) rejected, none.
    sched.update_from_output(out, yields(out, {req.handle: 6}), verified_drafts=[
        (req.handle, 0, 0), (req.handle, 2, 2), (req.handle, 1, 0), (req.handle, 0, 0)])
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 2)
    assert sched.accepted_lengths == {2: 1, 0: 1}, "steps without drafts are not verifications"
    assert len(req.output_token_ids) == 1 + 6 and req.num_computed_tokens == req.num_tokens - 1


def test_a_pool_too_short_for_every_slot_grants_none():
    # 3 requests of 6 prompt tokens in blocks of 4: 6 blocks; their 4
    # decode positions (6-9) need a third block each.
    sched, reqs = decoding(num_kv_blocks=8, max_tokens=20)
    out = sched.schedule()
    assert not out.multi_step and out.cached_num_scheduled_tokens == [1] * 3


def test_slots_stop_at_max_tokens():
    sched, reqs = decoding(num_requests=1, max_tokens=3)  # the prompt step sampled the first
    out = sched.schedule()
    assert out.lookahead_counts == [1]  # tokens 2 and 3
    assert sched.schedule().is_empty  # its last token is in flight


def test_a_run_that_ends_early_rolls_back_like_rejected_drafts_with_the_next_plan_in_flight():
    sched, reqs = decoding(num_requests=2)
    a, b = reqs
    first = sched.schedule()
    second = sched.schedule()  # planned assuming all 4 of first's steps run
    assert second.multi_step and second.entries[a.handle].start == 6 + 4
    # The executor ended a's run after 2 steps (a stop token, an arrival);
    # b's ran all 4.
    sched.update_from_output(first, yields(first, {a.handle: 2, b.handle: 4}))
    assert a.num_computed_tokens == 6 + 4 + 4 - 2 and len(a.output_token_ids) == 1 + 2
    sched.update_from_output(second, yields(second, {a.handle: 4, b.handle: 1}))
    for req, n in ((a, 1 + 2 + 4), (b, 1 + 4 + 1)):
        assert len(req.output_token_ids) == n and req.num_output_placeholders == 0
        assert req.num_computed_tokens == req.num_tokens - 1, "the next step computes its last token"
    assert (sched.num_lookahead_steps, sched.num_lookahead_steps_run) == (12, 1 + 3 + 3 + 0)
    assert sched.num_draft_tokens == 0 and not sched.accepted_lengths, "not counted as speculation"
    out = sched.schedule()
    assert out.entries[a.handle].start == a.num_tokens - 1


def test_a_stop_token_mid_run_finishes_the_request_and_frees_its_blocks():
    sched, (req,) = decoding(num_requests=1)
    out = sched.schedule()
    sched.update_from_output(out, yields(out, {req.handle: 3}, token=lambda r, i: EOS if i == 1 else 100))
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids[-1] == EOS
    assert sched.num_free_blocks == sched.config.num_kv_blocks


def test_runs_to_the_end_under_random_early_ends_and_leaks_nothing():
    import random
    rng = random.Random(3)
    sched, reqs = decoding(num_requests=4, max_tokens=23)
    inflight = []
    for _ in range(200):
        if sched.has_work:
            out = sched.schedule()
            if not out.is_empty:
                inflight.append(out)
        if inflight and (len(inflight) == 2 or not sched.has_work or rng.random() < 0.5):
            out = inflight.pop(0)
            sched.update_from_output(out, yields(out, {h: rng.randint(1, 1 + e.num_lookahead)
                                                        for h, e in out.entries.items()}))
        if not sched.has_work and not inflight:
            break
    assert all(len(r.output_token_ids) == 23 and r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.num_free_blocks == sched.config.num_kv_blocks
