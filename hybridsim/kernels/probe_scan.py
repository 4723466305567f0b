"""The Mamba probe's batched scan: many rows, every layer, one launch.

A *launch* advances each row (a run of tokens of one sequence) from an initial state
through every Mamba layer at once, and on the way

* writes the state after chosen tokens into pages of a state tensor (events; the
  executor's cache writes, or the oracle's own per-request slots),
* writes a draft row's conv history (K-2+n rows) into a page,
* writes every token's output ``y`` (the system under test), or compares it with
  outputs computed earlier (the oracle), and
* compares the state after chosen tokens with pages of another tensor (the oracle
  checking the cache), counting mismatching elements per (comparison, layer).

It knows tensors, pages and token indices; it does not know requests or columns.
Two implementations with identical results (the arithmetic is exact):

* ``scan_reference`` — torch, in the chunked matrix form (the same trick as Mamba2's
  SSD): within a chunk of T tokens, h_t = A_t (h_0 + sum_{i<=t} (x'_i / A_i) B_i^T), where
  the decays are powers of a generator of the multiplicative group mod Q, so the running
  product A_t and its inverse are table lookups and the recurrence becomes a prefix sum
  (exact: no division by small numbers as in real arithmetic). The only T x T matrix is
  C B^T per group. Matrix products run in float64, exact for residues < 2**11. No loop
  over tokens: a loop over chunks, as long as memory allows.
* ``scan_triton`` (``probe_scan_triton.py``) — one program per (row, layer, head,
  head-dim tile) walks the row's tokens in order with the state tile in registers; rows of
  32 tokens or more go to ``probe_scan_chunked.py``, this chunked form on int8 tensor cores.

The token-by-token definition lives in ``layers/mamba.py`` (``MambaProbe.token_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..device.transfer import upload_many
from ..layers.exact import Q, mod_q, pow_table
from ..layers.mamba import StackedTables, hash_channels, head_terms

NO_MISMATCH = 1 << 62  # "first mismatching index" when there is none
NAN_DIFF = 1 << 31  # |difference| reported for a NaN (unwritten) element


@dataclass
class ScanLaunch:
    """One scan over ``B`` rows and ``L`` layers. Page tensors: conv (slots, pages, R, dim) and
    temporal (slots, pages, H, P, N), float32 residues; ``*_slot`` (L,) maps a layer to its
    slot (the engine shares one tensor between the i-th layers of every Mamba group).
    Events and comparisons are sorted by row, then token; ``*_ptr`` (B+1,) delimit each row's."""

    tokens: torch.Tensor  # (T,) int64
    row_start: torch.Tensor  # (B,) first token of each row in ``tokens``
    row_len: torch.Tensor  # (B,) tokens per row, >= 1
    init_window: torch.Tensor  # (B, L, K-1, dim) float32: the conv window each row starts from
    init_tpage: torch.Tensor  # (B, L) temporal page each row starts from; -1: the zero state
    state_conv: torch.Tensor
    state_temporal: torch.Tensor
    state_slot: torch.Tensor  # (L,)
    ev_ptr: torch.Tensor  # (B+1,)
    ev_t: torch.Tensor  # (E,) write the state after this token of the row ...
    ev_tpage: torch.Tensor  # (E, L) ... its temporal part into this page (-1: not)
    ev_cpage: torch.Tensor  # (E, L) ... its conv window into rows 0..K-2 of this page (-1: not)
    hist_cpage: Optional[torch.Tensor] = None  # (B, L): rows 1..K-2 of the window then u_0..u_{n-1}
    y_out: Optional[torch.Tensor] = None  # (Ty, L, H*P) int32: y of token j of row b at y_start[b] + j
    y_start: Optional[torch.Tensor] = None  # (B,)
    # comparisons (the oracle)
    cmp_conv: Optional[torch.Tensor] = None
    cmp_temporal: Optional[torch.Tensor] = None
    cmp_slot: Optional[torch.Tensor] = None
    cmp_ptr: Optional[torch.Tensor] = None  # (B+1,)
    cmp_t: Optional[torch.Tensor] = None  # (C,) compare the state after this token ...
    cmp_tpage: Optional[torch.Tensor] = None  # (C, L) ... with this temporal page (-1: skip)
    cmp_cpage: Optional[torch.Tensor] = None  # (C, L) ... and rows off..off+K-2 of this conv page (-1: skip)
    cmp_off: Optional[torch.Tensor] = None  # (C,)
    y_ref: Optional[torch.Tensor] = None  # (Ty, L, H*P) int32 outputs to compare with
    y_from: Optional[torch.Tensor] = None  # (B,) outputs of tokens y_from .. y_from+y_count-1 are
    y_count: Optional[torch.Tensor] = None  # (B,)    compared with y_ref[y_start + j - y_from]
    stats: Optional[torch.Tensor] = None  # (C + B, L, 3) int64: mismatches, max |diff|, first index
    # on the host too (``build`` knows them): which kernel takes a row needs no read-back
    host_len: Optional[list[int]] = None  # (B,) row_len
    host_hist: Optional[list[bool]] = None  # (B,) whether the row writes a conv history

    @property
    def rows(self) -> int:
        return self.row_len.shape[0]

    @property
    def compares(self) -> bool:
        return self.stats is not None


