"""The MLA oracle's expanded rows with their scores computed exactly on the int8 tensor cores,
and the softmax and the weighted sum of values in float64 as before (``latent_attention_f64``).

Why: an expanded row's score is q . k over 192 columns, 60% of the oracle's float64 products,
and the card's float64 rate is 1/16 of its int8 rate (H200: 58 TFLOP/s against 965 T op/s
measured). The MLA probe's queries and keys are integers times powers of two (``layers/mla.py``),
so a score is an integer sum: written in balanced base-256 digits (each in [-128, 127], an int8),
q . k = sum over digit pairs of 256**(i+j) (q_i . k_j), and every q_i . k_j is an exact int32 on
the int8 tensor cores (each product at most 2**14, a sum of 128 at most 2**21). The pairs of one
power are summed in int32, two neighbouring powers joined there too (below 2**31), the rest in
float64 (every partial value an integer below 2**53: exact), and the nope and rope parts' units
(powers of two) joined in one float64 addition: the score rounded once, where float64 products
round a sum of 192 terms. The softmax and values are the float64 kernel's, so the two kernels
agree to float64 rounding, not bit for bit.

The values' products the same way, where the values come as int8 digits (``value_digits_fit``; the
oracle's default since session 41): session 34 measured the float64 products of the weights and values
at half of this kernel's time. Each key block's weights exp(s - running maximum), in [0, 1], are
rounded to integers of 2**-30 (``WEIGHT_BITS``: four balanced digits) and the running sum is taken of
those, so o = sum(w v) / sum(w) with every w . v product an exact int32 on the int8 tensor cores (four
weight digits by three value digits, each pair's sum of 64 keys below 2**21, joined as the scores'
are). The one rounding beyond float64's: a weight's, at most half a unit, 2**-31, where their sum is
at least 1 (the running maximum's own weight), so the normalised weights move by at most n 2**-30 in
all over n keys and an output by at most n 2**-31 of the values' spread (max v - min v) from the
float64 softmax's; by about sqrt(n) 2**-31 of it for roundings that do not line up. The oracle takes
this path only where the bound is within a thousandth of the check's tolerance (``oracle.WEIGHTS_SHARE``:
bf16 runs). Keys last in the values' digits: the int8 products take both operands along the summed
axis (session 38 tried the same arithmetic with the values' columns contiguous: 8.7-11.8 ms for
``bench/probes/digit_probe.py``'s chunk against 6.99; keys last, an H200 takes 6.16 against 7.01).

Digits: q_nope has 2 (its integers are below 2**13), k_nope, q_pe and k_pe 3 (below 2**23);
``digits_fit`` proves from the tables' bounds (``MLAStack.integer_bounds``) that every layer's values
fit (else the float64 kernel runs).

Layout (one layer at a time, as the expanded rows go): row r owns queries
``qd[q_start[r]:q_start[r] + q_len[r]]`` (tokens, heads, 2*DN + 3*DR) int8, digit-major
([nope digit 0 | nope digit 1 | rope digits 0, 1, 2]), at positions ``pos0[r] + j``, and keys
``kd[k_start[r] + i]`` (keys, heads, 3*DN) int8 with their rope part ``kr`` (keys, 3*DR) int8,
shared by every head, and values ``v`` (keys, heads, DV), float32 or float64 holding exact values
or int32 integers of ``unit_value``, or those integers' digits (heads, 3*DV, keys) int8, the keys last
(``value_digits_reference``). ``o`` (tokens, heads, DV) float64 =
softmax(scale * (u_nope * q_nope.k_nope + u_rope * q_pe.k_pe)) v.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..device.transfer import upload, upload_many
from .dense_attention_f64 import _hidden, _rope
from .flash_f64 import row_of_tile, softmax_block
from .latent_attention_f64 import latent_attention_reference, store_chunks

def digit_capacity(count: int) -> int:
    """The largest magnitude ``count`` balanced base-256 int8 digits hold (each at most 127)."""
    return 127 * sum(256 ** i for i in range(count))


DIGIT_MAX = digit_capacity(3)
Q_NOPE_DIGITS, K_DIGITS = 2, 3
V_DIGITS = 3  # the values' digits, where they come as digits
WEIGHT_BITS = 30  # the softmax weights' integers then: of 2**-30, in four digits (2**30 < digit_capacity(4))
_WEIGHT_SCALE = tl.constexpr(2.0 ** WEIGHT_BITS)  # (what a kernel may read of a module's globals)
# (queries a program takes, keys a block, warps, pipeline stages), the fastest of six on an H200 for
# bench_oracle's DeepSeek-V3 prefill chunks: 86.3 ms; 16 x 32 keys 109.2, 16 x 128 109.6 (1 stage) and
# 112.2 (2), 8 warps 147.2 (bench/RESULTS.md). 32 or 64 queries spill registers (the float64 values'
# products and their accumulators).
TILE = (16, 64, 4, 2)


def digit_widths_fit(nope: int, rope: int, value: int) -> bool:
    """Whether ``digit_attention`` takes these widths: int8 products need powers of two of at least 32,
    and the copy engine's tiles of 4-byte values rows of a multiple of 16 bytes."""
    return all(d >= 32 and d & (d - 1) == 0 for d in (nope, rope)) and value % 4 == 0


