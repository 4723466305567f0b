"""The executor: runs every StepPlan on real tensors and checks it against the oracle.

It knows tensors, never policy: block rows come from the plan, states are read,
copied and written where the cache-mode bookkeeping says, the probe layers run the
scheduled tokens, and after the step's outcome every committed token, every
resumable state, every boundary state and every prefix hit handed out is compared
with values recomputed from the committed tokens alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from time import perf_counter
from typing import Optional

import torch

from ..checks import Checks, Failure
from ..config import Scenario
from ..errors import InputError
from ..layers.mamba import MambaProbe
from ..layers.mla import MLAProbe
from ..oracle import MambaOracle, mla_expected
from ..sched.plan import PLACEHOLDER_DRAFT, StepOutcome, StepPlan, prefill_end
from .cache import BlockMap, MambaStateCache, PagedTensor
from .mamba_state import TRACKERS, Bugs, Copy, RowPlan
from .metadata import build_batch, chunk_metadata, chunk_metadata_varlen

TOLERANCE = {"float32": 1e-5, "float64": 1e-9, "bfloat16": 2e-2, "float16": 5e-3}


@dataclass
class GroupInfo:
    group_id: int
    kind: str
    block_size: int
    layers: tuple[int, ...]


class ExecRequest:
    __slots__ = ("rid", "tokens", "prompt_len", "rows")

    def __init__(self, rid: str, prompt: list[int]):
        self.rid = rid
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.rows: list[list[int]] = []


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a = a.double()
    b = b.double()
    if not torch.isfinite(a).all():
        return float("inf"), float("inf")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    ref = b.abs().max().item() if b.numel() else 0.0
    return diff, diff / max(ref, 1e-30)


class Executor:
    def __init__(self, scenario: Scenario, groups: list[GroupInfo], kernels, checks: Checks,
                 check: str = "full", bugs: Optional[set[str]] = None, device: str = "cpu",
                 mla_workspace_tokens: int = 256):
        self.s = scenario
        self.geo = scenario.geometry()
        self.groups = groups
        self.k = kernels
        self.checks = checks
        self.check = check
        self.bugs = Bugs(bugs or set())
        self.device = torch.device(device)
        self.S = scenario.spec_decode.num_speculative_tokens
        self.reqs: dict[str, ExecRequest] = {}
        self.blocks = BlockMap()
        self.timings: dict[str, float] = {"mamba": 0.0, "mla": 0.0, "oracle": 0.0, "copies": 0.0}
        self.kernel_timer = None  # a TimedKernels on a GPU: per-kernel CUDA-event timings
        self.last_copies = 0  # state copies (request x layer) made by the last step
        self.output_digest = hashlib.sha256()  # every checked output, in step order (golden traces)
        seed = scenario.seed
        self.mode = scenario.cache.resolved_mode()
        # Mamba
        self.mgroups = [g for g in groups if g.kind == "mamba"]
        self.mprobes: list[MambaProbe] = []
        self.mcache: Optional[MambaStateCache] = None
        self.mlayer_group: list[int] = []
        if self.geo.mamba is not None:
            why = scenario.cannot_execute()
            if why:
                raise InputError(why, "spec_decode.num_speculative_tokens")
            mg = self.geo.mamba
            rows = mg.conv_rows(self.S)
            oracle_probes = []
            for layer in range(mg.layers):
                cpu_probe = MambaProbe(mg, layer, seed)
                oracle_probes.append(cpu_probe)  # the oracle computes on the CPU, apart from the system under test
                probe = cpu_probe.to(self.device)
                self.mprobes.append(probe)
                self.mlayer_group.append(next(g.group_id for g in self.mgroups if layer in g.layers))
            p0 = self.mprobes[0]
            self.mcache = MambaStateCache(mg.layers, rows, p0.dim, (p0.H, p0.P, p0.N), self.device, self.blocks)
            bs_m = self.mgroups[0].block_size
            self.tracker = TRACKERS[self.mode](bs_m, self.S, self.bugs)
            self.moracle = MambaOracle(oracle_probes, bs_m)
            self.bs_m = bs_m
            self.conv_rows = rows
            natural = mg.state_bytes(self.S)
            self.page_bytes = scenario.cache.page_size_bytes or natural
            self.int32_pages = "int32_block_offset" in self.bugs
        # MLA
        self.lprobes: list[MLAProbe] = []
        self.lcache: list[PagedTensor] = []
        self.llayer_group: list[int] = []
        if self.geo.mla is not None:
            lg = self.geo.mla
            mla_groups = [g for g in groups if g.kind == "mla"]
            self.lprobes_cpu: list[MLAProbe] = []
            for layer in range(lg.layers):
                cpu_probe = MLAProbe(lg, layer, seed)
                self.lprobes_cpu.append(cpu_probe)
                probe = cpu_probe.to(self.device)
                self.lprobes.append(probe)
                g = next(g for g in mla_groups if layer in g.layers)
                self.llayer_group.append(g.group_id)
                self.lcache.append(PagedTensor((g.block_size, lg.entry_dim()), probe.dtype, self.device, self.blocks))
            self.bs_a = mla_groups[0].block_size
            ws = max(mla_workspace_tokens // self.bs_a, 1) * self.bs_a
            self.workspace = ws
            self.tol = TOLERANCE[lg.dtype]

    # ------------------------------------------------------------------ step
    def step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        self.last_copies = 0
        resumed = [s.req_id for s in plan.scheduled if s.is_new and s.resumed]
        for rid in plan.finished:
            self.reqs.pop(rid, None)
            if self.mprobes:
                self.moracle.forget(rid)
        if self.mprobes:
            self.tracker.cleanup(plan.finished, plan.preempted, resumed)
        for s in plan.scheduled:
            r = self.reqs.get(s.req_id)
            if s.is_new:
                if r is None:
                    if s.prompt_token_ids is None:
                        raise InputError(f"step {plan.step}: {s.req_id} admitted without a known prompt")
                    r = self.reqs[s.req_id] = ExecRequest(s.req_id, list(s.prompt_token_ids))
                r.rows = [list(g) for g in s.new_block_ids]
                if self.mprobes:
                    self.tracker.admit(s.req_id)
            elif s.new_block_ids is not None:
                for row, tail in zip(r.rows, s.new_block_ids):
                    row.extend(tail)
            if s.new_block_ids is not None:  # give every block a cache row before any tensor is held
                for tail in s.new_block_ids:
                    for b in tail:
                        self.blocks.row(b)
        if self.mcache is not None:
            self.mcache.conv.ensure()
            self.mcache.temporal.ensure()
        for c in self.lcache:
            c.ensure()
        if not plan.scheduled:
            return
        inputs = []
        for s in plan.scheduled:
            r = self.reqs[s.req_id]
            c, n, d = s.num_computed_tokens, s.num_scheduled_tokens, len(s.spec_token_ids)
            # a placeholder draft (padding) is computed from token 0 and then rejected, as any draft
            toks = r.tokens[c:c + n - d] + [t if t != PLACEHOLDER_DRAFT else 0 for t in s.spec_token_ids]
            if len(toks) != n:
                raise InputError(f"step {plan.step}: {s.req_id} schedules {n} tokens from position {c} "
                                 f"but only {len(r.tokens) - c} are known")
            inputs.append(toks)
        meta = build_batch([(s.num_computed_tokens, s.num_scheduled_tokens, len(s.spec_token_ids))
                            for s in plan.scheduled], self.S)
        if self.mprobes:
            self._check_chunk_meta(plan, meta)
            t0 = perf_counter()
            try:
                mamba_out, row_plans = self._mamba_forward(plan, inputs)
            except _BadAccess as e:  # the bookkeeping pointed at a column holding no block
                self.checks.get("ssm.running_state").failed(Failure(plan.step, None, str(e)))
                mamba_out = None
            self.timings["mamba"] += perf_counter() - t0
        if self.lprobes:
            t0 = perf_counter()
            mla_out = self._mla_forward(plan, inputs, meta)
            self.timings["mla"] += perf_counter() - t0
        # -- outcome: commit tokens, then check everything committed
        committed = []
        for s in plan.scheduled:
            r = self.reqs[s.req_id]
            toks = outcome.sampled.get(s.req_id, ())
            d = len(s.spec_token_ids)
            r.tokens.extend(toks)
            if toks:
                acc = outcome.accepted.get(s.req_id, len(toks) - 1)
                # positions whose input is a committed token (a length cap may drop accepted drafts)
                committed.append(min(s.num_scheduled_tokens - (d - acc), len(r.tokens) - s.num_computed_tokens))
            else:
                committed.append(s.num_scheduled_tokens)
        t0 = perf_counter()
        if self.mprobes and mamba_out is not None:
            try:
                self._mamba_after(plan, outcome, mamba_out, row_plans, committed)
            except _BadAccess as e:
                self.checks.get("ssm.running_state").failed(Failure(plan.step, None, str(e)))
        if self.lprobes:
            self._mla_check(plan, mla_out, committed)
        self.timings["oracle"] += perf_counter() - t0

    # ------------------------------------------------------------------ Mamba
    def _blk(self, r: ExecRequest, group: int, col: int, step: int) -> int:
        row = r.rows[group]
        if col < 0 or col >= len(row) or row[col] == 0:
            raise _BadAccess(f"step {step}: {r.rid} needs column {col} of group {group}, which holds no block")
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

    def _check_chunk_meta(self, plan: StepPlan, meta) -> None:
        pre = meta.order[meta.num_decodes:]
        if not pre:
            return
        computed = [plan.scheduled[i].num_computed_tokens for i in pre]
        qsl = [0]
        for i in pre:
            qsl.append(qsl[-1] + plan.scheduled[i].num_scheduled_tokens)
        cs = self.geo.mamba.chunk_size
        a = chunk_metadata(computed, qsl, cs, "chunk_crosses_boundary" in self.bugs)
        b = chunk_metadata_varlen(computed, qsl, cs)
        tally = self.checks.get("mamba.chunk_meta")
        if a == b:
            tally.passed()
        else:
            tally.failed(Failure(plan.step, None, f"chunk metadata differs: per-request cu={a[0][:8]} "
                                                  f"varlen cu={b[0][:8]}"))

    def _apply_copies(self, copies: list[tuple[ExecRequest, Copy]], step: int) -> None:
        """Every layer's copies in one provider call: a table of the block rows the copies
        name (one row per request and Mamba group) and one item per (copy, layer)."""
        if not copies:
            return
        layers = len(self.mprobes)
        self.last_copies += len(copies) * layers
        index: dict[tuple[str, int], int] = {}
        table: list[dict[int, int]] = []
        items = []
        for r, cp in copies:
            for layer in range(layers):
                g = self.mlayer_group[layer]
                ti = index.get((r.rid, g))
                if ti is None:
                    ti = index[(r.rid, g)] = len(table)
                    table.append({})
                row = table[ti]
                for col in (cp.src, cp.dst, cp.t_src):
                    if col not in row:  # each (request, group, column) resolved once
                        row[col] = self._blk(r, g, col, step)
                items.append((ti, layer, cp.src, cp.dst, cp.t_src, cp.offset))
        width = 1 + max(c for row in table for c in row)
        dense = torch.zeros(len(table), width, dtype=torch.int64)
        for i, row in enumerate(table):
            for c, b in row.items():
                dense[i, c] = b
        table_d, items_d = self._to_device(dense), self._to_device(torch.tensor(items, dtype=torch.int64))
        try:
            self.k.state_copy(self.mcache.conv.data, self.mcache.temporal.data, table_d, items_d)
        except ValueError as e:  # copies that depend on each other: the bookkeeping collided
            raise _BadAccess(f"step {step}: {e}") from None

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host-built index tensors go up asynchronously (pinned staging): no stream sync."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _mamba_forward(self, plan: StepPlan, inputs: list[list[int]]):
        plans: list[RowPlan] = []
        for s in plan.scheduled:
            r = self.reqs[s.req_id]
            p = self.tracker.plan_row(s.req_id, s.num_computed_tokens, s.num_scheduled_tokens,
                                      len(s.spec_token_ids))
            end = prefill_end(r.prompt_len, len(r.tokens))
            if self.mode == "align" and s.num_computed_tokens < end and not s.spec_token_ids:
                self.tracker.checkpoint(p, end)
            plans.append(p)
        reqs = [self.reqs[s.req_id] for s in plan.scheduled]
        # prefix hits handed out: the hit block must hold the state at the hit length
        for s, r in zip(plan.scheduled, reqs):
            if s.is_new and s.prefix_hit_tokens > 0:
                self._check_hit(plan.step, r, s.prefix_hit_tokens)
        B = len(plans)
        ns = [p.n for p in plans]
        max_n = max(ns)
        dev = self.device
        tok_cpu = torch.zeros(B, max_n, dtype=torch.int64)
        for i, t in enumerate(inputs):
            tok_cpu[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        tok = tok_cpu.to(dev)
        act_lists = [[i for i in range(B) if ns[i] > t] for t in range(max_n)]
        active = [torch.tensor(a, dtype=torch.int64, device=dev) for a in act_lists]
        outs = []
        K = self.geo.mamba.conv_kernel
        t0 = perf_counter()
        self._apply_copies([(r, cp) for r, p in zip(reqs, plans) for cp in p.pre], plan.step)
        self.timings["copies"] += perf_counter() - t0
        for layer, probe in enumerate(self.mprobes):
            g = self.mlayer_group[layer]
            conv = self.mcache.conv.data[layer]
            temporal = self.mcache.temporal.data[layer]
            window, h = probe.zero_state(B)
            for i, (r, p) in enumerate(zip(reqs, plans)):
                if p.has_state:
                    window[i] = conv[self._blk(r, g, p.read_col, plan.step), p.read_offset:p.read_offset + K - 1]
                    h[i] = temporal[self._blk(r, g, p.read_t_col, plan.step)]
            init_window = window.clone()
            y_all = torch.zeros(B, max_n, probe.H * probe.P, device=dev)
            boundary = {}
            for i, p in enumerate(plans):
                for t_b, col in p.boundary:
                    boundary.setdefault(t_b, []).append((i, col))
            for t in range(max_n):
                idx = active[t]
                y, w2, h2 = probe.token_step(window[idx], h[idx], tok[idx, t])
                window[idx] = w2
                h[idx] = h2
                y_all[idx, t] = y
                for i in act_lists[t]:
                    p = plans[i]
                    if p.token_cols is not None:
                        temporal[self._blk(reqs[i], g, p.token_cols[t], plan.step)] = h[i]
                for i, col in boundary.get(t, ()):
                    blk = self._blk(reqs[i], g, col, plan.step)
                    conv[blk, 0:K - 1] = window[i]
                    temporal[blk] = h[i]
            for i, (r, p) in enumerate(zip(reqs, plans)):
                if p.token_cols is not None:
                    u = probe.embed(tok[i, : p.n])
                    shifted = torch.cat([init_window[i], u], dim=0)[1:]
                    conv[self._blk(r, g, p.conv_col, plan.step), 0:shifted.shape[0]] = shifted
                else:
                    blk = self._blk(r, g, p.final_col, plan.step)
                    conv[blk, 0:K - 1] = window[i]
                    temporal[blk] = h[i]
            outs.append(y_all.cpu())
        return outs, plans

    def _check_hit(self, step: int, r: ExecRequest, hit: int) -> None:
        tally = self.checks.get("ssm.cached_blocks")
        self.moracle.advance(r.rid, r.tokens, hit)
        col = hit // self.bs_m - 1
        for layer in range(len(self.mprobes)):
            self._compare_state(tally, step, r, layer, col, 0, col, hit, "prefix hit")

    def _compare_state(self, tally, step, r, layer, col, off, tcol, pos, what) -> None:
        g = self.mlayer_group[layer]
        K = self.geo.mamba.conv_kernel
        try:
            blk = self._blk(r, g, col, step)
            tblk = self._blk(r, g, tcol, step)
        except _BadAccess as e:
            tally.failed(Failure(step, r.rid, str(e), layer=f"mamba{layer}", position=pos))
            return
        window = self.mcache.conv.data[layer, blk, off:off + K - 1].cpu()
        h = self.mcache.temporal.data[layer, tblk].cpu()
        ew, eh = self.moracle.state(r.rid, layer, pos)
        if torch.equal(window, ew) and torch.equal(h, eh):
            tally.passed()
            return
        wa, wr = _rel_err(window, ew)
        ha, hr = _rel_err(h, eh)
        tally.max_abs_err = max(tally.max_abs_err, wa, ha)
        tally.max_rel_err = max(tally.max_rel_err, wr, hr)
        tally.failed(Failure(step, r.rid, f"{what}: state at {pos} tokens differs (column {col}, conv offset "
                                          f"{off}, temporal column {tcol})", layer=f"mamba{layer}",
                             position=pos, max_abs_err=max(wa, ha), max_rel_err=max(wr, hr)))

    def _mamba_after(self, plan: StepPlan, outcome: StepOutcome, outs, plans: list[RowPlan], committed) -> None:
        reqs = [self.reqs[s.req_id] for s in plan.scheduled]
        finished = set(outcome.finished)
        post: list[tuple[ExecRequest, Copy]] = []
        for s, r, p in zip(plan.scheduled, reqs, plans):
            toks = outcome.sampled.get(s.req_id, ())
            acc = outcome.accepted.get(s.req_id, len(toks) - 1 if toks else 0)
            if "rejected_state_kept" in self.bugs and toks and p.drafts:
                acc = p.drafts  # treat every draft as accepted for the state's position
            for cp in self.tracker.post(p, acc, bool(toks)):
                post.append((r, cp))
        self._apply_copies(post, plan.step)
        out_tally = self.checks.get("ssm.output")
        run_tally = self.checks.get("ssm.running_state")
        blk_tally = self.checks.get("ssm.cached_blocks")
        self.moracle.advance_many([(r.rid, r.tokens, s.num_computed_tokens + committed[i])
                                   for i, (s, r) in enumerate(zip(plan.scheduled, reqs))])
        for i, (s, r, p) in enumerate(zip(plan.scheduled, reqs, plans)):
            c, k = s.num_computed_tokens, committed[i]
            for layer in range(len(self.mprobes)):
                got = outs[layer][i, :k]
                self.output_digest.update(got.numpy().tobytes())
                exp = torch.stack([self.moracle.output(r.rid, layer, c + t) for t in range(k)])
                if torch.equal(got, exp):
                    out_tally.passed(k)
                else:
                    bad = int((got != exp).any(dim=-1).nonzero()[0])
                    a, rel = _rel_err(got, exp)
                    out_tally.max_abs_err = max(out_tally.max_abs_err, a)
                    out_tally.max_rel_err = max(out_tally.max_rel_err, rel)
                    out_tally.failed(Failure(plan.step, s.req_id, f"output differs from token {c + bad}",
                                             layer=f"mamba{layer}", position=c + bad, max_abs_err=a, max_rel_err=rel))
                if s.req_id in finished:
                    continue
                col, off, tcol = self.tracker.resume_location(s.req_id, c + k)
                self._compare_state(run_tally, plan.step, r, layer, col, off, tcol, c + k, "running state")
                if self.check == "full":
                    for t_b, bcol in p.boundary:
                        if t_b < k:
                            self._compare_state(blk_tally, plan.step, r, layer, bcol, 0, bcol, c + t_b + 1,
                                                "boundary state")
                    for rr, cp in post:
                        if rr is not r:
                            continue
                        pos = (cp.dst + 1) * self.bs_m
                        if pos > c + k:
                            blk_tally.failed(Failure(plan.step, s.req_id, f"boundary state for {pos} tokens written "
                                                     f"but only {c + k} are committed", layer=f"mamba{layer}",
                                                     position=pos))
                        else:
                            self._compare_state(blk_tally, plan.step, r, layer, cp.dst, 0, cp.dst, pos,
                                                "boundary copy")

    # ------------------------------------------------------------------ MLA
    def _slots(self, r: ExecRequest, group: int, positions: range, bs: int) -> torch.Tensor:
        row = r.rows[group]
        return torch.tensor([self.blocks.row(row[pos // bs]) * bs + pos % bs for pos in positions], dtype=torch.int64,
                            device=self.device)

    def _mla_forward(self, plan: StepPlan, inputs, meta):
        outs = []
        decode_rows = set(meta.order[: meta.num_decodes])
        bs = self.bs_a
        for layer, probe in enumerate(self.lprobes):
            g = self.llayer_group[layer]
            cache_t = self.lcache[layer]
            for s, toks in zip(plan.scheduled, inputs):
                r = self.reqs[s.req_id]
                c, n = s.num_computed_tokens, s.num_scheduled_tokens
                pos = torch.arange(c, c + n, device=self.device)
                cache = cache_t.data
                lat = probe.latent(torch.tensor(toks, device=self.device), pos)
                self.k.concat_and_cache(lat, self._slots(r, g, range(c, c + n), bs), cache)
            cache = cache_t.data
            layer_out = []
            paths = self.checks.get("mla.paths")
            queries = []
            for s, toks in zip(plan.scheduled, inputs):
                c, n = s.num_computed_tokens, s.num_scheduled_tokens
                pos = torch.arange(c, c + n, device=self.device)
                queries.append(probe.queries(torch.tensor(toks, device=self.device), pos))
            table = self._block_table(plan, g, bs)
            decoded = self._decode_paths(probe, plan, queries, cache, table)
            for i, s in enumerate(plan.scheduled):
                c, n = s.num_computed_tokens, s.num_scheduled_tokens
                q_nope, q_pe = queries[i]
                dec = decoded[i]
                pre = self._prefill_path(probe, q_nope, q_pe, cache, table[i, : -(-(c + n) // bs)], c, n)
                out = dec if i in decode_rows else pre
                a, rel = _rel_err(dec.cpu(), pre.cpu())
                paths.max_abs_err = max(paths.max_abs_err, a)
                paths.max_rel_err = max(paths.max_rel_err, rel)
                if rel <= self.tol:
                    paths.passed()
                else:
                    paths.failed(Failure(plan.step, s.req_id, f"prefill and decode paths differ (rel {rel:.2e})",
                                         layer=f"mla{layer}", max_abs_err=a, max_rel_err=rel))
                layer_out.append(out.cpu())
            outs.append(layer_out)
        return outs

    def _block_table(self, plan: StepPlan, group: int, bs: int) -> torch.Tensor:
        """The step's block table of one group as cache rows, a row per scheduled request
        (padded with the null row), uploaded once."""
        rows = []
        for s in plan.scheduled:
            ncols = -(-(s.num_computed_tokens + s.num_scheduled_tokens) // bs)
            rows.append([self.blocks.row(b) for b in self.reqs[s.req_id].rows[group][:ncols]])
        width = max(1, max(len(row) for row in rows))
        return self._to_device(torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64))

    def _decode_paths(self, probe: MLAProbe, plan: StepPlan, queries, cache, table) -> list[torch.Tensor]:
        """The absorbed decode path for every scheduled request, one kernel call per query
        count (decode rows of a step share it; prefill chunks are checked through it too)."""
        by_n: dict[int, list[int]] = {}
        for i, s in enumerate(plan.scheduled):
            by_n.setdefault(s.num_scheduled_tokens, []).append(i)
        out: list[Optional[torch.Tensor]] = [None] * len(plan.scheduled)
        for idx in by_n.values():
            q_lat = torch.stack([probe.absorb(queries[i][0]).to(torch.float32) for i in idx])
            q_pe = torch.stack([queries[i][1].float() for i in idx])
            lens = [plan.scheduled[i].num_computed_tokens + plan.scheduled[i].num_scheduled_tokens for i in idx]
            sel = self._to_device(torch.tensor(idx, dtype=torch.int64))
            o_lat, _ = self.k.mla_decode(q_lat, q_pe, cache, table.index_select(0, sel),
                                         self._to_device(torch.tensor(lens, dtype=torch.int64)),
                                         probe.geo.kv_lora_rank, probe.scale, num_splits=0, max_seq_len=max(lens))
            for j, i in enumerate(idx):
                out[i] = probe.unabsorb(o_lat[j])
        return out

    def _prefill_path(self, probe: MLAProbe, q_nope, q_pe, cache, block_row, c, n):
        q = torch.cat([q_nope, q_pe], dim=-1).float()
        new_lat = self._gather(cache, block_row, c, n)
        k_new, v_new = probe.up_project(new_lat)
        ar = torch.arange(n, device=q.device)
        mask = ar[None, :] <= ar[:, None]
        out, lse = self.k.attention_partial(q, k_new, v_new, probe.scale, mask)
        base2 = "lse_base2" in self.bugs
        unguarded = "lse_unmasked" in self.bugs
        if c == 0 and unguarded:
            # the buggy variant merges an empty context partial without sanitising it
            empty_o = torch.full_like(out, float("nan"))
            empty_l = torch.full_like(lse, float("-inf"))
            out, lse = self.k.merge_states(empty_o, empty_l, out, lse, base2_bug=base2, unguarded=True)
        step = self.workspace - 1 if "ctx_chunk_unaligned" in self.bugs else self.workspace
        start = 0
        while start < c:
            length = min(step, c - start)
            lat = self._gather(cache, block_row, start, length,
                               unaligned_bug="ctx_chunk_unaligned" in self.bugs)
            k_ctx, v_ctx = probe.up_project(lat)
            o_c, l_c = self.k.attention_partial(q, k_ctx, v_ctx, probe.scale, None)
            out, lse = self.k.merge_states(o_c, l_c, out, lse, base2_bug=base2, unguarded=unguarded)
            start += length
        return out

    def _gather(self, cache, block_row, start, length, unaligned_bug=False):
        bs = self.bs_a
        if unaligned_bug and start % bs:
            start = start - start % bs  # the buggy kernel assumes a page-aligned chunk start
        if start % bs == 0:
            return self.k.gather_cache(cache, block_row, start, length)
        return self.k.gather_cache(cache, block_row, start - start % bs, length + start % bs)[start % bs:]

    def _mla_check(self, plan: StepPlan, outs, committed) -> None:
        tally = self.checks.get("mla.output")
        for layer, probe in enumerate(self.lprobes):
            for i, s in enumerate(plan.scheduled):
                k = committed[i]
                if k <= 0:
                    continue
                r = self.reqs[s.req_id]
                c = s.num_computed_tokens
                positions = list(range(c, c + k))
                exp = mla_expected(self.lprobes_cpu[layer], r.tokens, positions)
                got = outs[layer][i][:k]
                # attention outputs are compared within a tolerance: digest them rounded
                self.output_digest.update(torch.round(got.double() * 1e3).numpy().tobytes())
                a, rel = _rel_err(got, exp)
                tally.max_abs_err = max(tally.max_abs_err, a)
                tally.max_rel_err = max(tally.max_rel_err, rel)
                if rel <= self.tol:
                    tally.passed(k)
                else:
                    tally.failed(Failure(plan.step, s.req_id, f"attention output off by rel {rel:.2e} "
                                                              f"(tolerance {self.tol:g})", layer=f"mla{layer}",
                                         position=c, max_abs_err=a, max_rel_err=rel))


    def state_digests(self) -> dict[str, str]:
        """sha256 of every cache page, in physical block order, per layer."""
        order = [self.blocks.rows[b] for b in sorted(self.blocks.rows) if b != 0]
        out = {}
        for layer in range(len(self.mprobes)):
            h = hashlib.sha256()
            for t in (self.mcache.conv.data[layer], self.mcache.temporal.data[layer]):
                h.update(t[order].cpu().numpy().tobytes())
            out[f"mamba{layer}.state"] = h.hexdigest()
        for layer, c in enumerate(self.lcache):
            out[f"mla{layer}.latent_cache"] = hashlib.sha256(c.data[order].float().cpu().numpy().tobytes()).hexdigest()
        out["outputs"] = self.output_digest.hexdigest()
        return out


class _BadAccess(Exception):
    """The bookkeeping pointed a read or copy at a column holding no block, or made two
    copies of one step collide: a failure of ``ssm.running_state``, not a crash."""