def new_stats(n_cmp: int, rows: int, layers: int, device) -> torch.Tensor:
    st = torch.zeros(n_cmp + rows, layers, 3, dtype=torch.int64, device=device)
    st[..., 2] = NO_MISMATCH
    return st


@dataclass
class ScanBuilder:
    """Host-side assembly of a launch: rows, their events and comparisons, in any order."""

    layers: int
    tokens: list[np.ndarray] = field(default_factory=list)
    n_tokens: int = 0
    row_start: list[int] = field(default_factory=list)
    row_len: list[int] = field(default_factory=list)
    init_tpage: list[list[int]] = field(default_factory=list)
    events: list[tuple[int, int, list[int], list[int]]] = field(default_factory=list)
    hist: list[Optional[list[int]]] = field(default_factory=list)
    cmps: list[tuple[int, int, list[int], list[int], int, object]] = field(default_factory=list)
    y_from: list[int] = field(default_factory=list)
    y_count: list[int] = field(default_factory=list)

    def add_row(self, tokens, init_tpage: list[int], hist: Optional[list[int]] = None,
                y_from: int = 0, y_count: int = 0) -> int:
        toks = np.asarray(tokens, dtype=np.int64)
        self.row_start.append(self.n_tokens)
        self.tokens.append(toks)
        self.n_tokens += len(toks)
        self.row_len.append(len(toks))
        self.init_tpage.append(init_tpage)
        self.hist.append(hist)
        self.y_from.append(y_from)
        self.y_count.append(y_count)
        return len(self.row_len) - 1

    def write(self, row: int, t: int, tpages: list[int], cpages: list[int]) -> None:
        self.events.append((row, t, tpages, cpages))

    def compare(self, row: int, t: int, tpages: list[int], cpages: list[int], off: int, tag: object) -> None:
        """``tag`` comes back from ``build`` at the comparison's index into ``stats``."""
        self.cmps.append((row, t, tpages, cpages, off, tag))

    def build(self, init_window: torch.Tensor, state_conv, state_temporal, state_slot, device,
              y_out=None, y_start=None, cmp=None, y_ref=None) -> tuple[ScanLaunch, list]:
        """The launch, and the comparison tags in ``stats`` order. Every index vector goes to
        the device in one upload."""
        B, L = len(self.row_len), self.layers
        ev = sorted(self.events, key=lambda e: (e[0], e[1]))
        host: dict[str, np.ndarray] = {
            "tokens": np.concatenate(self.tokens), "row_start": np.asarray(self.row_start),
            "row_len": np.asarray(self.row_len), "init_tpage": np.asarray(self.init_tpage).reshape(B, L),
            "ev_ptr": np.asarray(_row_ptr([e[0] for e in ev], B)), "ev_t": np.asarray([e[1] for e in ev]),
            "ev_tpage": np.asarray([e[2] for e in ev]).reshape(len(ev), L),
            "ev_cpage": np.asarray([e[3] for e in ev]).reshape(len(ev), L)}
        if any(h is not None for h in self.hist):
            host["hist_cpage"] = np.asarray([h if h is not None else [-1] * L for h in self.hist]).reshape(B, L)
        tags: list = []
        if cmp is not None:
            order = sorted(range(len(self.cmps)), key=lambda i: (self.cmps[i][0], self.cmps[i][1]))
            cm = [self.cmps[i] for i in order]
            tags = [c[5] for c in cm]
            host.update(cmp_ptr=np.asarray(_row_ptr([c[0] for c in cm], B)), cmp_t=np.asarray([c[1] for c in cm]),
                        cmp_tpage=np.asarray([c[2] for c in cm]).reshape(len(cm), L),
                        cmp_cpage=np.asarray([c[3] for c in cm]).reshape(len(cm), L),
                        cmp_off=np.asarray([c[4] for c in cm]), y_from=np.asarray(self.y_from),
                        y_count=np.asarray(self.y_count))
        dev = dict(zip(host, upload_many(list(host.values()), device)))
        launch = ScanLaunch(
            tokens=dev["tokens"], row_start=dev["row_start"], row_len=dev["row_len"], init_window=init_window,
            init_tpage=dev["init_tpage"], state_conv=state_conv, state_temporal=state_temporal, state_slot=state_slot,
            ev_ptr=dev["ev_ptr"], ev_t=dev["ev_t"], ev_tpage=dev["ev_tpage"], ev_cpage=dev["ev_cpage"],
            hist_cpage=dev.get("hist_cpage"), y_out=y_out, y_start=y_start,
            host_len=list(self.row_len), host_hist=[h is not None and any(p >= 0 for p in h) for h in self.hist])
        if cmp is not None:
            launch.cmp_conv, launch.cmp_temporal, launch.cmp_slot = cmp
            launch.cmp_ptr, launch.cmp_t, launch.cmp_off = dev["cmp_ptr"], dev["cmp_t"], dev["cmp_off"]
            launch.cmp_tpage, launch.cmp_cpage = dev["cmp_tpage"], dev["cmp_cpage"]
            launch.y_ref, launch.y_from, launch.y_count = y_ref, dev["y_from"], dev["y_count"]
            launch.stats = new_stats(len(cm), B, L, device)
        return launch, tags


