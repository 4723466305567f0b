"""The shared block pool: null block, ref counts, prefix-hash index, free queue.

Free-queue discipline (read off the recorded vLLM 0.33 traces, see
docs/fidelity.md): new blocks come from the front; freed blocks that carry no
hash go back to the *front* as one group (reused first), freed blocks that
carry a hash go to the *tail*, so cached blocks are evicted least recently
freed first. Taking a hit on a free cached block removes it from the queue.
Several blocks may hold the same prefix; evicting one keeps the others.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable

NULL_BLOCK = 0


class BlockPool:
    __slots__ = ("num_blocks", "ref_cnt", "block_key", "cached", "dups", "free_queue", "evictions",
                 "cached_this_step")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK] = 1  # never freed
        # key = (group_id, block_hash) for a block holding a cached prefix
        self.block_key: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}  # key -> the holder a hit gets (earliest cached)
        self.dups: dict[Hashable, list[int]] = {}  # key -> further holders, in caching order
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.evictions = 0
        self.cached_this_step: set[Hashable] = set()

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, key: Hashable) -> int | None:
        return self.cached.get(key)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (caller checked num_free)."""
        if n == 1:  # the decode hot path
            b, _ = self.free_queue.popitem(last=False)
            key = self.block_key[b]
            if key is not None:
                self.block_key[b] = None
                self._unindex(key, b)
                self.evictions += 1
            self.ref_cnt[b] = 1
            return [b]
        out = []
        popitem = self.free_queue.popitem
        for _ in range(n):
            b, _ = popitem(last=False)
            key = self.block_key[b]
            if key is not None:  # evict the cached prefix it held
                self.block_key[b] = None
                self._unindex(key, b)
                self.evictions += 1
            self.ref_cnt[b] = 1
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
        fq = self.free_queue
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if ref[b] == 0:
                del fq[b]
            ref[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        Blocks that reach zero and carry no hash are put at the front as one
        group, in the order given; hashed ones are appended to the tail.
        """
        ref = self.ref_cnt
        fq = self.free_queue
        keys = self.block_key
        if type(blocks) is list and len(blocks) == 1:  # the decode hot path
            b = blocks[0]
            if b != NULL_BLOCK:
                r = ref[b] - 1
                ref[b] = r
                if r == 0:
                    fq[b] = None
                    if keys[b] is None:
                        fq.move_to_end(b, last=False)
                elif r < 0:  # pragma: no cover - caught by sched.invariants
                    raise AssertionError(f"block {b} freed more often than taken")
            return
        front = []
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if keys[b] is None:
                    front.append(b)
                else:
                    fq[b] = None
            elif r < 0:  # pragma: no cover - caught by sched.invariants
                raise AssertionError(f"block {b} freed more often than taken")
        for b in reversed(front):
            fq[b] = None
            fq.move_to_end(b, last=False)

    # ------------------------------------------------------------------ prefix cache
    def cache(self, block: int, key: Hashable, mark_step: bool = False) -> None:
        """Publish ``block`` as holding the prefix ``key``; several blocks may hold one prefix.

        Keys are ``block_hash << 6 | group_id``. ``mark_step`` records the key as published
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

    def new_step(self) -> None:
        self.cached_this_step.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.dups.clear()
        self.block_key = [None] * self.num_blocks  # queue order is kept, as upstream
        return True
