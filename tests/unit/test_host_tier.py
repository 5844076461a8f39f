"""The host KV tier in the scheduler: prefix blocks spilled on eviction and
found again, preemption by swap, and what a failed or lost copy costs."""

from __future__ import annotations

import pytest

from scheduler_svc import convert
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from tests.factories import FakeExecutor, make_request, make_scheduler, run_step

PREFIX = list(range(100, 132))  # 8 blocks of 4


def drain(sched, executor=None, failed=lambda out: ((), ())):
    """Runs steps until nothing is left; returns every plan."""
    plans = []
    while sched.has_work:
        out = sched.schedule()
        plans.append(out)
        fo, fi = failed(out)
        sched.update_from_output(out, (executor or FakeExecutor()).run(out), fo, fi)
    return plans


def evicting_scheduler(**kw):
    # 12 device blocks: one 33-token request and then another evict the first's prefix.
    return make_scheduler(num_kv_blocks=12, block_size=4, num_host_blocks=32, **kw)


def test_an_evicted_prefix_is_spilled_and_a_later_hit_swaps_it_back_in():
    sched = evicting_scheduler()
    first = make_request(prompt=PREFIX + [1], max_tokens=1)
    sched.add_request(first)
    drain(sched)
    # A request with nothing in common takes every device block: the cached
    # prefix is evicted, and copied out as it goes.
    other = make_request(prompt=list(range(500, 547)), max_tokens=1)
    sched.add_request(other)
    plans = drain(sched)
    spilled = [p.swaps for p in plans if p.swaps is not None]
    assert sum(len(s.out_host) for s in spilled) == 8, "all 8 prefix blocks are spilled"
    assert not sched.kv.pool.cached.keys() & set(sched.kv._block_hashes.get(first.request_id, []))
    assert sched.kv.host.pool.num_cached_blocks >= 8

    again = make_request(prompt=PREFIX + [2, 3], max_tokens=2)
    sched.add_request(again)
    out, _ = run_step(sched)
    new = out.new_requests[0]
    assert new.num_computed_tokens == 32 and new.num_scheduled_tokens == 2
    assert out.swaps is not None and out.swaps.in_device == new.block_ids[:8]
    assert again.num_cached_prompt_tokens == 32, "host hits count as cached prompt tokens"
    assert sched.kv.num_host_hit_blocks == 8


def test_a_spilled_block_is_found_only_once_its_copy_is_confirmed():
    sched = evicting_scheduler()
    first = make_request(prompt=PREFIX + [1], max_tokens=1)
    sched.add_request(first)
    drain(sched)
    sched.add_request(make_request(prompt=list(range(500, 547)), max_tokens=1))
    out = sched.schedule()  # evicts (and spills) the prefix; its result is not back yet
    assert out.swaps is not None and len(out.swaps.out_host) > 0
    assert sched.kv.host.pool.num_cached_blocks == 0, "nothing is cached while its copy is in flight"
    again = make_request(prompt=PREFIX + [7], max_tokens=1)
    assert sched.kv.find_cached_prefix(again).num_host_blocks == 0
    sched.update_from_output(out, FakeExecutor().run(out))
    assert sched.kv.find_cached_prefix(again).num_host_blocks == len(out.swaps.out_host)


def test_a_request_whose_prefix_is_being_spilled_waits_for_the_copy_instead_of_recomputing():
    sched = evicting_scheduler()
    sched.add_request(make_request(prompt=PREFIX + [1], max_tokens=1))
    drain(sched)
    sched.add_request(make_request(prompt=list(range(500, 547)), max_tokens=1))
    out = sched.schedule()  # evicts (and spills) the prefix's last blocks; the result is not back yet
    assert out.swaps is not None and out.swaps.out_host
    again = make_request(prompt=PREFIX + [7], max_tokens=1)
    sched.add_request(again)
    waiting = sched.schedule()
    assert again.status == RequestStatus.WAITING, "admitted while its prefix was still on its way to the host"
    assert not waiting.new_requests
    for plan in (out, waiting):  # results come back in order
        sched.update_from_output(plan, FakeExecutor().run(plan))
    plans = drain(sched)
    admitted = [n for p in plans for n in p.new_requests if n.request is again]
    assert admitted[0].num_computed_tokens == 32, "the whole prefix came from the host tier"
    assert again.num_cached_prompt_tokens == 32