def _row_ptr(rows: list[int], n: int) -> list[int]:
    """Row-sorted items' owning rows -> (n + 1,) offsets: row r's items are ptr[r]:ptr[r + 1]."""
    ptr = [0] * (n + 1)
    for r in rows:
        ptr[r + 1] += 1
    for i in range(n):
        ptr[i + 1] += ptr[i]
    return ptr


# ----------------------------------------------------------------------------- torch reference


def _residues(t: torch.Tensor) -> torch.Tensor:
    """Page contents (float32, or the oracle's int16) -> float64 residues; NaN (a page nothing wrote) reads as 0."""
    return torch.nan_to_num(t.double(), nan=0.0)


# The torch form computes in float64 holding exact integers: every value it forms stays below
# 2**53, where float64 arithmetic is exact, and the modulo vectorises (``mod_q``: int64 modulo is a
# scalar division per element on a CPU). Decay exponents are summed, then reduced mod Q - 1
# (the multiplicative group's order) to index the power table.


def _mod(x: torch.Tensor) -> torch.Tensor:
    return mod_q(x)


def _powers(device) -> torch.Tensor:
    """gamma**e mod Q for e in [0, Q-1) as float64 (cached per device)."""
    key = str(device)
    t = _POWERS.get(key)
    if t is None:
        t = _POWERS[key] = pow_table().double().to(device)
    return t


_POWERS: dict = {}


