"""The Mamba probe scan in chunks on tensor cores (semantics: ``probe_scan.ScanLaunch``).

The token-by-token kernel (``probe_scan_triton``) spends about ten integer operations on every
state element for every token, on the CUDA cores. Here a program (row, layer, head) takes its
row ``BT`` tokens at a time in the chunked form of ``probe_scan.scan_reference``:

    h_t = A_t (h_0 + sum_{i<=t} w_i B_i^T),   w_i = x'_i / A_i,   A_t = gamma**E_t
    y_t = A_t (C_t . h_0 + sum_{i<=t} (C_t . B_i) w_i) + D x_t

so a chunk is four matrix products of residues (C h_0^T, C B^T, (C B^T) W, W^T B) plus
element-wise work on (BT x P), (BT x N) and (P x N) tiles. The products are exact on int8
tensor cores: a residue r < Q = 2039 is 64 r_hi + r_lo with both digits below 64, so a product
of residue matrices is 4096 hh + 64 (hl + lh) + ll over four int8 products with int32 sums;
for an inner size up to 128 every sum stays below 2**30 (``_mdot_sum``), and one reduction mod Q
follows (one for two such sums where they are added). B and C come from a pre-pass as their
digits already (``_bc_conv_kernel``). The result equals the token-by-token definition bit for bit.

A chunk ends early where the row has an event or a comparison, so every state that is written
or compared is a chunk's end state. Rows with a draft's conv history, and rows too short to
fill a chunk, stay with the token-by-token kernel (``scan_triton`` routes them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .probe_scan_triton import SCAN_INTS, _cmp_state, _fold, _cmp_window, _hash, _head_keys, _keys, _residue, _row_cursors, _store_window, _weights


@triton.jit
def _mdot_sum(a, b):
    """a @ b for residue matrices (int32 in [0, Q)), exact and not yet reduced: below 2**30 for an
    inner size up to 128, so a caller can add one more such sum (or a residue) before reducing."""
    ah, al = _digits(a)
    bh, bl = _digits(b)
    return _digit_dot(ah, al, bh, bl)


@triton.jit
def _digits(a):
    """A residue r < Q = 2039 as its two base-64 digits (r >> 6, r & 63), int8 both."""
    return (a >> 6).to(tl.int8), (a & 63).to(tl.int8)


@triton.jit
def _digit_dot(ah, al, bh, bl):
    """``_mdot_sum`` of operands given as digits (``_digits``)."""
    # one accumulator: ((hh * 64 + hl + lh) * 64 + ll), every partial sum below 2**30
    acc = tl.dot(ah, bh, out_dtype=tl.int32)
    acc = tl.dot(ah, bl, acc * 64, out_dtype=tl.int32)
    acc = tl.dot(al, bh, acc, out_dtype=tl.int32)
    return tl.dot(al, bl, acc * 64, out_dtype=tl.int32)


@triton.jit
def _u_tile(j, lo, hi, k, iw, ch, cm, KM1: tl.constexpr, DIM: tl.constexpr, QQ: tl.constexpr):
    """Conv inputs u of row tokens j (T,) on channels ch (C,): the hash of the token, or for j < 0
    the starting window's row KM1 + j (zero before it)."""
    u = _hash(lo[:, None], hi[:, None], k[0][None, :], k[1][None, :], k[2][None, :], k[3][None, :], QQ)
    wr = KM1 + j
    wmask = (j < 0) & (wr >= 0)
    wv = _residue(tl.load(iw + tl.maximum(wr, 0)[:, None] * DIM + ch[None, :], mask=wmask[:, None] & cm[None, :],
                          other=0.0))
    return tl.where((j >= 0)[:, None], u, wv)


@triton.jit
def _token_parts(parts, start, j, jm):
    """(token mod Q, token / Q mod Q) of row tokens j, from ``token_parts``'s packing."""
    pp = tl.load(parts + start + tl.maximum(j, 0), mask=jm & (j >= 0), other=0)
    return pp & 0xFFFF, pp >> 16


@triton.jit
def _conv_tile(parts, start, j, jm, embl, cwl, cbl, iw, ch, cm, KM1: tl.constexpr, DIM: tl.constexpr,
               QQ: tl.constexpr):
    """z = (bias + sum of 4 taps) mod Q for tokens j (T,) on channels ch: taps u(j-3) .. u(j).
    Keys and weights are read here, chunk by chunk (cached), not held in registers for the row."""
    k = _keys(embl, ch, cm)
    w = _weights(cwl, cbl, ch, cm, DIM)
    z = tl.zeros([j.shape[0], ch.shape[0]], dtype=tl.int32) + w[4][None, :]
    for tap in tl.static_range(4):
        jj = j - 3 + tap
        lo, hi = _token_parts(parts, start, jj, jm)
        z += w[tap][None, :] * _u_tile(jj, lo, hi, k, iw, ch, cm, KM1, DIM, QQ)
    return z % QQ


