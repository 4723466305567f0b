"""The block pool's free-queue discipline and prefix index."""

from hybridsim.sched.block_pool import BlockPool


def test_allocation_order_and_grouped_front_free():
    p = BlockPool(10)
    a = p.allocate(4)
    assert a == [1, 2, 3, 4]
    p.free([3, 1])  # no hashes: back to the front as one group, in this order
    assert list(p.free_queue)[:2] == [3, 1]
    assert p.allocate(2) == [3, 1]


def test_hashed_blocks_go_to_tail_and_are_evicted_last():
    p = BlockPool(6)
    a = p.allocate(3)  # 1,2,3
    p.cache(a[0], "k1")
    p.free(a)  # 1 hashed -> tail; 2,3 -> front
    assert list(p.free_queue) == [2, 3, 4, 5, 1]
    assert p.lookup("k1") == 1
    p.allocate(4)
    assert p.lookup("k1") == 1  # not yet evicted
    p.allocate(1)
    assert p.lookup("k1") is None and p.evictions == 1


def test_touch_removes_free_cached_block_from_queue():
    p = BlockPool(5)
    (b,) = p.allocate(1)
    p.cache(b, "k")
    p.free([b])
    assert b in p.free_queue
    p.touch([b])
    assert b not in p.free_queue and p.ref_cnt[b] == 1


def test_duplicate_holders_survive_one_eviction():
    p = BlockPool(8)
    x, y = p.allocate(2)
    p.cache(x, "k")
    p.cache(y, "k")
    p.free([x])  # x to the tail
    p.allocate(6)  # pops everything incl. x -> evicts x's entry
    assert p.lookup("k") == y


def test_reset_prefix_cache_requires_all_free():
    p = BlockPool(4)
    (b,) = p.allocate(1)
    p.cache(b, "k")
    assert not p.reset_prefix_cache()
    p.free([b])
    assert p.reset_prefix_cache() and p.lookup("k") is None
