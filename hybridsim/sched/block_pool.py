"""The shared block pool: null block, ref counts, prefix-hash index, free queue.

Free-queue discipline (read off the recorded vLLM 0.33 traces, see
docs/fidelity.md): new blocks come from the front; freed blocks that carry no
hash go back to the *front* as one group (reused first), freed blocks that
carry a hash go to the *tail*, so cached blocks are evicted least recently
freed first. Taking a hit on a free cached block removes it from the queue.
Several blocks may hold the same prefix; evicting one keeps the others.

The queue is kept in three parts, front to back, so that no operation walks
it block by block: ``front`` (a stack of blocks freed without a hash, its end
is the queue's front), the never-used blocks ``next_fresh .. num_blocks-1``
(a range, so a pool of any size costs nothing to build), and ``tail`` (blocks
freed with a hash, in freeing order). A block only gets a hash while it is in
use, so every hashed free block is in the tail: only tail blocks are ever
evicted by allocation or taken back by a hit.

The tail is a deque that a hit does not edit (freeing adds a row's hashed
blocks with one ``extend``; inserting them into an ordered dict one by one was
about half the cost of freeing): a block a hit took back leaves a dead entry
behind, counted in ``tail_dead``. A block is in the tail at
most once, so its live entry is its latest and its dead ones come before it;
popping the front skips a block's entries while it has dead ones.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable, Iterator, Optional

NULL_BLOCK = 0
_WIPED = object()  # block_key of a tail block whose prefix reset_prefix_cache forgot
_DEAD_SLACK = 4096  # dead tail entries tolerated beyond the live ones (then the tail is rebuilt)


# Prefix-cache keys. Block hashes are ints in [0, 2**64) (sched.hashing). One group
# (KVCacheManager picks the first attention group) keys its blocks by the hash alone, so its
# lookups and publishing read a request's hash list as it is, with no arithmetic per block;
# every other group's key is ``hash << 6 | group id`` lifted by 2**70, into [2**70, 2**71),
# where no hash lies: no two groups can share a key.
_LIFT = 1 << 70


def key_lift(gid: int, plain: bool) -> Optional[int]:
    """What group ``gid``'s key adds to ``hash << 6`` (``KVManager.key``); None for the group
    keyed by plain hashes."""
    return None if plain else _LIFT + gid


class FreeQueue:
    """Read-only view of the pool's free queue, front to back (tests, invariants)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: "BlockPool"):
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_free

    def __iter__(self) -> Iterator[int]:
        p = self._pool
        yield from reversed(p.front)
        yield from range(p.next_fresh, p.num_blocks)
        yield from p.tail_blocks()

    def __contains__(self, b: int) -> bool:
        p = self._pool
        return p.in_tail(b) or p.next_fresh <= b < p.num_blocks or b in p.front


