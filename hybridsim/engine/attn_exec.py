"""GQA attention layers of a step on real tensors: K/V cache writes, paged attention, checks.

Per layer and step, as the engine runs it: every scheduled token's K and V go to its slot
through the attention group's block table (slot mapping) in one ``reshape_and_cache``
call, then one ``paged_attention`` call covers every scheduled query of every row —
prefill chunks over their cached context and themselves, decodes, and verification rows
with their drafts. A rejected draft's K/V stays in its slot but lies past the row's
length from then on, and is overwritten when that position is computed again.

Checks, after the step's outcome (one device-to-host transfer for all of them):
* ``attn.output``: every committed token's output, every layer, against dense float64
  attention over the committed tokens (the oracle; no cache involved).
* ``attn.cached_blocks``: every block handed out on a prefix hit holds, bit for bit, the
  K/V its tokens give (the probe's values are exact); and no step writes into a block
  another live request held before the step (full blocks are shared and immutable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..checks import Checks, Failure
from ..config import Scenario
from ..kernels.segments import bits_differ, rel_errors
from ..layers.exact import pages_digest, prepare_rope
from ..layers.gqa import GQAProbe, GQAStack
from ..oracle import GQAOracle
from ..sched.plan import StepPlan
from .cache import BlockMap, PageArena, PagedTensor, block_table
from .mamba_state import Bugs
from .compare import TOLERANCE, error_pairs, tally_outputs
from ..device.clock import PhaseClock
from ..device.verdicts import Verdicts
from ..device.transfer import to_device, upload


ORACLE_SCORES = 1 << 26  # float64 elements (scores, projected keys) the oracle materialises at once
ORACLE_MEMO = 1 << 30  # bytes of projected keys a CPU oracle keeps for the live requests (oracle.KeyMemo)


def oracle_memo_bytes(s: Scenario, device: torch.device) -> int:
    """What the oracle's key memo may hold: on a CPU, every live request's float64 K and V up to
    the model length, within ``ORACLE_MEMO``; nothing on a GPU (projecting again is cheap there)."""
    a = s.geometry().attention
    if torch.device(device).type != "cpu" or a is None:
        return 0
    per_token = a.layers * 2 * a.kv_heads * a.head_dim * 8
    return min(ORACLE_MEMO, 2 * s.scheduler.max_num_seqs * s.scheduler.max_model_len * per_token)


@dataclass
class AttentionForward:
    outs: list[torch.Tensor]  # per layer: (T, heads, D) float32, rows packed in plan order
    starts: np.ndarray  # (rows + 1,) token offsets of the rows
    hit_rows: list[int]  # plan rows whose hit blocks were compared
    hit_blocks: list[int]  # blocks compared per hit row
    hit_bad: Optional[torch.Tensor]  # (hit rows, layers) mismatching elements, on the device


class AttentionExecution:
    PHASES = ("attn", "attn_oracle")  # what its clock times: the layers, the oracle
    ORACLE_PHASES = ("attn_oracle",)  # (of those, the oracle's: the runs' oracle share)
    CHECK_PHASES: tuple[str, ...] = ()  # (no checks besides the oracle's run in a phase of their own)
    def __init__(self, scenario: Scenario, groups, kernels, checks: Checks, bugs: Bugs, device: torch.device,
                 blocks: BlockMap, arena: Optional[PageArena] = None):
        geo = scenario.geometry().attention
        self.geo = geo
        self.k = kernels
        self.checks = checks
        self.bugs = bugs
        self.device = device
        self.blocks = blocks
        self.groups = [g for g in groups if g.kind == "attention"]
        self.layer_group = [next(g.group_id for g in self.groups if layer in g.layers) for layer in range(geo.layers)]
        self.bs = self.groups[0].block_size
        probes = [GQAProbe(geo, layer, scenario.seed) for layer in range(geo.layers)]
        self.stack = GQAStack(probes, device, torch.float32)  # exact in float32 (layers/gqa.py)
        self.oracle = GQAOracle(probes, device, ORACLE_SCORES, memo_bytes=oracle_memo_bytes(scenario, device))
        for dtype in {self.stack.emb1.dtype, torch.float64}:  # the executor's projections and the oracle's
            prepare_rope(geo.head_dim, scenario.scheduler.max_model_len, device, dtype)
        shape = (self.bs, geo.kv_heads, geo.head_dim)
        if arena is not None:  # K then V inside each shared page of the layer's slot
            kv = geo.page_bytes(self.bs) // 2
            slot = [next(g.layers.index(layer) for g in self.groups if layer in g.layers) for layer in range(geo.layers)]
            self.caches = [(arena.slot_view(slot[l], 0, shape, self.stack.dtype),
                            arena.slot_view(slot[l], kv, shape, self.stack.dtype)) for l in range(geo.layers)]
        else:
            self.caches = [(PagedTensor(shape, self.stack.dtype, device, blocks.capacity).data,
                            PagedTensor(shape, self.stack.dtype, device, blocks.capacity).data)
                           for _ in range(geo.layers)]
        self.tol = TOLERANCE[geo.dtype]
        self.holders: dict[int, set[str]] = {}  # block -> live requests whose attention rows hold it
        self.rejected: dict[str, int] = {}  # drafts the last step rejected, per request (rejected_kv_visible)
        self.clock = PhaseClock(device, self.PHASES)  # (the executor hands every part its shared one)
        self.verdicts = Verdicts(0)  # (the executor hands every part its shared one)

    # ------------------------------------------------------------------ request lifecycle
    def release(self, rid: str, rows: list[list[int]]) -> None:
        """A finished or preempted request gives up its blocks."""
        for g in self.groups:
            if g.group_id < len(rows):
                for b in rows[g.group_id]:
                    held = self.holders.get(b)
                    if held is not None:
                        held.discard(rid)
                        if not held:
                            del self.holders[b]
        self.rejected.pop(rid, None)
        self.oracle.forget(rid)

    def _hold(self, plan: StepPlan, reqs) -> None:
        for s, r in zip(plan.scheduled, reqs):
            if s.new_block_ids is None:
                continue
            for g in self.groups:
                for b in (r.rows[g.group_id] if s.is_new else s.new_block_ids[g.group_id]):
                    if b:
                        self.holders.setdefault(b, set()).add(s.req_id)

    # ------------------------------------------------------------------ forward

    def _check_writes(self, plan: StepPlan, reqs) -> None:
        """Blocks written this step that another live request held before it: a shared (full,
        immutable) block being overwritten."""
        tally = self.checks.get("attn.cached_blocks")
        clean = 0
        for s, r in zip(plan.scheduled, reqs):
            c, n = s.num_computed_tokens, s.num_scheduled_tokens
            for g in self.groups:
                row = r.rows[g.group_id]
                for col in range(c // self.bs, min(-(-(c + n) // self.bs), len(row))):
                    others = self.holders.get(row[col], set()) - {s.req_id}
                    if others:
                        tally.failed(Failure(plan.step, s.req_id, f"writes positions of block {row[col]} (column "
                                             f"{col}), which {sorted(others)[0]} already held: a shared block is "
                                             "overwritten", layer=f"group{g.group_id}", position=col * self.bs))
                    else:
                        clean += 1
        tally.passed(clean)

    def forward(self, plan: StepPlan, reqs, inputs: list[np.ndarray]) -> AttentionForward:
        with self.clock.phase("attn"):
            return self._forward(plan, reqs, inputs)

    def _forward(self, plan: StepPlan, reqs, inputs: list[np.ndarray]) -> AttentionForward:
        dev, bs = self.device, self.bs
        ns = [s.num_scheduled_tokens for s in plan.scheduled]
        cs = [s.num_computed_tokens for s in plan.scheduled]
        starts = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
        pos_h = np.concatenate([np.arange(c, c + n) for c, n in zip(cs, ns)])
        tok = upload(np.concatenate(inputs), dev)
        pos = upload(pos_h, dev)
        n_pos = max(c + n for c, n in zip(cs, ns))
        k, v, q = self.stack.project(tok, pos, n_pos)  # exact; the cache cast rounds K and V
        seq = [c + n for c, n in zip(cs, ns)]
        if "rejected_kv_visible" in self.bugs:  # the previous step's rejected drafts still counted
            seq = [min(x + self.rejected.get(s.req_id, 0), (-(-x // bs) + 1) * bs)  # (within the padded table)
                   for x, s in zip(seq, plan.scheduled)]
        qsl = torch.from_numpy(starts)
        seq_t = torch.tensor(seq, dtype=torch.int64)
        row_of = np.repeat(np.arange(len(ns)), ns)
        col = pos_h // bs
        if "slot_off_by_one" in self.bugs:  # a block's first token mapped through the previous column
            col = np.where((pos_h % bs == 0) & (pos_h > 0), col - 1, col)
        col_d, off_d, row_d = upload(col, dev), upload(pos_h % bs, dev), upload(row_of, dev)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._check_writes(plan, reqs)
        outs = []
        for layer, (kc, vc) in enumerate(self.caches):
            g = self.layer_group[layer]
            if g not in tables:
                # one null column past the longest row: a kernel reading past a row's end reads
                # NaN pages, never another tensor
                t = to_device(block_table(plan, reqs, self.blocks, g, bs, pad_cols=1), dev)
                tables[g] = (t, t[row_d, col_d] * bs + off_d)
            table, slots = tables[g]
            self.k.reshape_and_cache(k[layer], v[layer], slots, kc, vc)
        past_end = "paged_attn_past_end" in self.bugs
        for layer, (kc, vc) in enumerate(self.caches):
            table, _ = tables[self.layer_group[layer]]
            outs.append(self.k.paged_attention(q[layer], kc, vc, table, qsl, seq_t, self.stack.scale,
                                               max_seq_len=max(seq), past_end_bug=past_end))
        hit_rows = [i for i, s in enumerate(plan.scheduled) if s.is_new and s.num_computed_tokens > 0]
        hit_bad = None
        if hit_rows:
            with self.clock.phase("attn_oracle"):  # (the hits' K/V from their tokens: the oracle's comparison)
                hit_bad = self._compare_hits(plan, reqs, hit_rows, tables)
        self._hold(plan, reqs)
        return AttentionForward(outs, starts, hit_rows, [-(-cs[i] // bs) for i in hit_rows], hit_bad)

    def _compare_hits(self, plan: StepPlan, reqs, hit_rows: list[int], tables) -> torch.Tensor:
        """Mismatching K/V elements per (hit row, layer) in the blocks the hit handed out: their
        tokens' exact K/V, cast to the cache's dtype, against the pages."""
        dev, bs = self.device, self.bs
        cs = [plan.scheduled[i].num_computed_tokens for i in hit_rows]
        tok = upload(np.concatenate([reqs[i].tokens[:c] for i, c in zip(hit_rows, cs)]), dev)
        pos_h = np.concatenate([np.arange(c) for c in cs])
        pos = upload(pos_h, dev)
        row_of = upload(np.repeat(np.asarray(hit_rows), cs), dev)
        k, v, _ = self.stack.project(tok, pos, max(cs))
        which = upload(np.repeat(np.arange(len(hit_rows)), cs), dev)
        bad = torch.zeros(len(hit_rows), len(self.caches), dtype=torch.int64, device=dev)
        for layer, (kc, vc) in enumerate(self.caches):
            table, _ = tables[self.layer_group[layer]]
            blk = table[row_of, pos // bs]
            off = pos % bs
            for cache, want in ((kc, k[layer]), (vc, v[layer])):
                got = cache[blk, off]
                w = want.to(cache.dtype)
                diff = bits_differ(got, w)
                bad[:, layer] += torch.zeros(len(hit_rows), dtype=torch.int64, device=dev).index_add_(
                    0, which, diff.flatten(1).sum(1))
        return bad

    # ------------------------------------------------------------------ checks
    def check(self, plan: StepPlan, reqs, fwd: AttentionForward, committed: list[int]) -> None:
        with self.clock.phase("attn_oracle"):
            self.compare(plan, fwd, committed, self.expected(plan, reqs, committed))

    def expected(self, plan: StepPlan, reqs, committed: list[int]) -> list[torch.Tensor]:
        """The oracle's outputs of every committed token (from token ids alone: nothing the step wrote)."""
        rows = [i for i, k in enumerate(committed) if k > 0]
        return self.oracle.expected([(reqs[i].tokens.view(), plan.scheduled[i].num_computed_tokens,
                                      committed[i]) for i in rows], [reqs[i].rid for i in rows])

    def compare(self, plan: StepPlan, fwd: AttentionForward, committed: list[int],
                expected: list[torch.Tensor]) -> None:
        """The step's outputs against ``expected``; the verdicts are tallied when read back."""
        rows = [i for i, k in enumerate(committed) if k > 0]
        L = len(self.caches)
        got = [fwd.outs[layer][int(fwd.starts[i]):int(fwd.starts[i]) + committed[i]] for i in rows for layer in range(L)]
        want = [exp[layer] for exp in expected for layer in range(L)]
        parts = [rel_errors(got, want).reshape(-1)] if got else []
        if fwd.hit_bad is not None:
            parts.append(fwd.hit_bad.reshape(-1).double().to(parts[0].device if parts else self.device))
        for i, s in enumerate(plan.scheduled):
            self.rejected[s.req_id] = s.num_scheduled_tokens - committed[i]
        if parts:
            hits = (fwd.hit_rows, fwd.hit_blocks) if fwd.hit_bad is not None else None  # (not fwd: its outputs)
            self.verdicts.add(torch.cat(parts), lambda res: self._tally(plan, rows, committed, hits, res.tolist()))

    def _tally(self, plan: StepPlan, rows: list[int], committed: list[int],
               hit: Optional[tuple[list[int], list[int]]], flat: list[float]) -> None:
        L = len(self.caches)
        tally_outputs(self.checks.get("attn.output"), plan, rows, committed, error_pairs(flat[:3 * len(rows) * L]),
                      L, self.tol, "attn")
        if hit is not None:
            hit_rows, hit_blocks = hit
            hits = self.checks.get("attn.cached_blocks")
            rest = flat[3 * len(rows) * L:]
            for j, i in enumerate(hit_rows):
                s = plan.scheduled[i]
                for layer in range(L):
                    n_bad = int(rest[j * L + layer])
                    if n_bad:
                        hits.failed(Failure(plan.step, s.req_id, f"{n_bad} K/V elements of the {hit_blocks[j]} "
                                            f"blocks handed out on a {s.num_computed_tokens}-token prefix hit differ "
                                            "from their tokens' K/V", layer=f"attn{layer}", position=0))
                    else:
                        hits.passed(hit_blocks[j])

    def cache_digests(self, order: list[int]) -> dict[str, str]:
        """Per layer: sha256 over the exact fingerprints of its K and V pages in physical block
        order (K and V are exact, so the same bits on every machine)."""
        idx = torch.tensor(order, dtype=torch.int64, device=self.device)
        return {f"attn{layer}.kv_cache": pages_digest([kc, vc], idx) for layer, (kc, vc) in enumerate(self.caches)}