def test_a_request_waits_for_a_spill_only_until_it_fails():
    sched = evicting_scheduler()
    sched.add_request(make_request(prompt=PREFIX + [1], max_tokens=1))
    drain(sched)
    sched.add_request(make_request(prompt=list(range(500, 547)), max_tokens=1))
    out = sched.schedule()
    again = make_request(prompt=PREFIX + [7], max_tokens=1)
    sched.add_request(again)
    every_spill_fails = lambda out: (range(len(out.swaps.out_host)) if out.swaps else (), ())  # noqa: E731
    sched.update_from_output(out, FakeExecutor().run(out), *every_spill_fails(out))
    plans = drain(sched, failed=every_spill_fails)
    admitted = [n for p in plans for n in p.new_requests if n.request is again]
    assert again.status == RequestStatus.FINISHED_LENGTH, "a failed copy is not waited for forever"
    assert admitted[0].num_computed_tokens < 32, "the blocks whose copy failed are computed"
    assert sched.kv.host.pool.num_cached_blocks == 0


def test_a_failed_spill_is_never_cached():
    sched = evicting_scheduler()
    sched.add_request(make_request(prompt=PREFIX + [1], max_tokens=1))
    drain(sched)
    sched.add_request(make_request(prompt=list(range(500, 547)), max_tokens=1))
    drain(sched, failed=lambda out: (range(len(out.swaps.out_host)) if out.swaps else (), ()))
    assert sched.kv.host.pool.num_cached_blocks == 0
    assert sched.kv.host.num_free_blocks == 32


def long_generations(mode: str, num_host_blocks: int = 64, caching: bool = True):
    """Two requests whose outputs cannot both fit 10 blocks of 4: the later
    one is preempted."""
    sched = Scheduler(SchedulerConfig(num_kv_blocks=10, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                                      num_host_blocks=num_host_blocks, preemption_mode=mode,
                                      enable_prefix_caching=caching))
    reqs = [make_request(prompt_len=6, max_tokens=20) for _ in range(2)]
    for r in reqs:
        sched.add_request(r)
    return sched, reqs


def test_swap_preemption_resumes_without_recomputing_a_token():
    sched, (early, late) = long_generations("swap")
    plans = drain(sched)
    assert late.num_preemptions >= 1 and late.preempted_by == "swap"
    assert sched.num_preemptions_by_mode == {"swap": late.num_preemptions}
    assert not sched.num_recomputed_tokens, "nothing is computed twice"
    resumed = [n for p in plans for n in p.new_requests if n.request is late][1:]
    assert resumed and all(n.num_computed_tokens > 0 for n in resumed), "it comes back with its KV"
    for n in resumed:
        p = next(p for p in plans if n in p.new_requests)
        assert p.swaps.in_device == n.block_ids[:len(p.swaps.in_device)]
    assert len(early.output_token_ids) == len(late.output_token_ids) == 20
    assert sched.kv.host.num_free_blocks == 64 and not sched.kv.host.swapped


def test_recompute_mode_never_swaps():
    # Prefix caching off: with it on, the victim's full blocks would come
    # back from either tier's prefix cache, and only its last block be
    # recomputed.
    sched, (early, late) = long_generations("recompute", caching=False)
    plans = drain(sched)
    assert late.num_preemptions >= 1 and late.preempted_by == "recompute"
    assert all(p.swaps is None for p in plans)
    assert sched.num_recomputed_tokens["recompute"] > 0
    assert len(late.output_token_ids) == 20


def test_auto_recomputes_when_the_copy_costs_more():
    class CopyIsDear:
        def swap_is_cheaper(self, num_blocks, num_tokens):
            return False

    sched = Scheduler(SchedulerConfig(num_kv_blocks=10, block_size=4, max_model_len=64, num_host_blocks=64),
                      swap_cost=CopyIsDear())
    for r in [make_request(prompt_len=6, max_tokens=20) for _ in range(2)]:
        sched.add_request(r)
    drain(sched)
    assert sched.num_preemptions_by_mode["recompute"] >= 1 and not sched.num_preemptions_by_mode["swap"]


