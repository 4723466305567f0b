"""The KV cache manager: composes one manager per group over one block pool.

Hybrid prefix hits are the fixed point of the per-group hits (attention scans
left to right, Mamba right to left and can only shorten the hit), as in the
engine's hybrid coordinator (research/vllm-hybrid.md §2.2). ``allocate`` follows
the engine's order: release skipped blocks, count what is needed against the
free queue, attach hit blocks, take fresh blocks, publish hashes.
"""

from __future__ import annotations

from typing import Optional

from .block_pool import BlockPool
from .groups import GroupSpec
from .managers import _INF, NULL_BLOCK, AttentionManager, KVManager, MambaAlignManager, align_targets, make_manager
from .plan import checkpoint_at
from .request import Request

NO_BOUND = _INF  # a quiet bound never crossed; ``next_publish_at`` without attention groups


class PrefixHit:
    __slots__ = ("tokens", "blocks", "attention_tokens", "attach")

    def __init__(self, tokens: int, blocks: list[list[int]], attention_tokens: int):
        self.tokens = tokens  # hit every group agrees on
        self.blocks = blocks  # per group, the row the hit contributes
        self.attention_tokens = attention_tokens  # attention-only cached prefix (junction)
        self.attach = tokens > 0  # the hit hands out blocks (a reference is taken on each)


