"""Mamba layers of a step on real tensors: state copies, the probe scan, and the checks.

The system under test is the bookkeeping: where each request's state is read, written
and copied (``mamba_state``'s trackers, one per cache mode), resolved through the
request's block rows to pages of the state cache. The cache is laid out as the engine
lays it out: one tensor per *slot*, shared by the i-th layers of every Mamba group, so a
block id names one page in each slot (research/vllm-hybrid.md §1.4).

A step is three launches for all rows and all layers: the step's pre-copies, the
probe scan (writing states where the bookkeeping says and every token's output), then,
once the outcome is known, the post-copies and the oracle's scan, which advances its
own per-request states and compares the outputs and the states at the resume point,
prefix hits and boundaries with the cache, element for element.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..checks import Checks, Failure
from ..config import Scenario
from ..errors import InputError
from ..layers.exact import fingerprint_rows, pages_digest
from ..layers.mamba import MambaProbe, stack_tables
from ..oracle import MambaOracle, OracleRow, StateCompare
from ..sched.plan import StepOutcome, StepPlan, prefill_end
from .cache import BlockMap, MambaStateCache, PageArena
from .mamba_state import TRACKERS, Bugs, Copy, RowPlan
from .metadata import chunk_metadata, chunk_metadata_varlen
from ..device.clock import PhaseClock
from ..device.verdicts import Verdicts
from ..device.transfer import upload


class BadAccess(Exception):
    """The bookkeeping pointed a read or copy at a column holding no block, or made two
    copies of one step collide: a failure of ``ssm.running_state``, not a crash."""


@dataclass
class Forward:
    """What the forward of a step leaves for the checks after the outcome."""

    plans: list[RowPlan]
    y: torch.Tensor  # (tokens, layers, H*P) int32
    y_start: list[int]


WHAT = {"hit": ("ssm.cached_blocks", "prefix hit"), "run": ("ssm.running_state", "running state"),
        "bnd": ("ssm.cached_blocks", "boundary state"), "copy": ("ssm.cached_blocks", "boundary copy")}


class MambaExecution:
    PHASES = ("mamba", "copies", "oracle")  # what its clock times: the layers, the state copies, the oracle
    ORACLE_PHASES = ("oracle",)  # (of those, the oracle's: the runs' oracle share)
    CHECK_PHASES: tuple[str, ...] = ()  # (no checks besides the oracle's run in a phase of their own)
    def __init__(self, scenario: Scenario, groups, kernels, checks: Checks, check: str, bugs: Bugs,
                 device: torch.device, blocks: BlockMap, oracle_scan, arena: Optional[PageArena] = None):
        geo = scenario.geometry().mamba
        self.geo = geo
        self.k = kernels
        self.checks = checks
        self.check = check
        self.bugs = bugs
        self.device = device
        self.blocks = blocks
        self.S = scenario.spec_decode.num_speculative_tokens
        self.groups = [g for g in groups if g.kind == "mamba"]
        self.layer_group = [next(g.group_id for g in self.groups if layer in g.layers) for layer in range(geo.layers)]
        self.layer_slot = [next(g.layers.index(layer) for g in self.groups if layer in g.layers)
                           for layer in range(geo.layers)]
        self.group_index = {g.group_id: i for i, g in enumerate(self.groups)}
        self.slots = max(len(g.layers) for g in self.groups)
        probes = [MambaProbe(geo, layer, scenario.seed) for layer in range(geo.layers)]
        self.tables = stack_tables(probes, device)
        self.K, self.L = geo.conv_kernel, geo.layers
        self.HP = self.tables.H * self.tables.P
        self.cache = MambaStateCache(self.slots, geo.conv_rows(self.S), self.tables.dim,
                                     (self.tables.H, self.tables.P, self.tables.N), device, blocks, arena)
        self.slot_of_layer = torch.tensor(self.layer_slot, dtype=torch.int64, device=device)
        self.bs = self.groups[0].block_size
        self.mode = scenario.cache.resolved_mode()
        self.tracker = TRACKERS[self.mode](self.bs, self.S, bugs, scenario.spec_decode.prefill_lookahead)
        unit = scenario.cache.prefix_match_unit or self.bs
        # partial-block prefix hits: prefill checkpoints at unit boundaries (vLLM 0.33's worker rule)
        self.unit = unit if self.mode == "align" and unit < self.bs else 0
        self.oracle = MambaOracle(self.tables, scenario.scheduler.max_num_seqs, device, oracle_scan)
        self.page_bytes = scenario.cache.page_size_bytes or geo.state_bytes(self.S)
        self.int32_pages = "int32_block_offset" in bugs
        self.last_copies = 0
        self.clock = PhaseClock(device, self.PHASES)  # (the executor hands every part its shared one)
        self.verdicts = Verdicts(0)  # (the executor hands every part its shared one)
        self.output_digest: Optional["hashlib._Hash"] = None  # set to collect a digest of every checked output

    # ------------------------------------------------------------------ request lifecycle
    def cleanup(self, finished, preempted, resumed) -> None:
        self.tracker.cleanup(finished, preempted, resumed)
        for rid in list(finished) + list(preempted):
            self.oracle.release(rid)

    def admit(self, rid: str) -> None:
        self.tracker.admit(rid)

    # ------------------------------------------------------------------ addressing
    def _blk(self, r, group: int, col: int, step: int) -> int:
        row = r.rows[group]
        if col < 0 or col >= len(row) or row[col] == 0:
            raise BadAccess(f"step {step}: {r.rid} needs column {col} of group {group}, which holds no block")
        block = row[col]
        if self.int32_pages:
            block = self._int32_page(block)
        return self.blocks.row(block)

    def _int32_page(self, block: int) -> int:
        """The page a kernel reaches when it computes ``block * page_bytes`` in 32-bit
        arithmetic (the injected bug): past 2 GiB the address wraps to another page."""
        page = self.page_bytes
        addr = (block * page) & 0xFFFFFFFF
        if addr >= 1 << 31:
            addr -= 1 << 32
        wrapped = addr // page
        return wrapped if wrapped > 0 else 0  # a negative address lands outside the cache: the NaN page

    def _pages(self, r, col: int, step: int) -> list[int]:
        """The page of column ``col`` for every layer (each layer reads its own group's row)."""
        per_group = [self._blk(r, g.group_id, col, step) for g in self.groups]
        return [per_group[self.group_index[g]] for g in self.layer_group]

    # ------------------------------------------------------------------ checks on metadata
    def check_chunk_meta(self, plan: StepPlan, meta) -> None:
        pre = meta.order[meta.num_decodes:]
        if not pre:
            return
        computed = [plan.scheduled[i].num_computed_tokens for i in pre]
        qsl = [0]
        for i in pre:
            qsl.append(qsl[-1] + plan.scheduled[i].num_scheduled_tokens)
        cs = self.geo.chunk_size
        a = chunk_metadata(computed, qsl, cs, "chunk_crosses_boundary" in self.bugs)
        b = chunk_metadata_varlen(computed, qsl, cs)
        tally = self.checks.get("mamba.chunk_meta")
        if a == b:
            tally.passed()
        else:
            tally.failed(Failure(plan.step, None, f"chunk metadata differs: per-request cu={a[0][:8]} "
                                                  f"varlen cu={b[0][:8]}"))

    # ------------------------------------------------------------------ copies
    def apply_copies(self, copies: list[tuple[object, Copy]], step: int) -> None:
        """Every layer's copies in one provider call: a table of the block rows the copies
        name (one row per request and Mamba group) and one item per (copy, layer)."""
        if not copies:
            return
        with self.clock.phase("copies"):
            self._apply_copies(copies, step)

    def _apply_copies(self, copies: list[tuple[object, Copy]], step: int) -> None:
        self.last_copies += len(copies) * self.L
        index: dict[tuple[str, int], int] = {}
        table: list[dict[int, int]] = []
        items = []
        for r, cp in copies:
            for layer in range(self.L):
                g = self.layer_group[layer]
                ti = index.get((r.rid, g))
                if ti is None:
                    ti = index[(r.rid, g)] = len(table)
                    table.append({})
                row = table[ti]
                for col in (cp.src, cp.dst, cp.t_src):
                    if col not in row:  # each (request, group, column) resolved once
                        row[col] = self._blk(r, g, col, step)
                items.append((ti, self.layer_slot[layer], cp.src, cp.dst, cp.t_src, cp.offset))
        width = 1 + max(c for row in table for c in row)
        dense = torch.zeros(len(table), width, dtype=torch.int64)
        for i, row in enumerate(table):
            for c, b in row.items():
                dense[i, c] = b
        # (host tensors: a provider uploads them without waiting; checking providers read them as they are,
        # where a device copy would have to be read back, making the host wait for the step's work)
        try:
            self.k.state_copy(self.cache.conv.data, self.cache.temporal.data, dense,
                              torch.tensor(items, dtype=torch.int64))
        except ValueError as e:  # copies that depend on each other: the bookkeeping collided
            raise BadAccess(f"step {step}: {e}") from None

    # ------------------------------------------------------------------ forward
    def forward(self, plan: StepPlan, reqs, inputs: list[np.ndarray]) -> Forward:
        self._check_partial_hits(plan, reqs)
        plans: list[RowPlan] = []
        for s, r in zip(plan.scheduled, reqs):
            p = self.tracker.plan_row(s.req_id, s.num_computed_tokens, s.num_scheduled_tokens,
                                      len(s.spec_token_ids))
            end = prefill_end(r.prompt_len, len(r.tokens))
            if self.unit and not s.spec_token_ids:
                self._unit_checkpoint(p, r, plan.step)
            elif self.mode == "align" and s.num_computed_tokens < end and not s.spec_token_ids:
                self.tracker.checkpoint(p, end)
            plans.append(p)
        self.apply_copies([(r, cp) for r, p in zip(reqs, plans) for cp in p.pre], plan.step)
        with self.clock.phase("mamba"):  # (the copies have their own phase)
            return self._scan(plan, reqs, inputs, plans)

    def _scan(self, plan: StepPlan, reqs, inputs: list[np.ndarray], plans: list[RowPlan]) -> Forward:
        """The step's rows through the provider's scan, from their states in the cache."""
        from ..kernels.probe_scan import ScanBuilder

        L = self.L
        b = ScanBuilder(L)
        none = [-1] * L
        win_pages, win_off = [], []
        y_start, total = [], 0
        for i, (r, p) in enumerate(zip(reqs, plans)):
            init_t = self._pages(r, p.read_t_col, plan.step) if p.has_state else none
            win_pages.append(self._pages(r, p.read_col, plan.step) if p.has_state else none)
            win_off.append(p.read_offset)
            hist = self._pages(r, p.conv_col, plan.step) if p.token_cols is not None else None
            row = b.add_row(inputs[i], init_t, hist)
            if p.token_cols is not None:
                for t, col in enumerate(p.token_cols):
                    b.write(row, t, self._pages(r, col, plan.step), none)
            else:
                fp = self._pages(r, p.final_col, plan.step)
                b.write(row, p.n - 1, fp, fp)
            for t_b, col in p.boundary:
                bp = self._pages(r, col, plan.step)
                if "unit_checkpoint_at_block" in self.bugs and self.unit:  # (injected: the block boundary's state)
                    t_b = max((p.c + t_b + 1) // self.bs * self.bs - p.c - 1, 0)
                b.write(row, t_b, bp, bp)
            y_start.append(total)
            total += p.n
        y = torch.full((total, L, self.HP), -1, dtype=torch.int32, device=self.device)  # poisoned
        window = self.stage_windows(win_pages, win_off)
        launch, _ = b.build(window, self.cache.conv.data, self.cache.temporal.data, self.slot_of_layer,
                            self.device, y_out=y, y_start=upload(y_start, self.device))
        self.k.mamba_scan(self.tables, launch)
        return Forward(plans, y, y_start)

    def _check_partial_hits(self, plan: StepPlan, reqs) -> None:
        """A hit that ends inside a block hands out the private copy of that block, and the
        step's own state may land in the same block: its state is compared with the oracle's
        (the hit's tokens from the zero state) now, before the step writes anything."""
        rows = []
        for s, r in zip(plan.scheduled, reqs):
            h = s.prefix_hit_tokens
            if s.is_new and h % self.bs:
                row = OracleRow(s.req_id, r.tokens, h, 0, 0)
                col = (h - 1) // self.bs
                self._compare(row, r, plan.step, "hit", h, col, 0, col)
                rows.append(row)
        if not rows:
            return
        with self.clock.phase("oracle"):
            cache = (self.cache.conv.data, self.cache.temporal.data, self.slot_of_layer)
            stats, tags = self.oracle.check(rows, cache, torch.zeros(1, self.L, self.HP, dtype=torch.int32,
                                                                     device=self.device))
            step = plan.step
            self.verdicts.add(stats, lambda st: self._tally(step, rows, st, tags))

    def _unit_checkpoint(self, p: RowPlan, r, step: int) -> None:
        """Partial-block prefix hits: a chunk that can export the state at the prompt's unit
        checkpoint writes it into its checkpoint column, ``cdiv(end, bs) - 2``, as the engine's
        worker decides it from the row's lengths alone (``compute_mamba_prefill_checkpoints``);
        a column holding the null block takes nothing (the worker's write there is discarded)."""
        from ..sched.partial import checkpoint_position, checkpoint_valid

        start, end = p.c, p.c + p.n
        pos = checkpoint_position(end, self.unit, self.tracker.lookahead)
        if not checkpoint_valid(start, end, pos, self.unit, self.bs):
            return
        col = -(-end // self.bs) - 2
        row = r.rows[self.groups[0].group_id]
        if col < len(row) and row[col] != 0:
            p.boundary.append((pos - start - 1, col))

    def stage_windows(self, pages: list[list[int]], offsets: list[int]) -> torch.Tensor:
        """Every row's starting conv window (B, L, K-1, dim), read from the cache before the scan
        writes anything (a row's pages may be written by the same launch). -1: zeros."""
        pg = upload(pages, self.device)
        off = upload(offsets, self.device)
        rows = off[:, None, None] + torch.arange(self.K - 1, device=self.device)[None, None, :]
        sl = self.slot_of_layer[None, :].expand_as(pg)
        w = self.cache.conv.data[sl[..., None], pg.clamp(min=0)[..., None], rows]
        return torch.where((pg >= 0)[..., None, None], w, torch.zeros((), device=self.device)).contiguous()

    # ------------------------------------------------------------------ after the outcome
    def post_copies(self, plan: StepPlan, outcome: StepOutcome, reqs, fwd: Forward) -> list[tuple[object, Copy]]:
        """The state copies the step's outcome calls for (the cache mode's bookkeeping), per request."""
        post: list[tuple[object, Copy]] = []
        for s, r, p in zip(plan.scheduled, reqs, fwd.plans):
            toks = outcome.sampled.get(s.req_id, ())
            acc = outcome.accepted.get(s.req_id, len(toks) - 1 if toks else 0)
            if "rejected_state_kept" in self.bugs and toks and p.drafts:
                acc = p.drafts  # treat every draft as accepted for the state's position
            for cp in self.tracker.post(p, acc, bool(toks)):
                post.append((r, cp))
        return post

    def after(self, plan: StepPlan, outcome: StepOutcome, reqs, committed: list[int], fwd: Forward) -> None:
        post = self.post_copies(plan, outcome, reqs, fwd)
        self.apply_copies(post, plan.step)
        with self.clock.phase("oracle"):
            self._check_step(plan, outcome, reqs, committed, fwd, post)

    def _check_step(self, plan: StepPlan, outcome: StepOutcome, reqs, committed: list[int], fwd: Forward,
                    post: list) -> None:
        """The oracle over every row's committed tokens: outputs, the states the step left, its copies."""
        finished = set(outcome.finished)
        blk_tally = self.checks.get("ssm.cached_blocks")
        rows: list[OracleRow] = []
        for i, (s, r, p) in enumerate(zip(plan.scheduled, reqs, fwd.plans)):
            c, k = s.num_computed_tokens, committed[i]
            row = OracleRow(s.req_id, r.tokens, c, k, fwd.y_start[i])
            if s.is_new and s.prefix_hit_tokens > 0 and not s.prefix_hit_tokens % self.bs:
                col = s.prefix_hit_tokens // self.bs - 1  # (a hit inside a block: _check_partial_hits)
                self._compare(row, r, plan.step, "hit", s.prefix_hit_tokens, col, 0, col)
            if s.req_id not in finished:
                col, off, tcol = self.tracker.resume_location(s.req_id, c + k)
                self._compare(row, r, plan.step, "run", c + k, col, off, tcol)
            if self.check == "full":
                for t_b, bcol in p.boundary:
                    if t_b < k:
                        self._compare(row, r, plan.step, "bnd", c + t_b + 1, bcol, 0, bcol)
                for rr, cp in post:
                    if rr is not r:
                        continue
                    pos = (cp.dst + 1) * self.bs
                    if pos > c + k:
                        for layer in range(self.L):
                            blk_tally.failed(Failure(plan.step, s.req_id, f"boundary state for {pos} tokens "
                                                     f"written but only {c + k} are committed",
                                                     layer=f"mamba{layer}", position=pos))
                    else:
                        self._compare(row, r, plan.step, "copy", pos, cp.dst, 0, cp.dst)
            rows.append(row)
        cache = (self.cache.conv.data, self.cache.temporal.data, self.slot_of_layer)
        stats, tags = self.oracle.check(rows, cache, fwd.y)
        step = plan.step
        self.verdicts.add(stats, lambda st: self._tally(step, rows, st, tags))
        if self.output_digest is not None:
            idx = [fwd.y_start[i] + t for i, row in enumerate(rows) for t in range(row.k)]
            if idx:
                fp = fingerprint_rows(fwd.y[upload(idx, self.device)])
                self.verdicts.add(fp, lambda h: self.output_digest.update(h.numpy().tobytes()))

    def _compare(self, row: OracleRow, r, step: int, kind: str, pos: int, col: int, off: int, tcol: int) -> None:
        try:
            cpages = self._pages(r, col, step)
            tpages = self._pages(r, tcol, step)
        except BadAccess as e:
            name, what = WHAT[kind]
            tally = self.checks.get(name)
            for layer in range(self.L):
                tally.failed(Failure(step, row.rid, f"{what}: {e}", layer=f"mamba{layer}", position=pos))
            return
        row.compares.append(StateCompare(pos, tpages, cpages, off, (kind, row.rid, pos, col, off, tcol)))

    def _tally(self, step: int, rows: list[OracleRow], stats_t: torch.Tensor, tags: list) -> None:
        stats = stats_t.tolist()
        for ci, (kind, rid, pos, col, off, tcol) in enumerate(tags):
            name, what = WHAT[kind]
            tally = self.checks.get(name)
            for layer in range(self.L):
                n, worst, first = stats[ci][layer]
                if n == 0:
                    tally.passed()
                    continue
                tally.max_abs_err = max(tally.max_abs_err, float(worst))
                tally.failed(Failure(step, rid, f"{what}: state at {pos} tokens differs in {n:,} elements (column "
                                                f"{col}, conv offset {off}, temporal column {tcol}; first at element "
                                                f"{first})", layer=f"mamba{layer}", position=pos,
                                     max_abs_err=float(worst)))
        out = self.checks.get("ssm.output")
        n_cmp = len(tags)
        for i, row in enumerate(rows):
            for layer in range(self.L):
                n, worst, first = stats[n_cmp + i][layer]
                if n == 0:
                    out.passed(row.k)
                    continue
                out.max_abs_err = max(out.max_abs_err, float(worst))
                out.failed(Failure(step, row.rid, f"output differs from token {row.c + first} ({n:,} elements)",
                                   layer=f"mamba{layer}", position=row.c + first, max_abs_err=float(worst)))

    def state_digests(self, order: list[int]) -> dict[str, str]:
        """Per slot: sha256 over the exact fingerprints of its pages in physical block order."""
        idx = torch.tensor(order, dtype=torch.int64, device=self.device)
        return {f"mamba.slot{s}.state": pages_digest([self.cache.conv.data[s], self.cache.temporal.data[s]], idx)
                for s in range(self.slots)}

    @staticmethod
    def needs_executing(scenario: Scenario) -> None:
        why = scenario.cannot_execute()
        if why:
            raise InputError(why, "spec_decode.num_speculative_tokens")