@triton.jit
def _u_row(parts, start, j, k, iw, ch, cm, KM1: tl.constexpr, DIM: tl.constexpr, QQ: tl.constexpr):
    """u of one row token j (scalar; j < 0 reads the starting window) on channels ch."""
    pp = tl.load(parts + start + tl.maximum(j, 0))
    lo = pp & 0xFFFF
    hi = pp >> 16
    u = _hash(lo, hi, k[0], k[1], k[2], k[3], QQ)
    wr = KM1 + j
    wv = _residue(tl.load(iw + tl.minimum(tl.maximum(wr, 0), KM1 - 1) * DIM + ch, mask=cm, other=0.0))
    return tl.where(j >= 0, u, tl.where(wr >= 0, wv, 0))


@triton.jit
def _window_at(parts, start, j, embl, iw, ch, cm, KM1: tl.constexpr, DIM: tl.constexpr, QQ: tl.constexpr):
    """The three newest conv inputs after token j (oldest first), as ``_store_window`` takes them."""
    k = _keys(embl, ch, cm)
    return (_u_row(parts, start, j - 2, k, iw, ch, cm, KM1, DIM, QQ),
            _u_row(parts, start, j - 1, k, iw, ch, cm, KM1, DIM, QQ),
            _u_row(parts, start, j, k, iw, ch, cm, KM1, DIM, QQ))


@triton.jit(do_not_specialize=["L"])
def _bc_conv_kernel(row_ids, bc_base, parts, row_start, row_len, init_window, emb, conv_w, conv_b, bcbuf, L,
                    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, KM1: tl.constexpr,
                    DIM: tl.constexpr, BT: tl.constexpr, QQ: tl.constexpr):
    """B and C (after the conv, mod Q) of BT tokens of a row, one layer and group, as their digits
    (``_digits``) into ``bcbuf`` (tokens, L, 4, G, N) int8: B's high and low digits, then C's. Every
    head of the group reads them, ready for the tensor cores, instead of computing and splitting them."""
    pid0 = tl.program_id(0)
    grp = tl.program_id(1)
    j = tl.program_id(2) * BT + tl.arange(0, BT)
    i = pid0 // L
    b = tl.load(row_ids + i).to(tl.int64)
    lay = pid0 % L
    n = tl.load(row_len + b).to(tl.int32)
    if tl.program_id(2) * BT < n:
        start = tl.load(row_start + b)
        jm = j < n
        offs_n = tl.arange(0, N)
        nm = offs_n < N
        L64 = L.to(tl.int64)
        embl = emb + lay * (DIM * 4)
        cwl = conv_w + lay * (4 * DIM)
        cbl = conv_b + lay * DIM
        iw = init_window + (b * L64 + lay) * (KM1 * DIM)
        out = bcbuf + ((tl.load(bc_base + i) + j).to(tl.int64)[:, None] * L64 + lay) * (4 * G * N) + offs_n[None, :]
        bch = H * P + grp * N + offs_n
        for part in tl.static_range(2):  # B, then C
            v = _conv_tile(parts, start, j, jm, embl, cwl, cbl, iw, bch + part * G * N, nm, KM1, DIM, QQ)
            vh, vl = _digits(v)
            tl.store(out + (2 * part * G + grp) * N, vh, mask=jm[:, None])
            tl.store(out + ((2 * part + 1) * G + grp) * N, vl, mask=jm[:, None])


