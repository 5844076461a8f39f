"""Prefix caching: chained block hashes, sharing with reference counts, LRU
eviction, and what the scheduler does with a hit."""

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.kv_cache_manager import ROOT_HASH, KVCacheManager, hash_block
from scheduler_svc.core.request import RequestStatus
from tests.factories import make_request, make_scheduler, run_step

PREFIX = list(range(100, 132))  # 8 blocks of 4


def finish_prefill(sched, req):
    """Runs steps until req has produced its first token."""
    while not req.output_token_ids:
        run_step(sched)


def test_block_hash_depends_on_the_whole_prefix_not_just_the_block():
    a = hash_block(hash_block(ROOT_HASH, [1, 2]), [3, 4])
    b = hash_block(hash_block(ROOT_HASH, [9, 9]), [3, 4])
    assert a != b
    assert a == hash_block(hash_block(ROOT_HASH, [1, 2]), [3, 4])


def test_second_request_reuses_the_cached_prefix_and_computes_only_the_rest():
    sched = make_scheduler(block_size=4, num_kv_blocks=64)
    first = make_request(prompt=PREFIX + [1, 2], max_tokens=3)
    sched.add_request(first)
    finish_prefill(sched, first)
    second = make_request(prompt=PREFIX + [7, 8, 9], max_tokens=3)
    sched.add_request(second)
    out, _ = run_step(sched)
    new = next(n for n in out.new_requests if n.request is second)
    assert new.num_computed_tokens == 32 and new.num_scheduled_tokens == 3
    assert new.block_ids[:8] == sched.kv.get_block_table(first)[:8]
    assert second.num_cached_prompt_tokens == 32
    assert all(sched.kv.pool.ref_counts[b] == 2 for b in new.block_ids[:8])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler(block_size=4)
    first = make_request(prompt=PREFIX, max_tokens=2)
    sched.add_request(first)
    finish_prefill(sched, first)
    again = make_request(prompt=PREFIX, max_tokens=2)
    sched.add_request(again)
    out, _ = run_step(sched)
    new = next(n for n in out.new_requests if n.request is again)
    assert new.num_computed_tokens == 28 and new.num_scheduled_tokens == 4


def test_a_lookup_leaves_the_last_token_even_when_the_requests_blocks_were_named_through_it():
    # A request's blocks are named through its last known token when that
    # token's KV is computed (or when a swap-out copies it). Should it come
    # back to a lookup before sampling more (its step's result void), a
    # twin's blocks cover it all: a hit that took every named block would
    # leave the scheduler nothing to compute.
    kv = KVCacheManager(num_blocks=8, block_size=4)
    twin = make_request(prompt=PREFIX[:8])
    kv.allocate_slots(twin, 8)
    kv.cache_computed_blocks(twin, 8)
    req = make_request(prompt=PREFIX[:8])
    kv.allocate_slots(req, 8)
    kv.cache_computed_blocks(req, 8)
    kv.free(req)
    hit = kv.find_cached_prefix(req)
    assert hit.num_tokens == 4 and len(hit.blocks) == 1, "one block is left, holding the last token"


def test_blocks_of_a_finished_request_stay_cached_until_evicted():
    sched = make_scheduler(block_size=4, num_kv_blocks=64)
    first = make_request(prompt=PREFIX, max_tokens=1)
    sched.add_request(first)
    while sched.has_work:
        run_step(sched)
    assert first.status == RequestStatus.FINISHED_LENGTH
    assert sched.num_free_blocks == 64, "cached blocks count as free"
    assert sched.kv.pool.num_cached_blocks == 8
    second = make_request(prompt=PREFIX + [5], max_tokens=1)
    sched.add_request(second)
    run_step(sched)
    assert second.num_cached_prompt_tokens == 32


