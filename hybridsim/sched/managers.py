"""One manager per KV-cache group: block rows, prefix hits, hashing, freeing.

``AttentionManager`` keeps one block per ``block_size`` tokens. The Mamba
managers keep a position-indexed row too, but only a few columns hold real
blocks; which ones, and which are published to the prefix cache, is the
cache-mode strategy (none / align / all), one class each.

Rows are lists of block ids indexed by column; ``NULL_BLOCK`` (0) marks a
column that holds nothing.
"""

from __future__ import annotations

from typing import Optional

from .block_pool import NULL_BLOCK, BlockPool, key_lift
from .groups import GroupSpec, cdiv
from .plan import keeps_state_at
from .request import Request


class Allocation:
    """What one allocate call decided for one group: fresh blocks to take, and how."""

    __slots__ = ("fresh", "apply")

    def __init__(self, fresh: int, apply):
        self.fresh = fresh
        self.apply = apply  # callable(list[int] fresh_blocks) -> list[int] new row tail


class KVManager:
    """Interface shared by every group kind."""

    def __init__(self, spec: GroupSpec, pool: BlockPool, plain_keys: bool = False):
        self.spec = spec
        self.gid = spec.group_id
        self.bs = spec.block_size
        self.pool = pool
        self.rows: dict[int, list[int]] = {}
        self.last_need = 0  # fresh blocks the last ``need`` asked for
        self.lift = key_lift(self.gid, plain_keys)  # prefix keys: see block_pool.key_lift
        self.max_len = _INF  # (set by KVCacheManager) caps lookahead slots
        self.reprefill = 0  # (set by KVCacheManager) trailing tokens never published
        self.hash_lookahead = 0  # (set by KVCacheManager) tokens past a block its hash covers

    def key(self, block_hash: int) -> int:
        """The prefix-cache key of a block of this group with that hash."""
        lift = self.lift
        return block_hash if lift is None else (block_hash << 6) + lift

    # -- prefix hits -------------------------------------------------------
    def hit_blocks(self, req: Request, bound_blocks: int) -> int:
        """Longest hit (in blocks, at most ``bound_blocks``) this group can serve."""
        raise NotImplementedError

    def blocks_for_hit(self, req: Request, nblocks: int) -> list[int]:
        raise NotImplementedError

    # -- per step ----------------------------------------------------------
    def remove_skipped(self, req: Request, num_computed: int) -> None:
        """Free blocks the request no longer needs once ``num_computed`` tokens are done."""

    def plan(self, req: Request, num_computed: int, total: int, hit: list[int],
             checkpoint: Optional[int]) -> Allocation:
        raise NotImplementedError

    def need(self, req: Request, total: int, checkpoint: Optional[int]) -> int:
        """Running request: fresh blocks this group needs to hold ``total`` tokens.
        Remembers what it decided for the ``commit`` that follows."""
        self._pending = self.plan(req, req.num_computed_tokens, total, (), checkpoint)
        self.last_need = self._pending.fresh
        return self.last_need

    def commit(self, req: Request, fresh: list[int]):
        """Apply the last ``need``; returns the new row tail (empty if unchanged)."""
        p = self._pending
        return p.apply(fresh) if p.fresh or p.apply is not _no_change else ()

    def decode_need(self, req: Request, num_computed: int, total: int) -> int:
        """A decoding request left this group's quiet bounds: release, then count fresh blocks."""
        if self.spec.is_mamba:
            self.remove_skipped(req, num_computed)
        return self.need(req, total, None)

    def decode_commit(self, req: Request, fresh: list[int], num_computed: int, total: int):
        """Finish ``decode_need``: take the blocks, publish, and return (row tail, new quiet bounds)."""
        tail = self.commit(req, fresh)
        self.cache(req, num_computed, total, None, False)
        return tail, self.quiet(req)

    def cache(self, req: Request, num_computed: int, total: int, checkpoint: Optional[int],
              publish_end: bool) -> None:
        """Publish hashes for blocks holding prefixes (after allocation)."""

    def free(self, req: Request) -> None:
        row = self.rows.pop(req.index, None)
        if row:
            self.pool.free(reversed(row))

    def row(self, req: Request) -> list[int]:
        return self.rows.get(req.index, [])

    def quiet(self, req: Request) -> tuple[int, int]:
        """(max total tokens, max computed tokens) up to which this group would neither
        allocate, publish nor release anything for the request (decode fast path).
        Attention groups put their second bound on ``min(total, tokens) - 1`` instead of
        the computed count (the same for a decode; see ``AttentionManager.quiet``)."""
        return _INF, _INF


