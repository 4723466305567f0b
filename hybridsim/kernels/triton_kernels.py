"""Triton kernel provider: the same semantics as ``reference.py``, as GPU kernels.

On a CPU these run under ``TRITON_INTERPRET=1`` (small sizes; that is how CI tests
them). Every block id and row index is widened to int64 before it is multiplied by
a stride: caches larger than 2^31 bytes are normal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import ReferenceKernels


# ----------------------------------------------------------------------------- Mamba state copies


@triton.jit
def _copy_window(sbase, dbase, n, BLOCK: tl.constexpr):
    """Copy n elements in tiles from low to high; each tile is fully loaded before any lane
    stores, so an in-place left shift (dbase < sbase) has memmove semantics."""
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK).to(tl.int64)
        m = idx < n
        v = tl.load(sbase + idx, mask=m)
        tl.debug_barrier()
        tl.store(dbase + idx, v, mask=m)


@triton.jit
def _conv_copy_kernel(conv, src, dst, off, page_stride, row_elems, rows, BLOCK: tl.constexpr):
    """conv[dst, 0:rows-o] = conv[src, o:rows] for copy i, one program per copy."""
    i = tl.program_id(0)
    s = tl.load(src + i).to(tl.int64)
    d = tl.load(dst + i).to(tl.int64)
    o = tl.load(off + i).to(tl.int64)
    _copy_window(conv + s * page_stride + o * row_elems, conv + d * page_stride, (rows - o) * row_elems, BLOCK)


@triton.jit
def _page_copy_kernel(data, src, dst, page_stride, page_elems, BLOCK: tl.constexpr):
    """data[dst_i] = data[src_i]; grid (copies, tiles): a large page is split over many programs."""
    i = tl.program_id(0)
    t = tl.program_id(1)
    s = tl.load(src + i).to(tl.int64)
    d = tl.load(dst + i).to(tl.int64)
    idx = t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < page_elems
    v = tl.load(data + s * page_stride + idx, mask=m)
    tl.store(data + d * page_stride + idx, v, mask=m)


@triton.jit
def _fused_state_copy_kernel(conv, temporal, src, dst, off, tsrc, layers,
                             conv_layer_stride, conv_page_stride, conv_row_elems, conv_rows,
                             t_layer_stride, t_page_stride, t_page_elems, t_tiles,
                             BLOCK: tl.constexpr, CONV_BLOCK: tl.constexpr):
    """Every (copy, layer, state) of a step in one launch. Grid (copies x layers, t_tiles + 1):
    tiles 0..t_tiles-1 each move one BLOCK of the temporal page (large pages spread over many
    programs), the last tile moves the conv window with its accept-bias shift (low to high)."""
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    i = pid // layers
    layer = (pid % layers).to(tl.int64)
    d = tl.load(dst + i).to(tl.int64)
    if tile < t_tiles:
        ts = tl.load(tsrc + i).to(tl.int64)
        idx = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = idx < t_page_elems
        tbase = temporal + layer * t_layer_stride
        v = tl.load(tbase + ts * t_page_stride + idx, mask=m)
        tl.store(tbase + d * t_page_stride + idx, v, mask=m)
    else:
        s = tl.load(src + i).to(tl.int64)
        o = tl.load(off + i).to(tl.int64)
        cbase = conv + layer * conv_layer_stride
        _copy_window(cbase + s * conv_page_stride + o * conv_row_elems, cbase + d * conv_page_stride,
                     (conv_rows - o) * conv_row_elems, CONV_BLOCK)


def fused_state_copy(conv: torch.Tensor, temporal: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                     offset: torch.Tensor, tsrc: torch.Tensor, block: int = 8192) -> None:
    """conv (layers, pages, rows, dim), temporal (layers, pages, ...): all layers, one launch."""
    n = src.numel()
    if n == 0:
        return
    layers = conv.shape[0]
    t_elems = temporal[0, 0].numel()
    tiles = triton.cdiv(t_elems, block)
    dev = conv.device
    _fused_state_copy_kernel[(n * layers, tiles + 1)](
        conv, temporal, src.to(dev, torch.int64), dst.to(dev, torch.int64), offset.to(dev, torch.int64),
        tsrc.to(dev, torch.int64), layers, conv.stride(0), conv.stride(1), conv.stride(2), conv.shape[2],
        temporal.stride(0), temporal.stride(1), t_elems, tiles, BLOCK=block, CONV_BLOCK=4096, num_warps=8)


# ----------------------------------------------------------------------------- cache ops


@triton.jit
def _scatter_rows_kernel(entries, slots, cache, dim, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    for start in range(0, dim, BLOCK):
        c = start + tl.arange(0, BLOCK)
        m = c < dim
        v = tl.load(entries + i.to(tl.int64) * dim + c, mask=m)
        tl.store(cache + slot * dim + c, v.to(cache.dtype.element_ty), mask=m)


@triton.jit
def _gather_rows_kernel(cache, block_row, out, start, length, page, dim, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr):
    """ROWS positions per program, each row read through the block table."""
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rm = i < length
    pos = start + i
    blk = tl.load(block_row + pos // page, mask=rm, other=0).to(tl.int64)
    src = (blk * page + pos % page) * dim
    for c0 in range(0, dim, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = rm[:, None] & (c < dim)[None, :]
        v = tl.load(cache + src[:, None] + c[None, :], mask=m)
        tl.store(out + i[:, None] * dim + c[None, :], v, mask=m)


# ----------------------------------------------------------------------------- merge


@triton.jit
def _merge_kernel(oa, la, ob, lb, out, lse_out, n_rows, D, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                  BASE2_BUG: tl.constexpr, UNGUARDED: tl.constexpr):
    """ROWS (token, head) rows per program: weights from the two natural-log lse values."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rm = r < n_rows
    a = tl.load(la + r, mask=rm, other=0.0)
    b = tl.load(lb + r, mask=rm, other=0.0)
    m = tl.maximum(a, b)
    if not UNGUARDED:
        both = (a == float("-inf")) & (b == float("-inf"))
        m = tl.where(both, 0.0, m)
    if BASE2_BUG:
        wa = tl.exp2(a - m)
        wb = tl.exp2(b - m)
    else:
        wa = tl.exp(a - m)
        wb = tl.exp(b - m)
    s = wa + wb
    if UNGUARDED:
        inv = 1.0 / s
        lse = m + tl.log(s)
    else:
        empty = s == 0.0
        safe = tl.where(empty, 1.0, s)
        inv = tl.where(empty, 0.0, 1.0 / safe)
        lse = tl.where(empty, float("-inf"), m + tl.log(safe))
    c = tl.arange(0, BLOCK_D)
    mask = rm[:, None] & (c < D)[None, :]
    off = r[:, None] * D + c[None, :]
    xa = tl.load(oa + off, mask=mask, other=0.0)
    xb = tl.load(ob + off, mask=mask, other=0.0)
    res = xa * (wa * inv)[:, None] + xb * (wb * inv)[:, None]
    tl.store(out + off, res, mask=mask)
    tl.store(lse_out + r, lse, mask=rm)


