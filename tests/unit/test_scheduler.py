"""Scheduling decisions, driven directly with a fake executor."""

import pytest

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.request import CompiledConstraint
from tests.factories import EOS, FakeExecutor, make_request, make_requests, make_scheduler, run_step


def drain(sched, executor=None, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_work:
            return
        run_step(sched, executor)
    raise AssertionError("scheduler did not drain")


def test_new_request_is_sent_in_full_once_then_as_a_diff():
    sched = make_scheduler(block_size=4)
    req = make_request(prompt_len=6, max_tokens=5)
    sched.add_request(req)
    out, _ = run_step(sched)
    assert [n.request for n in out.new_requests] == [req]
    assert out.new_requests[0].token_ids == req.prompt_token_ids
    assert out.new_requests[0].num_scheduled_tokens == 6
    out, _ = run_step(sched)
    assert out.new_requests == [] and out.cached_requests == [req]
    assert out.cached_num_scheduled_tokens == [1]
    assert out.new_block_ids == []  # token 7 still fits block 2
    out, _ = run_step(sched)  # token 8 fills block 2
    out, _ = run_step(sched)  # token 9 needs block 3
    assert out.new_block_handles == [req.handle] and len(out.new_block_ids) == 1


def test_running_requests_decode_while_new_ones_are_admitted():
    sched = make_scheduler()
    a = make_request(prompt_len=4, max_tokens=10)
    sched.add_request(a)
    run_step(sched)
    b = make_request(prompt_len=5, max_tokens=10)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert out.cached_requests == [a] and [n.request for n in out.new_requests] == [b]
    assert out.total_num_scheduled_tokens == 1 + 5


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=16, max_prefill_chunk=8, num_kv_blocks=64)
    a = make_request(prompt_len=4, max_tokens=20)
    sched.add_request(a)
    run_step(sched)
    long = make_request(prompt_len=40, max_tokens=2)
    sched.add_request(long)
    chunks = []
    for _ in range(5):
        out, _ = run_step(sched)
        assert a in out.cached_requests, "the running decode must not stall behind the long prompt"
        sched_long = dict((r.request_id, n) for r, n in out.scheduled()).get(long.request_id)
        chunks.append(sched_long)
    assert chunks == [8, 8, 8, 8, 8]
    assert long.num_computed_tokens == 40 and len(long.output_token_ids) == 1


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_num_seqs=3)
    for r in make_requests(5, max_tokens=50):
        sched.add_request(r)
    run_step(sched)
    assert len(sched.running) == 3 and len(sched.waiting) == 2


def test_token_budget_bounds_each_step():
    sched = make_scheduler(max_num_batched_tokens=10, max_prefill_chunk=10)
    for r in make_requests(3, prompt_len=6):
        sched.add_request(r)
    out, _ = run_step(sched)
    assert out.total_num_scheduled_tokens <= 10


def test_finished_request_frees_blocks_in_the_same_step_and_is_forgotten_next_plan():
    sched = make_scheduler()
    req = make_request(prompt_len=5, max_tokens=2)
    sched.add_request(req)
    run_step(sched)
    run_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert sched.num_free_blocks == sched.config.num_kv_blocks
    other = make_request()
    sched.add_request(other)
    out, _ = run_step(sched)
    assert out.finished_handles == [req.handle]


def test_eos_stops_unless_ignore_eos():
    sched = make_scheduler()
    stops = make_request(max_tokens=10)
    ignores = make_request(max_tokens=3, ignore_eos=True)
    sched.add_request(stops)
    sched.add_request(ignores)
    drain(sched, FakeExecutor(lambda r: EOS))
    assert stops.status == RequestStatus.FINISHED_STOPPED and stops.output_token_ids == [EOS]
    assert ignores.status == RequestStatus.FINISHED_LENGTH and ignores.output_token_ids == [EOS] * 3