class KVCacheManager:
    def __init__(self, groups: list[GroupSpec], num_blocks: int, enable_caching: bool, fused_events: bool = True,
                 max_model_len: int = 1 << 62, reprefill: int = 0, hash_lookahead: int = 0,
                 unit: int = 0, mirror: bool = False):
        """``max_model_len`` caps the lookahead slots of attention groups (MTP / EAGLE);
        ``reprefill``: trailing computed tokens a multi-module MTP drafter may prefill again,
        never published (vLLM 0.33's ``num_prefill_lookahead - 1``); ``unit``: the hashing
        unit, below the block size for partial-block prefix hits (``sched.partial``); ``mirror``:
        use that module's managers (vLLM 0.33's rules read off one by one) with the unit equal to
        the block size too (MTP with several modules)."""
        self.groups = groups
        self.pool = BlockPool(num_blocks)
        # the first attention group (most of the blocks) keys its prefixes by plain hashes
        plain = next((g.group_id for g in groups if not g.is_mamba), None)
        bs = min(g.block_size for g in groups)
        # (vLLM 0.33 takes hits inside a block only beside align-mode Mamba, prefix caching on)
        unit = unit if 0 < unit < bs else bs
        self.partial = bool(enable_caching and (unit < bs or mirror) and plain is not None
                            and any(g.is_mamba and g.mode == "align" for g in groups))
        self.unit = unit if self.partial else bs
        self.fine = self.unit < bs  # (hits inside a block; else cached counts are floored to blocks)
        if self.partial:
            from .partial import AttentionPartialManager, MambaPartialManager
            self.managers = [(MambaPartialManager(g, self.pool, g.group_id == plain) if g.is_mamba else
                              AttentionPartialManager(g, self.pool, True, g.group_id == plain)) for g in groups]
            for m in self.managers:
                m.init_partial(unit)
                if m.spec.is_mamba:
                    m.lookahead = hash_lookahead
            fused_events = False
        else:
            self.managers = [make_manager(g, self.pool, enable_caching, g.group_id == plain) for g in groups]
        for m in self.managers:
            m.max_len = max_model_len
            m.reprefill = reprefill
            m.hash_lookahead = hash_lookahead
        self.attn = [m for m in self.managers if not m.spec.is_mamba]
        self.mamba = [m for m in self.managers if m.spec.is_mamba]
        self.enable_caching = enable_caching
        self.block_size = min(g.block_size for g in groups)
        self._empty = [[] for _ in groups]
        self._unchanged: list = []  # allocate_running: no group changed
        # decode events of attention and align-mode Mamba groups (every hybrid layout in
        # align mode) go through one fused function; other layouts, group by group
        self.fused = fused_events and all(type(m) in (AttentionManager, MambaAlignManager)
                                           for m in self.managers)
        # per group: (id, manager, is attention, block size, draft columns); attention groups
        # bound committed tokens (publishing) rather than computed ones
        self._statics = [(m.gid, m, not m.spec.is_mamba, m.bs, m.spec.num_spec) for m in self.managers]
        self.uncut_attention_hits = False  # the attn_hit_not_cut bug (sched/injected.py)

    # ------------------------------------------------------------------ hits
    def attention_cached_blocks(self, req: Request) -> int:
        """Blocks of the request's prefix that every attention group holds cached."""
        n = (req.num_tokens - 1) // self.block_size
        for m in self.attn:
            n = min(n, m.hit_blocks(req, n))
        return n

    def lookup(self, req: Request) -> PrefixHit:
        if not self.enable_caching:
            return PrefixHit(0, self._empty, 0)
        if self.partial:
            return self._lookup_partial(req)
        attn_blocks = self.attention_cached_blocks(req) if self.attn else (req.num_tokens - 1) // self.block_size
        hit = attn_blocks
        changed = True
        while changed and hit > 0:
            changed = False
            for m in self.mamba:
                h = m.hit_blocks(req, hit)
                if h < hit:
                    hit, changed = h, True
            if changed and len(self.mamba) > 1:
                continue
            break
        if hit and self.mamba:
            # same-step guard: a state published by this step's schedule is not written yet
            recent = self.pool.cached_this_step
            for m in self.mamba:
                if m.key(req.block_hashes[hit - 1]) in recent:
                    return PrefixHit(-1, self._empty, attn_blocks * self.block_size)
        blocks = [m.blocks_for_hit(req, hit) if hit else [] for m in self.managers]
        out = PrefixHit(hit * self.block_size, blocks, attn_blocks * self.block_size)
        if self.uncut_attention_hits and hit < attn_blocks:  # an injected bug (sched/injected.py)
            out.blocks = [b if m.spec.is_mamba else m.blocks_for_hit(req, attn_blocks) for m, b in zip(self.managers, blocks)]
            out.attach = True
        return out

    # ------------------------------------------------------------------ allocation
    def allocate(self, req: Request, num_computed: int, num_new: int, hit: Optional[PrefixHit],
                 checkpoint: Optional[int], publish_end: bool,
                 admit_tokens: Optional[int] = None) -> Optional[list]:
        """Make room for ``num_new`` tokens after ``num_computed``; None if the pool is short.

        ``admit_tokens`` (admission of a waiting request): the pool must also have
        room for the request's whole prefill of that many tokens, though only the
        first chunk is allocated now.

        Returns, per group, the new tail of the request's block row (for a
        first allocation: the whole row).
        """
        total = num_computed + num_new
        if self.partial:
            return self._allocate_partial(req, num_computed, total, hit, admit_tokens)
        if hit is not None and self.fused:
            return self._fused_admit(req, num_computed, total, hit, checkpoint, publish_end, admit_tokens)
        managers = self.managers
        if num_computed:
            for m in self.mamba:
                m.remove_skipped(req, num_computed)
        hit_rows = hit.blocks if hit is not None else self._empty
        plans = [m.plan(req, num_computed, total, hit_rows[i], checkpoint) for i, m in enumerate(managers)]
        need = 0
        for p in plans:
            need += p.fresh
        if admit_tokens is not None and admit_tokens > total:
            bs = self.block_size
            full_ckpt = _admission_checkpoint(admit_tokens, bs)
            # (the engine's whole-sequence check counts no lookahead slots)
            full = sum(m.plan(req, num_computed, admit_tokens, hit_rows[i], full_ckpt, lookahead=False).fresh
                       for i, m in enumerate(managers))
            need = max(need, full)
        if hit is not None and hit.attach:
            need += self._hit_need(hit)
        if need > self.pool.num_free:
            return None
        if hit is not None and hit.attach:
            self._attach_hit(req, hit)
        out = []
        allocate = self.pool.allocate
        for p in plans:
            fresh = allocate(p.fresh) if p.fresh else []
            out.append(p.apply(fresh))
        if hit is not None:
            # a first allocation reports the whole row (hit blocks included)
            out = [list(m.rows.get(req.index, [])) for m in managers]
        if self.enable_caching:
            for m in managers:
                m.cache(req, num_computed, total, checkpoint, publish_end)
        self._set_quiet(req)
        return out

    def _hit_need(self, hit: PrefixHit) -> int:
        """Hit blocks that are free now: taking them shortens the free queue too."""
        ref = self.pool.ref_cnt
        n = 0
        for row in hit.blocks:
            for b in row:
                if b and ref[b] == 0:
                    n += 1
        return n

    def _attach_hit(self, req: Request, hit: PrefixHit) -> None:
        """Take a reference on every hit block; groups that publish count the hit as published."""
        for m, row in zip(self.managers, hit.blocks):
            self.pool.touch(row)
            if isinstance(m, AttentionManager):
                m.mark_hit_cached(req, len(row))
            elif hasattr(m, "num_cached"):
                m.num_cached[req.index] = len(row)

    def _fused_admit(self, req: Request, num_computed: int, total: int, hit: PrefixHit,
                     checkpoint: Optional[int], publish_end: bool, admit_tokens: Optional[int]) -> Optional[list]:
        """``allocate`` of a request that holds no rows yet (admission), for attention and
        align-mode Mamba groups in one function: the same decisions and pool operations in
        the same order (count, touch the hit, take fresh blocks group by group, publish),
        without planning objects and closures. A Mamba hit row is nulls ending in one state
        block, and a first Mamba layout recycles nothing, which is what makes the counts this
        short."""
        idx = req.index
        pool = self.pool
        bs = self.block_size
        hit_rows = hit.blocks
        full_ckpt = None
        if admit_tokens is not None and admit_tokens > total:
            full_ckpt = _admission_checkpoint(admit_tokens, bs)
        else:
            admit_tokens = None
        todo = []  # per group: (statics, hit row, fresh blocks, Mamba target columns)
        need = need_full = 0
        for g, hrow in zip(self._statics, hit_rows):
            h = len(hrow)
            if g[2]:
                k = -(-total // bs) - h
                if k < 0:
                    k = 0
                todo.append((g, hrow, k, None))
                need += k
                if admit_tokens is not None:
                    k = -(-admit_tokens // bs) - h
                    if k > 0:
                        need_full += k
            else:
                S = g[4]
                targets, k = _first_mamba_columns(total, checkpoint, h, S, bs)
                todo.append((g, hrow, k, targets))
                need += k
                if admit_tokens is not None:
                    need_full += _first_mamba_columns(admit_tokens, full_ckpt, h, S, bs)[1]
        if need_full > need:
            need = need_full
        if hit.attach:
            need += self._hit_need(hit)
        if need > pool.num_free:
            return None
        if hit.attach:
            self._attach_hit(req, hit)
        out = []
        for g, hrow, k, targets in todo:
            fresh = pool.allocate(k) if k else []
            row = list(hrow)
            if targets is None:
                row.extend(fresh)
            else:  # (a first layout recycles no draft block)
                g[1]._fill(row, (targets, (), targets[-1] + 1, len(row)), fresh)
            g[1].rows[idx] = row
            out.append(tuple(row))
        if self.enable_caching:
            for m in self.managers:
                m.cache(req, num_computed, total, checkpoint, publish_end)
        self._set_quiet(req)
        return out

    def allocate_running(self, req: Request, num_computed: int, num_new: int, checkpoint: Optional[int],
                         publish_end: bool) -> Optional[list]:
        """``allocate`` for a request that already holds its rows (no hit to attach, no
        admission check): the same decisions, without the admission machinery. Returns
        per group the new row tail, or None for every group when nothing changed."""
        total = num_computed + num_new
        if self.partial:
            return self._allocate_partial(req, num_computed, total, None, None)
        managers = self.managers
        quiet = req.quiet_by
        if quiet is not None and checkpoint is None and not publish_end:
            if self.fused:
                return self._fused_event(req, num_computed, total, quiet, len(req.token_ids))
            return self._decode_event(req, num_computed, total, quiet, len(req.token_ids))
        for m in self.mamba:
            m.remove_skipped(req, num_computed)
        need = 0
        for m in managers:
            need += m.need(req, total, checkpoint)
        pool = self.pool
        if need > pool.num_free:
            return None
        tails = [m.commit(req, pool.allocate(m.last_need) if m.last_need else []) for m in managers]
        if self.enable_caching:
            for m in managers:
                m.cache(req, num_computed, total, checkpoint, publish_end)
        self._set_quiet(req)
        return tails if any(tails) else self._unchanged

    def _decode_event(self, req: Request, c: int, total: int, quiet: list, ntok: int) -> Optional[list]:
        """A decoding request crossed a quiet bound: only the groups whose bound it crossed act."""
        active = []
        need = 0
        j = 0
        committed = (total if total < ntok else ntok) - 1
        for q, g in zip(quiet, self._statics):
            if total > q[0] or (committed if g[2] else c) > q[1]:
                m = self.managers[j]
                need += m.decode_need(req, c, total)
                active.append(m)
            j += 1
        pool = self.pool
        if need and need > pool.num_free:
            return None
        tails = None
        for m in active:
            gid = m.gid
            tail, quiet[gid] = m.decode_commit(req, pool.allocate(m.last_need) if m.last_need else (), c, total)
            if tail:
                if tails is None:
                    tails = [()] * len(quiet)
                tails[gid] = tail
        _publish_quiet(req, quiet)
        return self._unchanged if tails is None else tails

    def bulk_event(self, req: Request, c: int, total: int) -> Optional[list]:
        """``allocate_running(req, c, total - c, None, False)`` for a decoding request in bulk
        mode (``c + 1`` committed tokens), with its attention publishing deferred
        (``defer_publishing``): blocks are taken and Mamba columns released, nothing is
        published. Only with the fused layout (``self.fused``)."""
        return self._fused_event(req, c, total, req.quiet_by, c + 1, True)

    def _fused_event(self, req: Request, c: int, total: int, quiet: list, ntok: int,
                     deferred: bool = False) -> Optional[list]:
        """``_decode_event`` for attention and align-mode Mamba groups, in one function.

        The same decisions in the same order (each crossed Mamba group releases the
        column left behind while needs are counted, then every crossed group takes its
        blocks in group order), without the per-group method calls: the events of
        decoding requests are most of the scheduler's work. ``deferred``: attention
        groups take blocks but publish nothing (bulk mode, see ``defer_publishing``)."""
        committed = (total if total < ntok else ntok) - 1
        for q in quiet:
            if total > q[0]:
                break
        else:  # no group takes a block: only releases and publishing (most events)
            return self._quiet_event(req, c, total, quiet, ntok, committed)
        idx = req.index
        pool = self.pool
        todo = []  # per crossed group: (its statics, row, fresh needed, layout)
        need = 0
        for g in self._statics:
            q = quiet[g[0]]
            m = g[1]
            if g[2]:
                if total > q[0] or committed > q[1]:
                    row = m.rows[idx]
                    k = -(-total // g[3]) - len(row)
                    if k < 0:
                        k = 0
                    todo.append((g, row, k, None))
                    need += k
            elif total > q[0] or c > q[1]:
                if c > q[1]:  # (below its computed bound there is nothing to release)
                    m.remove_skipped(req, c)
                row = m.rows[idx]
                S = g[4]
                running = (total - 1) // g[3]
                new_len = running + 1 + S
                prev_len = len(row)
                if new_len > prev_len:
                    k = 1
                    movable = None
                    # (the steady case, every draft column live and the columns moving on
                    # by one, is one new block at the end: no recycling to plan)
                    if S and (new_len != prev_len + 1 or NULL_BLOCK in row[running:]):
                        live = 0
                        for t in range(running, prev_len):
                            if row[t] != NULL_BLOCK:
                                live += 1
                        movable = [j for j in range(max(prev_len - S, 0), min(prev_len, running))
                                   if row[j] != NULL_BLOCK]
                        empty = new_len - running - live
                        if len(movable) > empty:
                            del movable[empty:]
                        k = empty - len(movable)
                    todo.append((g, row, k, (running, new_len, prev_len, movable)))
                    need += k
                else:
                    todo.append((g, row, 0, None))
        if need and need > pool.num_free:
            return None
        tails = None
        for g, row, k, lay in todo:
            gid, m, is_attn, bs, S = g
            tail = ()
            if is_attn:
                if k:
                    tail = pool.allocate(k)
                    row.extend(tail)
                if deferred:
                    quiet[gid] = (len(row) * bs, _INF)
                else:
                    m.publish(req, row, total, ntok)
                    quiet[gid] = m.quiet(req)
            else:
                if lay is not None:
                    running, new_len, prev_len, movable = lay
                    fresh = pool.allocate(k) if k else ()
                    if movable is not None:  # old draft blocks are recycled into the new columns
                        tail = m._fill(row, (range(running, new_len), movable, new_len, prev_len), fresh)
                    else:  # (the draft columns move one on: the last is new)
                        if running > prev_len:
                            row.extend([NULL_BLOCK] * (running - prev_len))
                        row.append(fresh[0])
                        tail = row[prev_len:]
                quiet[gid] = ((len(row) - S) * bs, (m.low.get(idx, 0) + 1) * bs)  # (m.quiet, inline)
            if tail:
                if tails is None:
                    tails = [()] * len(quiet)
                tails[gid] = tail
        _publish_quiet(req, quiet)
        return self._unchanged if tails is None else tails

    def _quiet_event(self, req: Request, c: int, total: int, quiet: list, ntok: int, committed: int) -> list:
        """``_fused_event`` when no group's total bound is crossed: crossed Mamba groups
        release the columns left behind, then crossed attention groups publish their full
        blocks, in group order as there. Nothing is allocated, so it cannot fail."""
        idx = req.index
        for gid, m, is_attn, bs, S in self._statics:
            if not is_attn and c > quiet[gid][1]:
                m.remove_skipped(req, c)
                # (m.quiet inline: the call measured 3% of spec256, which has many such events)
                quiet[gid] = ((len(m.rows[idx]) - S) * bs, (m.low.get(idx, 0) + 1) * bs)
        for gid, m, is_attn, _, _ in self._statics:
            if is_attn and committed > quiet[gid][1]:
                m.publish(req, m.rows[idx], total, ntok)
                quiet[gid] = m.quiet(req)
        _publish_quiet(req, quiet)
        return self._unchanged

    # ------------------------------------------------------------------ deferred publishing
    # A request in bulk mode publishes its full attention blocks late: the scheduler calls
    # ``publish_deferred`` before anything could tell the difference (a prefix lookup, another
    # request's publishing, a preemption, the request leaving bulk mode, an observer), in
    # the order the step-by-step path would have published them. Publishing is not seen
    # by taking or releasing blocks: a block being published is in use, so never in the
    # free queue, and a holder evicted meanwhile leaves the other holders in their order.

    def defer_publishing(self, req: Request) -> None:
        """Attention groups stop bounding the request's committed tokens (no publish events)."""
        q = req.quiet_by
        for m in self.attn:
            q[m.gid] = (q[m.gid][0], _INF)
        _publish_quiet(req, q)

    def resume_publishing(self, req: Request) -> None:
        """Back to publishing at each block boundary (after ``publish_deferred`` caught up)."""
        q = req.quiet_by
        for m in self.attn:
            q[m.gid] = m.quiet(req)
        _publish_quiet(req, q)

    def next_publish_at(self, req: Request) -> int:
        """Computed tokens at which the request's next attention block is full of committed
        tokens (``c + 1`` committed): one past the tightest publish bound (``quiet``), or
        ``NO_BOUND`` without attention groups."""
        at = _INF
        for m in self.attn:
            k = m.quiet(req)[1] + 1
            if k < at:
                at = k
        return at

    def unpublished(self, req: Request, ntok: int) -> list[tuple[AttentionManager, int, int]]:
        """Per attention group, the blocks full of the first ``ntok`` committed tokens not
        published yet: (manager, first block, end)."""
        idx = req.index
        out = []
        for m in self.attn:
            done = m.num_cached.get(idx, 0)
            full = ntok // m.bs
            if full > done:
                out.append((m, done, full))
        return out

    def _publish_full(self, req: Request, ntok: int) -> None:
        """Publish, in every attention group, the blocks full of the first ``ntok`` tokens."""
        idx = req.index
        for m in self.attn:
            m.publish(req, m.rows[idx], ntok, ntok)

    def publish_deferred(self, req: Request, ntok: int) -> int:
        """Publish what the step-by-step path would have by the time the request had ``ntok``
        committed tokens (its block hashes cover them); returns ``next_publish_at``."""
        self._publish_full(req, ntok)
        return self.next_publish_at(req)

    def publish_computed(self, req: Request) -> None:
        """Publish the attention blocks full of the request's computed tokens. With drafts,
        vLLM 0.33 caches them after each step's update, not only when the request is next
        scheduled; only a request freed before that (finished, or preempted first) shows it."""
        if self.partial:
            return self.cache_partial(req, min(req.num_computed_tokens, len(req.token_ids)))
        self._publish_full(req, min(req.num_computed_tokens, len(req.token_ids)))

    def publish_pending(self, req: Request) -> None:
        """After a step's update (drafts on), vLLM 0.33 caches the request's blocks up to its
        computed tokens: a Mamba state kept earlier but not publishable then (MTP / EAGLE,
        ``MambaAlignManager.cache``) is published now, before the next step's lookups."""
        if self.partial:
            return self.cache_partial(req, min(req.num_computed_tokens, len(req.token_ids)))
        for m in self.mamba:
            pending = getattr(m, "pending", None)
            if pending and req.index in pending:
                m._publish_pending(req, min(req.num_computed_tokens, len(req.token_ids)))

    def publish_block(self, req: Request, m: AttentionManager, i: int) -> None:
        """Publish block ``i`` of the request's row in group ``m`` alone (ordered catch-up)."""
        idx = req.index
        self.pool.cache(m.rows[idx][i], m.key(req.block_hashes[i]))
        m.num_cached[idx] = i + 1

    def _set_quiet(self, req: Request) -> None:
        """Record, per group and overall, how far the request can decode untouched."""
        if self.partial:  # (every step the general way)
            req.quiet_by = None
            req.quiet_total = req.quiet_computed = -1
            return
        req.quiet_by = [m.quiet(req) for m in self.managers]
        _publish_quiet(req, req.quiet_by)

    # ------------------------------------------------------------------ partial-block hits
    def _lookup_partial(self, req: Request) -> PrefixHit:
        """vLLM 0.33's hybrid lookup with unit-granular hits (``sched.partial``): the attention
        groups' joint hit, then the latest Mamba state every Mamba group holds at or below it;
        attention rows are cut to the blocks that hit covers. The junction is the attention
        hit when the Mamba groups cut it (vLLM's ``shared_prefix_boundary``), else 0."""
        bs = self.block_size
        bound = req.num_tokens - 1
        a, rows = _joint_attention_hit(self.attn, req, bound)
        hit = a
        changed = True
        while changed and hit > 0:
            changed = False
            for m in self.mamba:
                h, _ = m.hit_tokens(req, hit)
                if h < hit:
                    hit, changed = h, True
        blocks = []
        recent = self.pool.cached_this_step
        keys = self.pool.block_key
        for m in self.managers:
            if m.spec.is_mamba:
                if not hit:
                    blocks.append([])
                    continue
                _, b = m.hit_tokens(req, hit)
                if keys[b] in recent:  # (written by this very step: not readable yet)
                    return PrefixHit(-1, self._empty, 0)
                blocks.append([NULL_BLOCK] * ((hit - 1) // bs) + [b])
            else:
                blocks.append(rows[m.gid][:-(-hit // bs)])
        return PrefixHit(hit, blocks, a if a > hit else 0)

    def _allocate_partial(self, req: Request, c: int, total: int, hit: Optional[PrefixHit],
                          admit_tokens: Optional[int]) -> Optional[list]:
        """``allocate`` with partial-block hits, in vLLM 0.33's ``allocate_slots`` order: the
        whole-sequence check (admission), releases, the count, the hit taken, new blocks group
        by group (a partial hit's private copy first), caching."""
        pool = self.pool
        managers = self.managers
        rows = hit.blocks if hit is not None else self._empty
        h = hit.tokens if hit is not None else 0
        evictable = self._hit_need(hit) if hit is not None and hit.attach else 0
        if hit is not None and admit_tokens is not None and admit_tokens > total:
            full = evictable
            for m, row in zip(managers, rows):
                full += (m.count(req, c, admit_tokens, row, h, True) if m.spec.is_mamba
                         else m.count(req, admit_tokens, row, h, False))
            if full > pool.num_free:
                return None
        if hit is None and c:
            for m in self.mamba:
                m.remove_skipped(req, c)
        need = evictable
        for m, row in zip(managers, rows):
            need += m.count(req, c, total, row, h) if m.spec.is_mamba else m.count(req, total, row, h)
        if need > pool.num_free:
            return None
        if hit is not None:
            for m, row in zip(managers, rows):
                pool.touch(row)
                m.admit(req, row, h)
        tails = [m.grow(req, total) for m in managers]
        ntok = self._cacheable(min(total, len(req.token_ids)))
        for m in managers:
            m.cache_to(req, ntok)
        self._set_quiet(req)
        if hit is not None:
            return [list(m.rows.get(req.index, [])) for m in managers]
        return tails if any(tails) else self._unchanged

    def cache_partial(self, req: Request, ntok: int) -> None:
        """vLLM 0.33's ``cache_blocks`` of every group with ``ntok`` cacheable tokens."""
        ntok = self._cacheable(ntok)
        for m in self.managers:
            if req.index in m.rows:
                m.cache_to(req, ntok)

    def _cacheable(self, ntok: int) -> int:
        """Tokens a later hit could match (``_align_cacheable``): all of them with hits inside a
        block, else whole blocks."""
        return ntok if self.fine else ntok // self.block_size * self.block_size

    def end_schedule(self) -> tuple[tuple[int, int], ...]:
        """The end of a schedule pass: the endpoints of this pass's private copies are let go,
        group by group (vLLM 0.33 frees them once the copies are queued). Returns the copies,
        (source, copy) in group order, for the worker (``StepPlan.block_copies``)."""
        held = []
        for m in self.managers:
            if m.held:
                held += m.held
                m.held = []
        if held:
            self.pool.free(held)
        return tuple(zip(held[0::2], held[1::2]))

    def free(self, req: Request) -> None:
        for m in self.managers:
            m.free(req)
        req.quiet_total = req.quiet_computed = -1
        req.quiet_by = None

    def rows(self, req: Request) -> list[list[int]]:
        return [m.row(req) for m in self.managers]

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            for m in self.managers:
                if hasattr(m, "num_cached"):
                    m.num_cached.clear()
        return ok


def _joint_attention_hit(managers: list, req: Request, bound: int) -> tuple[int, dict]:
    """The attention groups' joint unit-granular hit (``AttentionPartialManager.hit_tokens``,
    every group holding each block): (tokens, per group id its hit blocks)."""
    if len(managers) == 1:
        m = managers[0]
        a, blocks = m.hit_tokens(req, bound)
        return a, {m.gid: blocks}
    a = bound
    while True:
        got = [m.hit_tokens(req, a) for m in managers]
        low = min(t for t, _ in got)
        if low >= a or low == 0:
            return low, {m.gid: b for m, (_, b) in zip(managers, got)}
        a = low


def _admission_checkpoint(admit_tokens: int, bs: int) -> Optional[int]:
    """The checkpoint column a request's whole sequence of ``admit_tokens`` would take in one
    chunk, for the admission-room count (only the number of columns matters there)."""
    at = checkpoint_at(0, admit_tokens, admit_tokens, bs)
    return None if at is None else at // bs - 1


def _first_mamba_columns(total: int, checkpoint: Optional[int], h: int, S: int, bs: int) -> tuple[list, int]:
    """An align-mode Mamba row's first layout for ``total`` tokens over a hit row of ``h``
    columns (nulls, then the hit state): the columns to fill (the checkpoint first) and how
    many fresh blocks they take (a target on the hit state is already filled)."""
    targets = align_targets(total, checkpoint, bs, S)
    k = len(targets)
    if h and h - 1 in targets:
        k -= 1
    return targets, k


def _publish_quiet(req: Request, quiet: list[tuple[int, int]]) -> None:
    """The request's overall quiet bounds: the tightest of its groups'."""
    qt = qc = 1 << 62
    for t, c in quiet:
        if t < qt:
            qt = t
        if c < qc:
            qc = c
    req.quiet_total = qt
    req.quiet_computed = qc