def test_swap_mode_recomputes_when_the_host_tier_is_full():
    sched, (_, late) = long_generations("swap", num_host_blocks=1)
    drain(sched)
    assert late.preempted_by == "recompute"


def test_a_victim_swapped_out_with_a_token_in_flight_keeps_it():
    """Two plans in flight: the victim's step already sent computes and
    samples before the swap_out copies, so its token stands and it resumes
    one token behind, as a decode."""
    sched, (early, late) = long_generations("swap")
    in_flight = [sched.schedule()]
    executor = FakeExecutor()
    while not late.num_preemptions:
        in_flight.append(sched.schedule())
        if late.num_preemptions:
            break
        out = in_flight.pop(0)
        sched.update_from_output(out, executor.run(out))
    assert late.preempted_by == "swap" and late.num_output_placeholders == 1
    record = sched.kv.host.swapped[late.request_id]
    tokens_before = len(late.output_token_ids)
    while in_flight:
        out = in_flight.pop(0)
        sched.update_from_output(out, executor.run(out))
    assert len(late.output_token_ids) == tokens_before + 1 and late.num_output_placeholders == 0
    assert record.confirmed and record.num_tokens == late.num_tokens - 1
    plans = drain(sched)
    resume = next(n for p in plans for n in p.new_requests if n.request is late)
    assert resume.num_computed_tokens == record.num_tokens and resume.num_scheduled_tokens == 1
    assert not sched.num_recomputed_tokens


def test_a_failed_swap_out_falls_back_to_recompute():
    sched, (_, late) = long_generations("swap")
    drain(sched, failed=lambda out: (range(len(out.swaps.out_host)) if out.swaps else (), ()))
    assert late.num_preemptions >= 1 and len(late.output_token_ids) == 20
    assert sched.num_recomputed_tokens["swap"] > 0 and not sched.num_recomputed_tokens["recompute"]
    assert sched.kv.host.num_free_blocks == 64


def test_a_failed_swap_in_recomputes_only_its_own_request():
    sched, (early, late) = long_generations("swap")
    drain(sched, failed=lambda out: ((), range(len(out.swaps.in_host)) if out.swaps else ()))
    assert len(early.output_token_ids) == len(late.output_token_ids) == 20
    assert early.num_lost_tokens == 0, "the request beside it is untouched"
    assert late.num_lost_tokens > 0 and sched.num_recomputed_tokens["swap"] > 0


def test_a_request_swapped_out_again_before_its_swap_in_failed_still_computes_a_token():
    """Three greedy twins on a pool that holds two, two plans in flight,
    every swap-in failing: a request resumes from the host tier in one plan
    and is swapped out again by the next, naming its blocks through its
    last token; the first plan's result then voids its progress, and its
    lookup finds every block in a twin's. Before the fix the scheduler
    raised "scheduled with nothing left to compute" (an intermittent
    INTERNAL in tests/integration/test_host_kv_tier.py)."""
    sched = Scheduler(SchedulerConfig(num_kv_blocks=10, block_size=1, max_model_len=64, max_num_batched_tokens=64,
                                      num_host_blocks=64, preemption_mode="swap"))
    twins = [make_request(prompt=[50, 51], max_tokens=8) for _ in range(3)]
    for r in twins:
        sched.add_request(r)
    executor, in_flight = FakeExecutor(), []
    while sched.has_work or in_flight:
        while len(in_flight) < 2 and not (out := sched.schedule()).is_empty:
            in_flight.append(out)
        out = in_flight.pop(0)
        failed_ins = range(len(out.swaps.in_host)) if out.swaps else ()
        sched.update_from_output(out, executor.run(out), (), failed_ins)
    assert all(len(r.output_token_ids) == 8 for r in twins)
    assert sched.num_recomputed_tokens["swap"] > 0, "no swap-in failed: the scenario was not reached"
    assert sched.num_free_blocks == 10 and sched.kv.host.num_free_blocks == 64