def test_a_constrained_request_ends_at_eos_even_with_ignore_eos():
    # The executor samples EOS for it only where its grammar may end (with
    # ignore_eos, only where nothing else is left), so EOS is the end.
    sched = make_scheduler()
    req = make_request(max_tokens=10, ignore_eos=True)
    req.constraint = CompiledConstraint("choice", "{}")
    sched.add_request(req)
    drain(sched, FakeExecutor(lambda r: EOS if len(r.output_token_ids) == 2 else 5))
    assert req.output_token_ids == [5, 5, EOS] and req.status == RequestStatus.FINISHED_STOPPED


def test_every_generating_request_speculates_whatever_its_sampling_settings():
    # The executor masks each verified position with the grammar's mask
    # after the drafts before it and applies logit_bias, min_tokens and
    # penalties as at that position; a stop string completing mid-step cuts
    # the step's later tokens (test_a_stop_string_completing_mid_step_...).
    sched = make_scheduler(speculative_tokens=4, speculative_max_batch=16)
    constrained = make_request(max_tokens=20)
    constrained.constraint = CompiledConstraint("regex", "{}")
    others = [make_request(max_tokens=20, logit_bias=((7, 2.0),)), make_request(max_tokens=20, min_tokens=10),
              make_request(max_tokens=20, stop=("@@",)), make_request(max_tokens=20, frequency_penalty=0.5),
              make_request(max_tokens=20, temperature=0.8, seed=3, logprobs=2)]
    for req in [constrained] + others:
        sched.add_request(req)
    run_step(sched)  # the prompts
    out = sched.schedule()
    assert sorted(out.lookahead_handles) == sorted(r.handle for r in [constrained] + others)
    assert out.lookahead_counts == [4] * 6


def test_speculating_an_unseeded_request_gets_a_random_seed_of_its_own():
    """So a model-based proposer can draw its drafts with the uniforms the
    target's draws will use; a seeded request keeps its seed."""
    sched = make_scheduler(speculative_tokens=4, speculative_max_batch=16)
    unseeded, other, seeded = (make_request(temperature=1.0), make_request(temperature=1.0),
                               make_request(temperature=1.0, seed=7))
    for req in (unseeded, other, seeded):
        sched.add_request(req)
    assert unseeded.sampling.seed is not None and unseeded.sampling.seed != other.sampling.seed
    assert seeded.sampling.seed == 7
    plain = make_scheduler()
    req = make_request(temperature=1.0)
    plain.add_request(req)
    assert req.sampling.seed is None, "without speculation an unseeded request stays unseeded"


def test_a_stop_string_completing_mid_step_cuts_the_step_s_later_tokens_from_the_output():
    """A speculative step yields 4 tokens; the second completes a stop
    string: the request ends with it, and the 2 after it leave its output."""
    sched = make_scheduler()
    req = make_request(max_tokens=20, stop=("@@",))
    sched.add_request(req)
    req.output_token_ids += [5, 6, 7, 8]  # as update_from_output appends a step's tokens
    sched.stop_by_string(req, 2)
    assert req.output_token_ids == [5, 6] and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.num_free_blocks == sched.config.num_kv_blocks


def test_forgets_left_when_the_scheduler_goes_idle_are_flushed_in_a_plan_of_their_own():
    sched = make_scheduler()
    req = make_request(max_tokens=2)
    sched.add_request(req)
    drain(sched)
    assert not sched.has_work
    assert sched.schedule().is_empty  # nothing to run: not sent, the forget waits
    out = sched.flush_forgets()
    assert out is not None and out.is_empty and out.finished_handles == [req.handle]
    assert sched.update_from_output(out, []) == []
    assert sched.flush_forgets() is None, "a handle is forgotten once"
    assert sched._alloc_handle() == req.handle, "the handle is reusable once its forget is applied"


def test_stop_token_ids_stop_generation():
    sched = make_scheduler()
    req = make_request(max_tokens=10, stop_token_ids=frozenset({7}))
    sched.add_request(req)
    drain(sched, FakeExecutor(lambda r: 7 if len(r.output_token_ids) == 2 else 5))
    assert req.output_token_ids == [5, 5, 7] and req.status == RequestStatus.FINISHED_STOPPED


