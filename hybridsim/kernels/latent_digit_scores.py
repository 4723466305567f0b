"""The MLA oracle's absorbed rows (decodes): every score an exact integer from int8 digits, on the
int8 tensor cores, written as float64 for the float64 softmax and values that follow (torch).

Why: an absorbed row's float64 work is its scores (the query in the latent space times each latent
entry: 576 columns for DeepSeek-V3) and its values (the weights times kv_c: 512). On an H200 the
scores' float64 products were about half of ``deepseek_v3_mooncake``'s decode-row time (torch's
batched float64 products, 53 of 76 ms over five busy steps: ``bench/probes/oracle_decode_rows.py
--profile``), and the card's float64 rate is a sixteenth of its int8 rate.

The integers (``layers/mla.py``): the absorbed query q_lat = q_nope W_UK is an integer of
``MLAStack.nope_key_unit`` (below 2**22 for DeepSeek-V3: three balanced base-256 digits), kv_c one of
``query_unit`` (below 2**13: two digits), q_pe and k_pe ones of ``rope_unit`` (three each). So

    q_lat . kv_c = sum over q's digits i of 256**i (q_i . kv_c),  q_i . kv_c = 256 (q_i . k_1) + q_i . k_0,

each q_i . kv_c an int32 (``absorbed_digits_fit`` proves every partial sum stays below 2**31), joined
in float64 (every value an integer below 2**53: exact); the rope part's nine digit pairs joined as in
``digit_attention_f64``. The score is then scale * (u_nope * nope + u_rope * rope), rounded twice as the
reference rounds it: the kernel and ``latent_digit_scores_reference`` agree bit for bit.

Layout: z = layer * b + row of a padded batch (``MLAStack.attend``'s): queries ``qd`` (Z, M, 3 LR + 3 R)
int8, M = queries x heads (row m: query m // heads), digit-major [q_lat 0 | 1 | 2 | q_pe 0 | 1 | 2]; keys
``kd`` (Z, n, 2 LR + 3 R) int8 [kv_c 0 | 1 | k_pe 0 | 1 | 2] (``probe_latents.latent_rows(digits=True)``);
query positions ``qpos`` (b, q): key j is seen by query i of row r where j <= qpos[r, i]. Output ``s``
(Z, M, n) float64, -inf where a key is not seen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device.transfer import upload
from .digit_attention_f64 import DIGIT_MAX, digit_capacity

Q_DIGITS, KV_DIGITS = 3, 2
# (rows, keys, columns a product step, warps): 64 x 64 keeps the three int32 sums in registers beside a
# warp group's int8 products
TILE = (64, 64, 128, 8)


def absorbed_digits_fit(bounds: dict[str, float], kv_lora_rank: int, rope: int) -> bool:
    """Whether the absorbed scores of an MLA stack whose integers are bounded by ``bounds``
    (``MLAStack.integer_bounds``: q_lat, kv_c, q_pe, k_pe) can be taken here exactly: widths the products
    take (kv_lora_rank a multiple of the column step, rope a power of two of at least 32), q_lat, q_pe and
    k_pe within three digits and kv_c within two, every partial q_i . kv_c (a digit at most 128 times kv_c's
    bound, over kv_lora_rank columns) with a step's 256 q_i . k_1 added below 2**31, and each part's score
    an integer below 2**53."""
    b = bounds
    step = TILE[2]
    widths = kv_lora_rank % step == 0 and rope >= 32 and rope & (rope - 1) == 0
    partial = 128 * b["kv_c"] * kv_lora_rank + 256 * 128 * 128 * step
    return (widths and max(b["q_lat"], b["q_pe"], b["k_pe"]) <= DIGIT_MAX and b["kv_c"] <= digit_capacity(KV_DIGITS)
            and partial < 2.0 ** 31 and b["q_lat"] * b["kv_c"] * kv_lora_rank < 2.0 ** 53
            and b["q_pe"] * b["k_pe"] * rope < 2.0 ** 53)


def integer_digits(x: torch.Tensor, count: int) -> torch.Tensor:
    """Integers x (int64, (..., D)) -> their ``count`` balanced base-256 digits (..., count * D) int8,
    digit-major (the caller has proved they fit: no check, no sync)."""
    out = []
    for _ in range(count):
        d = ((x + 128) & 255) - 128
        out.append(d.to(torch.int8))
        x = (x - d) >> 8
    return torch.cat(out, dim=-1)


def absorbed_query_digits(q_lat: torch.Tensor, q_pe: torch.Tensor, unit_lat: float, unit_rope: float) -> torch.Tensor:
    """Absorbed queries [q_lat | q_pe] (float64 holding integers of ``unit_lat`` and ``unit_rope``, (..., LR) and
    (..., R)) -> ``qd``'s digits (..., 3 LR + 3 R) int8."""
    as_int = lambda x, unit: torch.round(x / unit).to(torch.int64)  # noqa: E731  (exact: powers of two)
    return torch.cat([integer_digits(as_int(q_lat, unit_lat), Q_DIGITS),
                      integer_digits(as_int(q_pe, unit_rope), 3)], dim=-1)


