import pytest

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from tests.factories import make_request


def test_allocate_takes_distinct_blocks_with_refcount_one():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5
    assert all(pool.ref_counts[b] == 1 for b in blocks)
    assert pool.num_free_blocks == 3


def test_allocate_more_than_free_raises_instead_of_overcommitting():
    pool = BlockPool(2)
    assert not pool.can_allocate(3)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(3)


def test_freed_blocks_return_to_pool_and_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks[:2])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.ref_counts[b] += 1  # a second holder
    pool.free([b])
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2


def test_block_table_grows_only_when_tokens_cross_a_block_boundary():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request(prompt_len=6)
    assert kv.allocate_slots(req, 6) is not None
    assert len(kv.get_block_table(req)) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1) == []  # slot 7 is in block 2
    req.num_computed_tokens = 8
    new = kv.allocate_slots(req, 1)
    assert len(new) == 1 and kv.get_block_table(req)[-1] == new[0]


def test_block_table_is_append_only():
    kv = KVCacheManager(num_blocks=10, block_size=2)
    req = make_request(prompt_len=3)
    kv.allocate_slots(req, 3)
    before = list(kv.get_block_table(req))
    req.num_computed_tokens = 3
    kv.allocate_slots(req, 4)
    assert kv.get_block_table(req)[: len(before)] == before


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    req = make_request(prompt_len=16)
    assert kv.allocate_slots(req, 16) is None
    assert kv.num_free_blocks == 3 and kv.get_block_table(req) == []


def test_free_returns_every_block_of_the_request():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    req = make_request(prompt_len=12)
    kv.allocate_slots(req, 12)
    kv.free(req)
    assert kv.num_free_blocks == 5