def test_pool_exhaustion_preempts_the_latest_request_and_it_recomputes_later():
    # 6 blocks of 4: two requests of 8-token prompts and 8 new tokens need
    # 4 blocks each eventually, so one must be preempted.
    sched = make_scheduler(num_kv_blocks=6, block_size=4)
    first, second = make_request(prompt_len=8, max_tokens=8), make_request(prompt_len=8, max_tokens=8)
    sched.add_request(first)
    sched.add_request(second)
    preempted_step = None
    for step in range(100):
        out, _ = run_step(sched)
        if out.num_preempted:
            preempted_step = out
            break
    assert preempted_step is not None
    assert second.num_preemptions == 1 and second.status == RequestStatus.WAITING
    assert sched.waiting.peek() is second and not preempted_step.new_requests, "no admission in a step that preempted"
    drain(sched)
    assert first.status == second.status == RequestStatus.FINISHED_LENGTH
    assert len(second.output_token_ids) == 8
    assert sched.num_free_blocks == 6


def test_preempted_request_is_resent_in_full_with_its_output_so_far():
    sched = make_scheduler(num_kv_blocks=6, block_size=4)
    first, second = make_request(prompt_len=8, max_tokens=8), make_request(prompt_len=8, max_tokens=8)
    sched.add_request(first)
    sched.add_request(second)
    while not second.num_preemptions:
        run_step(sched)
    outputs_before = list(second.output_token_ids)
    resent = None
    while resent is None:
        out, _ = run_step(sched)
        resent = next((n for n in out.new_requests if n.request is second), None)
    assert resent.token_ids == second.prompt_token_ids + outputs_before
    assert resent.num_output_tokens == len(outputs_before)


def test_abort_frees_blocks_and_is_idempotent():
    sched = make_scheduler()
    req = make_request(max_tokens=10)
    sched.add_request(req)
    run_step(sched)
    assert sched.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED) is req
    assert sched.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED) is None
    assert sched.num_free_blocks == sched.config.num_kv_blocks
    assert not sched.has_work


def test_handles_are_reused_only_after_the_executor_was_told_to_forget():
    sched = make_scheduler()
    a = make_request(max_tokens=1)
    sched.add_request(a)
    run_step(sched)  # a finishes
    b = make_request(max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert out.finished_handles == [a.handle]
    assert b.handle != a.handle


def test_request_that_can_never_fit_is_refused_at_admission():
    sched = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=100)
    assert "max_model_len" in sched.fits(90, 20)
    assert "KV pool" in sched.fits(10, 10)
    with pytest.raises(ValueError, match="KV pool"):
        sched.add_request(make_request(prompt_len=10, max_tokens=10))


def test_reset_executor_state_requeues_running_requests_for_recompute_in_order():
    sched = make_scheduler()
    reqs = make_requests(3, max_tokens=10)
    for r in reqs:
        sched.add_request(r)
    run_step(sched)
    run_step(sched)
    sched.reset_executor_state()
    assert list(sched.waiting) == reqs and not sched.running
    assert sched.num_free_blocks == sched.config.num_kv_blocks
    tokens_before = [r.all_token_ids for r in reqs]
    out, _ = run_step(sched)
    assert [n.request for n in out.new_requests] == reqs
    assert [n.token_ids for n in out.new_requests] == tokens_before
    assert all(n.num_computed_tokens == 0 for n in out.new_requests)


def test_requests_of_a_failed_step_are_retried_alone_then_rejoin_the_batch():
    sched = make_scheduler()
    reqs = make_requests(3, max_tokens=10)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # this step "fails" on the executor
    for r, _ in out.scheduled():
        r.num_failed_steps += 1
    sched.reset_executor_state()
    alone = [run_step(sched)[0] for _ in range(3)]
    assert [[r for r, _ in o.scheduled()] for o in alone] == [[reqs[0]], [reqs[1]], [reqs[2]]]
    assert all(r.num_failed_steps == 0 for r in reqs), "a step that succeeds clears the suspicion"
    out, _ = run_step(sched)
    assert {r.request_id for r, _ in out.scheduled()} == {r.request_id for r in reqs}