def digits_fit(bounds: dict[str, float], nope: int, rope: int, value: int, kv_lora_rank: int) -> bool:
    """Whether an MLA layer stack's scores can be taken exactly from int8 digits here: widths the kernel
    takes (``digit_widths_fit``), a kv_c rank whose per-head keys are exact (``digit_keys.expand_digits``:
    up to 1024), and its integers' bounds (``MLAStack.integer_bounds``) within their digits: |q_nope|
    within two, |k_nope|, |q_pe|, |k_pe| within three (``DIGIT_MAX``), each part's score an integer below
    2**53 (float64 joins the digits' powers exactly)."""
    b = bounds
    return (digit_widths_fit(nope, rope, value) and kv_lora_rank <= 1 << 10
            and b["q_nope"] <= digit_capacity(Q_NOPE_DIGITS)
            and max(b["k_nope"], b["q_pe"], b["k_pe"]) <= DIGIT_MAX
            and b["q_nope"] * b["k_nope"] * nope < 2.0 ** 53 and b["q_pe"] * b["k_pe"] * rope < 2.0 ** 53)


def value_width_fits(value: int) -> bool:
    """Whether ``digit_attention`` takes values of this width as digits: a power of two, at least 16 (one
    product takes the whole row)."""
    return value >= 16 and value & (value - 1) == 0


def value_digits_fit(bounds: dict[str, float], value: int) -> bool:
    """Whether the values' integers (``MLAStack.integer_bounds``' "v") fit ``V_DIGITS`` digits and their
    width is one the kernel takes (``value_width_fits``): then the oracle may hand ``digit_attention``
    their digits and its values' products run on the int8 tensor cores."""
    return bounds["v"] <= digit_capacity(V_DIGITS) and value_width_fits(value)


def split_digits_reference(x: torch.Tensor, unit: float, count: int) -> torch.Tensor:
    """x (rows, D) holding integers times ``unit`` (a power of two) -> (rows, count * D) int8, digit-major:
    the balanced base-256 digits d_0.. of x / unit (x / unit = sum of d_i 256**i, each d_i in [-128, 127]).
    Raises if a value needs more than ``count`` digits."""
    xi = torch.round(x.double() / unit).to(torch.int64)
    if not torch.equal(xi.double() * unit, x.double()):
        raise ValueError("split_digits_reference: values are not integers times the unit")
    out = []
    for _ in range(count):
        d = ((xi + 128) & 255) - 128
        out.append(d.to(torch.int8))
        xi = (xi - d) >> 8
    if bool((xi != 0).any()):
        raise ValueError(f"split_digits_reference: a value needs more than {count} digits")
    return torch.cat(out, dim=-1)


@triton.jit
def _next_digit(x):
    """x's lowest balanced base-256 digit (in [-128, 127]) and the rest (x - digit) / 256, exactly (int32)."""
    d = ((x + 128) & 255) - 128
    return d, (x - d) >> 8


