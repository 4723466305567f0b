"""Partial-block prefix hits: a hashing unit (vLLM 0.33's ``prefix_match_unit``) below the block size.

With align-mode Mamba and prefix caching on, vLLM 0.33 hashes every ``unit`` tokens and lets a
prefix hit end at any unit boundary ("fine-grained" hits; ``partial_hash_hits_enabled``):

* attention groups match whole blocks, then probe the unit boundaries inside the next block,
  highest first (``FullAttentionManager.find_longest_cache_hit``); a block reachable from a unit
  boundary is one the prompt-tail rule below registered;
* Mamba groups match the latest unit boundary whose state is cached (right to left);
* a hit that ends inside a block takes a private copy of that block (copy-on-write): a fresh
  block replaces it in the row, and both are held until the end of the schedule pass
  (``_apply_cow``, ``take_kv_cache_block_copies``);
* attention caches the block holding the prompt's last unit boundary before its last token
  under that boundary's hash too (``_cache_partial_tail_block``), besides full blocks;
* Mamba keeps the state at the prompt's unit-aligned checkpoint: in the prefill checkpoint
  column when the final chunk can export it, else by stopping a chunk there and keying the
  running block, whose state is moved to a private copy by the request's next allocation
  (``MambaManager._cache_partial_tail_block``, ``allocate_new_blocks``);
* the scheduler splits prefill chunks by ``_mamba_block_aligned_split`` with the unit rules.

Only this mode uses the classes here; with the unit equal to the block size nothing changes.
A block's hash is the unit hash at its end (``Request.block_hashes``), a unit boundary's the
unit hash there (``Request.unit_hashes``): one key space, as in vLLM.
"""

from __future__ import annotations

from typing import Optional

from .block_pool import NULL_BLOCK, BlockPool
from .groups import GroupSpec, cdiv
from .managers import AttentionManager, MambaAlignManager
from .request import Request


