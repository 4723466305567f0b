"""MLA layers of a step on real tensors: latent cache writes, both attention paths, checks.

Per layer and step: every scheduled token's latent entry goes to its slot through the
group's block table in one ``concat_and_cache`` call; the absorbed decode path runs for
every row (one ``mla_decode`` call per query count), the compute-friendly prefill path
(context up-projected chunk by chunk, merged by log-sum-exp) for every prefill row. A
decode row's output is the decode path's, a prefill row's the prefill path's, and on
prefill rows the two must agree (``mla.paths``). After the outcome every committed
token's output is compared with the float64 oracle (``mla.output``); the comparisons of
a step come back to the host in one transfer.

The engine runs a prefill row through the prefill path only: the decode path's calls that
serve no decode row exist for ``mla.paths`` alone, so the clock gives them a phase of their
own (``mla_paths``: checking, not the system's work; a call that also serves a decode row
stays the system's), and the hits' latent comparisons are the oracle's (``mla_oracle``).
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
from ..layers.mla import MLAProbe
from ..oracle import WEIGHTS_SHARE, MLAOracle
from ..sched.plan import StepPlan
from .cache import BlockMap, PagedTensor, block_table
from .compare import TOLERANCE, error_pairs, tally_outputs
from .mamba_state import Bugs
from ..device.clock import PhaseClock
from ..device.verdicts import Verdicts
from ..device.matmul import matmul_tf32
from ..device.transfer import to_device, upload

from ..kernels.reference import takes_causal, takes_host_lengths


@dataclass
class MLAForward:
    outs: list[list[torch.Tensor]]  # per layer, per row: (n, H, v) float32
    paths: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (row, layer, decode path, prefill path)


class MLAExecution:
    PHASES = ("mla", "mla_paths", "mla_oracle")  # what its clock times: the layers, the paths' cross-check, the oracle
    ORACLE_PHASES = ("mla_oracle",)  # (of those, the oracle's: the runs' oracle share)
    CHECK_PHASES = ("mla_paths",)  # (and checks other than the oracle: with it, the runs' checking share)

    def __init__(self, scenario: Scenario, groups, kernels, checks: Checks, bugs: Bugs, device: torch.device,
                 blocks: BlockMap, workspace_tokens: int = 256):
        lg = scenario.geometry().mla
        self.k = kernels
        self.partial_causal = takes_causal(kernels)  # (the new tokens' mask promised causal where understood)
        self.host_lengths = takes_host_lengths(kernels)  # (the decode rows' lengths passed on the host too)
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
        self.low_precision = lg.dtype in ("bfloat16", "float16")
        self.oracle = MLAOracle(cpu_probes, device, weights_within=self.tol * WEIGHTS_SHARE)
        for dtype in (torch.float32, torch.float64):  # the executor's projections and the oracle's
            prepare_rope(lg.qk_rope_head_dim, scenario.scheduler.max_model_len, device, dtype)
        self.clock = PhaseClock(device, self.PHASES)  # (the executor hands every part its shared one)
        self.verdicts = Verdicts(0)  # (the executor hands every part its shared one)

    # ------------------------------------------------------------------ forward
    def _block_table(self, plan: StepPlan, reqs, group: int) -> torch.Tensor:
        """The step's block table of one group as cache rows, uploaded once."""
        return to_device(block_table(plan, reqs, self.blocks, group, self.bs), self.device)

    def forward(self, plan: StepPlan, reqs, inputs: list[np.ndarray], meta) -> MLAForward:
        with self.clock.phase("mla"):
            return self._forward(plan, reqs, inputs, meta)

    def _forward(self, plan: StepPlan, reqs, inputs: list[np.ndarray], meta) -> MLAForward:
        dev = self.device
        ns = [s.num_scheduled_tokens for s in plan.scheduled]
        cs = [s.num_computed_tokens for s in plan.scheduled]
        decode_rows = set(meta.order[: meta.num_decodes])
        tok = upload(np.concatenate(inputs), dev)
        pos = upload(np.concatenate([np.arange(c, c + n) for c, n in zip(cs, ns)]), dev)
        row_of = upload(np.repeat(np.arange(len(ns)), ns), dev)
        starts = np.concatenate([[0], np.cumsum(ns)])
        by_n: dict[int, list[int]] = {}
        for i, n in enumerate(ns):
            by_n.setdefault(n, []).append(i)
        gather = {n: upload(np.concatenate([np.arange(starts[i], starts[i] + n) for i in idx]), dev)
                  for n, idx in by_n.items()}
        tables: dict[int, torch.Tensor] = {}
        outs, paths = [], []
        tf32 = self.low_precision and dev.type == "cuda"  # the engine runs these products in 16 bits
        for layer, probe in enumerate(self.probes):
            g = self.layer_group[layer]
            table = tables.get(g)
            if table is None:
                table = tables[g] = self._block_table(plan, reqs, g)
            cache = self.caches[layer].data
            slots = table[row_of, pos // self.bs] * self.bs + pos % self.bs
            lat, q_nope, q_pe = probe.project(tok, pos, max(c + n for c, n in zip(cs, ns)))
            self.k.concat_and_cache(lat, slots, cache)
            decoded: list[Optional[torch.Tensor]] = [None] * len(ns)
            for n, idx in by_n.items():  # the absorbed decode path, one call per query count
                phase = "mla" if decode_rows.intersection(idx) else "mla_paths"  # (prefill rows only: a check's)
                with self.clock.phase(phase):
                    self._decode_path(probe, n, idx, gather[n], q_nope, q_pe, cache, table, cs, tf32, decoded)
            layer_out = []
            for i, (c, n) in enumerate(zip(cs, ns)):
                if i in decode_rows:
                    layer_out.append(decoded[i])
                    continue
                sl = slice(int(starts[i]), int(starts[i]) + n)
                pre = self._prefill_path(probe, q_nope[sl], q_pe[sl], cache, table[i, : -(-(c + n) // self.bs)], c, n)
                paths.append((i, layer, decoded[i], pre))
                layer_out.append(pre)
            outs.append(layer_out)
        partial = [i for i, s in enumerate(plan.scheduled) if s.is_new and s.num_computed_tokens % self.bs]
        if partial:
            with self.clock.phase("mla_oracle"):  # (the hits' latents from their tokens: the oracle's comparison)
                self._check_partial_hits(plan, reqs, partial, tables)
        return MLAForward(outs, paths)

    def _decode_path(self, probe: MLAProbe, n: int, idx: list[int], sel: torch.Tensor, q_nope, q_pe, cache, table,
                     cs: list[int], tf32: bool, decoded: list) -> None:
        """The absorbed decode path for the rows ``idx`` of n queries each (their tokens ``sel``), in one
        ``mla_decode`` call: each row's output into ``decoded``."""
        dev = self.device
        with matmul_tf32(tf32):  # (the kernel reads the absorbed queries in the cache's 16 bits)
            q_lat = probe.absorb(q_nope[sel]).to(torch.float32).view(len(idx), n, probe.geo.heads, -1)
        qp = q_pe[sel].view(len(idx), n, probe.geo.heads, -1)
        lens = [cs[i] + n for i in idx]
        rows_d = to_device(torch.tensor(idx, dtype=torch.int64), dev)
        hint = {"seq_lens_cpu": lens} if self.host_lengths else {}
        o_lat, _ = self.k.mla_decode(q_lat, qp, cache, table.index_select(0, rows_d),
                                     to_device(torch.tensor(lens, dtype=torch.int64), dev),
                                     probe.geo.kv_lora_rank, probe.scale, num_splits=0, max_seq_len=max(lens), **hint)
        with matmul_tf32(tf32):  # (float32 sums of TF32 products: well inside the 16-bit tolerance)
            o = probe.unabsorb(o_lat)
        for j, i in enumerate(idx):
            decoded[i] = o[j]

    def _check_partial_hits(self, plan: StepPlan, reqs, hit_rows: list[int], tables) -> None:
        """``mla.cached_blocks``: a hit that ends inside a block (partial-block prefix hits) hands
        out a private copy of that block; every latent entry of the hit's tokens, in every block the
        hit handed out, must equal, bit for bit, what the tokens give (cast to the cache's dtype)."""
        dev, bs = self.device, self.bs
        cs = [plan.scheduled[i].num_computed_tokens for i in hit_rows]
        tok = upload(np.concatenate([reqs[i].tokens[:c] for i, c in zip(hit_rows, cs)]), dev)
        pos = upload(np.concatenate([np.arange(c) for c in cs]), dev)
        row_of = upload(np.repeat(np.asarray(hit_rows), cs), dev)
        which = upload(np.repeat(np.arange(len(hit_rows)), cs), dev)
        bad = torch.zeros(len(hit_rows), len(self.probes), dtype=torch.int64, device=dev)
        for layer, probe in enumerate(self.probes):
            cache = self.caches[layer].data
            lat = probe.project(tok, pos, max(cs))[0].to(cache.dtype)
            got = cache[tables[self.layer_group[layer]][row_of, pos // bs], pos % bs]
            bad[:, layer] = torch.zeros(len(hit_rows), dtype=torch.int64, device=dev).index_add_(
                0, which, bits_differ(got, lat).sum(1).to(torch.int64))
        step = plan.step
        rids = [plan.scheduled[i].req_id for i in hit_rows]
        self.verdicts.add(bad, lambda res: self._tally_hits(step, rids, cs, res.tolist()))

    def _tally_hits(self, step: int, rids: list[str], cs: list[int], bad: list[list[int]]) -> None:
        tally = self.checks.get("mla.cached_blocks")
        for rid, c, per_layer in zip(rids, cs, bad):
            for layer, n in enumerate(per_layer):
                if n:
                    tally.failed(Failure(step, rid, f"{n} latent elements of a {c}-token prefix hit (inside a "
                                                    "block) differ from their tokens' latents",
                                         layer=f"mla{layer}", position=0))
                else:
                    tally.passed()

    def _prefill_path(self, probe: MLAProbe, q_nope, q_pe, cache, block_row, c, n):
        """With a bf16/fp16 cache the engine runs this path on the matrix units; here its float32
        products may use TF32 (10-bit inputs, float32 sums), well inside the dtype's tolerance."""
        with matmul_tf32(self.low_precision and cache.is_cuda):
            return self._prefill_path_fp32(probe, q_nope, q_pe, cache, block_row, c, n)

    def _prefill_path_fp32(self, probe: MLAProbe, q_nope, q_pe, cache, block_row, c, n):
        """The new tokens attend to themselves (causal), then to the cached context chunk by chunk
        (each chunk up-projected once), merged by lse. Queries go in blocks as the provider asks:
        the reference materialises scores, within ``PARTIAL_SCORE_ELEMS`` elements (a 4k-token chunk
        over 12k of context is 25 GB whole); a streaming kernel takes them all at once."""
        q = torch.cat([q_nope, q_pe], dim=-1).float()
        qb = self.k.partial_query_rows(max(n, min(c, self.workspace), 1), q.shape[1])
        blocks = [(q0, min(n, q0 + qb)) for q0 in range(0, n, qb)]
        new_lat = self._gather(cache, block_row, c, n)
        k_new, v_new = probe.up_project(new_lat)
        ar = torch.arange(n, device=q.device)
        base2 = "lse_base2" in self.bugs
        unguarded = "lse_unmasked" in self.bugs
        parts = []
        for q0, q1 in blocks:
            mask = ar[None, :q1] <= ar[q0:q1, None]
            promise = {"causal": q0} if self.partial_causal else {}
            out, lse = self.k.attention_partial(q[q0:q1], k_new[:q1], v_new[:q1], probe.scale, mask, **promise)
            if c == 0 and unguarded:
                # the buggy variant merges an empty context partial without sanitising it
                empty_o = torch.full_like(out, float("nan"))
                empty_l = torch.full_like(lse, float("-inf"))
                out, lse = self.k.merge_states(empty_o, empty_l, out, lse, base2_bug=base2, unguarded=True)
            parts.append((out, lse))
        step = self.workspace - 1 if "ctx_chunk_unaligned" in self.bugs else self.workspace
        start = 0
        while start < c:
            length = min(step, c - start)
            lat = self._gather(cache, block_row, start, length, unaligned_bug="ctx_chunk_unaligned" in self.bugs)
            k_ctx, v_ctx = probe.up_project(lat)
            for j, (q0, q1) in enumerate(blocks):
                o_c, l_c = self.k.attention_partial(q[q0:q1], k_ctx, v_ctx, probe.scale, None)
                parts[j] = self.k.merge_states(o_c, l_c, *parts[j], base2_bug=base2, unguarded=unguarded)
            start += length
        return parts[0][0] if len(parts) == 1 else torch.cat([o for o, _ in parts])

    def _gather(self, cache, block_row, start, length, unaligned_bug=False):
        bs = self.bs
        if unaligned_bug and start % bs:
            start = start - start % bs  # the buggy kernel assumes a page-aligned chunk start
        if start % bs == 0:
            return self.k.gather_cache(cache, block_row, start, length)
        return self.k.gather_cache(cache, block_row, start - start % bs, length + start % bs)[start % bs:]

    # ------------------------------------------------------------------ checks
    def check(self, plan: StepPlan, reqs, fwd: MLAForward, committed: list[int]) -> None:
        with self.clock.phase("mla_oracle"):
            self.compare(plan, fwd, committed, self.expected(plan, reqs, committed))

    def expected(self, plan: StepPlan, reqs, committed: list[int]) -> list[torch.Tensor]:
        """The oracle's outputs of every committed token (from token ids alone: nothing the step wrote)."""
        rows = [i for i, k in enumerate(committed) if k > 0]
        return self.oracle.expected([(reqs[i].tokens.view(), plan.scheduled[i].num_computed_tokens,
                                      committed[i]) for i in rows])

    def compare(self, plan: StepPlan, fwd: MLAForward, committed: list[int], expected: list[torch.Tensor]) -> None:
        """The step's outputs against ``expected``, and its prefill rows' two paths against each other."""
        rows = [i for i, k in enumerate(committed) if k > 0]
        L = len(self.probes)
        got = [fwd.outs[layer][i][: committed[i]] for i in rows for layer in range(L)] + [d for *_, d, _ in fwd.paths]
        want = [exp[layer] for exp in expected for layer in range(L)] + [p for *_, p in fwd.paths]
        if got:
            paths = [(i, layer) for i, layer, _, _ in fwd.paths]  # (not fwd: its outputs)
            self.verdicts.add(rel_errors(got, want).reshape(-1),
                              lambda res: self._tally(plan, rows, committed, paths, error_pairs(res.tolist())))

    def _tally(self, plan: StepPlan, rows: list[int], committed: list[int], path_rows: list[tuple[int, int]],
               all_errs: list[tuple[float, float]]) -> None:
        L = len(self.probes)
        tally_outputs(self.checks.get("mla.output"), plan, rows, committed, all_errs, L, self.tol, "mla")
        paths = self.checks.get("mla.paths")
        for j, (i, layer) in enumerate(path_rows):
            a, rel = all_errs[len(rows) * L + j]
            paths.max_abs_err = max(paths.max_abs_err, a)
            paths.max_rel_err = max(paths.max_rel_err, rel)
            if rel <= self.tol:
                paths.passed()
            else:
                paths.failed(Failure(plan.step, plan.scheduled[i].req_id, f"prefill and decode paths differ "
                                                                          f"(rel {rel:.2e})", layer=f"mla{layer}",
                                     max_abs_err=a, max_rel_err=rel))

    def cache_digests(self, order: list[int]) -> dict[str, str]:
        """Per layer: sha256 over the exact fingerprints of its latent pages in physical block order
        (latent entries are exact, so the same bits on every machine)."""
        idx = torch.tensor(order, dtype=torch.int64, device=self.device)
        return {f"mla{layer}.latent_cache": pages_digest([c.data], idx) for layer, c in enumerate(self.caches)}
