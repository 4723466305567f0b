"""Known-wrong variants of the block bookkeeping, switched on by ``run --inject-bug``.

They exist to prove that the executor's checks notice a scheduler that hands the
worker wrong blocks (``bugs.BUGS`` lists every injectable bug and the check that
catches it). Each keeps the pool's own accounting from crashing, so a run with one
reports failed checks rather than a traceback.
"""

from __future__ import annotations

from .block_pool import NULL_BLOCK, BlockPool
from .kv_cache import KVCacheManager
from .managers import AttentionManager

SCHEDULER_BUGS = ("attn_hit_not_cut", "free_shared_block", "partial_hit_not_copied")


def inject(kv: KVCacheManager, bugs: set[str]) -> None:
    if "partial_hit_not_copied" in bugs and kv.partial:
        for m in kv.managers:
            m.admit = _admit_without_copy(m)
    if "attn_hit_not_cut" in bugs:
        kv.uncut_attention_hits = True
    if "free_shared_block" in bugs:
        kv.pool.__class__ = _ForgivingPool  # blocks released twice are skipped, not an assertion
        for m in kv.managers:
            if type(m) is AttentionManager and not m.spec.is_mamba:
                m.free = _free_ignoring_references(m)


class _ForgivingPool(BlockPool):
    """The pool under ``free_shared_block``: a block whose references the bug already dropped
    is skipped when its other holders free it (the pool itself asserts on that)."""

    __slots__ = ()

    def free(self, blocks) -> None:
        ref = self.ref_cnt
        taken: dict[int, int] = {}  # (a row may hold a block twice: freed under it, then handed back)
        kept = []
        for b in blocks:
            if b == NULL_BLOCK or ref[b] > taken.get(b, 0):
                kept.append(b)
                taken[b] = taken.get(b, 0) + 1
        super().free(kept)


def _free_ignoring_references(m: AttentionManager):
    """A free that drops every holder's reference to the request's blocks at once: a block
    another request still holds goes back to the free queue and can be handed out again.
    Blocks an earlier such free already released are skipped (no negative counts)."""
    pool = m.pool

    def free(req) -> None:
        m.num_cached.pop(req.index, None)
        row = m.rows.pop(req.index, None)
        if not row:
            return
        ref = pool.ref_cnt
        for b in row:
            if b != NULL_BLOCK and ref[b] > 1:
                ref[b] = 1
        pool.free(list(reversed(row)))
    return free


def _admit_without_copy(m):
    """Partial-block hits: a hit that ends inside a block keeps the hit block itself in the row
    (no private copy): the request writes past the hit into a block that others hold or find
    cached up to the hit."""
    admit = m.admit

    def without_copy(req, hit_row, hit) -> None:
        admit(req, hit_row, hit)
        m.cow.pop(req.index, None)
    return without_copy