# ----------------------------------------------------------------------------- MLA decode


@triton.jit
def _mla_decode_kernel(q_lat, q_pe, cache, block_table, seq_lens, o_part, lse_part,
                       M, H, nq, max_blocks, keys_per_split, scale,
                       L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                       LOW_PRECISION: tl.constexpr):
    """One program: request b, key split s, a tile of BLOCK_M (query token, head) rows.

    Every row of the tile shares the latent cache of request b, so each latent tile is
    loaded once per program and used both as K (with k_pe) and as V. Bottom-right causal
    mask: query token t of nq sees keys up to seq_len - nq + t. Writes the split's
    partial output and natural-log lse (-inf for a split with no visible key).
    """
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    mt = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    qtok = rows // H
    qpos = seq_len - nq + qtok
    lcols = tl.arange(0, BLOCK_L)
    lmask = lcols < L
    rcols = tl.arange(0, R)
    qbase = (b * M + rows.to(tl.int64))
    ql = tl.load(q_lat + qbase[:, None] * L + lcols[None, :], mask=rmask[:, None] & lmask[None, :], other=0.0)
    qr = tl.load(q_pe + qbase[:, None] * R + rcols[None, :], mask=rmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    k_start = sp * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, seq_len)
    for n0 in range(k_start, k_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < k_end
        blk = tl.load(block_table + b * max_blocks + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        kaddr = (blk * PAGE + kpos % PAGE) * (L + R)
        kv = tl.load(cache + kaddr[:, None] + lcols[None, :], mask=kmask[:, None] & lmask[None, :], other=0.0)
        kpe = tl.load(cache + kaddr[:, None] + L + rcols[None, :], mask=kmask[:, None], other=0.0)
        if LOW_PRECISION:  # bf16/fp16 cache: matrix units, fp32 accumulation
            kv = kv.to(cache.dtype.element_ty)
            s = tl.dot(ql.to(kv.dtype), tl.trans(kv)) + tl.dot(qr.to(kv.dtype), tl.trans(kpe))
        else:  # fp32 cache: exact fp32 products (no tf32)
            kv = kv.to(tl.float32)
            s = tl.dot(ql, tl.trans(kv), input_precision="ieee") + \
                tl.dot(qr, tl.trans(kpe.to(tl.float32)), input_precision="ieee")
        s = s * scale
        visible = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if LOW_PRECISION:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    out = acc * inv[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    obase = (sp.to(tl.int64) * tl.num_programs(0) + b) * M + rows.to(tl.int64)
    tl.store(o_part + obase[:, None] * L + lcols[None, :], out, mask=rmask[:, None] & lmask[None, :])
    tl.store(lse_part + obase, lse, mask=rmask)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class TritonKernels(ReferenceKernels):
    """Triton versions of the hot kernels; the rest falls back to the reference."""

    name = "triton"

    def state_copy(self, conv, temporal, src, dst, offset, rows):
        n = src.numel()
        if n == 0:
            return
        dev = conv.device
        row_elems = conv.stride(1)
        _conv_copy_kernel[(n,)](conv, src.to(dev, torch.int64), dst.to(dev, torch.int64),
                                offset.to(dev, torch.int64), conv.stride(0), row_elems, conv.shape[1], BLOCK=1024)

    def temporal_copy(self, temporal, src, dst):
        n = src.numel()
        if n == 0:
            return
        dev = temporal.device
        page = temporal[0].numel()
        BLOCK = 4096
        _page_copy_kernel[(n, triton.cdiv(page, BLOCK))](temporal, src.to(dev, torch.int64), dst.to(dev, torch.int64),
                                                         temporal.stride(0), page, BLOCK=BLOCK)

    def concat_and_cache(self, entries, slots, cache):
        n = entries.shape[0]
        if n == 0:
            return
        dim = cache.shape[-1]
        _scatter_rows_kernel[(n,)](entries.contiguous().to(cache.device), slots.to(cache.device, torch.int64), cache,
                                   dim, BLOCK=min(_pow2(dim), 1024))

    def gather_cache(self, cache, block_row, start, length):
        page = cache.shape[1]
        if start % page:
            raise ValueError(f"gather_cache: start {start} is not a multiple of the page size {page}")
        dim = cache.shape[-1]
        out = torch.full((length, dim), float("nan"), dtype=cache.dtype, device=cache.device)  # poisoned
        if length:
            rows = 8
            _gather_rows_kernel[(triton.cdiv(length, rows),)](cache, block_row.to(cache.device, torch.int64), out,
                                                              start, length, page, dim, BLOCK=min(_pow2(dim), 1024),
                                                              ROWS=rows)
        return out

    def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
        D = o_a.shape[-1]
        rows = lse_a.numel()
        # row-major, as the kernel writes; poisoned so an unwritten element cannot pass
        out = torch.full(o_a.shape, float("nan"), dtype=torch.float32, device=o_a.device)
        lse = torch.full(lse_a.shape, float("nan"), dtype=torch.float32, device=lse_a.device)
        if rows:
            per = max(1, min(16, 4096 // _pow2(D)))
            _merge_kernel[(triton.cdiv(rows, per),)](o_a.contiguous().float(), lse_a.contiguous().float(),
                                                     o_b.contiguous().float(), lse_b.contiguous().float(), out, lse,
                                                     rows, D, BLOCK_D=_pow2(D), ROWS=per, BASE2_BUG=base2_bug,
                                                     UNGUARDED=unguarded, num_warps=8)
        return out, lse

    def mla_decode_batched(self, q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits=0,
                           block_m=16, block_n=32, num_warps=4):
        """q_lat (B, nq, H, L), q_pe (B, nq, H, R); block_table (B, max_blocks); seq_lens (B,).

        Returns o_lat (B, nq, H, L) and lse (B, nq, H). ``num_splits`` 0 picks the split
        count from batch x head tiles against the multiprocessor count.
        """
        B, nq, H, L = q_lat.shape
        R = q_pe.shape[-1]
        page = cache.shape[1]
        M = nq * H
        mtiles = triton.cdiv(M, block_m)
        max_len = int(seq_lens.max())
        if num_splits <= 0:
            sms = torch.cuda.get_device_properties(cache.device).multi_processor_count if cache.is_cuda else 4
            num_splits = max(1, min(triton.cdiv(max_len, 256), triton.cdiv(2 * sms, B * mtiles)))
        per = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
        num_splits = triton.cdiv(max_len, per)
        dev = cache.device
        o_part = torch.full((num_splits, B, M, L), float("nan"), dtype=torch.float32, device=dev)
        lse_part = torch.full((num_splits, B, M), float("nan"), dtype=torch.float32, device=dev)
        _mla_decode_kernel[(B, num_splits, mtiles)](
            q_lat.contiguous().float(), q_pe.contiguous().float(), cache, block_table.to(dev, torch.int64).contiguous(),
            seq_lens.to(dev, torch.int64), o_part, lse_part, M, H, nq, block_table.shape[1], per, float(scale),
            L=L, R=R, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_L=_pow2(L),
            LOW_PRECISION=cache.dtype in (torch.bfloat16, torch.float16), num_warps=num_warps)
        o, lse = o_part[0], lse_part[0]
        for s in range(1, num_splits):
            o, lse = self.merge_states(o, lse, o_part[s], lse_part[s])
        return o.view(B, nq, H, L), lse.view(B, nq, H)

    def mla_decode(self, q_lat, q_pe, cache, block_row, seq_len, kv_lora_rank, scale, num_splits=1):
        nq, H, L = q_lat.shape
        table = block_row.view(1, -1)
        o, lse = self.mla_decode_batched(q_lat.view(1, nq, H, L), q_pe.view(1, nq, H, -1), cache, table,
                                         torch.tensor([seq_len]), kv_lora_rank, scale, num_splits=num_splits)
        return o[0], lse[0]


__all__ = ["TritonKernels", "fused_state_copy"]
