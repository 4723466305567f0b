"""The Mamba probe scan in Triton (semantics: ``probe_scan.ScanLaunch``): this token-by-token
kernel, and ``scan_triton``, which sends long rows to the chunked tensor-core kernel
(``probe_scan_chunked``) and the rest here, the same results bit for bit either way.

Grid: (row x layer, head x head-dim tile). A program keeps its (BP x N) slice of the
state in registers and walks the row's tokens in order: hash the token into its
channels, run the depthwise conv over a three-deep register window, update h, emit y,
and write or compare states where the row's events and comparisons say. All arithmetic
is int32 residues mod Q: every intermediate stays below 2**31 (``layers.exact``), so
the result equals the torch reference bit for bit whatever the tiling.

x channels belong to one program each; the B and C channels of a group are computed by
every program of the group (it needs them) but written and compared by one (the group's
first head, first tile), so each page element is touched by exactly one program.
Addresses of pages are int64. In the oracle's mode (``COMPARE``) a program reads its channels'
keys and conv weights again each token instead of holding them across the loop, and folds
mismatches into the stats with atomics masked to the mismatching lanes: there the registers go
to the compared pages' tiles (bench/history/2026-11-27_session28.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.exact import Q, pow_table
from ..layers.mamba import StackedTables
from ..device.transfer import upload
from .probe_scan import ScanLaunch


@triton.jit
def _hash(lo, hi, a, b, d, e, QQ: tl.constexpr):
    v = (lo * a + hi * b + d) % QQ
    return (v * v + e) % QQ


@triton.jit
def _residue(v):
    """A page value -> int32 residue: float32 (a cache page; NaN, nothing wrote it, reads as 0) or int16
    (the oracle's own states: residues below Q fit)."""
    if v.dtype.is_floating():
        v = tl.where(v == v, v, 0.0)
    return v.to(tl.int32)


@triton.jit
def _keys(tab, ch, m):
    return (tl.load(tab + ch * 4, mask=m, other=0), tl.load(tab + ch * 4 + 1, mask=m, other=0),
            tl.load(tab + ch * 4 + 2, mask=m, other=0), tl.load(tab + ch * 4 + 3, mask=m, other=0))


@triton.jit
def _weights(cw, cb, ch, m, DIM: tl.constexpr):
    return (tl.load(cw + ch, mask=m, other=0), tl.load(cw + DIM + ch, mask=m, other=0),
            tl.load(cw + 2 * DIM + ch, mask=m, other=0), tl.load(cw + 3 * DIM + ch, mask=m, other=0),
            tl.load(cb + ch, mask=m, other=0))


@triton.jit
def _window_rows(src, ch, m, KM1: tl.constexpr, DIM: tl.constexpr):
    """The three newest rows of a KM1-row window (oldest first), zeros where KM1 < 3."""
    v2 = _residue(tl.load(src + (KM1 - 1) * DIM + ch, mask=m, other=0.0))
    v1 = tl.zeros_like(v2)
    v0 = tl.zeros_like(v2)
    if KM1 >= 2:
        v1 = _residue(tl.load(src + (KM1 - 2) * DIM + ch, mask=m, other=0.0))
    if KM1 >= 3:
        v0 = _residue(tl.load(src + (KM1 - 3) * DIM + ch, mask=m, other=0.0))
    return v0, v1, v2


@triton.jit
def _conv(u, v0, v1, v2, w, QQ: tl.constexpr):
    return (w[4] + w[0] * v0 + w[1] * v1 + w[2] * v2 + w[3] * u) % QQ


@triton.jit
def _store_window(dst, row_stride, ch, m, v0, v1, v2, KM1: tl.constexpr):
    """Rows 0..KM1-1 of a conv page <- the window (oldest first)."""
    if KM1 >= 3:
        tl.store(dst + ch, v0.to(tl.float32), mask=m)
        tl.store(dst + row_stride + ch, v1.to(tl.float32), mask=m)
        tl.store(dst + 2 * row_stride + ch, v2.to(tl.float32), mask=m)
    elif KM1 == 2:
        tl.store(dst + ch, v1.to(tl.float32), mask=m)
        tl.store(dst + row_stride + ch, v2.to(tl.float32), mask=m)
    else:
        tl.store(dst + ch, v2.to(tl.float32), mask=m)


@triton.jit
def _fold(st, bad, cnt, d, first):
    """Fold mismatches into stats (count, max |diff|, first element) with atomics masked to the
    mismatching lanes: no reduction across warps, so no barrier, and nothing runs where all agree."""
    z = first * 0
    tl.atomic_add(st + z, cnt, mask=bad)
    tl.atomic_max(st + 1 + z, d, mask=bad)
    tl.atomic_min(st + 2 + z, first, mask=bad)


@triton.jit
def _cmp_row(src, ch, m, want, elem_base, st):
    """Compare one row of page values with residues; fold mismatches into stats (count, max, first)."""
    got = tl.load(src + ch, mask=m, other=0.0)
    wf = want.to(tl.float32)
    bad = (got != wf) & m
    d = tl.where(got == got, tl.abs(got - wf), 2147483648.0).to(tl.int64)
    _fold(st, bad, bad.to(tl.int64), d, elem_base + ch.to(tl.int64))


@triton.jit
def _cmp_state(src, h, tile, tm, st, base):
    """Compare a state tile (residues) with page values at src + tile (where tm); fold mismatches
    into stats: count, max |diff| (a NaN, never written, counts 2**31), first element (base + tile;
    int32: a page's elements number below 2**31)."""
    _cmp_state_values(tl.load(src + tile, mask=tm, other=0.0), h, tile, tm, st, base)


@triton.jit
def _cmp_state_values(got, h, tile, tm, st, base):
    """``_cmp_state`` of page values already read (``got``). Reduced along the tile's rows first (within a
    warp), then folded per row."""
    hf = h.to(tl.float32)
    bad = (got != hf) & tm
    cnt = tl.sum(bad.to(tl.int64), axis=1)
    d = tl.max(tl.where(bad, tl.where(got == got, tl.abs(got - hf), 2147483648.0), 0.0), axis=1)
    first = tl.min(tl.where(bad, tile, 2147483647), axis=1)
    _fold(st, cnt > 0, cnt, d.to(tl.int64), base + first.to(tl.int64))


@triton.jit
def _cmp_window(src, row_stride, ch, m, v0, v1, v2, st, KM1: tl.constexpr, DIM: tl.constexpr):
    if KM1 >= 3:
        _cmp_row(src, ch, m, v0, 0, st)
        _cmp_row(src + row_stride, ch, m, v1, DIM, st)
        _cmp_row(src + 2 * row_stride, ch, m, v2, 2 * DIM, st)
    elif KM1 == 2:
        _cmp_row(src, ch, m, v1, 0, st)
        _cmp_row(src + row_stride, ch, m, v2, DIM, st)
    else:
        _cmp_row(src, ch, m, v2, 0, st)


@triton.jit
def _head_keys(head, Dt, lay, hd, H: tl.constexpr):
    """Head hd's decay and step keys in layer lay (``layers.mamba.head_terms``) and its D."""
    hrow = head + (lay * H + hd) * 6
    return (tl.load(hrow), tl.load(hrow + 1), tl.load(hrow + 2), tl.load(hrow + 3), tl.load(hrow + 4),
            tl.load(hrow + 5), tl.load(Dt + lay * H + hd))


@triton.jit
def _row_cursors(b, ev_ptr, ev_t, cmp_ptr, cmp_t, y_from, y_count, y_start, WRITE_Y: tl.constexpr,
                 COMPARE: tl.constexpr):
    """Row b's cursors: its events [ei, ee) and the first one's token et, its comparisons [ci, ce)
    and the first one's token ct (-1: none), its compared outputs (from yf, yc of them) and where
    its outputs start (ys). Both scan kernels walk a row with them."""
    ei = tl.load(ev_ptr + b)
    ee = tl.load(ev_ptr + b + 1)
    et = tl.load(ev_t + ei, mask=ei < ee, other=-1)
    ci = tl.zeros([], dtype=tl.int64)
    ce = tl.zeros([], dtype=tl.int64)
    ct = tl.full([], -1, dtype=tl.int64)
    yf = tl.zeros([], dtype=tl.int64)
    yc = tl.zeros([], dtype=tl.int64)
    if COMPARE:
        ci = tl.load(cmp_ptr + b)
        ce = tl.load(cmp_ptr + b + 1)
        ct = tl.load(cmp_t + ci, mask=ci < ce, other=-1)
        yf = tl.load(y_from + b)
        yc = tl.load(y_count + b)
    ys = tl.zeros([], dtype=tl.int64)
    if WRITE_Y or COMPARE:
        ys = tl.load(y_start + b)
    return ei, ee, et, ci, ce, ct, yf, yc, ys


# A model of one Mamba layer must not turn L into a constant, and the oracle's count of comparisons
# changes every step: specialised (== 1, a multiple of 16), each new class compiled a variant in
# the middle of a run, 3.7 s of nemotron_h_8b_mooncake's 18.5 s loop (H200, session 29)
SCAN_INTS = ["L", "n_cmp"]


@triton.jit(do_not_specialize=SCAN_INTS)
def _probe_scan_kernel(
        row_ids, tokens, row_start, row_len, init_window, init_tpage,
        conv, temporal, state_slot, c_ss, c_sp, c_sr, t_ss, t_sp,
        ev_ptr, ev_t, ev_tpage, ev_cpage, hist_cpage,
        y_out, y_start,
        cmp_conv, cmp_temporal, cmp_slot, cc_ss, cc_sp, cc_sr, ct_ss, ct_sp,
        cmp_ptr, cmp_t, cmp_tpage, cmp_cpage, cmp_off, y_ref, y_from, y_count, stats, n_cmp,
        emb, conv_w, conv_b, head, Dt, bc, powt, L,
        H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, KM1: tl.constexpr,
        DIM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, NPT: tl.constexpr, BC_CONV: tl.constexpr,
        WRITE_Y: tl.constexpr, HAS_HIST: tl.constexpr, COMPARE: tl.constexpr, QQ: tl.constexpr):
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = tl.load(row_ids + pid0 // L).to(tl.int64)
    lay = pid0 % L
    hd = pid1 // NPT
    pt = pid1 % NPT
    R: tl.constexpr = H // G
    HP: tl.constexpr = H * P
    grp = hd // R
    offs_p = pt * BP + tl.arange(0, BP)
    pm = offs_p < P
    offs_n = tl.arange(0, BN)
    nm = offs_n < N
    om = nm & ((offs_n * 0 + hd % R + pt) == 0)  # the group's first head, first tile owns B and C
    xc = hd * P + offs_p
    bch = HP + grp * N + offs_n
    cch = HP + G * N + grp * N + offs_n
    start = tl.load(row_start + b)
    n = tl.load(row_len + b)
    L64 = L.to(tl.int64)
    # this layer's tables
    embl = emb + lay * (DIM * 4)
    cwl = conv_w + lay * (4 * DIM)
    cbl = conv_b + lay * DIM
    bcl = bc + lay * (2 * N * 4)
    rho, sig, tau, mu, nu, kap, Dh = _head_keys(head, Dt, lay, hd, H)
    if not COMPARE:  # the system's rows: the channels' keys and conv weights held across the loop
        kx = _keys(embl, xc, pm)
        wx = _weights(cwl, cbl, xc, pm, DIM)
        if BC_CONV:
            kb = _keys(embl, bch, nm)
            kc = _keys(embl, cch, nm)
            wb = _weights(cwl, cbl, bch, nm, DIM)
            wc = _weights(cwl, cbl, cch, nm, DIM)
        else:
            kb = _keys(bcl, offs_n, nm)
            kc = _keys(bcl, N + offs_n, nm)
    # the starting state
    iw = init_window + (b * L64 + lay) * (KM1 * DIM)
    x0, x1, x2 = _window_rows(iw, xc, pm, KM1, DIM)
    if BC_CONV:
        b0, b1, b2 = _window_rows(iw, bch, nm, KM1, DIM)
        c0, c1, c2 = _window_rows(iw, cch, nm, KM1, DIM)
    else:  # Mamba1: the conv carries x only
        b0 = tl.zeros([BN], dtype=tl.int32)
        b1, b2, c0, c1, c2 = b0, b0, b0, b0, b0
    slot = tl.load(state_slot + lay).to(tl.int64)
    tpg0 = tl.load(init_tpage + b * L64 + lay).to(tl.int64)
    tile = hd * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    tm = pm[:, None] & nm[None, :]
    h = _residue(tl.load(temporal + slot * t_ss + tl.maximum(tpg0, 0) * t_sp + tile, mask=tm, other=0.0))
    h = tl.where(tpg0 >= 0, h, 0)  # a row from the zero state
    hist = -1
    if HAS_HIST:
        hist = tl.load(hist_cpage + b * L64 + lay).to(tl.int64)
        if hist >= 0:  # rows 1..KM1-1 of the starting window go to rows 0..KM1-2
            hb = conv + slot * c_ss + hist * c_sp
            if KM1 >= 3:
                tl.store(hb + xc, x1.to(tl.float32), mask=pm)
                tl.store(hb + c_sr + xc, x2.to(tl.float32), mask=pm)
                if BC_CONV:
                    tl.store(hb + bch, b1.to(tl.float32), mask=om)
                    tl.store(hb + c_sr + bch, b2.to(tl.float32), mask=om)
                    tl.store(hb + cch, c1.to(tl.float32), mask=om)
                    tl.store(hb + c_sr + cch, c2.to(tl.float32), mask=om)
            elif KM1 == 2:
                tl.store(hb + xc, x2.to(tl.float32), mask=pm)
                if BC_CONV:
                    tl.store(hb + bch, b2.to(tl.float32), mask=om)
                    tl.store(hb + cch, c2.to(tl.float32), mask=om)
    ei, ee, et, ci, ce, ct, yf, yc, ys = _row_cursors(b, ev_ptr, ev_t, cmp_ptr, cmp_t, y_from, y_count, y_start,
                                                      WRITE_Y, COMPARE)
    for j in range(0, n):
        tok = tl.load(tokens + start + j)
        lo = (tok % QQ).to(tl.int32)
        hi = ((tok // QQ) % QQ).to(tl.int32)
        if COMPARE:
            # the oracle's rows read the channels' keys and conv weights again each token (L1 hits)
            # rather than hold them across the loop, where with the comparisons' tiles they spilled
            # (60.6 against 41.9 ms for bench_scan's 128 one-token rows, H200): ``z`` is 0 (token ids
            # are not negative), but a compiler cannot know it, so it cannot hoist these loads. The
            # system's rows keep them (a load a token cost its 4-token rows 29.5 against 35.2 ms).
            z = tl.minimum(tok, 0)
            kx = _keys(embl + z, xc, pm)
            wx = _weights(cwl + z, cbl + z, xc, pm, DIM)
            if BC_CONV:
                kb = _keys(embl + z, bch, nm)
                kc = _keys(embl + z, cch, nm)
                wb = _weights(cwl + z, cbl + z, bch, nm, DIM)
                wc = _weights(cwl + z, cbl + z, cch, nm, DIM)
            else:
                kb = _keys(bcl + z, offs_n, nm)
                kc = _keys(bcl + z, N + offs_n, nm)
        ux = _hash(lo, hi, kx[0], kx[1], kx[2], kx[3], QQ)
        zx = _conv(ux, x0, x1, x2, wx, QQ)
        if BC_CONV:
            ub = _hash(lo, hi, kb[0], kb[1], kb[2], kb[3], QQ)
            uc = _hash(lo, hi, kc[0], kc[1], kc[2], kc[3], QQ)
            Bv = _conv(ub, b0, b1, b2, wb, QQ)
            Cv = _conv(uc, c0, c1, c2, wc, QQ)
            b0, b1, b2 = b1, b2, ub
            c0, c1, c2 = c1, c2, uc
        else:
            Bv = _hash(lo, hi, kb[0], kb[1], kb[2], kb[3], QQ)
            Cv = _hash(lo, hi, kc[0], kc[1], kc[2], kc[3], QQ)
        x0, x1, x2 = x1, x2, ux
        e = (lo * rho + hi * sig + tau) % (QQ - 1)
        a = tl.load(powt + e)
        g = 1 + (lo * mu + hi * nu + kap) % (QQ - 1)
        xp = (g * zx) % QQ
        h = (a * h + xp[:, None] * Bv[None, :]) % QQ
        y = (tl.sum(h * Cv[None, :], axis=1) % QQ + Dh * zx) % QQ
        yo = ((ys + j).to(tl.int64) * L64 + lay) * HP + xc
        if WRITE_Y:
            tl.store(y_out + yo, y, mask=pm)
        if HAS_HIST:
            if hist >= 0:
                hr = conv + slot * c_ss + hist * c_sp + (KM1 - 1 + j) * c_sr
                tl.store(hr + xc, x2.to(tl.float32), mask=pm)
                if BC_CONV:
                    tl.store(hr + bch, b2.to(tl.float32), mask=om)
                    tl.store(hr + cch, c2.to(tl.float32), mask=om)
        while et == j:
            tp = tl.load(ev_tpage + ei * L64 + lay).to(tl.int64)
            cp = tl.load(ev_cpage + ei * L64 + lay).to(tl.int64)
            if tp >= 0:
                tl.store(temporal + slot * t_ss + tp * t_sp + tile, h.to(temporal.dtype.element_ty), mask=tm)
            if cp >= 0:
                cb = conv + slot * c_ss + cp * c_sp
                _store_window(cb, c_sr, xc, pm, x0, x1, x2, KM1)
                if BC_CONV:
                    _store_window(cb, c_sr, bch, om, b0, b1, b2, KM1)
                    _store_window(cb, c_sr, cch, om, c0, c1, c2, KM1)
            ei += 1
            et = tl.load(ev_t + ei, mask=ei < ee, other=-1)
        if COMPARE:
            if (j >= yf) & (j < yf + yc):
                yo_ref = ((ys + j - yf).to(tl.int64) * L64 + lay) * HP + xc
                yr = tl.load(y_ref + yo_ref, mask=pm, other=0)
                bad = (yr != y) & pm
                _fold(stats + ((n_cmp + b) * L64 + lay) * 3, bad, bad.to(tl.int64), tl.abs(yr - y).to(tl.int64),
                      (j - yf) + offs_p.to(tl.int64) * 0)
            cslot = tl.load(cmp_slot + lay).to(tl.int64)
            while ct == j:
                st = stats + (ci * L64 + lay) * 3
                tp = tl.load(cmp_tpage + ci * L64 + lay).to(tl.int64)
                cp = tl.load(cmp_cpage + ci * L64 + lay).to(tl.int64)
                if tp >= 0:
                    _cmp_state(cmp_temporal + cslot * ct_ss + tp * ct_sp, h, tile, tm, st, KM1 * DIM)
                if cp >= 0:
                    off = tl.load(cmp_off + ci).to(tl.int64)
                    cb = cmp_conv + cslot * cc_ss + cp * cc_sp + off * cc_sr
                    _cmp_window(cb, cc_sr, xc, pm, x0, x1, x2, st, KM1, DIM)
                    if BC_CONV:
                        _cmp_window(cb, cc_sr, bch, om, b0, b1, b2, st, KM1, DIM)
                        _cmp_window(cb, cc_sr, cch, om, c0, c1, c2, st, KM1, DIM)
                ci += 1
                ct = tl.load(cmp_t + ci, mask=ci < ce, other=-1)


def pack_tables(t: StackedTables) -> dict:
    """int32 copies of the tables in the kernel's layout (conv weights padded to 4 taps)."""
    if t.K > 4:
        raise ValueError(f"the Triton probe scan supports conv_kernel 2..4, not {t.K}")
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    L = t.layers
    w = torch.zeros(L, 4, t.dim, dtype=torch.int64, device=t.emb.device)
    w[:, 4 - t.K:] = t.conv_w
    dev = t.emb.device
    return {"emb": i32(t.emb), "conv_w": i32(w), "conv_b": i32(t.conv_b), "head": i32(t.head), "D": i32(t.D),
            "bc": i32(t.bc) if t.bc is not None else torch.zeros(1, dtype=torch.int32, device=dev),
            "pow": i32(pow_table().to(dev))}


# a row this long or longer goes to the chunked kernel (where its shapes fit); shorter rows cost more
# there: the oracle's decode rows (one state written, at the end) took 113 / 116 ms chunked against
# 66 / 84 ms token by token for 128 rows of 1 / 4 tokens (bench_scan, H100, 2026-11-27)
CHUNK_MIN_TOKENS = 32
# tokens per chunk and warps per program: at 32 x 8 the (64 x 128) state tile and the chunk's B and C
# tiles fit the registers (ptxas spills under 1 KB a thread, against 4-8 KB at 64 tokens x 4 warps);
# 64 tokens x 8 warps is miscompiled by Triton 3.6 (an out-of-range shared access on the H200)
CHUNK_TOKENS = 32
CHUNK_WARPS = 8
# registers a thread of the chunked kernel may take, in the system's mode and in the oracle's (None:
# as ptxas likes, 255 at 32 x 8). At 128 two programs share an SM, 16 warps to hide the products'
# and reductions' latency, for some spills: bench_scan's 4 x 1,024 tokens 21.8 against 27.1 ms. The
# oracle's mode (its comparisons' code and per-element tallies) spills more there: 32.2 against
# 30.5 ms unbounded (H200)
CHUNK_MAXNREG: dict[bool, int | None] = {False: 128, True: None}
BY_MODE = -1  # (``scan_triton``'s chunk_maxnreg: CHUNK_MAXNREG's figure for the launch's mode)
PREPASS_TOKENS = 64  # tokens a program of the B/C pre-pass takes


def _routes(tables: StackedTables, ln: ScanLaunch, chunk_min: int = CHUNK_MIN_TOKENS) -> tuple[list[int], list[int]]:
    """Rows for the token-by-token kernel, and rows for the chunked one (``probe_scan_chunked``):
    rows of ``chunk_min`` tokens or more without a draft's conv history, where the model's shapes
    fit tensor-core tiles."""
    from .probe_scan_chunked import chunked_fits
    lens = ln.host_len if ln.host_len is not None else ln.row_len.tolist()
    if not chunked_fits(tables.H, tables.P, tables.G, tables.N, tables.K, tables.bc_from_conv):
        return list(range(len(lens))), []
    hist = ln.host_hist if ln.host_hist is not None else (
        (ln.hist_cpage >= 0).any(1).tolist() if ln.hist_cpage is not None else [False] * len(lens))
    seq, chunked = [], []
    for b, (n, hh) in enumerate(zip(lens, hist)):
        (chunked if n >= chunk_min and not hh else seq).append(b)
    return seq, chunked


def scan_triton(tables: StackedTables, ln: ScanLaunch, block_p: int = 32, num_warps: int = 4,
                chunked: bool = True, chunk_tokens: int = CHUNK_TOKENS, chunk_warps: int = CHUNK_WARPS,
                chunk_min: int = CHUNK_MIN_TOKENS, chunk_maxnreg: int | None = BY_MODE) -> None:
    """The launch on the GPU (or the interpreter): rows of ``chunk_min`` tokens or more in chunks on
    tensor cores, the rest token by token; the same results bit for bit either way.
    ``chunked=False``: every row token by token. ``chunk_maxnreg``: the registers a thread of the
    chunked kernel may take (None: unbounded; by default ``CHUNK_MAXNREG``'s for the launch's mode)."""
    pk = tables.derived.get("triton")
    if pk is None:
        pk = tables.derived["triton"] = pack_tables(tables)
    seq, chk = _routes(tables, ln, chunk_min) if chunked else (list(range(ln.rows)), [])
    if seq:
        _scan_rows(tables, ln, pk, seq, block_p, num_warps)
    if chk:
        regs = CHUNK_MAXNREG[ln.compares] if chunk_maxnreg == BY_MODE else chunk_maxnreg
        _scan_rows_chunked(tables, ln, pk, chk, chunk_tokens, chunk_warps, regs)


def _args(tables: StackedTables, ln: ScanLaunch):
    """The launch's tensors as both kernels take them (placeholders where a part is absent)."""
    dummy_f = ln.state_temporal
    dummy_i = ln.row_len
    compare = ln.compares
    cconv = ln.cmp_conv if compare else dummy_f
    ctemp = ln.cmp_temporal if compare else dummy_f
    conv, temporal = ln.state_conv, ln.state_temporal
    assert conv.stride(-1) == 1 and temporal[0, 0].is_contiguous() and ln.init_window.is_contiguous()
    head = (ln.tokens, ln.row_start, ln.row_len, ln.init_window, ln.init_tpage,
            conv, temporal, ln.state_slot, conv.stride(0), conv.stride(1), conv.stride(2),
            temporal.stride(0), temporal.stride(1),
            ln.ev_ptr, ln.ev_t if ln.ev_t.numel() else dummy_i, ln.ev_tpage if ln.ev_tpage.numel() else dummy_i,
            ln.ev_cpage if ln.ev_cpage.numel() else dummy_i)
    hist = (ln.hist_cpage if ln.hist_cpage is not None else dummy_i,)
    tail = (ln.y_out if ln.y_out is not None else dummy_i, ln.y_start if ln.y_start is not None else dummy_i,
            cconv, ctemp, ln.cmp_slot if compare else dummy_i, cconv.stride(0), cconv.stride(1), cconv.stride(2),
            ctemp.stride(0), ctemp.stride(1),
            ln.cmp_ptr if compare else dummy_i, ln.cmp_t if compare and ln.cmp_t.numel() else dummy_i,
            ln.cmp_tpage if compare and ln.cmp_tpage.numel() else dummy_i,
            ln.cmp_cpage if compare and ln.cmp_cpage.numel() else dummy_i,
            ln.cmp_off if compare and ln.cmp_off.numel() else dummy_i,
            ln.y_ref if compare and ln.y_ref is not None else dummy_i,
            ln.y_from if compare else dummy_i, ln.y_count if compare else dummy_i,
            ln.stats if compare else dummy_i, ln.cmp_t.numel() if compare else 0)
    return head, hist, tail


def _row_ids(rows: list[int], ln: ScanLaunch) -> torch.Tensor:
    return upload(rows, ln.tokens.device)


def _scan_rows(tables: StackedTables, ln: ScanLaunch, pk: dict, rows: list[int], block_p: int, num_warps: int):
    L = tables.layers
    H, P, G, N, K = tables.H, tables.P, tables.G, tables.N, tables.K
    BP = min(triton.next_power_of_2(P), block_p)
    BN = triton.next_power_of_2(N)
    npt = triton.cdiv(P, BP)
    head, hist, tail = _args(tables, ln)
    _probe_scan_kernel[(len(rows) * L, H * npt)](
        _row_ids(rows, ln), *head, *hist, *tail,
        pk["emb"], pk["conv_w"], pk["conv_b"], pk["head"], pk["D"], pk["bc"], pk["pow"], L,
        H=H, P=P, G=G, N=N, KM1=K - 1, DIM=tables.dim, BP=BP, BN=BN, NPT=npt, BC_CONV=tables.bc_from_conv,
        WRITE_Y=ln.y_out is not None, HAS_HIST=ln.hist_cpage is not None, COMPARE=ln.compares, QQ=Q,
        num_warps=num_warps)


def _scan_rows_chunked(tables: StackedTables, ln: ScanLaunch, pk: dict, rows: list[int], bt: int, num_warps: int,
                       maxnreg: int | None = None):
    from .probe_scan_chunked import _bc_conv_kernel, _chunked_scan_kernel, token_parts
    L, G, N = tables.layers, tables.G, tables.N
    lens = ln.host_len if ln.host_len is not None else ln.row_len.tolist()
    base = [0]
    for b in rows:
        base.append(base[-1] + lens[b])
    dev = ln.tokens.device
    ids, bases = upload(rows, dev), upload(base[:-1], dev)
    parts = token_parts(ln.tokens, Q)
    bcbuf = torch.empty(base[-1], L, 4, G, N, dtype=torch.int8, device=dev)
    geo = dict(H=tables.H, P=tables.P, G=G, N=N, KM1=tables.K - 1, DIM=tables.dim, QQ=Q)
    _bc_conv_kernel[(len(rows) * L, G, triton.cdiv(max(lens[b] for b in rows), PREPASS_TOKENS))](
        ids, bases, parts, ln.row_start, ln.row_len, ln.init_window, pk["emb"], pk["conv_w"], pk["conv_b"],
        bcbuf, L, BT=PREPASS_TOKENS, **geo, num_warps=4)
    head, _, tail = _args(tables, ln)
    assert head[0] is ln.tokens  # (the chunked kernel takes the tokens' residues in their place)
    _chunked_scan_kernel[(len(rows) * L, tables.H)](
        ids, bases, bcbuf, parts, *head[1:], *tail,
        pk["emb"], pk["conv_w"], pk["conv_b"], pk["head"], pk["D"], pk["pow"], L,
        BT=bt, WRITE_Y=ln.y_out is not None, COMPARE=ln.compares, **geo, num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