def test_lru_eviction_drops_the_least_recently_freed_blocks_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in zip((a, b, c), (b"a", b"b", b"c")):
        pool.cache(blk, h)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    (taken,) = pool.allocate(1)
    assert taken == b and pool.lookup(b"b") is None
    assert pool.lookup(b"a") == a and pool.lookup(b"c") == c


def test_a_hit_on_a_cached_free_block_takes_it_out_of_the_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    first = make_request(prompt=[1, 2, 3, 4, 5])
    kv.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    kv.cache_computed_blocks(first, 5)
    kv.free(first)
    assert kv.num_free_blocks == 4
    second = make_request(prompt=[1, 2, 3, 4, 9])
    hit = kv.find_cached_prefix(second)
    assert hit.num_tokens == 4
    assert kv.num_blocks_to_take(second, 1, hit) == 3  # 2 reused + 1 fresh
    kv.allocate_slots(second, 1, hit)
    assert kv.num_free_blocks == 1


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(block_size=4, enable_prefix_caching=False)
    first = make_request(prompt=PREFIX, max_tokens=1)
    sched.add_request(first)
    while sched.has_work:
        run_step(sched)
    second = make_request(prompt=PREFIX + [1], max_tokens=1)
    sched.add_request(second)
    out, _ = run_step(sched)
    assert out.new_requests[0].num_computed_tokens == 0


def test_priority_policy_admits_urgent_first_and_preempts_the_least_urgent():
    sched = make_scheduler(policy="priority", max_num_seqs=2, num_kv_blocks=64)
    low = make_request(max_tokens=20, priority=5)
    high = make_request(max_tokens=20, priority=0)
    mid = make_request(max_tokens=20, priority=2)
    for r in (low, high, mid):
        sched.add_request(r)
    out, _ = run_step(sched)
    assert [n.request for n in out.new_requests] == [high, mid]
    assert sched.running[-1] is mid


def test_priority_policy_preempts_the_highest_priority_value_first():
    sched = make_scheduler(policy="priority", num_kv_blocks=8, block_size=4, max_num_seqs=4)
    urgent = make_request(prompt_len=8, max_tokens=12, priority=0)
    lazy = make_request(prompt_len=8, max_tokens=12, priority=9)
    sched.add_request(lazy)
    run_step(sched)
    sched.add_request(urgent)
    while not (lazy.num_preemptions or urgent.num_preemptions):
        run_step(sched)
    assert lazy.num_preemptions == 1 and urgent.num_preemptions == 0


def test_fcfs_preempts_the_latest_arrival_whatever_its_priority():
    sched = make_scheduler(policy="fcfs", num_kv_blocks=8, block_size=4, max_num_seqs=4)
    early = make_request(prompt_len=8, max_tokens=12, priority=9)
    late = make_request(prompt_len=8, max_tokens=12, priority=0)
    sched.add_request(early)
    sched.add_request(late)
    while not (early.num_preemptions or late.num_preemptions):
        run_step(sched)
    assert late.num_preemptions == 1 and early.num_preemptions == 0


def test_a_prefix_hit_never_crosses_lora_adapters():
    """KV computed under one adapter is another model's: the same prompt
    under another adapter (or the base) finds nothing cached, and under the
    same adapter finds it all."""
    sched = make_scheduler(block_size=4, num_kv_blocks=64, lora_adapters=("a", "b"))
    first = make_request(prompt=PREFIX + [1], max_tokens=2)
    first.adapter = "a"
    sched.add_request(first)
    finish_prefill(sched, first)
    others = [make_request(prompt=PREFIX + [1], max_tokens=2) for _ in range(3)]
    others[0].adapter, others[1].adapter = "b", "a"  # others[2]: the base model
    salted = make_request(prompt=PREFIX + [1], max_tokens=2)
    salted.adapter, salted.prefix_salt = "", b"a"  # a salt spelled as the adapter's name is not the adapter
    for r in [*others, salted]:
        sched.add_request(r)
    run_step(sched)
    assert [r.num_cached_prompt_tokens for r in [*others, salted]] == [0, 32, 0, 0]
