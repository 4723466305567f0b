"""Attention of a block of queries over a block of keys, with its lse: the MLA prefill path's
product (``attention_partial``), flash-style.

The prefill path attends the new tokens to themselves (a causal mask) and to each chunk of
up-projected cached context (no mask), then merges the partial results by their lse. The
reference (``ReferenceKernels.attention_partial``) materialises the score matrix: at
DeepSeek-V3's 128 heads, a 1,024-token chunk over 3,000 tokens of context is 1.6 GB of float32
scores, written, read and written again by the softmax, read by the product with V. Here each
program keeps a tile of queries of one head in registers and walks the keys in tiles with a
running max and sum (scores never leave the chip).

Semantics are the reference's, element for element: q (n, H, dq), k (m, H, dq) or (m, dq) shared
by the heads, v (m, H, dv) or (m, dv), an optional boolean mask (n, m) (True: visible); the result
is out (n, H, dv) float32 and lse (n, H) in natural log. A row that sees no key gives 0 and -inf; a
row whose visible scores hold a NaN gives 0 and NaN, one holding +inf (and no NaN) 0 and +inf (what
the reference's softmax gives). Products run on the tensor cores in TF32 where float32 products
may (``torch.backends.cuda.matmul.allow_tf32``, as the executor's low-precision path sets it: the
same rounding the reference's einsum gets there) and in full float32 otherwise.

With a mask, a key tile no query row of the tile can see is skipped (the causal part's upper
triangle); the reference multiplies such keys' values by zero probabilities, so a NaN in the
value of a key no row can see reaches its output and not this kernel's: such a value is an
unwritten cache entry outside every row's context, which no check reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["n", "m", "causal_off"])
def _partial_attention_kernel(q, q_r, k, k_r, v, mask, out, lse, n, m, H, dq, dv,
                              sq_n, sq_h, sk_m, sk_h, sv_m, sv_h, sm_n, sm_m, so_n, so_h,
                              scale_log2, causal_off,
                              D1: tl.constexpr, D2: tl.constexpr, BLOCK_DV: tl.constexpr,
                              HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr,
                              PRECISION: tl.constexpr, DESC: tl.constexpr, K_HEADS: tl.constexpr,
                              V_HEADS: tl.constexpr):
    """One program: BLOCK_M query rows of one head over all m keys. The query dimension is taken
    as D1 (a power of two) plus a remainder of D2 columns (0: none): 192 = 128 + 64.

    CAUSAL: the mask is the causal one, key j visible to row i where j <= i + causal_off (the
    prefill path's new tokens over themselves), computed here, and the key loop stops at the
    tile's last visible key; HAS_MASK: a boolean mask tensor is read, and tiles no row sees are
    skipped.

    DESC: q, k and v are tensor descriptors over 2-D views (rows, heads x dim) whose tiles are
    exactly the head's columns (dq == D1 + D2, dv == BLOCK_DV), q_r and k_r the same views in
    tiles of the D2 remainder: the copy engine moves the tiles and zero-fills rows past the end.
    Otherwise all are pointers (q_r, k_r unused), and every tile is a masked gather (any shape;
    a tile of 64-bit addresses costs registers that the descriptors do not)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    h64 = h.to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n
    rows64 = rows.to(tl.int64)
    d1 = tl.arange(0, D1)
    d2 = D1 + tl.arange(0, D2 if D2 > 0 else 16)
    dvs = tl.arange(0, BLOCK_DV)
    dvm = dvs < dv
    if DESC:
        q1 = q.load([pid * BLOCK_M, h * dq])
        if D2 > 0:
            q2 = q_r.load([pid * BLOCK_M, h * dq + D1])
    else:
        q1 = tl.load(q + rows64[:, None] * sq_n + h64 * sq_h + d1[None, :], mask=rmask[:, None] & (d1[None, :] < dq),
                     other=0.0)
        if D2 > 0:
            q2 = tl.load(q + rows64[:, None] * sq_n + h64 * sq_h + d2[None, :],
                         mask=rmask[:, None] & (d2[None, :] < dq), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    special = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)  # per element: 1 a visible NaN score met, 2 a +inf one
    hi = m
    if CAUSAL:  # key j visible to query row i where j <= i + causal_off: no tile past the last row's
        hi = tl.minimum(m, pid * BLOCK_M + BLOCK_M + causal_off)
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < m
        cols64 = cols.to(tl.int64)
        vis = rmask[:, None] & cmask[None, :]
        if CAUSAL:
            vis = vis & (cols[None, :] <= rows[:, None] + causal_off)
        if HAS_MASK:
            seen = tl.load(mask + rows64[:, None] * sm_n + cols64[None, :] * sm_m, mask=vis, other=0)
            vis = vis & (seen != 0)
            live = tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0
        else:
            live = True
        if live:
            if DESC:
                k1 = k.load([n0, h * dq if K_HEADS else 0])
            else:
                k1 = tl.load(k + cols64[:, None] * sk_m + h64 * sk_h + d1[None, :],
                             mask=cmask[:, None] & (d1[None, :] < dq), other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            if D2 > 0:
                if DESC:
                    k2 = k_r.load([n0, (h * dq if K_HEADS else 0) + D1])
                else:
                    k2 = tl.load(k + cols64[:, None] * sk_m + h64 * sk_h + d2[None, :],
                                 mask=cmask[:, None] & (d2[None, :] < dq), other=0.0)
                s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
            s = s * scale_log2
            # (tallied element by element and folded once after the loop: no row reductions a tile)
            special |= tl.where(vis & (s != s), 1, 0) | tl.where(vis & (s == float("inf")), 2, 0)
            s = tl.where(vis & (s == s), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where((m_new == float("-inf")) | (m_new == float("inf")), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            p = tl.where(p == p, p, 0.0)  # (+inf scores: flagged above, their rows are replaced)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DESC:
                vt = v.load([n0, h * dv if V_HEADS else 0])
            else:
                vt = tl.load(v + cols64[:, None] * sv_m + h64 * sv_h + dvs[None, :],
                             mask=cmask[:, None] & dvm[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PRECISION)
            m_i = m_new
    nan_row = tl.max(special & 1, 1)
    inf_row = tl.max(special & 2, 1)
    bad = (nan_row > 0) | (inf_row > 0)
    empty = (l_i == 0.0) | bad
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    res = tl.where(bad[:, None], 0.0, acc * inv[:, None])
    ln2 = 0.6931471805599453
    row_lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * ln2)
    row_lse = tl.where(inf_row > 0, float("inf"), row_lse)
    row_lse = tl.where(nan_row > 0, float("nan"), row_lse)
    tl.store(out + rows64[:, None] * so_n + h64 * so_h + dvs[None, :], res, mask=rmask[:, None] & dvm[None, :])
    tl.store(lse + rows64 * H + h64, row_lse, mask=rmask)


def _pow2_floor(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


# (BLOCK_M, BLOCK_N, num_warps, num_stages), the fastest of ten on an H200 at DeepSeek-V3's 128 heads x
# (192, 128), float32 inputs, TF32 products, 1,024 queries over 1,024 (causal) / 3,000 / 8,192 keys:
# 559 / 2,384 / 6,405 us, 105 TFLOP/s at the longer two; (128, 32, 4, 3) 4-6% slower, (128, 32, 8, 2)
# 13-17%, 64-row tiles 31-111% (bench/bench_kernels.py --only partial; bench/RESULTS.md). 128 x 64
# tiles need more shared memory than Hopper has at two stages (float32 tiles: twice bf16's bytes).
CONFIG = (128, 32, 8, 3)


def _flat_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x (rows, heads, dim) or (rows, dim) as a 2-D (rows, heads x dim) view a descriptor can
    address: unit stride along dim, heads packed, row stride a multiple of 16 bytes, 16-byte
    aligned; None if it is not such a view."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        return None
    if x.dim() == 3 and x.shape[1] > 1 and x.stride(1) != x.shape[2]:
        return None
    width = x.shape[-1] * (x.shape[1] if x.dim() == 3 else 1)
    if x.shape[0] > 1 and (x.stride(0) * 4) % 16:
        return None
    return x.as_strided((x.shape[0], width), (x.stride(0) if x.shape[0] > 1 else width, 1))


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] = CONFIG, precision: str | None = None,
                      descriptors: bool = True, causal: int | None = None):
    """The reference's ``attention_partial`` (module docstring), one launch. ``out`` / ``lse``:
    buffers to write (poisoned by a caller that checks every element is written). ``precision``:
    "tf32" or "ieee" (None: TF32 where torch allows it for float32 products, else full float32).
    ``descriptors``: False forces the gathering loads (tests cover both). ``causal``: the mask is
    the causal one with this offset (key j visible to query i where j <= i + causal; the mask
    tensor is then not read, only its shape checked)."""
    n, H, dq = q.shape
    m = k.shape[0]
    dv = v.shape[-1]
    q, k, v = q.float(), k.float(), v.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if out is None:
        out = torch.empty((n, H, dv), dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty((n, H), dtype=torch.float32, device=q.device)
    if n == 0 or H == 0:
        return out, lse
    sk_h = k.stride(1) if k.dim() == 3 else 0
    sv_h = v.stride(1) if v.dim() == 3 else 0
    if causal is not None and mask is not None and tuple(mask.shape) != (n, m):
        raise ValueError(f"mask of shape {tuple(mask.shape)} for {n} queries over {m} keys")
    has_mask = mask is not None and causal is None
    mk = mask.view(torch.int8) if has_mask and mask.dtype == torch.bool else mask
    if not has_mask:
        mk = lse  # (never read)
    d1 = max(16, _pow2_floor(dq))
    rest = max(dq - d1, 0)
    d2 = max(16, _pow2_ceil(rest)) if rest > 0 else 0
    block_dv = max(16, _pow2_ceil(dv))
    bm, bn, warps, stages = config
    if precision is None:
        precision = "tf32" if q.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    qa, ka, va = q, k, v
    qr, kr = q, k
    use_desc = descriptors and dq == d1 + d2 and dv == block_dv and m > 0
    if use_desc:
        views = [_flat_rows(x) for x in (q, k, v)]
        use_desc = all(x is not None for x in views)
    if use_desc:
        qa = TensorDescriptor.from_tensor(views[0], block_shape=[bm, d1])
        ka = TensorDescriptor.from_tensor(views[1], block_shape=[bn, d1])
        va = TensorDescriptor.from_tensor(views[2], block_shape=[bn, dv])
        qr, kr = qa, ka
        if d2:  # (a descriptor has one block shape: the remainder's tiles come from a second one)
            qr = TensorDescriptor.from_tensor(views[0], block_shape=[bm, d2])
            kr = TensorDescriptor.from_tensor(views[1], block_shape=[bn, d2])
    grid = (triton.cdiv(n, bm), H)
    _partial_attention_kernel[grid](
        qa, qr, ka, kr, va, mk, out, lse, n, m, H, dq, dv,
        q.stride(0), q.stride(1), k.stride(0), sk_h, v.stride(0), sv_h,
        mk.stride(0) if has_mask else 0, mk.stride(1) if has_mask else 0, out.stride(0), out.stride(1),
        scale * LOG2E, causal or 0,
        D1=d1, D2=d2, BLOCK_DV=block_dv, HAS_MASK=has_mask, CAUSAL=causal is not None, BLOCK_M=bm, BLOCK_N=bn,
        PRECISION=precision, DESC=use_desc, K_HEADS=k.dim() == 3, V_HEADS=v.dim() == 3, num_warps=warps,
        num_stages=stages)
    return out, lse