def widths(qd: torch.Tensor, kd: torch.Tensor) -> tuple[int, int]:
    """(kv_lora_rank, rope) of query digits (3 LR + 3 R wide) and key digits (2 LR + 3 R)."""
    LR = qd.shape[-1] - kd.shape[-1]
    R = (kd.shape[-1] - 2 * LR) // 3
    assert LR > 0 and R > 0 and qd.shape[-1] == 3 * LR + 3 * R, "latent digits: widths"
    return LR, R


def _joined(d: torch.Tensor, count: int) -> torch.Tensor:
    """Digit-major int8 digits (..., count * D) -> the integers (..., D) as float64."""
    parts = d.to(torch.float64).unflatten(-1, (count, -1))
    return sum(parts[..., i, :] * 256.0 ** i for i in range(count))


def latent_digit_scores_reference(qd: torch.Tensor, kd: torch.Tensor, qpos: torch.Tensor, heads: int, scale: float,
                                  unit_nope: float, unit_rope: float) -> torch.Tensor:
    """``latent_digit_scores`` in torch: the digits joined into integers (float64 products and sums of them are
    exact: every value an integer below 2**53), each part's score times its unit, summed, times the scale."""
    Z, M, _ = qd.shape
    LR, R = widths(qd, kd)
    q_lat, q_pe = _joined(qd[..., :3 * LR], 3), _joined(qd[..., 3 * LR:], 3)
    kv, k_pe = _joined(kd[..., :2 * LR], 2), _joined(kd[..., 2 * LR:], 3)
    nope = torch.einsum("zmd,znd->zmn", q_lat, kv)
    rope = torch.einsum("zmd,znd->zmn", q_pe, k_pe)
    s = (nope * unit_nope + rope * unit_rope) * scale
    b, q = qpos.shape
    pos = qpos.repeat_interleave(heads, dim=1).repeat(Z // b, 1)  # (Z, M): z = layer * b + row
    seen = torch.arange(kd.shape[1], device=kd.device)[None, None, :] <= pos[:, :, None]
    return s.masked_fill(~seen, float("-inf"))


@triton.jit
def _q_i_kv(q, k0t, k1t, acc):
    """acc + q . kv_c over one column step, kv_c = 256 k_1 + k_0: int32 (its bound proved by the caller)."""
    return tl.dot(q, k0t, acc + tl.dot(q, k1t, out_dtype=tl.int32) * 256, out_dtype=tl.int32)


@triton.jit(do_not_specialize=["M", "n", "b", "q_len"])  # (a step's batch shapes vary)
def _latent_digit_scores_kernel(qd, kd, qpos, s, consts, M, n, b, q_len, H,
                                LR: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BK: tl.constexpr):
    """Rows program_id(0) * BM.. and keys program_id(1) * BN.. of batch entry z = program_id(2)."""
    z = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    rc = tl.minimum(rows, M - 1)  # (rows and keys past the ends: finite, never stored)
    kc = tl.minimum(keys, n - 1)
    pos = tl.load(qpos + (z % b) * q_len + rc // H)
    out = s + (z * M + rc.to(tl.int64))[:, None] * n + keys[None, :]
    om = (rows < M)[:, None] & (keys < n)[None, :]
    if tl.program_id(1) * BN <= tl.max(pos, 0):  # (else no query of the tile sees a key of the block)
        scale = tl.load(consts)  # float64 (a float argument would arrive as float32)
        u_n = tl.load(consts + 1)
        u_r = tl.load(consts + 2)
        qrow = qd + (z * M + rc.to(tl.int64))[:, None] * (3 * LR + 3 * R)
        krow = kd + (z * n + kc.to(tl.int64))[:, None] * (2 * LR + 3 * R)
        t0 = tl.zeros([BM, BN], tl.int32)
        t1 = tl.zeros([BM, BN], tl.int32)
        t2 = tl.zeros([BM, BN], tl.int32)
        for c in tl.range(0, LR, BK):
            d = c + tl.arange(0, BK)[None, :]
            k0t = tl.trans(tl.load(krow + d))
            k1t = tl.trans(tl.load(krow + LR + d))
            t0 = _q_i_kv(tl.load(qrow + d), k0t, k1t, t0)
            t1 = _q_i_kv(tl.load(qrow + LR + d), k0t, k1t, t1)
            t2 = _q_i_kv(tl.load(qrow + 2 * LR + d), k0t, k1t, t2)
        s_n = (t2.to(tl.float64) * 65536.0 + t1.to(tl.float64) * 256.0) + t0.to(tl.float64)
        dr = tl.arange(0, R)[None, :]
        qr0 = tl.load(qrow + 3 * LR + dr)
        qr1 = tl.load(qrow + 3 * LR + R + dr)
        qr2 = tl.load(qrow + 3 * LR + 2 * R + dr)
        kr0 = tl.trans(tl.load(krow + 2 * LR + dr))
        kr1 = tl.trans(tl.load(krow + 2 * LR + R + dr))
        kr2 = tl.trans(tl.load(krow + 2 * LR + 2 * R + dr))
        r_hi = tl.dot(qr2, kr2, out_dtype=tl.int32) * 256  # powers 4 and 3
        r_hi = tl.dot(qr2, kr1, tl.dot(qr1, kr2, r_hi, out_dtype=tl.int32), out_dtype=tl.int32)
        r_mid = tl.dot(qr2, kr0, tl.dot(qr1, kr1, tl.dot(qr0, kr2, out_dtype=tl.int32), out_dtype=tl.int32),
                       out_dtype=tl.int32)  # power 2
        r_lo = tl.dot(qr1, kr0, tl.dot(qr0, kr1, out_dtype=tl.int32), out_dtype=tl.int32) * 256  # 1 and 0
        r_lo = tl.dot(qr0, kr0, r_lo, out_dtype=tl.int32)
        s_r = (r_hi.to(tl.float64) * 256.0 + r_mid.to(tl.float64)) * 65536.0 + r_lo.to(tl.float64)
        sc = (s_n * u_n + s_r * u_r) * scale
        tl.store(out, tl.where(keys[None, :] <= pos[:, None], sc, float("-inf")), mask=om)
    else:
        tl.store(out, tl.full([BM, BN], float("-inf"), tl.float64), mask=om)


def latent_digit_scores(qd: torch.Tensor, kd: torch.Tensor, qpos: torch.Tensor, heads: int, scale: float,
                        unit_nope: float, unit_rope: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``latent_digit_scores_reference`` in one launch (Triton: a GPU, or the interpreter): qd (Z, M, 3 LR + 3 R),
    kd (Z, n, 2 LR + 3 R) int8, contiguous; qpos (b, q) int64 with Z a multiple of b and M = q * heads.
    Returns s (Z, M, n) float64 (``out``, contiguous, if given)."""
    assert qd.dtype == kd.dtype == torch.int8 and qd.is_contiguous() and kd.is_contiguous()
    Z, M, _ = qd.shape
    n = kd.shape[1]
    LR, R = widths(qd, kd)
    b, q = qpos.shape
    BM, BN, BK, warps = TILE
    assert kd.shape[0] == Z and Z % b == 0 and M == q * heads and LR % BK == 0
    s = torch.empty((Z, M, n), dtype=torch.float64, device=qd.device) if out is None else out
    assert s.shape == (Z, M, n) and s.dtype == torch.float64 and s.is_contiguous()
    if Z == 0 or M == 0 or n == 0:
        return s
    consts = upload([float(scale), float(unit_nope), float(unit_rope)], qd.device, torch.float64)
    _latent_digit_scores_kernel[(triton.cdiv(M, BM), triton.cdiv(n, BN), Z)](
        qd, kd, qpos.contiguous(), s, consts, M, n, b, q, heads, LR=LR, R=R, BM=BM, BN=BN, BK=BK, num_warps=warps)
    return s
