"""``kernel.<name>`` checks: run every provider call through the reference too and compare.

The reference runs on copies of the same inputs, so the comparison is between two
implementations of one kernel on identical data: state copies must be bit-exact,
attention pieces within the dtype tolerance, and ±inf/NaN positions identical.

Comparisons are made on the device and kept pending; ``flush`` brings a step's verdicts
to the host in one transfer (a sync per comparison would serialise the whole run).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..checks import Checks, Failure
from ..device.transfer import upload
from ..device.verdicts import Verdicts
from .paged_attention import paged_attention_layers
from .reference import ReferenceKernels
from .segments import LARGE, bits_differ, rel_errors, segment_ids


LOW_PRECISION_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
REFERENCE_MAX_QUERIES = 16  # mla_decode calls with more query tokens a request are prefill rows (see mla_decode)
REFERENCE_ROWS = 8  # paged_attention rows a call re-runs through the reference (the oracle checks every row)
CHECKS_PHASE = "kernel checks"  # the executor's phase (device/clock.py) of the references and comparisons
STAGED_PAGES = 256  # state pages one checked state_copy batch copies for the reference (about 1 GB at real sizes)
BLOCK_COPY_STAGED = 64  # (slot, page) pairs one checked block_copy batch stages for the reference


@dataclass
class _PagedCall:
    """A checked paged_attention call waiting for its reference (run at the step's end, with the
    other layers of its group, before anything writes a cache again)."""

    key: tuple
    rows: torch.Tensor  # (rows,) host: the rows re-run
    q: torch.Tensor
    caches: tuple[torch.Tensor, torch.Tensor]
    block_table: torch.Tensor
    query_start_loc: torch.Tensor  # host
    seq_lens: torch.Tensor  # host
    scale: float
    past_end_bug: bool
    tok: torch.Tensor  # (tokens,) on the device: the rows' query tokens
    got: torch.Tensor  # the kernel's outputs of those tokens
    tol: float


class CheckedKernels:
    def __init__(self, inner, checks: Checks, tol: float = 1e-5):
        self.inner = inner
        self.ref = ReferenceKernels()
        self.checks = checks
        self.tol = tol
        self.name = inner.name
        self.exact: list[tuple[str, torch.Tensor]] = []  # (check, differs: a 0-dim device tensor)
        self.close: list[tuple[str, float, torch.Tensor, torch.Tensor]] = []  # (check, tolerance, got, want)
        self.small_exact: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (index into exact, got, want)
        self.paged: list[_PagedCall] = []  # paged_attention calls whose reference runs at flush
        self._paged_steps = 0
        self.verdicts = Verdicts(0)  # (an executor hands it its shared one)
        self.clock = None  # (and its phase clock: the checks' own work a phase, CHECKS_PHASE)

    def _checking(self):
        """The checks' own work (references, staging, comparisons) as the executor's ``CHECKS_PHASE``."""
        return self.clock.phase(CHECKS_PHASE) if self.clock is not None else nullcontext()

    def _exact(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Bit-exact, NaN where NaN. Large pairs (state pages) are decided on the device now, so
        they are not held; small ones are kept and decided at ``flush`` in one pass."""
        if got.numel() >= LARGE:
            self.exact.append((name, bits_differ(got, want).any()))
        else:
            self.exact.append((name, None))
            self.small_exact.append((len(self.exact) - 1, got.reshape(-1), want.reshape(-1).to(got.device, got.dtype)))

    def _small_exact_verdicts(self) -> None:
        """Fill the verdicts of the kept small pairs: per dtype, one concatenation, one comparison,
        one segmented reduction."""
        by_dtype: dict = {}
        for item in self.small_exact:
            by_dtype.setdefault(item[1].dtype, []).append(item)
        for items in by_dtype.values():
            dev = items[0][1].device
            got = torch.cat([g for _, g, _ in items])
            want = torch.cat([w for _, _, w in items])
            seg = segment_ids([g.numel() for _, g, _ in items], dev)
            differs = torch.zeros(len(items), dtype=torch.int64, device=dev).index_add_(
                0, seg, bits_differ(got, want).to(torch.int64))
            for j, (k, _, _) in enumerate(items):
                self.exact[k] = (self.exact[k][0], differs[j] > 0)
        self.small_exact.clear()

    def _close(self, name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        """Within a relative tolerance, specials alike: measured at ``flush`` for the whole step at once."""
        self.close.append((name, tol, got, want))

    def flush(self, step: int) -> None:
        """Tally every comparison of the step: one pass over the tolerance comparisons
        (segmented reductions), one device-to-host transfer (through ``verdicts``: on a GPU
        the executor reads it one step late)."""
        with self._checking():
            self._flush(step)

    def _flush(self, step: int) -> None:
        self._run_paged_references()
        self._small_exact_verdicts()
        self._paged_steps += 1
        parts = [torch.stack([d for _, d in self.exact]).double()] if self.exact else []
        if self.close:
            parts.append(rel_errors([g for _, _, g, _ in self.close], [w for _, _, _, w in self.close]).reshape(-1))
        if not parts:
            return
        exact = [name for name, _ in self.exact]
        close = [(name, tol) for name, tol, _, _ in self.close]
        self.exact, self.close = [], []
        self.verdicts.add(torch.cat([p.to(parts[0].device) for p in parts]),
                          lambda res: self._tally(step, exact, close, res.tolist()))

    def _tally(self, step: int, exact: list[str], close: list[tuple[str, float]], flat: list[float]) -> None:
        for name, differs in zip(exact, flat):
            t = self.checks.get(f"kernel.{name}")
            if differs:
                t.failed(Failure(step, None, f"{self.name} {name} differs from the reference"))
            else:
                t.passed()
        rest = flat[len(exact):]
        for k, (name, tol) in enumerate(close):
            _, rel, specials = rest[3 * k:3 * k + 3]
            t = self.checks.get(f"kernel.{name}")
            t.max_rel_err = max(t.max_rel_err, rel)
            if rel <= tol and not specials:
                t.passed()
            else:
                t.failed(Failure(step, None, f"{self.name} {name} off the reference by rel {rel:.2e}",
                                 max_rel_err=rel))

    def mamba_scan(self, tables, launch) -> None:
        """The probe's scan is the test harness's model, not a kernel under test: its Triton and
        torch forms are proven equal by the test suite, and the oracle checks what it wrote."""
        self._run_paged_references()
        self.inner.mamba_scan(tables, launch)

    def state_copy(self, conv, temporal, table, items):
        """The reference runs on copies of just the pages the copies touch (a state cache is tens
        of GB at real sizes), and the kernel's result is compared on those pages. A step's copies
        are independent of each other (the reference refuses any that are not), so a step with
        many copies is checked, and launched, in batches of at most ``STAGED_PAGES`` pages."""
        self._run_paged_references()  # (the references read the caches as the kernels saw them)
        t = table.to(torch.int64).cpu()
        it = items.to(torch.int64).cpu()
        self.ref.check_copy_items(t, it)
        batch, pages = [], set()
        for k in range(len(it)):
            mine = {(int(it[k, 1]), int(t[it[k, 0], c])) for c in it[k, 2:5].tolist()}
            if batch and len(pages | mine) > STAGED_PAGES:
                self._state_copy_batch(conv, temporal, table, items, t, it, batch)
                batch, pages = [], set()
            batch.append(k)
            pages |= mine
        self._state_copy_batch(conv, temporal, table, items, t, it, batch)

    def _state_copy_batch(self, conv, temporal, table, items, t, it_all, batch):
        sel = torch.tensor(batch)
        it = it_all[sel]
        rows, slots = it[:, 0], it[:, 1]
        touched = sorted({(int(sl), int(t[r, c])) for r, sl, *cols in zip(rows, slots, it[:, 2], it[:, 3], it[:, 4])
                          for c in cols})
        where = {key: i for i, key in enumerate(touched)}
        sl_idx = upload([k[0] for k in touched], conv.device)
        pg_idx = upload([k[1] for k in touched], conv.device)
        # every (slot, page) gets its own page of the small copy; the table names those pages
        local = torch.zeros(len(it), t.shape[1], dtype=torch.int64)
        for k, (r, sl) in enumerate(zip(rows.tolist(), slots.tolist())):
            for c in it[k, 2:5].tolist():
                local[k, c] = where[(sl, int(t[r, c]))]
        local_items = it.clone()
        local_items[:, 0] = torch.arange(len(it))
        local_items[:, 1] = 0
        with self._checking():
            ref_c = conv[sl_idx, pg_idx].unsqueeze(0).clone()  # (1, pages, ...): one slot of touched pages
            ref_t = temporal[sl_idx, pg_idx].unsqueeze(0).clone()
            self.ref.state_copy(ref_c, ref_t, local, local_items)
        self.inner.state_copy(conv, temporal, table, items if len(batch) == len(it_all) else
                              items.index_select(0, sel.to(items.device)))
        with self._checking():
            self._exact("state_copy", conv[sl_idx, pg_idx], ref_c[0])
            self._exact("state_copy", temporal[sl_idx, pg_idx], ref_t[0])

    def block_copy(self, pages, pairs):
        """The reference copies staged copies of just the pages involved, and the kernel's
        destination pages are compared with it bit for bit; in batches of at most
        ``BLOCK_COPY_STAGED`` staged (slot, page) pairs (a page is megabytes at real sizes)."""
        self._run_paged_references()  # (the references read the caches as the kernels saw them)
        p = pairs.to(torch.int64).cpu()
        self.ref.check_block_pairs(p, pages.shape[1])
        per = max(1, BLOCK_COPY_STAGED // (2 * pages.shape[0]))
        for k in range(0, len(p), per):
            self._block_copy_batch(pages, p[k:k + per])

    def _block_copy_batch(self, pages, p):
        touched = sorted(set(p.flatten().tolist()))
        where = {b: i for i, b in enumerate(touched)}
        idx = torch.tensor(touched, dtype=torch.int64, device=pages.device)
        local = torch.tensor([[where[a], where[b]] for a, b in p.tolist()], dtype=torch.int64)
        with self._checking():
            staged = pages[:, idx].clone()
            self.ref.block_copy(staged, local)
        self.inner.block_copy(pages, p)
        with self._checking():
            dst = p[:, 1].to(pages.device)
            self._exact("block_copy", pages[:, dst], staged[:, local[:, 1].to(pages.device)])

    def concat_and_cache(self, entries, slots, cache):
        """Compared on the slots written: each holds its entry in the cache's dtype."""
        self._run_paged_references()  # (the references read the caches as the kernels saw them)
        self.inner.concat_and_cache(entries, slots, cache)
        with self._checking():
            got = cache.view(-1, cache.shape[-1])[slots.to(cache.device, torch.int64)]
            self._exact("cache_ops", got, entries.to(cache.device, cache.dtype))

    def gather_cache(self, cache, block_row, start, length):
        got = self.inner.gather_cache(cache, block_row, start, length)
        with self._checking():
            self._exact("cache_ops", got, self.ref.gather_cache(cache, block_row, start, length))
        return got

    def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
        got = self.inner.merge_states(o_a, lse_a, o_b, lse_b, base2_bug=base2_bug, unguarded=unguarded)
        with self._checking():
            want = self.ref.merge_states(o_a, lse_a, o_b, lse_b, base2_bug=base2_bug, unguarded=unguarded)
            self._close("merge_states", got[0], want[0], 1e-6)
            self._close("merge_states", got[1], want[1], 1e-6)
        return got

    def attention_partial(self, *a, **k):
        return self.inner.attention_partial(*a, **k)

    def partial_query_rows(self, keys: int, heads: int) -> int:
        return self.inner.partial_query_rows(keys, heads)

    def reshape_and_cache(self, key, value, slots, k_cache, v_cache):
        """Compared on the slots written: each holds its token's K and V in the cache's dtype."""
        self._run_paged_references()  # (the references read the caches as the kernels saw them)
        self.inner.reshape_and_cache(key, value, slots, k_cache, v_cache)
        with self._checking():
            s = slots.to(k_cache.device, torch.int64)
            bs = k_cache.shape[1]
            self._exact("reshape_and_cache", k_cache[s // bs, s % bs], key.to(k_cache.device, k_cache.dtype))
            self._exact("reshape_and_cache", v_cache[s // bs, s % bs], value.to(v_cache.device, v_cache.dtype))

    def paged_attention(self, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                        max_seq_len=None, num_splits=0, past_end_bug=False):
        """Rows of up to ``REFERENCE_MAX_QUERIES`` queries (decodes, speculative verification) are
        re-run through the reference on the same cache, at most ``REFERENCE_ROWS`` a step (a window
        that moves on with every step, so every row position is compared as the run goes; at
        real scale the reference gathering every row's context in float32 would cost more than
        the rest of the step). The reference runs at the step's end for all layers of a call's
        rows at once. Longer (prefill) rows, and every row in any case, are checked against the
        oracle by ``attn.output``."""
        got = self.inner.paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                                         max_seq_len=max_seq_len, num_splits=num_splits, past_end_bug=past_end_bug)
        qsl = query_start_loc.to("cpu", torch.int64)
        qlen = qsl[1:] - qsl[:-1]
        rows = torch.nonzero(qlen <= REFERENCE_MAX_QUERIES).flatten()
        if len(rows) == 0:
            return got
        if len(rows) > REFERENCE_ROWS:  # a rotating window of rows: every row is covered over the steps
            start = self._paged_steps * REFERENCE_ROWS % len(rows)
            rows = torch.cat([rows, rows])[start:start + REFERENCE_ROWS]
        tok = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in rows.tolist()])
        tok_d = upload(tok, q.device)
        tol = max(self.tol, LOW_PRECISION_TOL.get(k_cache.dtype, 0.0))
        key = (id(block_table), id(query_start_loc), id(seq_lens), tuple(rows.tolist()), float(scale), past_end_bug,
               q.shape[1:], q.dtype, k_cache.shape[1:], k_cache.dtype)
        with self._checking():
            kept = got.index_select(0, tok_d.to(got.device))
        self.paged.append(_PagedCall(key, rows, q, (k_cache, v_cache), block_table, qsl, seq_lens, scale, past_end_bug,
                                     tok_d, kept, tol))
        return got

    def _run_paged_references(self) -> None:
        """The reference for the pending paged_attention calls: one batched call per group of
        calls sharing rows, table and lengths (a step's layers)."""
        if not self.paged:
            return
        groups: dict = {}
        for c in self.paged:
            groups.setdefault(c.key, []).append(c)
        self.paged = []
        with self._checking():
            for calls in groups.values():
                self._paged_reference(calls)

    def _paged_reference(self, calls: list[_PagedCall]) -> None:
        """One group of calls sharing rows, table and lengths: the reference over them at once, compared."""
        c0 = calls[0]
        qlen = c0.query_start_loc[1:] - c0.query_start_loc[:-1]
        sub_qsl = torch.zeros(len(c0.rows) + 1, dtype=torch.int64)
        sub_qsl[1:] = torch.cumsum(qlen[c0.rows], 0)
        table = c0.block_table.index_select(0, upload(c0.rows, c0.block_table.device))
        want = paged_attention_layers([c.q.index_select(0, c.tok) for c in calls], [c.caches for c in calls], table,
                                      sub_qsl, c0.seq_lens.to("cpu", torch.int64)[c0.rows], c0.scale,
                                      past_end_bug=c0.past_end_bug)
        for c, w in zip(calls, want):
            self._close("paged_attention", c.got, w, c.tol)

    def mla_decode(self, q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits=0,
                   max_seq_len=None, seq_lens_cpu=None):
        """Decode and speculative-verification calls (up to ``REFERENCE_MAX_QUERIES`` query tokens a
        request) are re-run through the reference, every row. Longer calls are prefill rows sent through the
        decode path only to compare it with the prefill path (``mla.paths``), which checks them.

        ``seq_lens_cpu``: the same lengths on the host (vLLM's attention metadata carries them beside
        the device's for the same reason), a hint only the checks take (the executor passes it where the
        kernels' ``mla_decode`` names it): the reference then runs in length groups, each padded to its own
        longest row (``ReferenceKernels.mla_decode_by_length``), where one call pads every row to the
        call's longest; reading the device's lengths back instead would make the host wait for the step."""
        got = self.inner.mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits,
                                    max_seq_len=max_seq_len)
        if q_lat.shape[1] > REFERENCE_MAX_QUERIES:
            return got
        with self._checking():
            if seq_lens_cpu is not None:
                want = self.ref.mla_decode_by_length(q_lat, q_pe, cache, block_table, seq_lens, seq_lens_cpu,
                                                     kv_lora_rank, scale, num_splits)
            else:
                want = self.ref.mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale,
                                           num_splits, max_seq_len=max_seq_len)
            # the reference computes in fp32; a bf16/fp16 cache feeds the kernel's matrix units in
            # that precision, so the bar is the dtype's (SPEC §7: rel. err <= 2e-2 for bf16)
            tol = max(self.tol, LOW_PRECISION_TOL.get(cache.dtype, 0.0))
            self._close("mla_decode", got[0], want[0], tol)
            self._close("mla_decode", got[1], want[1], tol)
        return got