def _split(tables: StackedTables, z: torch.Tensor, tok: torch.Tensor):
    """z (b, L, T, dim) -> x (b, L, T, H, P), B and C (b, L, T, G, N)."""
    b, L, T, _ = z.shape
    H, P, G, N = tables.H, tables.P, tables.G, tables.N
    if tables.bc_from_conv:
        x = z[..., : H * P].reshape(b, L, T, H, P)
        Bm = z[..., H * P: H * P + G * N].reshape(b, L, T, G, N)
        Cm = z[..., H * P + G * N: H * P + 2 * G * N].reshape(b, L, T, G, N)
    else:
        x = z.reshape(b, L, T, 1, P)
        bc = hash_channels(tok.reshape(-1).double(), tables.bc, mod_q)
        bc = bc.reshape(L, b, T, 2 * N).transpose(0, 1)  # (b, L, T, 2N)
        Bm, Cm = bc[..., None, :N], bc[..., None, N:]
    return x, Bm, Cm


@dataclass
class _Chunk:
    """What one chunk leaves for reading states at any of its tokens (layouts in comments;
    G groups of R = H / G heads, a group's heads side by side as R*P columns)."""

    w: torch.Tensor  # (b, L, G, T, R*P) gamma**-E_i x'_i: the inputs brought back to decay 1
    Bg: torch.Tensor  # (b, L, G, T, N)
    A: torch.Tensor  # (b, L, T, H) gamma**E_t: the running decay
    U: torch.Tensor  # (b, L, K-1+T, dim) the conv inputs, starting window first


_CAUSAL: dict = {}


def _causal(T: int, device) -> torch.Tensor:
    """(T, T) bool, True on and below the diagonal (cached per size and device)."""
    key = (T, str(device))
    m = _CAUSAL.get(key)
    if m is None:
        m = _CAUSAL[key] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return m


def _chunk(tables: StackedTables, tok: torch.Tensor, window: torch.Tensor, h0: torch.Tensor):
    """One chunk of T tokens for b rows (every row has T tokens here; padding is harmless
    because token t only ever influences later tokens). Returns y (b, T, L, H, P) and the
    ``_Chunk`` to read states from.

    Decays are powers of a generator of the multiplicative group mod Q, so the running product
    A_t = gamma**E_t (E_t the sum of the exponents up to t) has an exact inverse, and
    h_t = A_t (h0 + sum_{i<=t} w_i B_i^T) with w_i = x'_i / A_i: the recurrence is a prefix sum.
    The only T x T matrix is C B^T per group (masked causal); every head of the group shares it."""
    b, T = tok.shape
    L, K, H, G, P, N = tables.layers, tables.K, tables.H, tables.G, tables.P, tables.N
    R = H // G
    flat = tok.reshape(-1).double()
    u = hash_channels(flat, tables.emb, mod_q).reshape(L, b, T, -1).transpose(0, 1)  # (b, L, T, dim)
    U = torch.cat([window, u], dim=2)  # (b, L, K-1+T, dim)
    w_conv = tables.conv_w.double()  # (L, K, dim)
    z = tables.conv_b.double()[None, :, None, :] + U[:, :, :T] * w_conv[None, :, None, 0]
    for k in range(1, K):  # tap by tap over contiguous slices (sums < 2**25: exact)
        z = z + U[:, :, k:k + T] * w_conv[None, :, None, k]
    x, Bm, Cm = _split(tables, _mod(z), tok)
    e, g = head_terms(flat, tables.head)  # (L, bT, H)
    E = (torch.cumsum(e.reshape(L, b, T, H).transpose(0, 1), dim=2) % (Q - 1)).long()  # (b, L, T, H)
    pw = _powers(tok.device)
    A, A_inv = pw[E], pw[(Q - 1 - E) % (Q - 1)]
    g = g.reshape(L, b, T, H).transpose(0, 1)  # (b, L, T, H)
    w = _mod(_mod(g * A_inv)[..., None] * x)  # (b, L, T, H, P)
    wg = w.reshape(b, L, T, G, R * P).transpose(2, 3)  # (b, L, G, T, R*P)
    Bg, Cg = Bm.transpose(2, 3), Cm.transpose(2, 3)  # (b, L, G, T, N)
    causal = _causal(T, tok.device)
    CB = torch.where(causal, _mod(torch.matmul(Cg, Bg.transpose(-1, -2))), 0.0)  # (b, L, G, T, T)
    h0g = h0.reshape(b, L, G, R, P, N).permute(0, 1, 2, 5, 3, 4).reshape(b, L, G, N, R * P)
    # y_t = A_t (C_t . h0 + sum_{i<=t} (C_t . B_i) w_i) + D x_t; each sum < 2**42, exact in float64
    s = _mod(torch.matmul(Cg, h0g) + torch.matmul(CB, wg))  # (b, L, G, T, R*P)
    s = s.transpose(2, 3).reshape(b, L, T, H, P)
    y = _mod(A[..., None] * s + tables.D.double()[None, :, None, :, None] * x)  # (b, L, T, H, P)
    return y.transpose(1, 2), _Chunk(wg, Bg, A, U)