class BlockPool:
    __slots__ = ("num_blocks", "ref_cnt", "block_key", "cached", "dups", "front", "next_fresh", "tail",
                 "tail_dead", "num_tail", "evictions", "cached_this_step", "extra", "ktok")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK] = 1  # never freed
        # the key of the prefix a block holds (None: none; see key_lift)
        self.block_key: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}  # key -> the holder a hit gets (earliest cached)
        self.dups: dict[Hashable, list[int]] = {}  # key -> further holders, in caching order
        self.front: list[int] = []  # freed without a hash; front[-1] is the queue's front
        self.next_fresh = 1  # blocks next_fresh .. num_blocks-1 were never used
        self.tail: deque[int] = deque()  # freed with a hash, oldest first, with dead entries
        self.tail_dead: dict[int, int] = {}  # block -> its dead entries in ``tail``
        self.num_tail = 0  # live entries
        self.evictions = 0
        self.cached_this_step: set[Hashable] = set()
        # partial-block prefix hits only (sched.partial): a block may hold further prefixes
        # (keys past its primary ``block_key``), and the primary's length in tokens
        self.extra: dict[int, list[Hashable]] = {}
        self.ktok: dict[int, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def free_queue(self) -> FreeQueue:
        """A view of the free queue (made on demand: a stored one would be a reference cycle)."""
        return FreeQueue(self)

    @property
    def num_free(self) -> int:
        return len(self.front) + (self.num_blocks - self.next_fresh) + self.num_tail

    def in_tail(self, b: int) -> bool:
        """Free and hashed (or wiped by a reset): such blocks are exactly the tail's."""
        return self.ref_cnt[b] == 0 and self.block_key[b] is not None  # (the null block's ref is 1)

    def tail_blocks(self) -> Iterator[int]:
        """The tail's live entries, oldest first."""
        dead = dict(self.tail_dead)
        for b in self.tail:
            d = dead.get(b)
            if d:
                dead[b] = d - 1
            else:
                yield b

    def lookup(self, key: Hashable) -> int | None:
        return self.cached.get(key)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (caller checked num_free)."""
        front = self.front
        ref = self.ref_cnt
        if n == 1 and front:  # the decode hot path
            b = front.pop()
            ref[b] = 1
            return [b]
        out: list[int] = []
        if front:
            k = n if n < len(front) else len(front)
            out = front[-k:]
            out.reverse()
            del front[-k:]
            for b in out:
                ref[b] = 1
            n -= k
        if n:
            lo = self.next_fresh
            k = self.num_blocks - lo
            if k > n:
                k = n
            if k:
                out.extend(range(lo, lo + k))
                ref[lo:lo + k] = [1] * k
                self.next_fresh = lo + k
                n -= k
        if n:
            popleft = self.tail.popleft
            dead = self.tail_dead
            keys = self.block_key
            self.num_tail -= n
            for _ in range(n):
                b = popleft()
                while dead:
                    d = dead.get(b)
                    if not d:
                        break
                    if d == 1:
                        del dead[b]
                    else:
                        dead[b] = d - 1
                    b = popleft()
                key = keys[b]
                keys[b] = None
                if key is not _WIPED:  # evict the cached prefix it held
                    self._unindex(key, b)
                    self.evictions += 1
                    if self.extra or self.ktok:
                        self.ktok.pop(b, None)
                        for k2 in self.extra.pop(b, ()):
                            self._unindex(k2, b)
                ref[b] = 1
                out.append(b)
        return out

    def _unindex(self, key: Hashable, b: int) -> None:
        """Forget ``b`` as a holder of ``key``; another holder, if any, keeps the prefix cached."""
        others = self.dups.get(key)
        if self.cached.get(key) == b:
            if others:
                self.cached[key] = others.pop(0)
                if not others:
                    del self.dups[key]
            else:
                del self.cached[key]
        elif others is not None:
            others.remove(b)
            if not others:
                del self.dups[key]

    def touch(self, blocks: Iterable[int]) -> None:
        """A request takes a reference on (cached) blocks it hit."""
        ref = self.ref_cnt
        keys = self.block_key
        dead = self.tail_dead
        taken = 0
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            r = ref[b]
            if r == 0:  # free and hashed, so in the tail, where its entry is dead from now on
                if keys[b] is None:  # pragma: no cover - caught by sched.invariants
                    raise AssertionError(f"block {b} is free and hit but not in the hashed tail")
                dead[b] = dead.get(b, 0) + 1
                taken += 1
            ref[b] = r + 1
        if taken:
            self.num_tail -= taken
            if len(self.tail) > 2 * self.num_tail + _DEAD_SLACK:  # mostly dead: rebuild it
                self.tail = deque(self.tail_blocks())
                dead.clear()

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        Blocks that reach zero and carry no hash are put at the front as one
        group, in the order given; hashed ones are appended to the tail.
        """
        ref = self.ref_cnt
        keys = self.block_key
        if type(blocks) is list and len(blocks) == 1:  # the decode hot path
            b = blocks[0]
            if b != NULL_BLOCK:
                r = ref[b] - 1
                ref[b] = r
                if r == 0:
                    if keys[b] is None:
                        self.front.append(b)
                    else:
                        self.tail.append(b)
                        self.num_tail += 1
                elif r < 0:  # pragma: no cover - caught by sched.invariants
                    raise AssertionError(f"block {b} freed more often than taken")
            return
        group = []
        hashed = []
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if keys[b] is None:
                    group.append(b)
                else:
                    hashed.append(b)
            elif r < 0:  # pragma: no cover - caught by sched.invariants
                raise AssertionError(f"block {b} freed more often than taken")
        if hashed:
            self.tail.extend(hashed)
            self.num_tail += len(hashed)
        if group:
            group.reverse()
            self.front.extend(group)

    # ------------------------------------------------------------------ prefix cache
    def cache(self, block: int, key: Hashable, mark_step: bool = False) -> None:
        """Publish ``block`` as holding the prefix ``key``; several blocks may hold one prefix.

        Keys come from ``KVManager.key``. ``mark_step`` records the key as published
        by the current step (Mamba states: not readable until the step has run)."""
        if block == NULL_BLOCK or self.block_key[block] is not None:
            return
        self.block_key[block] = key
        if key not in self.cached:
            self.cached[key] = block
        else:
            self.dups.setdefault(key, []).append(block)
        if mark_step:
            self.cached_this_step.add(key)

    def cache_row(self, row: list[int], hashes: list[int], start: int, stop: int, lift: Optional[int]) -> None:
        """``cache(row[i], key of hashes[i])`` for i in start .. stop-1 (attention rows; ``lift``:
        see ``key_lift``)."""
        keys = self.block_key
        cached = self.cached
        for i in range(start, stop):
            b = row[i]
            if b == NULL_BLOCK or keys[b] is not None:
                continue
            key = hashes[i] if lift is None else (hashes[i] << 6) + lift
            keys[b] = key
            if key not in cached:
                cached[key] = b
            else:
                self.dups.setdefault(key, []).append(b)

    # ------------------------------------------------------------------ several prefixes a block
    # (partial-block prefix hits, sched.partial: vLLM 0.33's block pool keeps a primary hash
    # per block plus further keys that point at it)
    def holds(self, block: int, key: Hashable) -> bool:
        """Whether ``block`` is one of the holders of ``key``."""
        return self.cached.get(key) == block or block in self.dups.get(key, ())

    def insert_key(self, block: int, key: Hashable, ntok: int) -> None:
        """Make ``block`` a holder of ``key`` (its primary if it has none; ``ntok``: the
        primary's prefix length), after any holders it already has (vLLM 0.33's
        ``_insert_block_hash``)."""
        if block == NULL_BLOCK or self.block_key[block] == key or self.holds(block, key):
            return
        if self.block_key[block] is None:
            self.block_key[block] = key
            self.ktok[block] = ntok
        else:
            self.extra.setdefault(block, []).append(key)
        if key not in self.cached:
            self.cached[key] = block
        else:
            self.dups.setdefault(key, []).append(block)

    def remove_keys(self, block: int) -> list[Hashable]:
        """Forget every prefix ``block`` holds (vLLM 0.33's ``_remove_cached_block_hashes``)."""
        key = self.block_key[block]
        if key is None or key is _WIPED:
            return []
        keys = [key] + self.extra.pop(block, [])
        for k in keys:
            self._unindex(k, block)
        self.block_key[block] = None
        self.ktok.pop(block, None)
        return keys

    def move_keys(self, src: int, dst: int) -> None:
        """Re-point ``src``'s prefixes to ``dst`` (a private copy takes them over)."""
        ntok = self.ktok.get(src, 0)
        for k in self.remove_keys(src):
            self.insert_key(dst, k, ntok)

    def new_step(self) -> None:
        self.cached_this_step.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_free != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.dups.clear()
        self.extra.clear()
        self.ktok.clear()
        # queue order is kept, as upstream: tail blocks stay there, their prefixes forgotten
        self.block_key = [None if k is None else _WIPED for k in self.block_key]
        return True