@triton.jit(do_not_specialize=["first", "n_tok", "layer"])  # (layer 1 would be a constant; a step's count varies)
def _query_digits_kernel(tok, pos, emb1, emb2, w_qn, w_qr, cc, ss, qd, first, n_tok, layer, H,
                         HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
                         BT: tl.constexpr):
    """Tokens program_id(0) * BT.. of head program_id(1): the query's integers from its token id (two
    embedding rows, exact TF32 products of small integers, rope from the integer tables), split into
    digits and stored, never in memory as floats."""
    i = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1).to(tl.int64)
    im = i < n_tok
    x = _hidden(tok, first, i, im, emb1, emb2, layer, HID, T1, T2)
    hid = tl.arange(0, HID).to(tl.int64)
    row = (layer.to(tl.int64) * HID + hid) * H + h
    dn = tl.arange(0, N)
    q_n = tl.dot(x, tl.load(w_qn + row[:, None] * N + dn[None, :])).to(tl.int32)
    dr = tl.arange(0, R // 2)
    lo = tl.dot(x, tl.load(w_qr + row[:, None] * R + dr[None, :]))
    hi = tl.dot(x, tl.load(w_qr + row[:, None] * R + R // 2 + dr[None, :]))
    p = tl.load(pos + first + i, mask=im, other=0)
    r_lo, r_hi = _rope(lo, hi, p, im, cc, ss, R, R // 2)
    r_lo = r_lo.to(tl.int32)
    r_hi = r_hi.to(tl.int32)
    out = qd + (i.to(tl.int64) * H + h)[:, None] * (2 * N + 3 * R)
    for c in tl.static_range(2):
        dig, q_n = _next_digit(q_n)
        tl.store(out + c * N + dn[None, :], dig.to(tl.int8), mask=im[:, None])
    for c in tl.static_range(3):
        d_lo, r_lo = _next_digit(r_lo)
        d_hi, r_hi = _next_digit(r_hi)
        tl.store(out + 2 * N + c * R + dr[None, :], d_lo.to(tl.int8), mask=im[:, None])
        tl.store(out + 2 * N + c * R + R // 2 + dr[None, :], d_hi.to(tl.int8), mask=im[:, None])


def query_digits(emb1: torch.Tensor, emb2: torch.Tensor, w_qn: torch.Tensor, w_qr: torch.Tensor, tok: torch.Tensor,
                 pos: torch.Tensor, n_pos: int, layer: int, first: int = 0) -> torch.Tensor:
    """The digits ``digit_attention`` reads of one layer's queries, (tokens, heads, 2 N + 3 R) int8, from the
    tokens' ids ``tok`` at positions ``pos`` (below n_pos) and the MLA probe's float32 tables (``MLAStack``'s:
    emb1, emb2 (layers, table rows, hidden), w_qn (layers, hidden, heads, N), w_qr (layers, hidden, heads,
    R)): the digits of q_nope over ``MLAStack.query_unit`` and of q_pe over ``rope_unit``, exactly those
    splitting ``MLAStack.queries`` gives (the caller has proved the bounds: ``digits_fit``). The queries are
    tok[first:] at pos[first:] (an offset, not a slice: a slice's pointer alignment would build a kernel
    variant for each)."""
    from ..layers.exact import rotation_tables
    _, HID, H, N = w_qn.shape
    R = w_qr.shape[-1]
    n_tok = tok.shape[0] - first
    assert n_tok >= 0 and pos.shape[0] == tok.shape[0]
    qd = torch.empty((n_tok, H, 2 * N + 3 * R), dtype=torch.int8, device=tok.device)
    if n_tok == 0:
        return qd
    cc, ss = rotation_tables(R, n_pos, tok.device, torch.float32)
    BT = 32
    _query_digits_kernel[(triton.cdiv(n_tok, BT), H)](
        tok, pos, emb1, emb2, w_qn, w_qr, cc, ss, qd, first, n_tok, layer, H, HID=HID, T1=emb1.shape[1], T2=emb2.shape[1],
        N=N, R=R, BT=BT, num_warps=4)
    return qd


def value_digits_reference(v: torch.Tensor) -> torch.Tensor:
    """Values (keys, heads, DV) holding integers (of some unit) -> their balanced base-256 digits as
    ``digit_attention`` takes them: (heads, V_DIGITS * DV, keys rounded up to 16) int8, digit-major along
    the middle axis, the keys last (int8 products take both operands along their summed axis)."""
    n, H, DV = v.shape
    d = split_digits_reference(v.reshape(n * H, DV), 1.0, V_DIGITS).view(n, H, V_DIGITS * DV)
    out = torch.zeros((H, V_DIGITS * DV, -(-n // 16) * 16), dtype=torch.int8, device=v.device)
    out[:, :, :n] = d.permute(1, 2, 0)
    return out


def join_digits(d: torch.Tensor, unit: float, count: int) -> torch.Tensor:
    """split_digits' inverse: (..., count * D) int8 -> (..., D) float64 values (tests, the reference)."""
    parts = d.to(torch.float64).unflatten(-1, (count, -1))
    weights = torch.tensor([256.0 ** i for i in range(count)], dtype=torch.float64, device=d.device)
    return (parts * weights[:, None]).sum(-2) * unit


def digit_attention_reference(qd, kd, kr, v, q_start, q_len, k_start, pos0, scale: float,
                              unit_nope: float, unit_rope: float, unit_value: float = 1.0,
                              weight_bits: int | None = None) -> torch.Tensor:
    """``digit_attention`` in torch: the digits joined into float64 queries and keys (the unit of
    q_nope . k_nope is ``unit_nope``: q's digits carry 1 and k's ``unit_nope``; the same for rope),
    then ``latent_attention_reference``; or, for values as digits (int8), the integer weights' softmax
    a key block (``TILE``'s) at a time (``_integer_weights_reference``). Returns o (tokens, heads, DV),
    NaN where no row writes."""
    DN = kd.shape[-1] // K_DIGITS
    DR = kr.shape[-1] // K_DIGITS
    H = qd.shape[1]
    q = torch.cat([join_digits(qd[..., :Q_NOPE_DIGITS * DN], 1.0, Q_NOPE_DIGITS),
                   join_digits(qd[..., Q_NOPE_DIGITS * DN:], 1.0, K_DIGITS)], dim=-1)
    k = torch.cat([join_digits(kd, unit_nope, K_DIGITS),
                   join_digits(kr, unit_rope, K_DIGITS)[:, None, :].expand(-1, H, -1)], dim=-1)
    if v.dtype != torch.int8:
        v = v.double() * unit_value
        return latent_attention_reference(q[None], k[None], v[None], q_start, q_len, k_start, pos0, scale)[0]
    vv = join_digits(v.permute(2, 0, 1), 1.0, V_DIGITS)  # (keys, heads, DV)
    return _integer_weights_reference(q, k, vv, q_start, q_len, k_start, pos0, scale, TILE[1]) * unit_value


def _integer_weights_reference(q, k, v, q_start, q_len, k_start, pos0, scale: float, block: int) -> torch.Tensor:
    """The softmax of flash attention a block of ``block`` keys at a time (from each row's key 0), each
    block's weights exp(s - running maximum) rounded to integers of 2**-WEIGHT_BITS (half up) and the
    running sum taken of those: o = sum(w v) / sum(w). (tokens, heads, DV), NaN where no row writes."""
    nq, H, _ = q.shape
    o = torch.full((nq, H, v.shape[-1]), float("nan"), dtype=torch.float64, device=q.device)
    for qs, ql, ks, p0 in zip(q_start, q_len, k_start, pos0):
        n = p0 + ql
        s = torch.einsum("qhd,nhd->hqn", q[qs:qs + ql], k[ks:ks + n]) * scale
        qpos = torch.arange(p0, n, device=q.device)
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        m = torch.full(s.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros((H, ql, v.shape[-1]), dtype=torch.float64, device=q.device)
        for b0 in range(0, n, block):
            sb = s[..., b0:b0 + block]
            m_new = torch.maximum(m, sb.amax(-1))
            alpha = torch.exp(m - m_new)
            w = torch.floor(torch.exp(sb - m_new[..., None]) * 2.0 ** WEIGHT_BITS + 0.5)
            l_sum = l_sum * alpha + w.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("hqn,nhd->hqd", w, v[ks + b0:ks + min(n, b0 + block)])
            m = m_new
        o[qs:qs + ql] = (acc / l_sum[..., None]).permute(1, 0, 2)
    return o


@triton.jit
def _tile(desc, r0, h, c0, rows: tl.constexpr, cols: tl.constexpr):
    """A (rows x cols) tile of a 3-D (rows, heads, columns) descriptor at head h: the copy engine moves it
    and fills what lies past the tensor's rows or a head's columns with zeros."""
    return desc.load([r0, h, c0]).reshape(rows, cols)


@triton.jit
def _digit_attention_kernel(qd, qdr, kd, kr, v, o, tile_row, tile_q0, q_start, q_len, k_start, pos0, so_t, so_h, consts,
                            DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, DVC: tl.constexpr,
                            NV: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, VD: tl.constexpr = 0):
    """One program: BQ queries of one row and head program_id(1). qd, kd, kr and v are tensor
    descriptors (3-D: rows, heads, columns; kr's head axis has one head), qdr the queries' again in
    tiles of the rope part's width (a descriptor has one tile shape). Gathering loads measured worse:
    a tile of 64-bit addresses costs registers, and int8 bytes gathered into the products' operand
    layout cost byte permutes (twice the instructions a key block at 16 x 32, spills at 16 x 64)."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    scale = tl.load(consts)  # float64 (a float argument would arrive as float32)
    u_n = tl.load(consts + 1)
    u_r = tl.load(consts + 2)
    u_v = tl.load(consts + 3)
    r, i0, qs, ql, ks, p0 = row_of_tile(t, tile_row, tile_q0, q_start, q_len, k_start, pos0)
    qi = i0 + tl.arange(0, BQ)
    valid = qi < ql
    qpos = p0 + tl.minimum(qi, ql - 1)  # rows past the row's queries: finite, never stored
    q_0 = (qs + i0).to(tl.int32)  # (a descriptor's coordinates are 32-bit)
    qn0 = _tile(qd, q_0, head, 0, BQ, DN)
    qn1 = _tile(qd, q_0, head, DN, BQ, DN)
    qr0 = _tile(qdr, q_0, head, 2 * DN, BQ, DR)
    qr1 = _tile(qdr, q_0, head, 2 * DN + DR, BQ, DR)
    qr2 = _tile(qdr, q_0, head, 2 * DN + 2 * DR, BQ, DR)
    m_i = tl.full([BQ], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ], tl.float64)
    acc0 = tl.zeros([BQ, DVC], tl.float64)
    acc1 = tl.zeros([BQ, DVC], tl.float64)
    acc2 = tl.zeros([BQ, DVC], tl.float64)
    acc3 = tl.zeros([BQ, DVC], tl.float64)
    hi = p0 + tl.minimum(i0 + BQ, ql)  # keys 0..hi-1: up to the tile's last query
    for n0 in range(0, hi, BN):
        n = n0 + tl.arange(0, BN)
        k_0 = (ks + n0).to(tl.int32)  # (keys past hi belong to no query here: masked below, finite)
        # a part's score: sum over powers e of 256**e of its digit pairs i + j = e, the pairs of one power
        # summed on the tensor cores and two neighbouring powers joined in int32 (the higher times 256
        # before the lower's products accumulate: below 2**31), the joined pairs in float64
        kn0 = tl.trans(_tile(kd, k_0, head, 0, BN, DN))
        kn1 = tl.trans(_tile(kd, k_0, head, DN, BN, DN))
        kn2 = tl.trans(_tile(kd, k_0, head, 2 * DN, BN, DN))
        n_hi = tl.dot(qn1, kn2, out_dtype=tl.int32) * 256  # powers 3 and 2
        n_hi = tl.dot(qn1, kn1, tl.dot(qn0, kn2, n_hi, out_dtype=tl.int32), out_dtype=tl.int32)
        n_lo = tl.dot(qn1, kn0, tl.dot(qn0, kn1, out_dtype=tl.int32), out_dtype=tl.int32) * 256  # 1 and 0
        n_lo = tl.dot(qn0, kn0, n_lo, out_dtype=tl.int32)
        s_n = n_hi.to(tl.float64) * 65536.0 + n_lo.to(tl.float64)
        kr0 = tl.trans(_tile(kr, k_0, 0, 0, BN, DR))
        kr1 = tl.trans(_tile(kr, k_0, 0, DR, BN, DR))
        kr2 = tl.trans(_tile(kr, k_0, 0, 2 * DR, BN, DR))
        r_hi = tl.dot(qr2, kr2, out_dtype=tl.int32) * 256  # powers 4 and 3
        r_hi = tl.dot(qr2, kr1, tl.dot(qr1, kr2, r_hi, out_dtype=tl.int32), out_dtype=tl.int32)
        r_mid = tl.dot(qr2, kr0, tl.dot(qr1, kr1, tl.dot(qr0, kr2, out_dtype=tl.int32), out_dtype=tl.int32),
                       out_dtype=tl.int32)  # power 2
        r_lo = tl.dot(qr1, kr0, tl.dot(qr0, kr1, out_dtype=tl.int32), out_dtype=tl.int32) * 256  # 1 and 0
        r_lo = tl.dot(qr0, kr0, r_lo, out_dtype=tl.int32)
        s_r = (r_hi.to(tl.float64) * 256.0 + r_mid.to(tl.float64)) * 65536.0 + r_lo.to(tl.float64)
        s = (s_n * u_n + s_r * u_r) * scale
        s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))  # key 0 is seen by all: m stays finite
        if VD > 0:
            m_i, acc0, l_i = _integer_values(s, m_i, l_i, acc0, v, head, ks + n0, DV, BN)
        else:
            m_i, acc0, acc1, acc2, acc3, l_i = _float_values(s, m_i, l_i, acc0, acc1, acc2, acc3, v, k_0, head, BN,
                                                             DVC, NV)
    o_rows = (qs + tl.minimum(qi, ql - 1)).to(tl.int64) * so_t + head.to(tl.int64) * so_h
    store_chunks(o, o_rows, valid, acc0, acc1, acc2, acc3, l_i / u_v, DV, DVC, NV)  # (u_v a power of two: exact)


@triton.jit
def _integer_values(s, m_i, l_i, acc, vd, head, key0, DV: tl.constexpr, BN: tl.constexpr):
    """A key block's scores folded into the running maximum and sum with the weights rounded to integers of
    2**-30, and their products with the values' digits (vd: (heads, 3 DV, keys)) on the int8 tensor cores:
    four weight digits by three value digits, the pairs of one power summed in int32 and two neighbouring
    powers joined there (each pair's sum below 2**21: below 2**31), the three joined in float64."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    w = (tl.exp(s - m_new[:, None]) * _WEIGHT_SCALE + 0.5).to(tl.int32)  # (in [0, 2**30]: the cast floors)
    l_i = l_i * alpha + tl.sum(w.to(tl.float64), 1)
    w0, w = _next_digit(w)
    w1, w = _next_digit(w)
    w2, w3 = _next_digit(w)
    w0 = w0.to(tl.int8)
    w1 = w1.to(tl.int8)
    w2 = w2.to(tl.int8)
    w3 = w3.to(tl.int8)
    k = key0.to(tl.int32)  # (keys last: the products' summed axis contiguous, as int8 products take it)
    v0 = tl.trans(vd.load([head, 0, k]).reshape(DV, BN))
    v1 = tl.trans(vd.load([head, DV, k]).reshape(DV, BN))
    v2 = tl.trans(vd.load([head, 2 * DV, k]).reshape(DV, BN))
    a54 = tl.dot(w3, v2, out_dtype=tl.int32) * 256  # powers 5 and 4
    a54 = tl.dot(w3, v1, tl.dot(w2, v2, a54, out_dtype=tl.int32), out_dtype=tl.int32)
    a32 = tl.dot(w1, v2, tl.dot(w2, v1, tl.dot(w3, v0, out_dtype=tl.int32), out_dtype=tl.int32),
                 out_dtype=tl.int32) * 256  # 3 and 2
    a32 = tl.dot(w0, v2, tl.dot(w1, v1, tl.dot(w2, v0, a32, out_dtype=tl.int32), out_dtype=tl.int32),
                 out_dtype=tl.int32)
    a10 = tl.dot(w0, v1, tl.dot(w1, v0, out_dtype=tl.int32), out_dtype=tl.int32) * 256  # 1 and 0
    a10 = tl.dot(w0, v0, a10, out_dtype=tl.int32)
    acc = acc * alpha[:, None] + ((a54.to(tl.float64) * 65536.0 + a32.to(tl.float64)) * 65536.0 + a10.to(tl.float64))
    return m_new, acc, l_i


@triton.jit
def _float_values(s, m_i, l_i, acc0, acc1, acc2, acc3, v, k_0, head, BN: tl.constexpr, DVC: tl.constexpr,
                  NV: tl.constexpr):
    """A key block's scores folded into the running softmax, and its weights' products with the values
    (float64, in NV chunks of DVC columns)."""
    m_new, alpha, p, l_i = softmax_block(s, m_i, l_i)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, _tile(v, k_0, head, 0, BN, DVC).to(tl.float64))
    if NV > 1:
        acc1 = acc1 * alpha[:, None] + tl.dot(p, _tile(v, k_0, head, DVC, BN, DVC).to(tl.float64))
    if NV > 2:
        acc2 = acc2 * alpha[:, None] + tl.dot(p, _tile(v, k_0, head, 2 * DVC, BN, DVC).to(tl.float64))
    if NV > 3:
        acc3 = acc3 * alpha[:, None] + tl.dot(p, _tile(v, k_0, head, 3 * DVC, BN, DVC).to(tl.float64))
    return m_new, acc0, acc1, acc2, acc3, l_i


def digit_attention(qd: torch.Tensor, kd: torch.Tensor, kr: torch.Tensor, v: torch.Tensor, q_start: list[int],
                    q_len: list[int], k_start: list[int], pos0: list[int], scale: float, unit_nope: float,
                    unit_rope: float, out: torch.Tensor | None = None, unit_value: float = 1.0) -> torch.Tensor:
    """``digit_attention_reference`` in one launch (Triton: a GPU, or the interpreter). qd (tokens,
    heads, 2*DN + 3*DR), kd (keys, heads, 3*DN), kr (keys, 3*DR) int8, v (keys, heads, DV) float32,
    float64 or int32 (values ``unit_value`` times v, a power of two) or v's integers as digits (heads,
    3*DV, keys) int8 (``value_digits_reference``; then each row's first key at a multiple of 16), each
    with its last axis contiguous and the others' strides multiples of 16 bytes (the copy engine's
    tiles); DN and DR powers of two (at least 32). The heaviest tiles (most keys) start first. ``out``
    (tokens, heads, DV) float64: where to write."""
    assert qd.dtype == kd.dtype == kr.dtype == torch.int8
    assert v.dtype in (torch.float32, torch.float64, torch.int32, torch.int8)
    for x in (qd, kd, kr, v):  # (the copy engine's tiles: unit last stride, the others and the start 16-byte aligned)
        assert x.stride(-1) == 1 and x.data_ptr() % 16 == 0, "digit_attention: layout"
        assert all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1]), "digit_attention: layout"
    nq, H, _ = qd.shape
    DN, DR = kd.shape[-1] // K_DIGITS, kr.shape[-1] // K_DIGITS
    BQ, BN, warps, stages = TILE
    assert qd.shape[-1] == Q_NOPE_DIGITS * DN + K_DIGITS * DR
    digits = v.dtype == torch.int8
    if digits:
        assert kd.shape[1] == v.shape[0] == H
        DV = DVC = v.shape[1] // V_DIGITS
        assert value_width_fits(DV), "digit_attention: the values' digits' width"
        assert all(k % 16 == 0 for k in k_start), "digit_attention: a value tile's keys start 16-byte aligned"
    else:
        assert kd.shape[1] == v.shape[1] == H
        DV = v.shape[-1]
        DVC = max(16, triton.next_power_of_2(triton.cdiv(DV, 4)))
    o = torch.empty((nq, H, DV), dtype=torch.float64, device=qd.device) if out is None else out
    tiles = sorted(((p0 + min(i0 + BQ, ql), r, i0) for r, (ql, p0) in enumerate(zip(q_len, pos0))
                    for i0 in range(0, ql, BQ)), reverse=True)
    if not tiles:
        return o
    dev = qd.device
    ids = upload_many([[x[1] for x in tiles], [x[2] for x in tiles]], dev)
    meta = upload_many([q_start, q_len, k_start, pos0], dev)
    consts = upload([float(scale), float(unit_nope), float(unit_rope), float(unit_value)], dev, torch.float64)
    descs = [TensorDescriptor.from_tensor(x, block_shape=[rows, 1, cols]) for x, rows, cols in (
        (qd, BQ, DN), (qd, BQ, DR), (kd, BN, DN), (kr[:, None], BN, DR))]
    descs.append(TensorDescriptor.from_tensor(v, block_shape=[1, DV, BN]) if digits else
                 TensorDescriptor.from_tensor(v, block_shape=[BN, 1, DVC]))
    _digit_attention_kernel[(len(tiles), H)](
        *descs, o, ids[0], ids[1], meta[0], meta[1], meta[2], meta[3], o.stride(0), o.stride(1), consts,
        DN=DN, DR=DR, DV=DV, DVC=DVC, NV=triton.cdiv(DV, DVC), BQ=BQ, BN=BN, VD=V_DIGITS if digits else 0,
        num_warps=warps, num_stages=stages)
    return o