def _states_at(sel: torch.Tensor, ts: torch.Tensor, ch: _Chunk, h0, K: int):
    """States after token ts[k] of row sel[k]: windows (k, L, K-1, dim), h (k, L, H, P, N)."""
    k = sel.shape[0]
    L, G, T = ch.w.shape[1], ch.w.shape[2], ch.w.shape[3]
    H = ch.A.shape[-1]
    upto = (torch.arange(T, device=ts.device)[None, :] <= ts[:, None]).to(ch.w.dtype)  # (k, T)
    wk = ch.w[sel] * upto[:, None, None, :, None]  # (k, L, G, T, R*P)
    S = torch.matmul(wk.transpose(-1, -2), ch.Bg[sel])  # (k, L, G, R*P, N): sums < 2**42
    S = S.reshape(k, L, H, -1, S.shape[-1])
    A = ch.A[sel, :, ts]  # (k, L, H)
    h = _mod(A[..., None, None] * _mod(h0[sel] + S))
    idx = ts[:, None] + 1 + torch.arange(K - 1, device=ts.device)[None, :]  # U rows t+1 .. t+K-1
    win = ch.U[sel[:, None], :, idx].permute(0, 2, 1, 3)  # (k, L, K-1, dim)
    return win, h


def _conv_rows(conv, slot, pages, off, K):
    """(k, L) pages -> their conv rows off..off+K-2, (k, L, K-1, dim) float32."""
    sl = slot[None, :].expand_as(pages)
    rows = off[:, None, None] + torch.arange(K - 1, device=pages.device)[None, None, :]  # (k, 1, K-1)
    return conv[sl[..., None], pages.clamp(min=0)[..., None], rows]


def _temporal_pages(temporal, slot, pages):
    """(k, L) pages -> their temporal states, (k, L, H, P, N) float32."""
    return temporal[slot[None, :].expand_as(pages), pages.clamp(min=0)]


def _mismatch(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor):
    """Page values ``got`` (k, L, ...) against residues ``want``, where ``mask`` (k, L) says the
    comparison is made: (mismatches, max |diff|, first mismatching element), each (k, L); None
    when every compared element is equal."""
    k, L = got.shape[:2]
    g = got.reshape(k, L, -1).double()
    w = want.reshape(k, L, -1).double()
    bad = ~(g == w) & mask[..., None]
    if not bool(bad.any()):  # the usual case: nothing to count or locate (this torch form reads back anyway)
        return None
    diff = torch.where(torch.isnan(g), torch.full_like(g, float(NAN_DIFF)), (g - w).abs())
    idx = torch.arange(g.shape[-1], device=g.device)
    count = bad.sum(-1)
    maxd = torch.where(bad, diff, torch.zeros_like(diff)).amax(-1).to(torch.int64) if g.shape[-1] else count
    first = torch.where(bad, idx, torch.full_like(idx, NO_MISMATCH)).amin(-1) if g.shape[-1] else count
    return count, maxd, first


def _accumulate(stats: torch.Tensor, rows: torch.Tensor, count, maxd, first) -> None:
    stats[rows, :, 0] += count
    stats[rows, :, 1] = torch.maximum(stats[rows, :, 1], maxd)
    stats[rows, :, 2] = torch.minimum(stats[rows, :, 2], first)