class AttentionManager(KVManager):
    """Full attention (GQA or MLA latent cache): every block is kept and, with prefix
    caching on, published (hashed) when full."""

    def __init__(self, spec: GroupSpec, pool: BlockPool, caching: bool = True, plain_keys: bool = False):
        super().__init__(spec, pool, plain_keys)
        self.num_cached: dict[int, int] = {}
        self.caching = caching  # off: nothing is ever published, so freed blocks carry no hash

    def hit_blocks(self, req: Request, bound_blocks: int) -> int:
        cached = self.pool.cached
        hashes = req.block_hashes
        n = 0
        lim = min(bound_blocks, len(hashes))
        lift = self.lift
        if lift is None:
            while n < lim and hashes[n] in cached:
                n += 1
        else:
            while n < lim and (hashes[n] << 6) + lift in cached:
                n += 1
        return n

    def blocks_for_hit(self, req: Request, nblocks: int) -> list[int]:
        if self.lift is None:
            return list(map(self.pool.cached.__getitem__, req.block_hashes[:nblocks]))
        return [self.pool.cached[self.key(h)] for h in req.block_hashes[:nblocks]]

    def slots(self, total: int) -> int:
        """Token slots the row must hold for ``total`` tokens: the draft model (MTP / EAGLE)
        writes ``lookahead`` more, never past max_model_len (vLLM 0.33's allocate_slots)."""
        la = self.spec.lookahead
        if not la:
            return total
        t = total + la
        return t if t < self.max_len else max(self.max_len, total)

    def plan(self, req, num_computed, total, hit, checkpoint, lookahead: bool = True):
        row_len = len(self.rows.get(req.index, ())) or len(hit)
        need = cdiv(self.slots(total) if lookahead else total, self.bs) - row_len
        if need <= 0:
            return Allocation(0, _no_change)
        idx = req.index

        def apply(fresh: list[int]) -> list[int]:
            row = self.rows.get(idx)
            if row is None:
                row = self.rows[idx] = list(hit)
            row.extend(fresh)
            return fresh
        return Allocation(need, apply)

    def need(self, req, total, checkpoint):
        k = -(-self.slots(total) // self.bs) - len(self.rows[req.index])
        self.last_need = k if k > 0 else 0
        return self.last_need

    def commit(self, req, fresh):
        if self.last_need:
            self.rows[req.index].extend(fresh)
            return fresh
        return ()

    def cache(self, req, num_computed, total, checkpoint, publish_end):
        self.publish(req, self.rows[req.index], total, len(req.token_ids))

    def publish(self, req: Request, row: list[int], total: int, ntok: int) -> int:
        """Publish the blocks of ``row`` full of committed tokens (the first ``min(total, ntok)``
        tokens) not published yet; returns how many blocks are published now."""
        idx = req.index
        num_cached = self.num_cached
        done = num_cached.get(idx, 0)
        full = (total if total < ntok else ntok) - self.reprefill
        full = min(full, len(req.unit_hashes) * req.hash_block_size) // self.bs
        if full > done and self.caching:
            self.pool.cache_row(row, req.block_hashes, done, full, self.lift)
            num_cached[idx] = done = full
        return done

    def free(self, req):
        self.num_cached.pop(req.index, None)
        super().free(req)

    def mark_hit_cached(self, req: Request, nblocks: int) -> None:
        self.num_cached[req.index] = nblocks

    def decode_need(self, req, num_computed, total):
        k = -(-self.slots(total) // self.bs) - len(self.rows[req.index])
        self.last_need = k if k > 0 else 0
        return self.last_need

    def decode_commit(self, req, fresh, num_computed, total):
        """``commit`` + ``cache`` + ``quiet`` in one pass (the decode hot path)."""
        idx = req.index
        row = self.rows[idx]
        if fresh:
            row.extend(fresh)
        self.publish(req, row, total, len(req.token_ids))
        return (fresh or ()), self.quiet(req)

    def quiet(self, req):
        """The publish bound is on committed tokens less one (``min(total, tokens) - 1``,
        which is the computed count for a decode): drafts scheduled past a block's end
        publish nothing until the tokens that fill it are committed."""
        idx = req.index
        bs = self.bs
        top = len(self.rows[idx]) * bs - self.spec.lookahead  # (a row at max_model_len: never crossed)
        if not self.caching:
            return top, _INF
        return top, (self.num_cached.get(idx, 0) + 1) * bs - 2


def _no_change(fresh: list[int]) -> list[int]:
    return []


_INF = 1 << 62


class MambaManager(KVManager):
    """Base for the three cache modes; rows are position-indexed, mostly null."""

    def __init__(self, spec: GroupSpec, pool: BlockPool, plain_keys: bool = False):
        super().__init__(spec, pool, plain_keys)
        self.low: dict[int, int] = {}  # per request: every column below this is null

    def remove_skipped(self, req: Request, num_computed: int) -> None:
        """Release columns left of the block holding the last computed token.

        That block itself stays one more step: it is the previous running state,
        the source of the next pre-copy (research/vllm-hybrid.md §2.4).
        """
        row = self.rows.get(req.index)
        if not row or num_computed <= 0:
            return
        keep_from = min((num_computed - 1) // self.bs, len(row))
        low = self.low.get(req.index, 0)
        if keep_from <= low:
            return
        if keep_from == low + 1:  # one column (a decode moving on)
            b = row[low]
            row[low] = NULL_BLOCK
            self.low[req.index] = keep_from
            if b != NULL_BLOCK:
                self.pool.free([b])
            return
        # (a prompt's row is dozens of null columns: sliced and filtered at C speed)
        left = row[low:keep_from]
        row[low:keep_from] = [NULL_BLOCK] * (keep_from - low)
        self.low[req.index] = keep_from
        free = list(filter(None, reversed(left)))  # (NULL_BLOCK is 0) right to left
        if free:
            self.pool.free(free)

    def free(self, req: Request) -> None:
        self.low.pop(req.index, None)
        row = self.rows.pop(req.index, None)
        if row:  # the live columns, right to left, nulls dropped at C speed (NULL_BLOCK is 0)
            self.pool.free(list(filter(None, reversed(row))))

    def blocks_for_hit(self, req: Request, nblocks: int) -> list[int]:
        if nblocks == 0:
            return []
        block = self.pool.cached[self.key(req.block_hashes[nblocks - 1])]
        return [NULL_BLOCK] * (nblocks - 1) + [block]

    def hit_blocks(self, req: Request, bound_blocks: int) -> int:
        """Right to left: the latest boundary whose state is cached."""
        cached = self.pool.cached
        lift = self.lift
        hashes = req.block_hashes
        for i in range(min(bound_blocks, len(hashes)) - 1, -1, -1):
            if ((hashes[i] << 6) + lift if lift is not None else hashes[i]) in cached:
                return i + 1
        return 0


class MambaNoneManager(MambaManager):
    """``none``: one running block plus one per draft for the life of the request; no caching."""

    def hit_blocks(self, req, bound_blocks):
        return 0

    def plan(self, req, num_computed, total, hit, checkpoint, lookahead=True):
        if req.index in self.rows:
            return Allocation(0, _no_change)
        idx = req.index

        def apply(fresh):
            self.rows[idx] = list(fresh)
            return fresh
        return Allocation(1 + self.spec.num_spec, apply)


class MambaAlignManager(MambaManager):
    """``align``: the running state sits in the block of the last scheduled token.

    Live columns: the previous step's running column (kept one more step as the
    copy source), an optional prefill checkpoint column (state at the last full
    block of the prompt), the running column and one column per draft. Old
    draft blocks are recycled into the new columns when the running column
    moves on, as upstream does.
    """

    def __init__(self, spec: GroupSpec, pool: BlockPool, plain_keys: bool = False):
        super().__init__(spec, pool, plain_keys)
        self.pending: dict[int, int] = {}  # per request: a kept state column not yet publishable

    def _layout(self, base: list[int], first: bool, total: int, checkpoint: Optional[int]):
        """Target columns for ``total`` tokens and how to fill them: (fresh needed, state) or None."""
        S = self.spec.num_spec
        prev_len = len(base)
        running = (total - 1) // self.bs
        new_len = running + 1 + S
        if new_len <= prev_len:
            return None
        targets = align_targets(total, checkpoint, self.bs, S)
        live_at_target = 0
        for t in targets:
            if t < prev_len and base[t] != NULL_BLOCK:
                live_at_target += 1
        movable = [] if first else [c for c in range(max(prev_len - S, 0), prev_len)
                                    if base[c] != NULL_BLOCK and c not in targets]
        empty = len(targets) - live_at_target
        moved = min(len(movable), empty)
        return empty - moved, (targets, movable[:moved], new_len, prev_len)

    def _fill(self, r: list[int], state, fresh: list[int]) -> list[int]:
        targets, movable, new_len, prev_len = state
        r.extend([NULL_BLOCK] * (new_len - len(r)))
        supply = []
        for c in movable:  # old draft blocks are recycled into the new columns
            supply.append(r[c])
            r[c] = NULL_BLOCK
        supply.extend(fresh)
        k = 0
        for t in targets:
            if r[t] == NULL_BLOCK:
                r[t] = supply[k]
                k += 1
        return r[prev_len:]

    def plan(self, req, num_computed, total, hit, checkpoint, lookahead=True):
        idx = req.index
        row = self.rows.get(idx)
        first = row is None
        lay = self._layout(list(hit) if first else row, first, total, checkpoint)
        if lay is None:
            return Allocation(0, _no_change)
        fresh_needed, state = lay

        def apply(fresh: list[int]) -> list[int]:
            r = self.rows.get(idx)
            if r is None:
                r = self.rows[idx] = list(hit)
            return self._fill(r, state, fresh)
        return Allocation(fresh_needed, apply)

    def need(self, req, total, checkpoint):
        lay = self._layout(self.rows[req.index], False, total, checkpoint)
        self._pending = lay
        self.last_need = 0 if lay is None else lay[0]
        return self.last_need

    def commit(self, req, fresh):
        lay = self._pending
        return () if lay is None else self._fill(self.rows[req.index], lay[1], fresh)

    def decode_need(self, req, num_computed, total):
        """Release the column left behind, then: a fresh block when the running column moves on.

        Without draft columns the layout is one live column, so this is ``remove_skipped``
        + ``need`` without the general column planning (the decode hot path)."""
        if self.spec.num_spec:
            return KVManager.decode_need(self, req, num_computed, total)
        self.remove_skipped(req, num_computed)
        self.last_need = 1 if (total - 1) // self.bs >= len(self.rows[req.index]) else 0
        return self.last_need

    def decode_commit(self, req, fresh, num_computed, total):
        if self.spec.num_spec:
            return KVManager.decode_commit(self, req, fresh, num_computed, total)
        idx = req.index
        row = self.rows[idx]
        bs = self.bs
        prev_len = len(row)
        tail = ()
        if fresh:
            running = (total - 1) // bs
            if running > prev_len:
                row.extend([NULL_BLOCK] * (running - prev_len))
            row.append(fresh[0])
            tail = row[prev_len:]
        return tail, self.quiet(req)

    def cache(self, req, num_computed, total, checkpoint, publish_end):
        """Publish the states kept for later requests (``sched.plan.keeps_state_at``: the
        prompt's replay point and the junction, ``Request.junction``): the checkpoint column
        when it sits on one of them, and the chunk's end state when the scheduler says it
        does (``publish_end``, decided by the same rule). No other state is published."""
        idx = req.index
        if self.pending and idx in self.pending:
            self._publish_pending(req, total)
        if checkpoint is None and not publish_end:
            return
        row = self.rows.get(idx)
        if row is None:
            return
        hashes = req.block_hashes
        bs = self.bs
        # (a state whose block hash does not exist yet, MTP / EAGLE lookahead hashes, or that
        # lies in a multi-module MTP drafter's re-prefillable tail is published later, by the
        # first allocation whose computed tokens reach past it, if its block is still held)
        upto = min(len(hashes), (total - self.reprefill) // bs)
        if checkpoint is not None and row[checkpoint] != NULL_BLOCK:
            at = (checkpoint + 1) * bs  # (sched.plan.checkpoint_at)
            if keeps_state_at(at, req.junction, req.num_prompt_tokens, bs):
                if checkpoint < upto:
                    self.pool.cache(row[checkpoint], self.key(hashes[checkpoint]), True)
                else:
                    self.pending[idx] = checkpoint
        if publish_end and total % bs == 0:
            col = total // bs - 1
            if row[col] != NULL_BLOCK:
                if col < upto:
                    self.pool.cache(row[col], self.key(hashes[col]), True)
                else:
                    self.pending[idx] = col

    def _publish_pending(self, req: Request, total: int) -> None:
        """Publish a kept state that could not be published when it was written (see ``cache``)."""
        idx = req.index
        col = self.pending[idx]
        row = self.rows.get(idx)
        if row is None or col >= len(row) or row[col] == NULL_BLOCK:
            del self.pending[idx]  # (released meanwhile: freed without a hash)
            return
        if col < min(len(req.block_hashes), (total - self.reprefill) // self.bs):
            self.pool.cache(row[col], self.key(req.block_hashes[col]), True)
            del self.pending[idx]

    def free(self, req: Request) -> None:
        self.pending.pop(req.index, None)
        super().free(req)


def align_targets(total: int, checkpoint: Optional[int], bs: int, S: int) -> list[int]:
    """The columns an align-mode Mamba row fills for ``total`` tokens: the prefill
    checkpoint (when before the running column), the running column, one per draft."""
    running = (total - 1) // bs
    targets = list(range(running, running + 1 + S))
    if checkpoint is not None and checkpoint < running:
        targets.insert(0, checkpoint)
    return targets


def _mamba_quiet(m: "MambaManager", req: Request) -> tuple[int, int]:
    row = m.rows.get(req.index)
    if row is None:
        return -1, -1
    bs = m.bs
    return (len(row) - m.spec.num_spec) * bs, (m.low.get(req.index, 0) + 1) * bs


MambaAlignManager.quiet = _mamba_quiet  # publishing happens only in prefill, never on the fast path


class MambaAllManager(MambaManager):
    """``all``: a state block at every block boundary (like attention) plus draft blocks;
    blocks before the last computed token are released but stay cached."""

    def __init__(self, spec: GroupSpec, pool: BlockPool, plain_keys: bool = False):
        super().__init__(spec, pool, plain_keys)
        self.num_cached: dict[int, int] = {}

    def plan(self, req, num_computed, total, hit, checkpoint, lookahead=True):
        idx = req.index
        row = self.rows.get(idx)
        prev_len = len(row) if row is not None else len(hit)
        need = cdiv(total, self.bs) + self.spec.num_spec - prev_len
        if need <= 0:
            return Allocation(0, _no_change)

        def apply(fresh):
            r = self.rows.get(idx)
            if r is None:
                r = self.rows[idx] = list(hit)
            r.extend(fresh)
            return fresh
        return Allocation(need, apply)

    def cache(self, req, num_computed, total, checkpoint, publish_end):
        idx = req.index
        done = self.num_cached.get(idx, 0)
        full = min(total, req.num_tokens) // self.bs
        if full <= done:
            return
        row = self.rows[idx]
        for i in range(done, full):
            if row[i] != NULL_BLOCK:
                self.pool.cache(row[i], self.key(req.block_hashes[i]), True)
        self.num_cached[idx] = full

    def free(self, req):
        self.num_cached.pop(req.index, None)
        super().free(req)

    def quiet(self, req):
        t, c = _mamba_quiet(self, req)
        return min(t, (self.num_cached.get(req.index, 0) + 1) * self.bs - 1), c


MAMBA_STRATEGIES = {"none": MambaNoneManager, "align": MambaAlignManager, "all": MambaAllManager}


def make_manager(spec: GroupSpec, pool: BlockPool, caching: bool = True, plain_keys: bool = False) -> KVManager:
    """``plain_keys``: this group's prefix keys are the block hashes themselves (one group
    per pool; see ``block_pool.key_lift``)."""
    if spec.is_mamba:
        return MAMBA_STRATEGIES[spec.mode](spec, pool, plain_keys)
    return AttentionManager(spec, pool, caching, plain_keys)
