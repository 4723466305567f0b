"""Triton kernel provider: the same semantics as ``reference.py``, as GPU kernels.

On a CPU these run under ``TRITON_INTERPRET=1`` (small sizes; that is how CI tests
them). Every block id and row index is widened to int64 before it is multiplied by
a stride: caches larger than 2^31 bytes are normal.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..device.transfer import to_device
from .attention_triton import (_pow2, _sm_count, combine_splits, launch_reshape_and_cache,
                               plan_paged_attention, run_paged_attention)
from .mla_gluon import gluon_applies, launch_gluon_split
from .mla_seesaw import launch_seesaw, seesaw_applies
from .partial_attention import partial_attention
from .probe_scan_triton import scan_triton
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
def _fused_state_copy_kernel(conv, temporal, table, items, table_stride,
                             conv_layer_stride, conv_page_stride, conv_row_elems, conv_rows,
                             t_layer_stride, t_page_stride, t_page_elems, c_tiles,
                             BLOCK: tl.constexpr, CONV_BLOCK: tl.constexpr):
    """Every (request, layer) state copy of a step in one launch; grid (items, c_tiles + t_tiles).

    An item is (table row, layer, src col, dst col, temporal src col, conv offset); block
    rows are read from the step's block table on the device. Tiles 0..c_tiles-1 move the
    conv window (rows offset.. of src to rows 0.. of dst) and are scheduled first, the rest
    move one BLOCK of the temporal page each, so a multi-MB state is spread over many
    programs. An in-place shift (src == dst, offset > 0) is the one case that needs
    ordering: tile 0 walks it low to high alone (memmove), the other conv tiles do nothing.
    """
    i = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    it = items + i * 6
    trow = table + tl.load(it) * table_stride
    layer = tl.load(it + 1)
    d = tl.load(trow + tl.load(it + 3)).to(tl.int64)
    if tile < c_tiles:
        s = tl.load(trow + tl.load(it + 2)).to(tl.int64)
        o = tl.load(it + 5)
        cbase = conv + layer * conv_layer_stride
        sbase = cbase + s * conv_page_stride + o * conv_row_elems
        dbase = cbase + d * conv_page_stride
        n = (conv_rows - o) * conv_row_elems
        if (s != d) | (o == 0):
            idx = tile.to(tl.int64) * CONV_BLOCK + tl.arange(0, CONV_BLOCK).to(tl.int64)
            m = idx < n
            v = tl.load(sbase + idx, mask=m)
            tl.store(dbase + idx, v, mask=m)
        elif tile == 0:
            _copy_window(sbase, dbase, n, CONV_BLOCK)
    else:
        ts = tl.load(trow + tl.load(it + 4)).to(tl.int64)
        idx = (tile - c_tiles).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = idx < t_page_elems
        tbase = temporal + layer * t_layer_stride
        v = tl.load(tbase + ts * t_page_stride + idx, mask=m)
        tl.store(tbase + d * t_page_stride + idx, v, mask=m)


def fused_state_copy(conv: torch.Tensor, temporal: torch.Tensor, table: torch.Tensor, items: torch.Tensor,
                     block: int = 8192, conv_block: int = 4096) -> None:
    """conv (layers, pages, rows, dim), temporal (layers, pages, ...); table (rows, cols) int64
    block rows on the device; items (n, 6) int64: (table row, layer, src, dst, temporal src, offset)."""
    n = items.shape[0]
    if n == 0:
        return
    t_elems = temporal[0, 0].numel()
    c_elems = conv[0, 0].numel()
    t_tiles = triton.cdiv(t_elems, block)
    c_tiles = triton.cdiv(c_elems, conv_block)
    _fused_state_copy_kernel[(n, c_tiles + t_tiles)](
        conv, temporal, table, items, table.stride(0), conv.stride(0), conv.stride(1), conv.stride(2),
        conv.shape[2], temporal.stride(0), temporal.stride(1), t_elems, c_tiles,
        BLOCK=block, CONV_BLOCK=conv_block, num_warps=8)


# ----------------------------------------------------------------------------- block copies


@triton.jit
def _block_copy_kernel(pages, pairs, slots, slot_stride, page_stride, elems, BLOCK: tl.constexpr):
    """grid (copies x slots, tiles): one BLOCK of one page of one slot per program; page rows
    and offsets in int64 (a slot of pages is tens of GB at real sizes)."""
    i = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    k = i // slots
    s = i % slots
    src = tl.load(pairs + 2 * k).to(tl.int64)
    dst = tl.load(pairs + 2 * k + 1).to(tl.int64)
    idx = tile * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < elems
    base = pages + s * slot_stride
    v = tl.load(base + src * page_stride + idx, mask=m)
    tl.store(base + dst * page_stride + idx, v, mask=m)


def block_copy(pages: torch.Tensor, pairs: torch.Tensor, block: int = 4096) -> None:
    """pages (slots, capacity, elems), the last axis contiguous; pairs (n, 2) int64 page rows
    (source, destination) on the device. Floating pages are moved as integers of their width,
    so every bit (NaN payloads included) arrives."""
    n = pairs.shape[0]
    if n == 0:
        return
    if pages.stride(2) != 1:
        raise ValueError("block_copy: a page's elements must be contiguous")
    if pages.dtype.is_floating_point:
        pages = pages.view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[pages.element_size()])
    slots, _, elems = pages.shape
    _block_copy_kernel[(n * slots, triton.cdiv(elems, block))](
        pages, pairs, slots, pages.stride(0), pages.stride(1), elems, BLOCK=block, num_warps=4)


# ----------------------------------------------------------------------------- cache ops


@triton.jit(do_not_specialize=["n"])  # (counts change every step: tests/test_kernels_triton.py, STEP_INTS)
def _scatter_rows_kernel(entries, slots, cache, n, dim, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """ROWS entries per program, each written to its slot (row index into the flat cache)."""
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rm = i < n
    slot = tl.load(slots + i, mask=rm, other=0).to(tl.int64)
    for c0 in range(0, dim, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = rm[:, None] & (c < dim)[None, :]
        v = tl.load(entries + i[:, None] * dim + c[None, :], mask=m)
        tl.store(cache + slot[:, None] * dim + c[None, :], v.to(cache.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["start", "length"])
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


@triton.jit(do_not_specialize=["n_rows"])
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
def _attend_tile(q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, visible, m_i, l_i, acc_lo, acc_hi, qk_scale_log2,
                 LOW_PRECISION: tl.constexpr):
    """One latent tile into the running softmax: the tile is K (kv_lo | kv_hi | k_r) and V (kv_lo | kv_hi)."""
    if LOW_PRECISION:  # bf16/fp16 cache: matrix units, fp32 accumulation
        s = tl.dot(q_lo, tl.trans(kv_lo))
        s = tl.dot(q_hi, tl.trans(kv_hi), s)
        s = tl.dot(q_r, tl.trans(k_r), s)
    else:  # fp32 cache: exact fp32 products (no tf32)
        s = tl.dot(q_lo, tl.trans(kv_lo), input_precision="ieee")
        s = tl.dot(q_hi, tl.trans(kv_hi), s, input_precision="ieee")
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision="ieee")
    s = tl.where(visible, s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_lo = acc_lo * alpha[:, None]
    acc_hi = acc_hi * alpha[:, None]
    if LOW_PRECISION:
        pl = p.to(kv_lo.dtype)
        acc_lo = tl.dot(pl, kv_lo, acc_lo)
        acc_hi = tl.dot(pl, kv_hi, acc_hi)
    else:
        acc_lo = tl.dot(p, kv_lo, acc_lo, input_precision="ieee")
        acc_hi = tl.dot(p, kv_hi, acc_hi, input_precision="ieee")
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _mla_split_kernel(q_lat, q_pe, cache, kv_desc, kr_desc, block_table, seq_lens, o_part, lse_part,
                      M, H, nq, max_blocks, keys_per_split, qk_scale_log2,
                      L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      LOW_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    """One program: a tile of BLOCK_M (query token, head) rows of request b over key split sp.

    All rows share request b's latent cache. Each latent tile [BLOCK_N, L] is loaded once
    per program as two halves and used both as K (with k_pe) and as V; the 512-wide fp32
    accumulator is kept as two [BLOCK_M, HALF] halves so it stays in registers across
    the warps. Head tiles are the fastest grid axis: the programs that share a latent
    tile run side by side and the second read comes from L2.
    With TMA (pages a multiple of BLOCK_N), every full tile is one page slice fetched by
    the copy engine through a tensor descriptor, pipelined NUM_STAGES deep; the partial
    last tile of a sequence (rows past its end may hold anything, NaN included) and every
    tile without TMA go through masked pointer loads.
    Softmax runs in base 2 (scale * log2 e folded into the logits); the stored lse is in
    natural log. Bottom-right causal mask: query token t of nq sees keys up to
    seq_len - nq + t. A split with no visible key writes 0 and -inf.
    """
    mt = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_b = tl.num_programs(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    qpos = seq_len - nq + rows // H
    c_lo = tl.arange(0, HALF)
    c_hi = HALF + tl.arange(0, HALF)
    m_lo = c_lo < L
    m_hi = c_hi < L
    c_r = tl.arange(0, BLOCK_R)
    m_r = c_r < R
    qrow = b * M + rows.to(tl.int64)
    q_lo = tl.load(q_lat + qrow[:, None] * L + c_lo[None, :], mask=rmask[:, None] & m_lo[None, :], other=0.0)
    q_hi = tl.load(q_lat + qrow[:, None] * L + c_hi[None, :], mask=rmask[:, None] & m_hi[None, :], other=0.0)
    q_r = tl.load(q_pe + qrow[:, None] * R + c_r[None, :], mask=rmask[:, None] & m_r[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    k_start = sp * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, seq_len)
    # no tile at or past the tile's last query row's last visible key (the causal mask hides those keys from
    # every row here: a prefill chunk through this path, ``mla.paths``, would walk them for its first tokens)
    vis_end = tl.minimum(k_end, seq_len - nq + (tl.minimum(mt * BLOCK_M + BLOCK_M, M) - 1) // H + 1)
    stop = k_start + tl.cdiv(tl.maximum(vis_end - k_start, 0), BLOCK_N) * BLOCK_N
    table = block_table + b * max_blocks
    if TMA:
        tail = k_start + tl.maximum(k_end - k_start, 0) // BLOCK_N * BLOCK_N
        for n0 in tl.range(k_start, tl.minimum(tail, stop), BLOCK_N, num_stages=NUM_STAGES):
            row = tl.load(table + n0 // PAGE).to(tl.int32) * PAGE + n0 % PAGE
            kpos = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc_lo, acc_hi = _attend_tile(q_lo, q_hi, q_r, kv_desc.load([row, 0]), kv_desc.load([row, HALF]),
                                                    kr_desc.load([row, L]), kpos[None, :] <= qpos[:, None],
                                                    m_i, l_i, acc_lo, acc_hi, qk_scale_log2, LOW_PRECISION)
        if (tail < k_end) & (tail < stop):  # the partial last tile: rows past the end may hold anything: zero them
            row = tl.load(table + tail // PAGE).to(tl.int32) * PAGE + tail % PAGE
            kpos = tail + tl.arange(0, BLOCK_N)
            kmask = kpos < k_end
            kv_lo = tl.where(kmask[:, None], kv_desc.load([row, 0]), 0.0).to(cache.dtype.element_ty)
            kv_hi = tl.where(kmask[:, None], kv_desc.load([row, HALF]), 0.0).to(cache.dtype.element_ty)
            k_r = tl.where(kmask[:, None], kr_desc.load([row, L]), 0.0).to(cache.dtype.element_ty)
            m_i, l_i, acc_lo, acc_hi = _attend_tile(q_lo, q_hi, q_r, kv_lo, kv_hi, k_r,
                                                    kmask[None, :] & (kpos[None, :] <= qpos[:, None]),
                                                    m_i, l_i, acc_lo, acc_hi, qk_scale_log2, LOW_PRECISION)
    else:
        for n0 in tl.range(k_start, tl.minimum(k_end, stop), BLOCK_N, num_stages=NUM_STAGES):
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < k_end
            blk = tl.load(table + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
            kaddr = (blk * PAGE + kpos % PAGE) * (L + R)
            kv_lo = tl.load(cache + kaddr[:, None] + c_lo[None, :], mask=kmask[:, None] & m_lo[None, :], other=0.0)
            kv_hi = tl.load(cache + kaddr[:, None] + c_hi[None, :], mask=kmask[:, None] & m_hi[None, :], other=0.0)
            k_r = tl.load(cache + kaddr[:, None] + L + c_r[None, :], mask=kmask[:, None] & m_r[None, :], other=0.0)
            m_i, l_i, acc_lo, acc_hi = _attend_tile(q_lo, q_hi, q_r, kv_lo, kv_hi, k_r,
                                                    kmask[None, :] & (kpos[None, :] <= qpos[:, None]), m_i, l_i,
                                                    acc_lo, acc_hi, qk_scale_log2, LOW_PRECISION)
    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    orow = (sp.to(tl.int64) * num_b + b) * M + rows.to(tl.int64)
    tl.store(o_part + orow[:, None] * L + c_lo[None, :], acc_lo * inv[:, None], mask=rmask[:, None] & m_lo[None, :])
    tl.store(o_part + orow[:, None] * L + c_hi[None, :], acc_hi * inv[:, None], mask=rmask[:, None] & m_hi[None, :])
    tl.store(lse_part + orow, lse, mask=rmask)


class TritonKernels(ReferenceKernels):
    """Triton versions of the hot kernels; the rest falls back to the reference."""

    name = "triton"

    def __init__(self, poison: bool = False):
        # poison: fill every output buffer with NaN before the launch, so that an element a
        # kernel fails to write cannot pass a comparison (tests and checked runs); off for
        # benchmarks, where the fill would be timed as part of the kernel
        self.poison = poison
        self._paged_plan = None  # (key, PagedPlan) of the last paged_attention call

    def _out(self, shape, dtype, device) -> torch.Tensor:
        if self.poison:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    def mamba_scan(self, tables, launch) -> None:
        scan_triton(tables, launch)

    def state_copy(self, conv, temporal, table, items):
        fused_state_copy(conv, temporal, to_device(table.to(torch.int64), conv.device).contiguous(),
                         to_device(items.to(torch.int64), conv.device).contiguous())

    def prepare_block_copy(self, pages, pairs):
        """The call's host side (the pairs checked, uploaded through pinned memory), done before a
        timer's events (``TimedKernels``) and kept for the call (keyed by identity)."""
        from ..device.transfer import upload

        p = pairs.to(torch.int64).cpu()
        self.check_block_pairs(p, pages.shape[1])
        self._pairs = (id(pairs), pairs, upload(p, pages.device))
        return self._pairs[2]

    def block_copy(self, pages, pairs):
        kept = getattr(self, "_pairs", None)
        self._pairs = None
        ready = kept[2] if kept is not None and kept[0] == id(pairs) else self.prepare_block_copy(pages, pairs)
        block_copy(pages, ready.contiguous())

    def concat_and_cache(self, entries, slots, cache):
        n = entries.shape[0]
        if n == 0:
            return
        dim = cache.shape[-1]
        rows = 8
        _scatter_rows_kernel[(triton.cdiv(n, rows),)](entries.contiguous().to(cache.device),
                                                      slots.to(cache.device, torch.int64), cache, n, dim,
                                                      BLOCK=min(_pow2(dim), 1024), ROWS=rows)

    def gather_cache(self, cache, block_row, start, length):
        page = cache.shape[1]
        if start % page:
            raise ValueError(f"gather_cache: start {start} is not a multiple of the page size {page}")
        dim = cache.shape[-1]
        out = self._out((length, dim), cache.dtype, cache.device)
        if length:
            rows = 8
            _gather_rows_kernel[(triton.cdiv(length, rows),)](cache, block_row.to(cache.device, torch.int64), out,
                                                              start, length, page, dim, BLOCK=min(_pow2(dim), 1024),
                                                              ROWS=rows)
        return out

    def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
        D = o_a.shape[-1]
        rows = lse_a.numel()
        out = self._out(o_a.shape, torch.float32, o_a.device)  # row-major, as the kernel writes
        lse = self._out(lse_a.shape, torch.float32, lse_a.device)
        if rows:
            per = max(1, min(16, 4096 // _pow2(D)))
            _merge_kernel[(triton.cdiv(rows, per),)](o_a.contiguous().float(), lse_a.contiguous().float(),
                                                     o_b.contiguous().float(), lse_b.contiguous().float(), out, lse,
                                                     rows, D, BLOCK_D=_pow2(D), ROWS=per, BASE2_BUG=base2_bug,
                                                     UNGUARDED=unguarded, num_warps=8)
        return out, lse

    def partial_query_rows(self, keys: int, heads: int) -> int:
        """No score matrix leaves the chip: every query in one call."""
        return 1 << 62

    def attention_partial(self, q, k, v, scale, mask, causal=None):
        n, H = q.shape[0], q.shape[1]
        out = self._out((n, H, v.shape[-1]), torch.float32, q.device)
        lse = self._out((n, H), torch.float32, q.device)
        return partial_attention(q, k, v, scale, mask, out, lse, causal=causal)

    def reshape_and_cache(self, key, value, slots, k_cache, v_cache):
        launch_reshape_and_cache(key, value, slots, k_cache, v_cache)

    def paged_attention(self, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                        max_seq_len=None, num_splits=0, past_end_bug=False, block_m=None, block_n=None,
                        num_warps=None, num_stages=None):
        """The launch plan depends on the lengths only: the layers of a step (the same length
        tensors) share one, made at the first layer's call."""
        # (the length tensors by identity: the entry keeps them alive, so their ids stay theirs)
        key = (id(query_start_loc), id(seq_lens), q.shape[1], tuple(k_cache.shape[1:3]), k_cache.dtype,
               k_cache.device, num_splits, past_end_bug, block_m, block_n)
        last = self._paged_plan
        if last is None or last[0] != key:
            plan = plan_paged_attention(query_start_loc, seq_lens, q.shape[1], k_cache.shape[2], k_cache.shape[1],
                                        k_cache.dtype in (torch.bfloat16, torch.float16), k_cache.device,
                                        num_splits, past_end_bug, block_m, block_n)
            self._paged_plan = last = (key, plan, (query_start_loc, seq_lens))
        return run_paged_attention(last[1], q, k_cache, v_cache, block_table, scale,
                                   lambda shape, dtype: self._out(shape, dtype, k_cache.device),
                                   num_warps=num_warps, num_stages=num_stages)

    def mla_decode(self, q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits=0,
                           max_seq_len=None, block_m=None, block_n=None, num_warps=None, num_stages=None,
                           tma=None, impl="auto"):
        """q_lat (B, nq, H, L), q_pe (B, nq, H, R); block_table (B, max_blocks); seq_lens (B,).

        Returns o_lat (B, nq, H, L) fp32 and lse (B, nq, H) fp32, natural log. ``num_splits``
        0 picks the split count so that batch x head tiles x splits fills the multiprocessors
        about once; ``max_seq_len`` (if the caller knows it) avoids a device-to-host sync.
        Launches (Triton kernel): the query cast (bf16/fp16 caches), the split kernel, and with
        more than one split a single combine over all of them. The Gluon kernel casts the
        queries itself and merges two splits itself (more go through the combine launch).
        ``impl``: "auto" uses the Gluon split kernel where it applies (Hopper, bf16/fp16,
        512 + 64, pages a multiple of 64; see mla_gluon.py) and the Triton one elsewhere;
        "gluon" / "triton" force one (benchmarks, tests); "seesaw" the two-warp-group Gluon kernel
        (``mla_seesaw.py``, Hopper).
        """
        B, nq, H, L = q_lat.shape
        R = q_pe.shape[-1]
        page = cache.shape[1]
        M = nq * H
        dev = cache.device
        low = cache.dtype in (torch.bfloat16, torch.float16)
        block_m = block_m or (64 if low else min(64, _pow2(M)))
        block_n = block_n or (64 if low else 32)
        if impl in ("gluon", "seesaw") and not (seesaw_applies if impl == "seesaw" else gluon_applies)(
                cache, L, R, block_n):
            raise ValueError(f"mla_decode: the {impl} kernel needs a Hopper GPU, a 16-bit cache, L = 512, R = 64 "
                             "and pages a multiple of 64")
        use_gluon = impl == "gluon" or (impl == "auto" and block_m == 64 and gluon_applies(cache, L, R, block_n))
        num_warps = num_warps or (8 if low else 4)
        num_stages = num_stages or (2 if low else 1)
        mtiles = triton.cdiv(M, block_m)
        max_len = int(seq_lens.max()) if max_seq_len is None else int(max_seq_len)
        if num_splits <= 0:
            sms = _sm_count(dev) if cache.is_cuda else 4
            # at most one wave: a program per multiprocessor (shared memory allows no more); splits of 4
            # tiles, or of 2 where 4 would leave three quarters of the multiprocessors idle (B = 1-4 at
            # ctx 1k on an H200: 8 splits 17.0-17.3 us, 4 splits 20.4-20.9; at 4k, 16 splits and 32 alike)
            cap = sms // (B * mtiles)
            num_splits = max(1, min(triton.cdiv(max_len, 4 * block_n), cap))
            if 4 * num_splits * B * mtiles < sms:
                num_splits = max(1, min(triton.cdiv(max_len, 2 * block_n), cap))
        per = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
        num_splits = max(1, triton.cdiv(max_len, per))
        o_part = self._out((num_splits, B, M, L), torch.float32, dev)
        lse_part = self._out((num_splits, B, M), torch.float32, dev)
        table = block_table.to(dev, torch.int64).contiguous()
        lens = seq_lens.to(dev, torch.int64)
        scale_log2 = float(scale) * 1.4426950408889634
        if impl == "seesaw":  # it casts the queries itself; splits merge in the combine launch
            launch_seesaw(q_lat.reshape(B, M, L).contiguous(), q_pe.reshape(B, M, R).contiguous(), cache, table,
                          lens, o_part, lse_part, M, H, nq, per, scale_log2, num_splits, block_n=block_n)
        elif use_gluon:  # it casts the queries itself, and merges two splits itself
            two = num_splits == 2
            o = self._out((B, M, L), torch.float32, dev) if two else o_part[0]
            lse = self._out((B, M), torch.float32, dev) if two else lse_part[0]
            launch_gluon_split(q_lat.reshape(B, M, L).contiguous(), q_pe.reshape(B, M, R).contiguous(), cache, table,
                               lens, o_part, lse_part, o, lse, M, H, nq, per, scale_log2, num_splits,
                               block_n=block_n, num_stages=num_stages)
            if two:
                return o.view(B, nq, H, L), lse.view(B, nq, H)
        else:
            half = max(16, _pow2((L + 1) // 2))
            if tma is None:  # the copy engine needs whole page slices, exact column splits, aligned rows
                tma = (cache.is_cuda and page % block_n == 0 and L == 2 * half and R == _pow2(R)
                       and max(half, R, block_n) <= 256 and cache.is_contiguous() and cache.data_ptr() % 16 == 0
                       and (L + R) * cache.element_size() % 16 == 0)
            # queries in the cache's precision: loaded straight into shared memory as matrix-unit
            # operands (a conversion inside the kernel would keep them in registers, which spills)
            qdt = cache.dtype if low else torch.float32
            kv_desc = kr_desc = None
            if tma:
                flat = cache.view(-1, L + R)
                kv_desc = TensorDescriptor.from_tensor(flat, block_shape=[block_n, half])
                kr_desc = TensorDescriptor.from_tensor(flat, block_shape=[block_n, R])
            _mla_split_kernel[(mtiles, num_splits, B)](
                q_lat.to(qdt).contiguous(), q_pe.to(qdt).contiguous(), cache, kv_desc, kr_desc, table, lens,
                o_part, lse_part, M, H, nq, block_table.shape[1], per, scale_log2,
                L=L, R=R, PAGE=page, HALF=half, BLOCK_R=_pow2(R), BLOCK_M=block_m,
                BLOCK_N=block_n, LOW_PRECISION=low, NUM_STAGES=num_stages, TMA=bool(tma), num_warps=num_warps)
        if num_splits == 1:
            return o_part[0].view(B, nq, H, L), lse_part[0].view(B, nq, H)
        o = self._out((B, M, L), torch.float32, dev)
        lse = self._out((B, M), torch.float32, dev)
        combine_splits(o_part, lse_part, o, lse, B * M, num_splits, L)
        return o.view(B, nq, H, L), lse.view(B, nq, H)


__all__ = ["TritonKernels", "fused_state_copy"]