CHUNK_ELEMS = 1 << 22  # elements of a chunk's largest tensors: C B^T (rows x layers x groups x T x T), per-token terms


def scan_reference(tables: StackedTables, ln: ScanLaunch, chunk: int | None = None) -> None:
    """``ScanLaunch`` in torch (chunked matrix form). Meant for a CPU and small models: it holds
    every row's state (B x L states) and chunk-sized matrices at once. The chunk is as long as
    ``CHUNK_ELEMS`` allows (16 tokens or more; at tiny sizes the whole launch): fewer, larger operations."""
    dev = ln.tokens.device
    B, L, K = ln.rows, tables.layers, tables.K
    n_max = int(ln.row_len.max())
    if chunk is None:  # as long as the budget allows: fewer, larger operations
        chunk = 16
        per_token = tables.H * tables.P * 4 + tables.dim * 2
        while chunk < n_max and B * L * (tables.G * 4 * chunk * chunk + 2 * chunk * per_token) <= CHUNK_ELEMS:
            chunk *= 2
    HP, wsz = tables.H * tables.P, (K - 1) * tables.dim
    lens = ln.row_len.tolist()
    starts = ln.row_start.tolist()
    slot = ln.state_slot
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    # every row's initial state, read before anything is written
    window = _residues(ln.init_window)  # (B, L, K-1, dim)
    tp = ln.init_tpage
    h = torch.where((tp >= 0)[..., None, None, None], _residues(_temporal_pages(ln.state_temporal, slot, tp)), zero)
    ev_ptr, ev_t = ln.ev_ptr.tolist(), ln.ev_t.tolist()
    cmp_ptr = ln.cmp_ptr.tolist() if ln.compares else [0] * (B + 1)
    cmp_t = ln.cmp_t.tolist() if ln.compares else []
    n_cmp = len(cmp_t)
    hist = ln.hist_cpage
    if hist is not None:  # a draft row's conv history: rows 1..K-2 of its starting window first
        m = hist >= 0
        ln.state_conv[slot[None, :].expand(B, L)[m], hist[m], 0:K - 2] = window[m][:, 1:].float()
    for c0 in range(0, n_max, chunk):
        rows = [b for b in range(B) if lens[b] > c0]
        T = min(chunk, n_max - c0)
        sel = torch.tensor(rows, dtype=torch.int64, device=dev)
        ar = torch.arange(T, device=dev)
        valid = torch.tensor([min(lens[b] - c0, T) for b in rows], device=dev)
        vmask = ar[None, :] < valid[:, None]  # (b', T)
        pos = torch.tensor([starts[b] + c0 for b in rows], device=dev)[:, None] + ar
        tok = ln.tokens[torch.where(vmask, pos, pos[:, :1])]
        y, ch = _chunk(tables, tok, window[sel], h[sel])
        if ln.y_out is not None:
            yidx = (ln.y_start[sel] + c0)[:, None] + ar
            ln.y_out[yidx[vmask]] = y[vmask].reshape(-1, L, HP).to(ln.y_out.dtype)
        if ln.compares:
            jj = c0 + ar[None, :]
            yf, yc = ln.y_from[sel][:, None], ln.y_count[sel][:, None]
            cm = vmask & (jj >= yf) & (jj < yf + yc)  # (b', T) outputs compared in this chunk
            if bool(cm.any()):
                ref = ln.y_ref[(ln.y_start[sel][:, None] + jj - yf)[cm]].double()  # (M, L, HP)
                got = y[cm].reshape(-1, L, HP)
                bad = got != ref  # (M, L, HP)
                if bool(bad.any()):  # (the usual case, none: the stats stay as they are)
                    row_of = torch.arange(len(rows), device=dev)[:, None].expand(-1, T)[cm]
                    tok_of = (jj - yf).expand(len(rows), -1)[cm]
                    per = torch.zeros(len(rows), L, dtype=torch.int64, device=dev)
                    per.index_add_(0, row_of, bad.sum(-1))
                    dmax = torch.zeros(len(rows), L, dtype=torch.int64, device=dev)
                    dmax.scatter_reduce_(0, row_of[:, None].expand(-1, L), torch.where(bad, (got - ref).abs(), zero)
                                         .amax(-1).to(torch.int64), "amax")
                    first = torch.full((len(rows), L), NO_MISMATCH, dtype=torch.int64, device=dev)
                    cand = torch.where(bad.any(-1), tok_of[:, None], torch.full((), NO_MISMATCH, device=dev))
                    first.scatter_reduce_(0, row_of[:, None].expand(-1, L), cand, "amin")
                    _accumulate(ln.stats, n_cmp + sel, per, dmax, first)
        # states wanted in this chunk: events, comparisons, and each row's last state of the chunk
        want_i, want_t, ev_k, ev_i, cmp_k, cmp_i = [], [], [], [], [], []
        for i, b in enumerate(rows):
            for e in range(ev_ptr[b], ev_ptr[b + 1]):
                if c0 <= ev_t[e] < c0 + T:
                    ev_k.append(len(want_i)), ev_i.append(e)
                    want_i.append(i), want_t.append(ev_t[e] - c0)
            for c in range(cmp_ptr[b], cmp_ptr[b + 1]):
                if c0 <= cmp_t[c] < c0 + T:
                    cmp_k.append(len(want_i)), cmp_i.append(c)
                    want_i.append(i), want_t.append(cmp_t[c] - c0)
        carry0 = len(want_i)
        last = c0 + T >= n_max  # no later chunk: no state to carry
        if not last:
            want_i += list(range(len(rows)))
            want_t += (valid - 1).tolist()
        as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        if want_i:
            win, hs = _states_at(as_t(want_i), as_t(want_t), ch, h[sel], K)
        if ev_k:
            ki, ei = as_t(ev_k), as_t(ev_i)
            sl = slot[None, :].expand(len(ev_k), L)
            tpg, cpg = ln.ev_tpage[ei], ln.ev_cpage[ei]
            m = tpg >= 0
            ln.state_temporal[sl[m], tpg[m]] = hs[ki][m].to(ln.state_temporal.dtype)
            m = cpg >= 0
            ln.state_conv[sl[m], cpg[m], 0:K - 1] = win[ki][m].float()
        if cmp_k:
            ki, ci = as_t(cmp_k), as_t(cmp_i)
            cpg, tpg = ln.cmp_cpage[ci], ln.cmp_tpage[ci]
            cv = _conv_rows(ln.cmp_conv, ln.cmp_slot, cpg, ln.cmp_off[ci], K)
            tv = _temporal_pages(ln.cmp_temporal, ln.cmp_slot, tpg)
            c_bad, t_bad = _mismatch(cv, win[ki], cpg >= 0), _mismatch(tv, hs[ki], tpg >= 0)
            if c_bad is not None or t_bad is not None:  # (else the stats stay as they are)
                clean = torch.zeros(len(cmp_k), L, dtype=torch.int64, device=dev)
                c_cnt, c_max, c_first = c_bad or (clean, clean, clean + NO_MISMATCH)
                t_cnt, t_max, t_first = t_bad or (clean, clean, clean + NO_MISMATCH)
                t_first = torch.where(t_first == NO_MISMATCH, t_first, t_first + wsz)
                _accumulate(ln.stats, ci, c_cnt + t_cnt, torch.maximum(c_max, t_max), torch.minimum(c_first, t_first))
        if hist is not None:  # the draft rows' inputs of this chunk after the window rows
            hm = (hist[sel] >= 0)[:, :, None] & vmask[:, None, :]  # (b', L, T)
            i_, l_, t_ = hm.nonzero(as_tuple=True)
            ln.state_conv[slot[l_], hist[sel][i_, l_], K - 2 + c0 + t_] = ch.U[i_, l_, K - 1 + t_].float()
        if not last:
            window[sel] = win[carry0:]
            h[sel] = hs[carry0:]