def checkpoint_position(num_tokens: int, grid: int, lookahead: int) -> int:
    """The last ``grid``-aligned boundary that leaves a token to compute and whose hash exists
    (vLLM 0.33's ``get_mamba_prefill_checkpoint_position``, no EAGLE block drop)."""
    return max((num_tokens - max(1, lookahead)) // grid * grid, 0)


def checkpoint_valid(start: int, end: int, position: int, unit: int, bs: int) -> bool:
    """Whether a chunk from ``start`` to ``end`` can export the state at ``position`` in its
    checkpoint column (``is_mamba_prefill_checkpoint_valid``, the Mamba2 mixer's alignment 1)."""
    return (start % unit == 0 and cdiv(end, bs) - 2 > (start - 1) // bs
            and start + unit <= position and start < position < end)


def split(req: Request, start: int, n: int, bs: int, unit: int, lookahead: int, max_prefill: int,
          junction: int) -> int:
    """Tokens of a prefill chunk from ``start`` (``n`` asked for) under align mode with partial
    hits (vLLM 0.33's ``_mamba_block_aligned_split`` with ``mamba_partial_cache_hit``)."""
    P = req.num_prompt_tokens
    prefill_end = max(P, len(req.token_ids) - 1)
    if start >= prefill_end:
        return n
    last_cache = checkpoint_position(len(req.token_ids), bs, lookahead)
    end = start + n
    internal = end >= prefill_end and checkpoint_valid(
        start, end, checkpoint_position(prefill_end, unit, lookahead), unit, bs)
    if internal:
        last_cache = 0
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or bs <= max_prefill:
            end = aligned
    tail = 0 if internal or unit == bs else checkpoint_position(P, unit, lookahead)
    stops = ((start // bs + 1) * bs if start % bs and not internal else 0,
             last_cache,
             tail if last_cache < tail < P else 0,
             start + (junction - start) // bs * bs if start < junction < end else 0)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def retained_block(pos: int, unit: int, bs: int) -> int:
    """The block whose state a reachable boundary at ``pos`` keeps (``reachable_block_mask``)."""
    return pos // unit * unit // bs - 1


class PartialMixin:
    """What both partial-mode managers share: CoW bookkeeping, held endpoints, cached counts."""

    pool: BlockPool
    spec: GroupSpec
    bs: int
    rows: dict

    def init_partial(self, unit: int) -> None:
        self.unit = unit
        self.num_cached: dict[int, int] = {}
        self.cow: dict[int, tuple[int, int]] = {}  # request -> (column, source block) to copy
        self.held: list[int] = []  # copy endpoints held until the pass ends (source, copy, ...)

    def partial_key(self, req: Request, ntok: int):
        return self.key(req.unit_hashes[ntok // self.unit - 1])

    def cache_partial(self, block: int, key, ntok: int, replace: bool = False) -> None:
        """vLLM 0.33's ``cache_partial_block``: ``block`` also holds the prefix of ``ntok``."""
        pool = self.pool
        if block == NULL_BLOCK:
            return
        already = pool.block_key[block] == key or pool.holds(block, key)
        if replace:
            pool.remove_keys(block)
        elif not already and pool.block_key[block] is not None and pool.ktok.get(block, 0) < ntok:
            pool.remove_keys(block)
        pool.insert_key(block, key, ntok)

    def cache_full(self, req: Request, row: list[int], start: int, stop: int, mask=None) -> None:
        """Key blocks ``start .. stop-1`` of ``row`` by their full-block hashes (a block keyed by a
        shorter prefix is promoted: its keys are dropped first, as ``cache_full_blocks`` does)."""
        pool = self.pool
        for i in range(start, stop):
            b = row[i]
            if b == NULL_BLOCK or (mask is not None and not mask(i)):
                continue
            if pool.block_key[b] is not None:
                pool.remove_keys(b)
            pool.insert_key(b, self.key(req.block_hashes[i]), (i + 1) * self.bs)

    def admit(self, req: Request, hit_row: list[int], hit: int) -> None:
        """Take the hit (its blocks are touched by the caller); a hit ending inside a block
        marks that block for a private copy."""
        idx = req.index
        self.rows[idx] = list(hit_row)
        self.num_cached[idx] = len(hit_row)
        if hit_row and hit % self.bs:
            self.cow[idx] = (hit // self.bs, hit_row[-1])
            self.num_cached[idx] = hit // self.bs

    def free(self, req: Request) -> None:
        self.num_cached.pop(req.index, None)
        self.cow.pop(req.index, None)
        super().free(req)  # type: ignore[misc]


class AttentionPartialManager(PartialMixin, AttentionManager):
    """Full attention with unit-granular hits (vLLM 0.33's ``FullAttentionManager``)."""

    def hit_tokens(self, req: Request, bound: int) -> tuple[int, list[int]]:
        """Longest cached prefix of at most ``bound`` tokens: whole blocks, then one unit
        boundary inside the next block; (tokens, blocks)."""
        cached = self.pool.cached
        bs, unit = self.bs, self.unit
        hashes = req.block_hashes
        blocks: list[int] = []
        n = min(bound // bs, len(hashes))
        while len(blocks) < n:
            b = cached.get(self.key(hashes[len(blocks)]))
            if b is None:
                break
            blocks.append(b)
        hit = len(blocks) * bs
        scale = bs // unit
        first = len(blocks) * scale
        units = req.unit_hashes
        top = min(first + scale - 1, bound // unit, len(units))
        for k in range(top - 1, first - 1, -1):
            b = cached.get(self.key(units[k]))
            if b is not None:
                blocks.append(b)
                hit = (k + 1) * unit
                break
        return hit, blocks

    def count(self, req: Request, total: int, hit_row: list[int], hit: int, lookahead: bool = True) -> int:
        """Fresh blocks ``get_num_blocks_to_allocate`` asks for (hit blocks not counted;
        the whole-sequence check counts no lookahead slots)."""
        idx = req.index
        need = cdiv(self.slots(total) if lookahead else total, self.bs)
        if idx in self.num_cached:
            return max(need - len(self.rows[idx]), 0)
        return max(need - len(hit_row), 0) + (1 if hit_row and hit % self.bs else 0)

    def grow(self, req: Request, total: int) -> list[int]:
        """``allocate_new_blocks``: the private copy first, then blocks up to ``total`` tokens."""
        idx = req.index
        pool = self.pool
        row = self.rows.setdefault(idx, [])
        out: list[int] = []
        c = self.cow.pop(idx, None)
        if c is not None:
            col, src = c
            copy = pool.allocate(1)[0]
            row[col] = copy
            pool.ref_cnt[copy] += 1  # (held with the source until the pass ends)
            self.held += [src, copy]
            out.append(copy)
        k = cdiv(self.slots(total), self.bs) - len(row)
        if k > 0:
            fresh = pool.allocate(k)
            row.extend(fresh)
            out.extend(fresh)
        return out

    def cache_to(self, req: Request, ntok: int) -> None:
        """``cache_blocks`` with ``ntok`` cacheable tokens: full blocks, then the prompt's tail."""
        idx = req.index
        row = self.rows.get(idx)
        if row is None or not self.caching:
            return
        done = self.num_cached.get(idx, 0)
        full = min(ntok, req.hashed_tokens) // self.bs
        if full > done:
            self.cache_full(req, row, done, full)
            self.num_cached[idx] = full
        unit = self.unit
        at = min((req.num_prompt_tokens - 1) // unit, len(req.unit_hashes)) * unit
        if at == 0 or at > ntok or at % self.bs == 0:
            return
        col = at // self.bs
        if col < len(row):
            self.cache_partial(row[col], self.partial_key(req, at), at)


class MambaPartialManager(PartialMixin, MambaAlignManager):
    """Align-mode Mamba with unit-granular hits and the prompt's unit checkpoint (vLLM 0.33's
    ``MambaManager`` in align mode, retention interval 0)."""

    def init_partial(self, unit: int) -> None:
        super().init_partial(unit)
        self.allocated: set[int] = set()
        self.checkpoints: dict[int, tuple[int, int]] = {}  # request -> (position, column)
        self.lookahead = 0  # (set by KVCacheManager) tokens past a unit its hash covers

    def hit_tokens(self, req: Request, bound: int) -> tuple[int, int]:
        """The latest unit boundary of at most ``bound`` tokens whose state is cached:
        (tokens, block), or (0, NULL_BLOCK)."""
        cached = self.pool.cached
        units = req.unit_hashes
        for k in range(min(bound // self.unit, len(units)) - 1, -1, -1):
            b = cached.get(self.key(units[k]))
            if b is not None:
                return (k + 1) * self.unit, b
        return 0, NULL_BLOCK

    def _checkpoint(self, req: Request, start: int, end: int) -> Optional[tuple[int, int]]:
        """(position, column) of the state a chunk ``start .. end`` exports, or None
        (``_needs_internal_checkpoint``)."""
        prefill_end = max(req.num_prompt_tokens, len(req.token_ids) - 1)
        if end < prefill_end:
            return None
        pos = checkpoint_position(end, self.unit, self.lookahead)
        if not checkpoint_valid(start, end, pos, self.unit, self.bs):
            return None
        col = cdiv(end, self.bs) - 2
        row = self.rows.get(req.index, [])
        S = self.spec.num_spec
        if col < 0 or not (col >= len(row) or row[col] == NULL_BLOCK
                           or (req.index in self.allocated and col >= len(row) - S)):
            return None
        return pos, col

    def count(self, req: Request, start: int, total: int, hit_row: list[int], hit: int,
              admission: bool = False) -> int:
        """Fresh blocks ``get_num_blocks_to_allocate`` asks for (hit blocks not counted);
        records the chunk's checkpoint unless ``admission`` (the whole-sequence check)."""
        idx = req.index
        S = self.spec.num_spec
        new = cdiv(total, self.bs) + S - len(hit_row) - len(self.rows.get(idx, ()))
        partial = bool(hit_row) and hit % self.bs != 0 or idx in self.cow
        if partial:
            new = max(new, 0) + 1
        ck = self._checkpoint(req, start, total)
        if not admission:
            if ck is None:
                self.checkpoints.pop(idx, None)
            else:
                self.checkpoints[idx] = ck
        if new > 0:
            new = min(new, 1 + partial + (ck is not None) + (0 if idx in self.allocated else S))
        return new

    def grow(self, req: Request, total: int) -> list[int]:
        """``allocate_new_blocks`` in align mode: null columns up to the running one (less the
        checkpoint column), draft blocks recycled forward, the private copy of a partial state
        (a new request's hit: in its row; the request's own prompt-tail state: the copy takes
        over the state's keys and leaves the row), then the new columns."""
        idx = req.index
        pool = self.pool
        S = self.spec.num_spec
        row = self.rows.setdefault(idx, [])
        required = cdiv(total, self.bs) + S
        ck = int(idx in self.checkpoints)
        c = self.cow.get(idx)
        allocated = idx in self.allocated
        if required <= len(row) and c is None and not ck:
            self.allocated.add(idx)
            return []
        prev = len(row)
        skipped = required - S - 1
        if prev < skipped:
            row.extend([NULL_BLOCK] * (skipped - ck - prev))
        if allocated:
            for j in range(prev - S, prev):
                if j < skipped - ck:
                    row.append(row[j])
                    row[j] = NULL_BLOCK
                else:
                    break
        k = max(required - len(row), 0) + (c is not None)
        fresh = pool.allocate(k) if k else []
        out = row[prev:]
        if c is not None:
            col, src = c
            copy, fresh = fresh[0], fresh[1:]
            if allocated:
                pool.move_keys(src, copy)
                pool.ref_cnt[src] += 1
                self.held += [src, copy]
                if pool.block_key[copy] is not None:
                    pool.cached_this_step.add(pool.block_key[copy])
            else:
                row[col] = copy
                pool.ref_cnt[copy] += 1
                self.held += [src, copy]
                out = [copy] + out
            del self.cow[idx]
        row.extend(fresh)
        self.allocated.add(idx)
        return out + fresh

    def cache_to(self, req: Request, ntok: int) -> None:
        """``cache_blocks`` with ``ntok`` cacheable tokens: the states at the request's
        reachable boundaries (the prompt's replay point, the junction) in full blocks, then
        the prompt's unit checkpoint."""
        idx = req.index
        row = self.rows.get(idx)
        if row is None:
            return
        pool = self.pool
        before = self.num_cached.get(idx, 0)
        full = min(ntok, req.hashed_tokens) // self.bs
        if full > before:
            keep = {retained_block(req.num_prompt_tokens - 1, self.unit, self.bs)}
            if req.junction:
                keep.add(retained_block(req.junction, self.unit, self.bs))
            self.cache_full(req, row, before, full, keep.__contains__)
            self.num_cached[idx] = full
        key = self._cache_tail(req, row, ntok)
        if key is not None:
            pool.cached_this_step.add(key)
        for i in range(before, self.num_cached.get(idx, 0)):
            b = row[i]
            if b != NULL_BLOCK and pool.block_key[b] is not None:
                pool.cached_this_step.add(pool.block_key[b])

    def _cache_tail(self, req: Request, row: list[int], ntok: int):
        idx = req.index
        pool = self.pool
        unit, bs = self.unit, self.bs
        ck = self.checkpoints.get(idx)
        prompt_point = checkpoint_position(req.num_prompt_tokens, unit, self.lookahead)
        if ck is not None:
            pos, col = ck
            b = row[col]
            if pos != prompt_point and pos != req.junction:
                if b != NULL_BLOCK:
                    pool.remove_keys(b)  # (a transient state: not reusable)
                return None
            if b == NULL_BLOCK or pool.ktok.get(b) == pos and pool.block_key[b] is not None:
                return None
            key = self.partial_key(req, pos)
            self.cache_partial(b, key, pos, replace=True)
            return key
        if ntok <= 0 or ntok % unit or ntok != prompt_point:
            return None
        col = cdiv(ntok, bs) - 1
        if col >= len(row):
            return None
        b = row[col]
        if b == NULL_BLOCK or pool.block_key[b] is not None and pool.ktok.get(b) == ntok:
            return None
        key = self.partial_key(req, ntok)
        self.cache_partial(b, key, ntok)
        if ntok % bs:
            self.cow[idx] = (col, b)
            self.num_cached[idx] = col
        return key

    def free(self, req: Request) -> None:
        self.allocated.discard(req.index)
        self.checkpoints.pop(req.index, None)
        super().free(req)
