"""The block pool's free-queue discipline and prefix index."""

from hypothesis import given, settings
from hypothesis import strategies as st

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


class _ListPool:
    """The free-queue discipline written out as one plain list (front first) and a key map:
    slow and obvious, to hold the three-part queue and its lazy tail to."""

    def __init__(self, n: int):
        self.queue = list(range(1, n))
        self.ref = [0] * n
        self.key: dict[int, object] = {}  # block -> key it holds
        self.holders: dict[object, list[int]] = {}  # key -> holders, in caching order
        self.evictions = 0

    def allocate(self, n):
        out = self.queue[:n]
        del self.queue[:n]
        for b in out:
            if b in self.key:
                k = self.key.pop(b)
                self.holders[k].remove(b)
                if not self.holders[k]:
                    del self.holders[k]
                self.evictions += 1
            self.ref[b] = 1
        return out

    def free(self, blocks):
        group = []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.key:
                    self.queue.append(b)
                else:
                    group.append(b)
        self.queue[:0] = group

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def cache(self, b, k):
        if b not in self.key:
            self.key[b] = k
            self.holders.setdefault(k, []).append(b)

    def lookup(self, k):
        return self.holders[k][0] if k in self.holders else None

    def reset(self):
        if len(self.queue) != len(self.ref) - 1:
            return False
        self.key.clear()
        self.holders.clear()
        return True


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(4, 40), st.booleans())
def test_pool_matches_a_plain_list_model(seed, n, compact):
    """Random allocations, frees (rows in any order), publishing (shared keys too), hits on
    free cached blocks (which leave dead entries in the lazy tail), evictions and resets: the
    queue order, lookups, evictions and counts always equal the plain model's (``compact``:
    the tail is rebuilt whenever dead entries outnumber live ones)."""
    import hybridsim.sched.block_pool as bp

    slack = bp._DEAD_SLACK
    bp._DEAD_SLACK = 0 if compact else slack
    try:
        _pool_against_list_model(seed, n)
    finally:
        bp._DEAD_SLACK = slack


def _pool_against_list_model(seed: int, n: int) -> None:
    import random

    rnd = random.Random(seed)
    pool, ref = BlockPool(n), _ListPool(n)
    held: list[list[int]] = []  # rows in use (a block may be in several: hits)
    for _ in range(200):
        op = rnd.random()
        if op < 0.3 and ref.queue:
            k = rnd.randint(1, min(4, len(ref.queue)))
            got = pool.allocate(k)
            assert got == ref.allocate(k)
            held.append(got)
        elif op < 0.55 and held:
            row = held.pop(rnd.randrange(len(held)))
            if rnd.random() < 0.5:
                row = row[::-1]
            pool.free(row)
            ref.free(row)
        elif op < 0.75 and held:
            row = rnd.choice(held)
            b = rnd.choice(row)
            k = rnd.randint(0, 6)  # few keys: several holders of one prefix
            pool.cache(b, k)
            ref.cache(b, k)
        elif op < 0.95:
            hits = [ref.lookup(k) for k in range(7)]
            assert hits == [pool.lookup(k) for k in range(7)]
            row = sorted({b for b in hits if b is not None})[:rnd.randint(0, 3)]
            pool.touch(row)
            ref.touch(row)
            if row:
                held.append(row)
        else:
            assert pool.reset_prefix_cache() == ref.reset()
        assert list(pool.free_queue) == ref.queue
        assert pool.num_free == len(ref.queue) and pool.evictions == ref.evictions
        assert all((b in pool.free_queue) == (ref.ref[b] == 0) for b in range(1, n))


def test_prefix_keys_of_groups_never_meet():
    """The first attention group keys prefixes by the plain block hash; every other group's
    keys lie above any hash and differ by group, whatever the hash (extremes included)."""
    from hybridsim.sched.groups import GroupSpec
    from hybridsim.sched.kv_cache import KVCacheManager

    groups = [GroupSpec(0, "mamba", 16, (0,), "align"), GroupSpec(1, "attention", 16, (0,)),
              GroupSpec(2, "mamba", 16, (1,), "align"), GroupSpec(3, "attention", 16, (1,))]
    kv = KVCacheManager(groups, 64, True)
    hashes = [0, 1, 2, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 12345678901234567]
    assert [kv.managers[1].key(h) for h in hashes] == hashes  # the plain-keyed group
    keys = {(m.gid, h): m.key(h) for m in kv.managers for h in hashes}
    assert len(set(keys.values())) == len(keys)
    for (gid, h), k in keys.items():
        if gid != 1:
            assert 1 << 70 <= k < 1 << 71