def test_an_embedding_whose_host_hit_failed_to_swap_in_is_neither_served_nor_cached():
    # An embedding ends in the step that reads its prompt, so its vector and
    # its blocks would be taken before update_from_output saw the failure.
    sched = evicting_scheduler()
    sched.add_request(make_request(prompt=PREFIX + [1], max_tokens=1))
    drain(sched)
    sched.add_request(make_request(prompt=list(range(500, 547)), max_tokens=1))
    drain(sched)  # the prefix is evicted and spilled to the host tier
    embed = make_request(prompt=PREFIX + [2, 3], max_tokens=0)
    embed.embed = True
    sched.add_request(embed)
    out = sched.schedule()
    assert out.swaps is not None and out.swaps.in_host, "the prefix comes back from the host tier"
    failed_ins = list(range(len(out.swaps.in_host)))
    with pytest.raises(RuntimeError, match="before its swap outcomes"):
        sched.apply_prompt_outputs(out, [], [(embed.handle, [0.0])])
    sched.confirm_swaps(out, (), failed_ins)
    assert sched.apply_prompt_outputs(out, [], [(embed.handle, [0.0])]) == [], "a vector read from garbage KV"
    sched.update_from_output(out, [], (), failed_ins)
    assert embed.status == RequestStatus.WAITING and embed.lost_cause == "swap"
    assert not set(out.swaps.in_device) & set(sched.kv.pool.cached.values()), "garbage blocks cached"
    assert not set(out.swaps.in_host) & set(sched.kv.host.pool.cached.values()), "host copies it failed to read"


def test_a_failed_step_keeps_confirmed_swaps_but_a_lost_executor_does_not():
    sched, (early, late) = long_generations("swap")
    while not late.num_preemptions:
        run_step(sched)
    run_step(sched)  # confirms the swap-out
    assert sched.kv.host.swapped[late.request_id].confirmed
    sched.reset_executor_state(host_lost=False)
    assert late.request_id in sched.kv.host.swapped, "a failed step leaves the host tier's content alone"
    sched.reset_executor_state(host_lost=True)
    assert not sched.kv.host.swapped and sched.kv.host.num_free_blocks == 64
    assert late.lost_cause == "swap"
    drain(sched)
    assert len(late.output_token_ids) == 20


def test_a_request_that_ends_while_swapped_out_frees_its_host_blocks():
    sched, (_, late) = long_generations("swap")
    while not late.num_preemptions:
        run_step(sched)
    assert late.request_id in sched.kv.host.swapped
    sched.finish_request(late.request_id, RequestStatus.FINISHED_ABORTED)
    drain(sched)
    assert not sched.kv.host.swapped and sched.kv.host.num_free_blocks == 64


def test_a_plan_without_swaps_costs_no_extra_bytes():
    with_tier = make_scheduler(num_host_blocks=16)
    without = make_scheduler()
    sizes = []
    for sched in (with_tier, without):
        sched.add_request(make_request(prompt=[5, 6, 7], max_tokens=3, request_id="same"))
        out, _ = run_step(sched)
        out2 = sched.schedule()
        assert out.swaps is None and out2.swaps is None
        sizes.append((convert.plan_to_proto(out).ByteSize(), convert.plan_to_proto(out2).ByteSize()))
    assert sizes[0] == sizes[1]


def test_an_executor_back_with_another_host_tier_size_keeps_every_request():
    sched, (early, late) = long_generations("swap")
    while not late.num_preemptions:
        run_step(sched)
    run_step(sched)  # confirms the swap-out
    with pytest.raises(RuntimeError, match="still holds blocks"):
        sched.replace_host_tier(16)  # never before the lost executor's tier is emptied
    sched.reset_executor_state(host_lost=True)
    sched.replace_host_tier(16)
    assert sched.kv.host.num_blocks == sched.kv.host.num_free_blocks == 16
    assert sched.config.num_host_blocks == 16
    plans = drain(sched)
    assert len(early.output_token_ids) == len(late.output_token_ids) == 20
    assert any(p.swaps is not None for p in plans), "the new tier is used"
    assert sched.kv.host.num_free_blocks == 16 and sched.num_free_blocks == sched.config.num_kv_blocks
    sched.reset_executor_state(host_lost=True)
    sched.replace_host_tier(0)
    assert sched.kv.host is None
    again = make_request(prompt=PREFIX + [1], max_tokens=2)
    sched.add_request(again)
    drain(sched)
    assert len(again.output_token_ids) == 2