@triton.jit(do_not_specialize=SCAN_INTS)
def _chunked_scan_kernel(
        row_ids, bc_base, bcbuf, parts, row_start, row_len, init_window, init_tpage,
        conv, temporal, state_slot, c_ss, c_sp, c_sr, t_ss, t_sp,
        ev_ptr, ev_t, ev_tpage, ev_cpage,
        y_out, y_start,
        cmp_conv, cmp_temporal, cmp_slot, cc_ss, cc_sp, cc_sr, ct_ss, ct_sp,
        cmp_ptr, cmp_t, cmp_tpage, cmp_cpage, cmp_off, y_ref, y_from, y_count, stats, n_cmp,
        emb, conv_w, conv_b, head, Dt, powt, L,
        H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, KM1: tl.constexpr,
        DIM: tl.constexpr, BT: tl.constexpr, WRITE_Y: tl.constexpr, COMPARE: tl.constexpr, QQ: tl.constexpr):
    pid0 = tl.program_id(0)
    hd = tl.program_id(1)
    base = tl.load(bc_base + pid0 // L)
    b = tl.load(row_ids + pid0 // L).to(tl.int64)
    lay = pid0 % L
    R: tl.constexpr = H // G
    HP: tl.constexpr = H * P
    grp = hd // R
    offs_p = tl.arange(0, P)
    offs_n = tl.arange(0, N)
    pm = offs_p < P
    nm = offs_n < N
    om = nm & ((offs_n * 0 + hd % R) == 0)  # the group's first head writes and compares its B and C channels
    xc = hd * P + offs_p
    bch = HP + grp * N + offs_n
    cch = HP + G * N + grp * N + offs_n
    start = tl.load(row_start + b)
    n = tl.load(row_len + b).to(tl.int32)
    L64 = L.to(tl.int64)
    embl = emb + lay * (DIM * 4)
    cwl = conv_w + lay * (4 * DIM)
    cbl = conv_b + lay * DIM
    rho, sig, tau, mu, nu, kap, Dh = _head_keys(head, Dt, lay, hd, H)
    iw = init_window + (b * L64 + lay) * (KM1 * DIM)
    slot = tl.load(state_slot + lay).to(tl.int64)
    tpg0 = tl.load(init_tpage + b * L64 + lay).to(tl.int64)
    tile = hd * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    h = _residue(tl.load(temporal + slot * t_ss + tl.maximum(tpg0, 0) * t_sp + tile))
    h = tl.where(tpg0 >= 0, h, 0)
    ei, ee, et, ci, ce, ct, yf, yc, ys = _row_cursors(b, ev_ptr, ev_t, cmp_ptr, cmp_t, y_from, y_count, y_start,
                                                      WRITE_Y, COMPARE)
    ar = tl.arange(0, BT)
    causal = ar[:, None] >= ar[None, :]
    cslot = 0
    # output mismatches, element by element over the row's chunks (folded once, after the last):
    # how many chunks mismatched (bits 0-19) and the largest |difference| (bits 20-30), and the
    # first mismatching token; no reduction across the tile a chunk
    ybad = tl.zeros([BT, P], dtype=tl.int32)
    yfirst = tl.full([BT, P], 2147483647, tl.int32)
    if COMPARE:
        cslot = tl.load(cmp_slot + lay).to(tl.int64)
    t0 = 0
    while t0 < n:
        # the chunk ends at the row's end, after BT tokens, or at the next event or comparison
        t1 = tl.minimum(n, t0 + BT)
        if et >= 0:
            t1 = tl.minimum(t1, (et + 1).to(tl.int32))
        if ct >= 0:
            t1 = tl.minimum(t1, (ct + 1).to(tl.int32))
        j = t0 + ar
        jm = j < t1
        lo, hi = _token_parts(parts, start, j, jm)
        # y_t's first part: C_t . h_0 (B and C of the chunk's tokens: from the pre-pass)
        bc_row = bcbuf + ((base + j).to(tl.int64)[:, None] * L64 + lay) * (4 * G * N) + offs_n[None, :]
        Ch = tl.load(bc_row + (2 * G + grp) * N, mask=jm[:, None], other=0)
        Cl = tl.load(bc_row + (3 * G + grp) * N, mask=jm[:, None], other=0)
        hh, hl = _digits(tl.trans(h))
        ych = _digit_dot(Ch, Cl, hh, hl)  # (BT, P), reduced below with the chunk's own part
        Bh = tl.load(bc_row + grp * N, mask=jm[:, None], other=0)
        Bl = tl.load(bc_row + (G + grp) * N, mask=jm[:, None], other=0)
        S = _digit_dot(Ch, Cl, tl.trans(Bh), tl.trans(Bl)) % QQ  # (BT, BT): C_t . B_i
        S = tl.where(causal, S, 0)
        zx = _conv_tile(parts, start, j, jm, embl, cwl, cbl, iw, xc, pm, KM1, DIM, QQ)
        e = tl.where(jm, (lo * rho + hi * sig + tau) % (QQ - 1), 0)
        g = 1 + (lo * mu + hi * nu + kap) % (QQ - 1)
        E = tl.cumsum(e, axis=0) % (QQ - 1)
        A = tl.load(powt + E)
        A_inv = tl.load(powt + (QQ - 1 - E) % (QQ - 1))
        gi = (g * A_inv) % QQ
        W = tl.where(jm[:, None], (gi[:, None] * zx) % QQ, 0)  # (BT, P)
        # the state after the chunk, A_end (h_0 + W^T B), as A_end h_0 + (A_end W)^T B: A_end
        # scales the (BT, P) W (its tokens' factors) rather than the (P, N) state, and the sum
        # (below 2**22 + 2**30) takes one reduction
        A_end = tl.load(powt + tl.sum(e, axis=0) % (QQ - 1))
        W_end = tl.where(jm[:, None], (((A_end * gi) % QQ)[:, None] * zx) % QQ, 0)
        yacc = (ych + _mdot_sum(S, W)) % QQ  # (two sums below 2**30 each: one reduction)
        y = (A[:, None] * yacc + Dh * zx) % QQ
        yo = ((ys + j).to(tl.int64)[:, None] * L64 + lay) * HP + xc[None, :]
        if WRITE_Y:
            tl.store(y_out + yo, y, mask=jm[:, None])
        if COMPARE:
            inr = jm & (j >= yf) & (j < yf + yc)
            yo_ref = ((ys + j - yf).to(tl.int64)[:, None] * L64 + lay) * HP + xc[None, :]
            yr = tl.load(y_ref + yo_ref, mask=inr[:, None], other=0)
            bad = (yr != y) & inr[:, None]
            worst = tl.maximum(ybad >> 20, tl.where(bad, tl.abs(yr - y), 0))
            ybad = (worst << 20) | ((ybad & 0xFFFFF) + bad.to(tl.int32))
            yfirst = tl.minimum(yfirst, tl.where(bad, (j - yf).to(tl.int32)[:, None], 2147483647))
        h = (A_end * h + _digit_dot(*_digits(tl.trans(W_end)), Bh, Bl)) % QQ
        last = t1 - 1
        if (et == last) | (ct == last):
            x0, x1, x2 = _window_at(parts, start, last, embl, iw, xc, pm, KM1, DIM, QQ)
            b0, b1, b2 = _window_at(parts, start, last, embl, iw, bch, nm, KM1, DIM, QQ)
            c0, c1, c2 = _window_at(parts, start, last, embl, iw, cch, nm, KM1, DIM, QQ)
            while et == last:
                tp = tl.load(ev_tpage + ei * L64 + lay).to(tl.int64)
                cp = tl.load(ev_cpage + ei * L64 + lay).to(tl.int64)
                if tp >= 0:
                    tl.store(temporal + slot * t_ss + tp * t_sp + tile, h.to(temporal.dtype.element_ty))
                if cp >= 0:
                    cb = conv + slot * c_ss + cp * c_sp
                    _store_window(cb, c_sr, xc, pm, x0, x1, x2, KM1)
                    _store_window(cb, c_sr, bch, om, b0, b1, b2, KM1)
                    _store_window(cb, c_sr, cch, om, c0, c1, c2, KM1)
                ei += 1
                et = tl.load(ev_t + ei, mask=ei < ee, other=-1)
            if COMPARE:
                while ct == last:
                    st = stats + (ci * L64 + lay) * 3
                    tp = tl.load(cmp_tpage + ci * L64 + lay).to(tl.int64)
                    cp = tl.load(cmp_cpage + ci * L64 + lay).to(tl.int64)
                    if tp >= 0:
                        _cmp_state(cmp_temporal + cslot * ct_ss + tp * ct_sp, h, tile, tile >= 0, st, KM1 * DIM)
                    if cp >= 0:
                        off = tl.load(cmp_off + ci).to(tl.int64)
                        cb = cmp_conv + cslot * cc_ss + cp * cc_sp + off * cc_sr
                        _cmp_window(cb, cc_sr, xc, pm, x0, x1, x2, st, KM1, DIM)
                        _cmp_window(cb, cc_sr, bch, om, b0, b1, b2, st, KM1, DIM)
                        _cmp_window(cb, cc_sr, cch, om, c0, c1, c2, st, KM1, DIM)
                    ci += 1
                    ct = tl.load(cmp_t + ci, mask=ci < ce, other=-1)
        t0 = t1
    if COMPARE:
        cnt = tl.sum(tl.sum(ybad & 0xFFFFF, axis=1), axis=0)
        worst = tl.max(tl.max(ybad >> 20, axis=1), axis=0)
        first = tl.min(tl.min(yfirst, axis=1), axis=0)
        _fold(stats + ((n_cmp + b) * L64 + lay) * 3, cnt > 0, cnt.to(tl.int64), worst.to(tl.int64), first.to(tl.int64))


def token_parts(tokens: torch.Tensor, q: int) -> torch.Tensor:
    """The two residues every token's hashes take, (token mod q) + 65536 (token / q mod q), as
    int32 (both below 2**11): computed once a launch on the device, not in 64-bit integer division
    five times a token in each of the kernels' programs (several hundred instructions a chunk)."""
    return ((tokens % q) + ((tokens // q) % q) * 65536).to(torch.int32)


def chunked_fits(H: int, P: int, G: int, N: int, K: int, bc_from_conv: bool) -> bool:
    """Shapes this kernel takes: Mamba2 (B and C from the conv), power-of-two head and state sizes
    within tensor-core tiles (an int8 product's inner size, here the state size, is 32 or more) and
    up to 128 (the exact products' inner-size bound), conv <= 4."""
    pow2 = lambda v: v & (v - 1) == 0  # noqa: E731
    return (bc_from_conv and pow2(P) and pow2(N) and 16 <= P <= 128 and 32 <= N <= 128 and 2 <= K <= 4
            and H % G == 0)
