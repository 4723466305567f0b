"""The oracle: values recomputed from nothing but each request's committed tokens.

No block table, paged cache or copy is involved in what it computes; it is only told
where in the cache to *look* when it compares.

* Mamba: one slot per live request holds that request's state at its committed
  frontier (every layer). A step advances each scheduled request from its frontier
  through its newly committed tokens with the probe scan, from its own slot, and on
  the way compares, inside the same launch, every output with the system's and the
  state at each position the executor asks about (resume point, prefix hit, boundary
  states) with the cache pages the bookkeeping says hold it. A request whose frontier
  is past its computed count (preempted, then resumed from a prefix hit) or whose hit
  lies behind its frontier starts again from the zero state: memory is bounded by the
  running requests, not by history.
* MLA and GQA attention: dense causal attention in float64 over the committed prefix,
  recomputed each step from the token ids (K, V and latent entries are exact,
  ``layers/mla.py``, ``layers/gqa.py``); for MLA, queries absorbed or keys up-projected,
  whichever costs less for a batch (``MLAStack.attend``), equal up to float64 rounding. On a
  GPU float64 kernels do most of it, with no score in memory (``DenseOracle``'s ``fused``); the
  MLA prefill chunks' scores are exact integers there, from int8 digits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np
import torch

from .device.matmul import matmul_tf32
from .device.transfer import upload, upload_many
from .kernels.batching import CPU_CALL_ELEMS, worth_merging
from .kernels.probe_scan import ScanBuilder, ScanLaunch
from .layers.mamba import StackedTables
from .layers.exact import Q
from .layers.gqa import GQAProbe, GQAStack
from .layers.mla import LATENT_SHIFT, ROPE_SHIFT, MLAProbe, MLAStack


# Padding a batch of the torch path may take on a GPU (where, with the fused kernels, it holds only MLA decode
# rows): PAD_WORK times its real (query, key) pairs, plus SMALL_BATCH score elements (pairs times layers and
# heads): one call beats two small ones. deepseek_v3_mooncake's decode rows took 2.19 times their real work
# at twice plus 2**14 pairs (2.2 batches a step), 1.19 times at these (6.0 batches a step).
PAD_WORK = 1.25
SMALL_BATCH = 1 << 14
# The most the MLA oracle's rounded weights (its values' products on int8: ``DenseOracle``) may move an output, as a
# share of the check's tolerance (over the values' spread: a bound proven, n 2**-31 over n keys, not estimated).
# bf16's 2e-2 allows rows up to 42,949 keys; fp32's 1e-5 none (their values' products stay float64).
WEIGHTS_SHARE = 1e-3
STATE_DTYPE = torch.int16  # the Mamba oracle's own states: residues mod Q, below 2**15
assert Q < 1 << 15


@dataclass
class StateCompare:
    """Compare the state at ``position`` with the cache: temporal pages and conv pages (rows
    off..off+K-2) per layer (-1: skip that layer's part). ``tag`` comes back with the result."""

    position: int
    tpages: list[int]
    cpages: list[int]
    off: int
    tag: object


@dataclass
class OracleRow:
    rid: str
    tokens: list[int]  # the committed sequence (at least c + k tokens)
    c: int  # computed before this step
    k: int  # committed by this step (outputs of positions c..c+k-1 are compared)
    y_start: int  # where the system's outputs of this row start in y_ref
    compares: list[StateCompare] = field(default_factory=list)


class MambaOracle:
    def __init__(self, tables: StackedTables, max_requests: int, device: torch.device,
                 scan: Callable[[StackedTables, ScanLaunch], None]):
        self.t = tables
        self.scan = scan
        self.device = device
        L, K, dim = tables.layers, tables.K, tables.dim
        self.conv = torch.zeros(L, max_requests, K - 1, dim, dtype=torch.float32, device=device)
        # (int16: residues below Q fit; half the bytes of the cache's float32 pages, which a decode row's
        # scan reads and writes once each beside reading the system's page it compares)
        self.temporal = torch.zeros(L, max_requests, tables.H, tables.P, tables.N, dtype=STATE_DTYPE, device=device)
        self.identity = torch.arange(L, dtype=torch.int64, device=device)
        self.free = list(range(max_requests - 1, -1, -1))
        self.slot: dict[str, int] = {}
        self.frontier: dict[str, int] = {}

    def release(self, rid: str) -> None:
        s = self.slot.pop(rid, None)
        if s is not None:
            self.free.append(s)
        self.frontier.pop(rid, None)

    def _slot_of(self, rid: str) -> int:
        s = self.slot.get(rid)
        if s is None:
            if not self.free:
                raise RuntimeError("oracle: more live requests than max_num_seqs")
            s = self.slot[rid] = self.free.pop()
            self.frontier[rid] = 0
        return s

    def check(self, rows: list[OracleRow], cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              y_ref: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Advance every row through its committed tokens, comparing as asked. Returns
        stats (compares + rows, layers, 3) on the device — mismatching elements, max |diff|, first
        mismatching index — with the compare tags in row order, then one entry per row."""
        L = self.t.layers
        b = ScanBuilder(L)
        reads = []
        for r in rows:
            s = self._slot_of(r.rid)
            f = self.frontier[r.rid]
            if f > r.c or any(cp.position <= f for cp in r.compares):
                f = 0  # start over from the zero state (a resumed request, or a hit behind the frontier)
            end = r.c + r.k
            i = b.add_row(r.tokens[f:end], [s] * L if f > 0 else [-1] * L, y_from=r.c - f, y_count=r.k)
            reads.append(s if f > 0 else -1)
            b.write(i, end - f - 1, [s] * L, [s] * L)
            for cp in r.compares:
                b.compare(i, cp.position - f - 1, cp.tpages, cp.cpages, cp.off, cp.tag)
            self.frontier[r.rid] = end
        idx = upload(reads, self.device)
        window = self.conv[:, idx.clamp(min=0)].transpose(0, 1)  # (B, L, K-1, dim)
        window = torch.where((idx >= 0)[:, None, None, None], window, torch.zeros((), device=self.device))
        y_start = upload([r.y_start for r in rows], self.device)
        launch, tags = b.build(window.contiguous(), self.conv, self.temporal, self.identity, self.device,
                               y_start=y_start, cmp=cache, y_ref=y_ref)
        self.scan(self.t, launch)
        return launch.stats, tags


def fused_by_default(device) -> bool:
    """Whether the attention oracles run as float64 kernels (``DenseOracle``'s ``fused``): on a GPU."""
    return torch.device(device).type == "cuda"


class DenseOracle:
    """Expected attention outputs (float64, on the run's device) of committed query positions,
    every layer at once, rows batched with padding up to ``budget_elems`` elements a batch
    (scores, and each row's projected keys: for a decode row the keys are the larger part). ``stack`` is a layer kind's stacked probe (``MLAStack``, ``GQAStack``): its
    ``attend`` recomputes everything from token ids.

    On a GPU a batch may take padding up to a quarter of its real work (``PAD_WORK``, ``SMALL_BATCH``
    more): its calls cost little there next to an MLA decode row's float64 products. A CPU computes
    every padded element (scores and keys) at full price and slows down once a batch's scores leave its
    cache, so there pieces merge only where one call costs less than two and the scores stay in the
    cache (``kernels/batching.py``).
    Where keys cost projections (``GQAStack``) and ``memo_bytes`` allows, a CPU keeps each
    request's projected keys (``KeyMemo``): a long row then attends alone over them. A row too
    long for one piece (a long prefill chunk) has its keys projected once for all its pieces.

    ``fused`` (default: on a GPU): scores never in memory. GQA: no padded batches: rows are packed
    up to ``budget_elems`` elements of outputs (a longer row alone) and float64 kernels
    (``kernels/dense_attention_f64.py``) attend, each tile projecting its queries from their token
    ids (queries never in memory). A decode row's tile projects each key block from its token ids
    inside the kernel, its keys in ranges merged after; a long prefill chunk's keys are projected
    once into a bounded float32 workspace (``WORKSPACE_ELEMS``) that all its tiles read.
    MLA: a long prefill chunk's per-head keys are projected once (exactly: int32 from int8 products,
    or float32) and one kernel attends over them (``_expected_latent``): its scores exact from int8
    digits where the tables' bounds allow (``kernels/digit_attention_f64.py``, its ``digits_fit``), else all
    in float64; and then its values' products too where the values fit their digits (``value_digits_fit``)
    and the row's proven rounding bound is within ``weights_within`` (the executor: ``WEIGHTS_SHARE`` of the
    check's tolerance): the softmax weights rounded to integers of 2**-30, each output within n 2**-31 of
    the values' spread from float64's over the row's n keys (``value_digits_for``)."""

    def __init__(self, stack, device: torch.device, budget_elems: int = 1 << 27, work_bound: bool | None = None,
                 memo_bytes: int = 0, fused: bool | None = None, absorbed_kernel: bool = False,
                 digit_scores: bool | None = None, digit_values: bool | None = None, weights_within: float = 0.0):
        self.stack = stack
        self.device = device
        # batching for a machine where the work, not the calls, is the cost (default: a CPU)
        self.work_bound = torch.device(device).type == "cpu" if work_bound is None else work_bound
        self.budget = budget_elems
        self.memo = KeyMemo(stack, memo_bytes) if memo_bytes and self.work_bound and hasattr(stack, "keys") else None
        if fused is None:
            fused = fused_by_default(device)
        self.fused = fused
        self.mla = isinstance(stack, MLAStack)
        self.absorbed_kernel = absorbed_kernel  # (MLA, fused: see _expected_latent)
        # (MLA, fused: expanded rows' scores exact from int8 digits where the tables' bounds allow; False: float64)
        self.digit_scores = self.mla and fused and digit_scores is not False and _digits_fit(stack)
        # (and their values' products from digits, the weights integers, where the rounding's bound is within
        # ``weights_within``; False: float64 products)
        self.digit_values = self.digit_scores and digit_values is not False and _value_digits_fit(stack)
        self.weights_within = weights_within
        self.stack32 = stack.cast(torch.float32) if fused and not self.mla else None  # the GQA kernel's tables

    def value_digits_for(self, n_keys: int) -> bool:
        """Whether an expanded row over ``n_keys`` keys takes its values' products from digits, its weights
        rounded (``weights_within``)."""
        return self.digit_values and _weights_bound(n_keys) <= self.weights_within

    def forget(self, key) -> None:
        """A request that left (finished, preempted): its kept keys go."""
        if self.memo is not None:
            self.memo.forget(key)

    def expected(self, rows: list[tuple[np.ndarray, int, int]], keys: list | None = None) -> list[torch.Tensor]:
        """rows: (committed tokens, c, k). Returns per row (layers, k, H, v): attention of positions
        c..c+k-1 over the tokens [0, c+k). ``keys``: each row's request (for the key memo)."""
        if self.fused:
            return self._expected_latent(rows) if self.mla else self._expected_fused(rows)
        return self._expected_batched(rows, keys)

    def _expected_batched(self, rows: list[tuple[np.ndarray, int, int]], keys: list | None) -> list[torch.Tensor]:
        """The torch path: rows' query pieces in padded batches (or, with the key memo, over kept keys)."""
        per_q = self.stack.layers * self.stack.heads  # score elements per query and key
        per_k = self.stack.layers * self.stack.key_elems  # K/V (or latent) elements per key and row
        out: list[list[tuple[int, torch.Tensor]]] = [[] for _ in rows]
        pieces = []  # (row, q0, q1): a row's queries split so one piece fits the budget
        for i, (toks, c, k) in enumerate(rows):
            kv = None
            step = max(1, (self.budget // (c + k) - per_k) // per_q)
            if self.memo is not None and keys is not None and (c + k) * per_k >= CPU_CALL_ELEMS:
                kv = self.memo.get(keys[i], toks, c + k)  # (None: the memo is full)
            if kv is None and step < k and hasattr(self.stack, "keys"):
                # a row whose queries take several pieces: its keys once, not once a piece
                n = c + k
                kv = self.stack.keys(upload(toks[:n], self.device), torch.arange(n, device=self.device), n)
            if kv is not None:  # alone, over keys it has, its queries in pieces
                step = max(1, (self.budget // (c + k)) // per_q)
                for q0 in range(0, k, step):
                    q1 = min(k, q0 + step)
                    qtok = upload(toks[c + q0: c + q1], self.device)
                    qpos = torch.arange(c + q0, c + q1, device=self.device)
                    res = self.stack.attend_keys(kv[0][:, : c + q1], kv[1][:, : c + q1], qtok, qpos)
                    out[i].append((q0, res[:, 0]))
                continue
            pieces += [(i, q0, min(k, q0 + step)) for q0 in range(0, k, step)]
        # (queries, keys): a piece's last query sees c + q1 keys (causal), so earlier pieces of a
        # long prefill chunk need fewer keys than the row has
        size = lambda p: (p[2] - p[1], rows[p[0]][1] + p[2])  # noqa: E731
        elems = lambda b, q, n: b * n * (q * per_q + per_k)  # noqa: E731
        pieces.sort(key=lambda p: size(p), reverse=True)
        start = 0
        while start < len(pieces):  # batches padded to their largest piece
            q_max, n_max = size(pieces[start])
            end, actual = start + 1, q_max * n_max
            while end < len(pieces):
                q, n = size(pieces[end])
                b, n2 = end - start + 1, max(n_max, n)
                merged = elems(b, q_max, n2)
                if merged > self.budget:
                    break
                if self.work_bound:  # (a piece alone may pass the cache bound: split, it projects its keys again)
                    if not worth_merging(merged, elems(b - 1, q_max, n_max) + elems(1, q, n), b * q_max * n2 * per_q):
                        break
                elif b * q_max * n2 > PAD_WORK * (actual + q * n) + SMALL_BATCH / per_q:
                    break
                n_max, actual, end = n2, actual + q * n, end + 1
            batch = pieces[start:end]
            tok = np.zeros((len(batch), n_max), dtype=np.int64)
            qpos = np.zeros((len(batch), q_max), dtype=np.int64)
            for j, (i, q0, q1) in enumerate(batch):
                toks, c, k = rows[i]
                tok[j, : c + q1] = toks[: c + q1]
                qpos[j] = np.minimum(c + q0 + np.arange(q_max), c + q1 - 1)  # padding repeats the last query
            res = self._attend(upload(tok, self.device), upload(qpos, self.device))
            for j, (i, q0, q1) in enumerate(batch):
                out[i].append((q0, res[:, j, : q1 - q0]))
            start = end
        return [_joined(parts) for parts in out]

    def _attend(self, tok: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """``stack.attend`` over padded rows; on a GPU an MLA stack's latents from one kernel
        (``kernels/probe_latents.py``: the same values)."""
        if not (self.mla and tok.is_cuda):
            return self.stack.attend(tok, qpos)
        n = tok.shape[1]
        return self.stack.attend(tok, qpos, lat=self._latents(tok, torch.arange(n, device=tok.device), n))

    def _latents(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int, dtype: torch.dtype = torch.float64):
        """The MLA stack's ``latents_at`` (every layer) from one kernel (``kernels/probe_latents.py``)."""
        from .kernels.probe_latents import latent_rows
        st = self.stack
        return latent_rows(st.key1, st.key2, st.geo.qk_rope_head_dim, tok, pos, n_pos, LATENT_SHIFT, ROPE_SHIFT, dtype)

    def _expected_fused(self, rows: list[tuple[np.ndarray, int, int]]) -> list[torch.Tensor]:
        """Rows in groups whose float64 outputs fit the budget (the kernels keep no queries in memory)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        per_query = self.stack.layers * self.stack.heads * self.stack.geo.head_dim  # elements of a query's output
        group: list[int] = []
        used = 0
        for i, (_, c, k) in enumerate(rows):
            if group and used + k * per_query > self.budget:
                self._fused_group(rows, group, out)
                group, used = [], 0
            group.append(i)
            used += k * per_query
        if group:
            self._fused_group(rows, group, out)
        return out

    def _fused_group(self, rows, group: list[int], out: list) -> None:
        """``probe_attention`` over the group's packed rows: queries and keys from token ids, the
        queries projected in each tile, the keys inside the kernel or, for long rows, once into
        its workspace; o (layers, queries, heads, D) float64."""
        from .kernels.dense_attention_f64 import probe_attention
        p = _Packed(rows, [(i, 0, rows[i][2]) for i in group])
        o = probe_attention(self.stack32, upload(p.tokens, self.device), p.q_start, p.q_len, p.k_start, p.pos0)
        for i, qs, ql in zip(group, p.q_start, p.q_len):
            out[i] = o[:, qs:qs + ql]

    def _expected_latent(self, rows: list[tuple[np.ndarray, int, int]]) -> list[torch.Tensor]:
        """MLA, fused: each row in its cheaper association (``MLAStack.expands``). An expanded row
        (a long prefill chunk) goes alone to one kernel over keys in memory, a layer at a time (its
        per-head keys are the large part): scores exact from int8 digits
        (``kernels/digit_attention_f64.py``; on an H200 the step's prefill chunks of ``bench_oracle``
        took 86.3 ms against 107.4 with float64 scores) where ``digit_scores``, else float64 ones
        (``kernels/latent_attention_f64.py``). Absorbed rows (decodes) take the torch path's padded
        batches: on an H200 the same
        kernel over the latent (``absorbed_kernel``) took 48.9 ms where torch took 40.9 for
        ``bench_oracle``'s DeepSeek-V3 step (its 576-wide queries do not fit in registers). With
        ``absorbed_kernel`` they go in groups whose queries, latent outputs and outputs fit the
        budget (a longer row's queries in pieces)."""
        st = self.stack
        g = st.geo
        H, Lr, R, V, Ly = st.heads, g.kv_lora_rank, g.qk_rope_head_dim, g.v_head_dim, st.layers
        out: list[list[tuple[int, torch.Tensor]]] = [[] for _ in rows]
        per_query = Ly * H * (2 * (Lr + R) + V)  # float64 elements: its query, latent output and output
        per_key = Ly * (Lr + R)
        group: list[tuple[int, int, int]] = []  # (row, first query, queries): absorbed pieces
        used = 0
        batched: list[int] = []  # absorbed rows for the torch path
        for i, (_, c, k) in enumerate(rows):
            n = c + k
            if Lr <= 1 << 10 and st.expands(1, k, n, bounded=False):
                self._expanded_row(rows[i], out[i])
                continue
            if not self.absorbed_kernel:
                batched.append(i)
                continue
            step = max(1, (self.budget - n * per_key) // per_query)
            for q0 in range(0, k, step):
                q1 = min(k, q0 + step)
                cost = (q1 - q0) * per_query + (c + q1) * per_key
                if group and used + cost > self.budget:
                    self._absorbed_group(rows, group, out)
                    group, used = [], 0
                group.append((i, q0, q1))
                used += cost
        if group:
            self._absorbed_group(rows, group, out)
        if batched:
            for i, o in zip(batched, self._expected_batched([rows[i] for i in batched], None)):
                out[i].append((0, o))
        return [_joined(parts) for parts in out]

    def _absorbed_group(self, rows, group: list[tuple[int, int, int]], out: list) -> None:
        """Queries absorbed into the latent space, keys the latent entries themselves (values: their
        kv_c part, the same memory), then W_UV on the latent outputs."""
        from .kernels.latent_attention_f64 import latent_attention
        st = self.stack
        Lr = st.geo.kv_lora_rank
        p = _Packed(rows, group)
        kpos = np.concatenate([np.arange(m) for m in p.n])
        tok_d, kpos_d, qtok_d, qpos_d = upload_many([p.tokens, kpos, p.qtok, p.qpos], self.device)
        lat = self._latents(tok_d, kpos_d, p.n_pos, torch.float32)[:, :, None]  # exact: (Ly, keys, 1, Lr + R)
        q = st.absorbed_queries(qtok_d, qpos_d, p.n_pos)
        o_lat = latent_attention(q, lat, lat[..., :Lr], p.q_start, p.q_len, p.k_start, p.pos0, st.scale)
        del q
        o = torch.einsum("lqkr,lkrv->lqkv", o_lat, st.w_uv)
        for (i, q0, _), qs, ql in zip(group, p.q_start, p.q_len):
            out[i].append((q0, o[:, qs:qs + ql]))

    def _expanded_row(self, row, out_row: list) -> None:
        """One row with every key up-projected per head, a layer at a time, and the heads in groups
        whose keys and values fit the budget (a long chunk over long context: all of them at once
        would be gigabytes)."""
        from .kernels.latent_attention_f64 import latent_attention
        st = self.stack
        g = st.geo
        toks, c, k = row
        n = c + k
        tok_d, pos_d = upload_many([toks[:n], np.arange(n)], self.device)
        o = torch.empty((st.layers, k, st.heads, g.v_head_dim), dtype=torch.float64, device=self.device)
        if self.digit_scores:
            self._expanded_row_digits(tok_d, pos_d, c, k, o)
            out_row.append((0, o))
            return
        per_head = n * (g.qk_nope_head_dim + g.qk_rope_head_dim + g.v_head_dim)  # float32 key and value elements
        group = max(1, min(st.heads, self.budget // per_head))
        for layer in range(st.layers):  # (a long chunk's queries and latents of every layer at once: gigabytes)
            # (exact in float32: half the bytes of float64, the products on the tensor cores)
            q = torch.cat(st.queries(tok_d[c:], pos_d[c:], n, layer, torch.float32), dim=-1)  # (1, k, H, N + R)
            lat = st.latents_at(tok_d, pos_d, n, layer, torch.float32)[0]  # (n, Lr + R)
            for h0 in range(0, st.heads, group):
                heads = slice(h0, min(st.heads, h0 + group))
                with matmul_tf32():  # exact: ``MLAStack.expanded_keys``
                    kk, vv = st.expanded_keys(lat, layer, heads)
                latent_attention(q[:, :, heads], kk[None], vv[None], [0], [k], [0], [c], st.scale,
                                 out=o[layer:layer + 1, :, heads])
                del kk, vv
            del q, lat
        out_row.append((0, o))

    def _expanded_row_digits(self, tok_d: torch.Tensor, pos_d: torch.Tensor, c: int, k: int, o: torch.Tensor) -> None:
        """``_expanded_row`` with exact scores from int8 digits (``kernels/digit_attention_f64.py``): per layer
        the queries' digits and the keys' kv_c parts and k_pe digits, each from token ids in one kernel, then
        per group of heads k_nope's digits and the values as int32 integers or their digits in two
        (``kernels/digit_keys.py``: int8 products, exact), and one attention kernel."""
        from .kernels.digit_attention_f64 import digit_attention, query_digits
        from .kernels.digit_keys import expand_digits, key_parts
        st = self.stack
        g = st.geo
        n = c + k
        H = st.heads
        per_head = n * (g.qk_nope_head_dim + g.v_head_dim)  # 4-byte elements of a head's keys and values, at most
        group = max(1, min(H, self.budget // per_head))
        value_digits = self.value_digits_for(n)
        for layer in range(st.layers):
            qd = query_digits(*st.query_tables(), tok_d, pos_d, n, layer, first=c)  # (k, H, 2 N + 3 R), from token ids
            parts, kr = key_parts(*st.key_tables(), g.qk_rope_head_dim, tok_d, pos_d, n, layer)
            w_k, w_v = st.expansion_weights(layer)
            for h0 in range(0, H, group):
                heads = slice(h0, min(H, h0 + group))
                kd, vv = expand_digits(parts, w_k, w_v, heads, value_digits)  # exact integers or their digits
                digit_attention(qd[:, heads], kd, kr, vv, [0], [k], [0], [c], st.scale,
                                st.query_unit * st.nope_key_unit, st.rope_unit * st.rope_unit, out=o[layer, :, heads],
                                unit_value=st.value_unit)
                del kd, vv
            del qd, parts, kr


def _digits_fit(stack: MLAStack) -> bool:
    """Whether the MLA stack's scores can be taken exactly from int8 digits (``kernels/digit_attention_f64``)."""
    from .kernels.digit_attention_f64 import digits_fit
    from .kernels.digit_keys import expand_widths_fit
    g = stack.geo
    return (digits_fit(stack.integer_bounds, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, g.kv_lora_rank)
            and expand_widths_fit(g.kv_lora_rank))


def _weights_bound(n_keys: int) -> float:
    """The most rounding the weights to integers of 2**-WEIGHT_BITS moves an output over ``n_keys`` keys, over
    the values' spread: n 2**-(WEIGHT_BITS + 1) (``kernels/digit_attention_f64``: each weight off by at most
    half a unit, their sum at least one whole)."""
    from .kernels.digit_attention_f64 import WEIGHT_BITS
    return n_keys * 2.0 ** -(WEIGHT_BITS + 1)


def _value_digits_fit(stack: MLAStack) -> bool:
    """Whether the MLA stack's values fit the digits whose products ``digit_attention`` takes."""
    from .kernels.digit_attention_f64 import value_digits_fit
    return value_digits_fit(stack.integer_bounds, stack.geo.v_head_dim)


def _joined(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """A row's pieces (first query, outputs (layers, queries, ...)) in query order along dim 1; a row in
    one piece as it is (a long chunk's outputs are a gigabyte: no copy)."""
    if len(parts) == 1:
        return parts[0][1]
    return torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])], dim=1)


class _Packed:
    """Rows' query pieces (row, first query, end) packed for the float64 kernels' layout: a piece
    owns its row's tokens up to its last query (``n`` of them, from ``k_start`` in ``tokens``) and
    its queries (``q_len`` of them, from ``q_start`` in ``qtok`` and ``qpos``, the first at
    position ``pos0``)."""

    def __init__(self, rows: list[tuple[np.ndarray, int, int]], pieces: list[tuple[int, int, int]]):
        self.n = [rows[i][1] + q1 for i, _, q1 in pieces]  # keys a piece's last query sees
        self.pos0 = [rows[i][1] + q0 for i, q0, _ in pieces]
        self.q_len = [q1 - q0 for _, q0, q1 in pieces]
        self.k_start = np.concatenate([[0], np.cumsum(self.n)[:-1]]).tolist()
        self.q_start = np.concatenate([[0], np.cumsum(self.q_len)[:-1]]).tolist()
        self.tokens = np.concatenate([rows[i][0][:m] for (i, _, _), m in zip(pieces, self.n)])
        self.n_pos = max(self.n)

    @cached_property
    def qtok(self) -> np.ndarray:
        """The pieces' query tokens: each piece's own tokens from position pos0 (the MLA kernel
        takes them; the GQA kernels read them from ``tokens`` in place)."""
        return np.concatenate([self.tokens[k + p:k + m] for k, p, m in zip(self.k_start, self.pos0, self.n)])

    @cached_property
    def qpos(self) -> np.ndarray:
        return np.concatenate([np.arange(p, m) for p, m in zip(self.pos0, self.n)])


@dataclass
class _Kept:
    """One request's kept keys: its first ``len(tokens)`` tokens' K and V, in tensors with room for more."""

    tokens: np.ndarray  # (n,) int64
    k: torch.Tensor  # (layers, capacity, K, D)
    v: torch.Tensor

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KeyMemo:
    """The K and V a CPU oracle projected for each live request's committed tokens (float64, exact),
    so a step projects only the tokens new to it. Without it a decode row over 2,000 tokens
    projects all 2,000 again each step: the vLLM-recorded golden traces spent most of their replay
    there. Committed tokens never change, but each use checks the kept prefix against the row's
    tokens all the same. At most ``budget_bytes`` in all: a request that would pass it is not kept."""

    def __init__(self, stack, budget_bytes: int):
        self.stack = stack
        self.budget = budget_bytes
        self.used = 0
        self.rows: dict[object, _Kept] = {}

    def forget(self, key) -> None:
        row = self.rows.pop(key, None)
        if row is not None:
            self.used -= row.bytes

    def get(self, key, tokens: np.ndarray, n: int):
        """K, V (layers, >= n, K, D) whose first n rows are tokens[:n]'s (a row may see more
        tokens kept than it needs: a preempted request computing its prefix again), or None."""
        row = self.rows.get(key)
        if row is not None and (row.n > len(tokens) or not np.array_equal(row.tokens, tokens[: row.n])):
            self.forget(key)
            row = None
        have = row.n if row is not None else 0
        if have < n:
            dev = self.stack.emb1.device
            k, v = self.stack.keys(upload(tokens[have:n], dev), torch.arange(have, n, device=dev), n)
            if row is None or row.k.shape[1] < n:  # room for twice as many tokens
                cap = max(64, 2 * n)
                grown = _Kept(row.tokens if row is not None else tokens[:0],
                              *(torch.empty((k.shape[0], cap, *k.shape[2:]), dtype=k.dtype, device=k.device)
                                for _ in (k, v)))
                add = grown.bytes - (row.bytes if row is not None else 0)
                if self.used + add > self.budget:
                    return None if row is None else self._without(key, k, v, row)
                if row is not None:
                    grown.k[:, :have], grown.v[:, :have] = row.k[:, :have], row.v[:, :have]
                self.used += add
                row = self.rows[key] = grown
            row.k[:, have:n], row.v[:, have:n] = k, v
            row.tokens = np.array(tokens[:n])
        return row.k, row.v

    def _without(self, key, k, v, row: _Kept):
        """The memo is full: this request's keys once more, whole, and it is kept no longer."""
        whole = (torch.cat([row.k[:, :row.n], k], dim=1), torch.cat([row.v[:, :row.n], v], dim=1))
        self.forget(key)
        return whole


MLA_ORACLE_ELEMS = 1 << 28  # float64 elements of one MLA oracle batch: scores and latent keys


def MLAOracle(probes: list[MLAProbe], device: torch.device, budget_elems: int = MLA_ORACLE_ELEMS,
              work_bound: bool | None = None, fused: bool | None = None, absorbed_kernel: bool = False,
              digit_scores: bool | None = None, digit_values: bool | None = None,
              weights_within: float = 0.0) -> DenseOracle:
    """Dense float64 attention over the committed tokens of every MLA layer (``digit_scores`` False: the
    fused path's expanded rows take float64 scores even where exact int8 digits would do; ``digit_values``
    False: float64 products of their weights and values, where the values' digits would do;
    ``weights_within``: how far rounding the weights may move an output, over the values' spread, for the
    values' digits to be taken (0: never; the executor passes ``WEIGHTS_SHARE`` of its tolerance))."""
    return DenseOracle(MLAStack(probes, device), device, budget_elems, work_bound, fused=fused,
                       absorbed_kernel=absorbed_kernel, digit_scores=digit_scores, digit_values=digit_values,
                       weights_within=weights_within)


def GQAOracle(probes: list[GQAProbe], device: torch.device, budget_elems: int = 1 << 26,
              work_bound: bool | None = None, memo_bytes: int = 0, fused: bool | None = None) -> DenseOracle:
    """Dense float64 causal attention over the committed tokens of every GQA layer."""
    return DenseOracle(GQAStack(probes, device), device, budget_elems, work_bound, memo_bytes, fused)
