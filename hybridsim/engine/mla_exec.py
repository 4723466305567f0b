"""MLA layers of a step on real tensors: latent cache writes, both attention paths, checks.

Per layer and step: every scheduled token's latent entry goes to its slot through the
group's block table in one ``concat_and_cache`` call; the absorbed decode path runs for
every row (one ``mla_decode`` call per query count), the compute-friendly prefill path
(context up-projected chunk by chunk, merged by log-sum-exp) for every prefill row. A
decode row's output is the decode path's, a prefill row's the prefill path's, and on
prefill rows the two must agree (``mla.paths``). After the outcome every committed
token's output is compared with the float64 oracle (``mla.output``); the comparisons of
a step come back to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Optional

import numpy as np
import torch

from ..checks import Checks, Failure
from ..config import Scenario
from ..layers.exact import fingerprint_rows
from ..layers.mla import MLAProbe
from ..oracle import MLAOracle
from ..sched.plan import StepPlan
from .cache import BlockMap, PagedTensor
from .mamba_state import Bugs
from .transfer import to_device

TOLERANCE = {"float32": 1e-5, "float64": 1e-9, "bfloat16": 2e-2, "float16": 5e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """(max |got - want|, that over max |want|) as a (2,) float64 tensor, inf when got is not finite."""
    g, w = got.double(), want.double()
    if not g.numel():
        return torch.zeros(2, dtype=torch.float64, device=g.device)
    d = (g - w).abs().amax()
    rel = d / w.abs().amax().clamp_min(1e-30)
    out = torch.stack([d, rel])
    return torch.where(torch.isfinite(g).all(), out, torch.full_like(out, float("inf")))


@dataclass
class MLAForward:
    outs: list[list[torch.Tensor]]  # per layer, per row: (n, H, v) float32
    paths: list[tuple[int, int, torch.Tensor]]  # (row, layer, rel_err) of prefill rows


class MLAExecution:
    def __init__(self, scenario: Scenario, groups, kernels, checks: Checks, bugs: Bugs, device: torch.device,
                 blocks: BlockMap, workspace_tokens: int = 256):
        lg = scenario.geometry().mla
        self.k = kernels
        self.checks = checks
        self.bugs = bugs
        self.device = device
        self.blocks = blocks
        mla_groups = [g for g in groups if g.kind == "mla"]
        cpu_probes = [MLAProbe(lg, layer, scenario.seed) for layer in range(lg.layers)]
        self.probes = [p.to(device) for p in cpu_probes]
        self.layer_group = [next(g.group_id for g in mla_groups if layer in g.layers) for layer in range(lg.layers)]
        self.bs = mla_groups[0].block_size
        self.caches = [PagedTensor((self.bs, lg.entry_dim()), p.dtype, device, blocks.capacity) for p in self.probes]
        self.workspace = max(workspace_tokens // self.bs, 1) * self.bs
        self.tol = TOLERANCE[lg.dtype]
        self.oracle = MLAOracle(cpu_probes, device)
        self.timings = {"mla": 0.0, "mla_oracle": 0.0}

    # ------------------------------------------------------------------ forward
    def _block_table(self, plan: StepPlan, reqs, group: int) -> torch.Tensor:
        """The step's block table of one group as cache rows, a row per scheduled request
        (padded with the null row), uploaded once."""
        rows = []
        for s, r in zip(plan.scheduled, reqs):
            ncols = -(-(s.num_computed_tokens + s.num_scheduled_tokens) // self.bs)
            rows.append([self.blocks.row(b) for b in r.rows[group][:ncols]])
        width = max(1, max(len(row) for row in rows))
        return to_device(torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64),
                         self.device)

    def forward(self, plan: StepPlan, reqs, inputs: list[np.ndarray], meta) -> MLAForward:
        t0 = perf_counter()
        dev = self.device
        ns = [s.num_scheduled_tokens for s in plan.scheduled]
        cs = [s.num_computed_tokens for s in plan.scheduled]
        decode_rows = set(meta.order[: meta.num_decodes])
        tok = torch.from_numpy(np.concatenate(inputs)).to(dev)
        pos = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in zip(cs, ns)])).to(dev)
        row_of = torch.repeat_interleave(torch.arange(len(ns), device=dev), torch.tensor(ns, device=dev))
        starts = np.concatenate([[0], np.cumsum(ns)])
        by_n: dict[int, list[int]] = {}
        for i, n in enumerate(ns):
            by_n.setdefault(n, []).append(i)
        gather = {n: torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i] + n) for i in idx])).to(dev)
                  for n, idx in by_n.items()}
        tables: dict[int, torch.Tensor] = {}
        outs, paths = [], []
        for layer, probe in enumerate(self.probes):
            g = self.layer_group[layer]
            table = tables.get(g)
            if table is None:
                table = tables[g] = self._block_table(plan, reqs, g)
            cache = self.caches[layer].data
            slots = table[row_of, pos // self.bs] * self.bs + pos % self.bs
            self.k.concat_and_cache(probe.latent(tok, pos), slots, cache)
            q_nope, q_pe = probe.queries(tok, pos)
            decoded: list[Optional[torch.Tensor]] = [None] * len(ns)
            for n, idx in by_n.items():  # the absorbed decode path, one call per query count
                sel = gather[n]
                q_lat = probe.absorb(q_nope[sel]).to(torch.float32).view(len(idx), n, probe.geo.heads, -1)
                qp = q_pe[sel].view(len(idx), n, probe.geo.heads, -1)
                lens = [cs[i] + n for i in idx]
                rows_d = to_device(torch.tensor(idx, dtype=torch.int64), dev)
                o_lat, _ = self.k.mla_decode(q_lat, qp, cache, table.index_select(0, rows_d),
                                             to_device(torch.tensor(lens, dtype=torch.int64), dev),
                                             probe.geo.kv_lora_rank, probe.scale, num_splits=0, max_seq_len=max(lens))
                for j, i in enumerate(idx):
                    decoded[i] = probe.unabsorb(o_lat[j])
            layer_out = []
            for i, (c, n) in enumerate(zip(cs, ns)):
                if i in decode_rows:
                    layer_out.append(decoded[i])
                    continue
                sl = slice(int(starts[i]), int(starts[i]) + n)
                pre = self._prefill_path(probe, q_nope[sl], q_pe[sl], cache, table[i, : -(-(c + n) // self.bs)], c, n)
                paths.append((i, layer, rel_err(decoded[i], pre)))
                layer_out.append(pre)
            outs.append(layer_out)
        self.timings["mla"] += perf_counter() - t0
        return MLAForward(outs, paths)

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
            lat = self._gather(cache, block_row, start, length, unaligned_bug="ctx_chunk_unaligned" in self.bugs)
            k_ctx, v_ctx = probe.up_project(lat)
            o_c, l_c = self.k.attention_partial(q, k_ctx, v_ctx, probe.scale, None)
            out, lse = self.k.merge_states(o_c, l_c, out, lse, base2_bug=base2, unguarded=unguarded)
            start += length
        return out

    def _gather(self, cache, block_row, start, length, unaligned_bug=False):
        bs = self.bs
        if unaligned_bug and start % bs:
            start = start - start % bs  # the buggy kernel assumes a page-aligned chunk start
        if start % bs == 0:
            return self.k.gather_cache(cache, block_row, start, length)
        return self.k.gather_cache(cache, block_row, start - start % bs, length + start % bs)[start % bs:]

    # ------------------------------------------------------------------ checks
    def check(self, plan: StepPlan, reqs, fwd: MLAForward, committed: list[int]) -> None:
        t0 = perf_counter()
        rows = [i for i, k in enumerate(committed) if k > 0]
        expected = self.oracle.expected([(reqs[i].tokens.view(), plan.scheduled[i].num_computed_tokens,
                                          committed[i]) for i in rows])
        errs = [rel_err(fwd.outs[layer][i][: committed[i]], exp[layer])
                for i, exp in zip(rows, expected) for layer in range(len(self.probes))]
        all_errs = torch.stack(errs + [e for _, _, e in fwd.paths]).cpu() if errs or fwd.paths else None
        tally = self.checks.get("mla.output")
        L = len(self.probes)
        for j, i in enumerate(rows):
            s = plan.scheduled[i]
            for layer in range(L):
                a, rel = (float(v) for v in all_errs[j * L + layer])
                tally.max_abs_err = max(tally.max_abs_err, a)
                tally.max_rel_err = max(tally.max_rel_err, rel)
                if rel <= self.tol:
                    tally.passed(committed[i])
                else:
                    tally.failed(Failure(plan.step, s.req_id, f"attention output off by rel {rel:.2e} "
                                                              f"(tolerance {self.tol:g})", layer=f"mla{layer}",
                                         position=s.num_computed_tokens, max_abs_err=a, max_rel_err=rel))
        paths = self.checks.get("mla.paths")
        for j, (i, layer, _) in enumerate(fwd.paths):
            a, rel = (float(v) for v in all_errs[len(errs) + j])
            paths.max_abs_err = max(paths.max_abs_err, a)
            paths.max_rel_err = max(paths.max_rel_err, rel)
            if rel <= self.tol:
                paths.passed()
            else:
                paths.failed(Failure(plan.step, plan.scheduled[i].req_id, f"prefill and decode paths differ "
                                                                          f"(rel {rel:.2e})", layer=f"mla{layer}",
                                     max_abs_err=a, max_rel_err=rel))
        self.timings["mla_oracle"] += perf_counter() - t0

    def cache_digests(self, order: list[int]) -> dict[str, str]:
        """Per layer: sha256 over the exact fingerprints of its latent pages in physical block order
        (latent entries are exact, so the same bits on every machine)."""
        import hashlib

        idx = torch.tensor(order, dtype=torch.int64, device=self.device)
        return {f"mla{layer}.latent_cache": hashlib.sha256(fingerprint_rows(c.data[idx]).cpu().numpy().tobytes())
                .hexdigest() for layer, c in enumerate(self.caches)}
