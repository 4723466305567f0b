"""Triton kernels for attention over paged caches: GQA cache writes and paged attention, and
the combine of split-KV partials (shared with MLA decode). Semantics: ``paged_attention.py``.

Block ids are widened to int64 before they meet a stride; every cache is addressed through
its strides, so a page may live inside a larger page shared with other layer kinds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ..device.transfer import upload_many
from .paged_attention import key_limit


# Integer arguments that change from step to step (counts, splits, table widths) are not
# specialised: Triton compiles a variant per class (1, a multiple of 16, other), so a new class
# compiled the kernel again in the middle of a run (bench/profile_run.py reports variants made
# inside a measured run). Strides stay specialised: their alignment feeds vector loads.
@triton.jit(do_not_specialize=["n_rows", "num_splits"])
def combine_splits_kernel(o_part, lse_part, out, lse_out, n_rows, num_splits, L: tl.constexpr,
                          BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the splits' partials of row program_id(0), its columns program_id(1) * BLOCK_L..: weights
    exp(lse_s - max); splits with lse -inf weigh 0; a row empty in every split gives 0 and -inf.
    BLOCK_S splits are read at once (a running maximum across groups of them): a loop over the splits
    one at a time waited for each one's read in turn, most of a small batch's merge (session 38)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    cm = c < L
    s = tl.arange(0, BLOCK_S)
    m = tl.full([], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    wsum = tl.zeros([], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        sr = (s0 + s).to(tl.int64) * n_rows + r
        sm = s0 + s < num_splits
        lse = tl.load(lse_part + sr, mask=sm, other=float("-inf"))
        if L % BLOCK_L == 0:  # (no column mask: the loads go 16 bytes at a time)
            o = tl.load(o_part + sr[:, None] * L + c[None, :], mask=sm[:, None], other=0.0)
        else:
            o = tl.load(o_part + sr[:, None] * L + c[None, :], mask=sm[:, None] & cm[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)  # (0 while every split so far was empty)
        w = tl.exp(lse - m_safe)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        wsum = wsum * alpha + tl.sum(w, 0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    empty = wsum == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, wsum))
    tl.store(out + r * L + c, acc * inv, mask=cm)
    if tl.program_id(1) == 0:
        tl.store(lse_out + r, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, wsum))))


# A merge program takes a whole row (up to 512 columns) and reads 8 splits at once (32 registers a thread):
# on an H200 (session 38, bench/probes/mla_small_batch.py) MLA decode at B = 1, 2, 4 took 14.96 / 15.40 /
# 15.90 us at ctx 1k and 19.80 / 22.12 / 24.97 at 4k, against 16.55 / 16.99 / 17.65 and 25.14 / 25.27 /
# 26.66 with the splits read one after another; 16 splits x 128 columns a program was slower from B = 2 on
# (four times the programs).
COMBINE_SPLITS = 8
COMBINE_COLUMNS = 512


def combine_splits(o_part, lse_part, out, lse_out, n_rows: int, num_splits: int, L: int) -> None:
    """``combine_splits_kernel`` over n_rows rows of L columns: o_part (splits, n_rows, L), lse_part (splits,
    n_rows) -> out (n_rows, L), lse_out (n_rows,)."""
    block_l = min(COMBINE_COLUMNS, _pow2(L))
    combine_splits_kernel[(n_rows, triton.cdiv(L, block_l))](o_part, lse_part, out, lse_out, n_rows, num_splits, L=L,
                                                             BLOCK_L=block_l, BLOCK_S=COMBINE_SPLITS, num_warps=4)


@triton.jit(do_not_specialize=["n"])
def _reshape_and_cache_kernel(key, value, slots, k_cache, v_cache, n, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                              KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                              ROWS: tl.constexpr):
    """ROWS tokens a program: each token's K and V rows (KVH x D, contiguous in the input) go to
    its slot's page and offset, cast to the cache's dtype."""
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rm = i < n
    e = tl.arange(0, BLOCK)
    em = e < KVH * D
    h = (e // D).to(tl.int64)
    d = (e % D).to(tl.int64)
    slot = tl.load(slots + i, mask=rm, other=0).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    mask = rm[:, None] & em[None, :]
    src = i[:, None] * (KVH * D) + e[None, :]
    k = tl.load(key + src, mask=mask)
    v = tl.load(value + src, mask=mask)
    tl.store(k_cache + (blk * sk_b + off * sk_t)[:, None] + h[None, :] * sk_h + d[None, :],
             k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + (blk * sv_b + off * sv_t)[:, None] + h[None, :] * sv_h + d[None, :],
             v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["table_stride", "keys_per_split", "num_tokens"])
def _paged_attention_kernel(q, k_cache, v_cache, block_table, tile_row, tile_q0, qsl, seq_lens, out, lse_part,
                            sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, table_stride, keys_per_split, num_tokens,
                            qk_scale_log2, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                            BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LOW_PRECISION: tl.constexpr,
                            PAST_END_BUG: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One program: BLOCK_Q query tokens of one row x the G query heads of one KV head
    (BLOCK_M rows of the tile), over one split of that row's keys.

    Every tile row shares the KV head's keys, so each K/V tile is read once for G heads and
    BLOCK_Q tokens (decode tiles are memory-bound; the G heads fill the matrix unit's rows).
    Keys are gathered through the block table page by page (any page size), masked per row
    by the bottom-right causal rule; a tile stops at its last query's position. Softmax runs
    in base 2 (scale * log2 e folded in); split partials carry a natural-log lse.
    """
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    b = tl.load(tile_row + tile).to(tl.int64)
    q0 = tl.load(tile_q0 + tile).to(tl.int32)
    start = tl.load(qsl + b)
    qlen = (tl.load(qsl + b + 1) - start).to(tl.int32)
    seq = tl.load(seq_lens + b).to(tl.int32)
    ctx = seq - qlen
    m = tl.arange(0, BLOCK_M)
    t = q0 + m // G
    head = kvh * G + (m % G).to(tl.int64)
    rmask = (m < BLOCK_Q * G) & (t < qlen)
    tok = start + t.to(tl.int64)
    qpos = ctx + t
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qt = tl.load(q + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=rmask[:, None] & dm[None, :],
                 other=0.0)
    first = (seq + PAGE - 1) // PAGE * PAGE
    if PAST_END_BUG:  # the loop runs one table column past the row's last block, unmasked
        tile_end = first + PAGE
    else:
        tile_end = ctx + tl.minimum(q0 + BLOCK_Q, qlen)
    k_start = sp * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, tile_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    trow = block_table + b * table_stride
    for n0 in tl.range(k_start, k_end, BLOCK_N, num_stages=NUM_STAGES):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < k_end
        blk = tl.load(trow + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        off = (kpos % PAGE).to(tl.int64)
        kaddr = blk * sk_b + off * sk_t + kvh * sk_h
        vaddr = blk * sv_b + off * sv_t + kvh * sv_h
        lmask = kmask[:, None] & dm[None, :]
        kt = tl.load(k_cache + kaddr[:, None] + d[None, :], mask=lmask, other=0.0)
        vt = tl.load(v_cache + vaddr[:, None] + d[None, :], mask=lmask, other=0.0)
        if LOW_PRECISION:  # bf16/fp16 cache: matrix units, fp32 accumulation
            s = tl.dot(qt, tl.trans(kt))
        else:  # fp32 cache: exact fp32 products (no tf32)
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        vis = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        if PAST_END_BUG:
            vis = vis | (kmask[None, :] & (kpos[None, :] >= first))
        s = tl.where(vis, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if LOW_PRECISION:
            acc = tl.dot(p.to(vt.dtype), vt, acc)
        else:
            acc = tl.dot(p, vt, acc, input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0
    o = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    orow = tok * H + head
    omask = rmask[:, None] & dm[None, :]
    if SPLIT:
        base = sp.to(tl.int64) * num_tokens * H + orow
        tl.store(out + base[:, None] * D + d[None, :], o, mask=omask)
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        tl.store(lse_part + base, lse, mask=rmask)
    else:
        tl.store(out + orow[:, None] * D + d[None, :], o, mask=omask)


@functools.lru_cache(maxsize=None)
def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def launch_reshape_and_cache(key, value, slots, k_cache, v_cache) -> None:
    n = key.shape[0]
    if n == 0:
        return
    KVH, D = k_cache.shape[2], k_cache.shape[3]
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    rows = 4
    dev = k_cache.device
    _reshape_and_cache_kernel[(triton.cdiv(n, rows),)](
        key.to(dev).contiguous(), value.to(dev).contiguous(), slots.to(dev, torch.int64).contiguous(), k_cache, v_cache,
        n, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), KVH=KVH, D=D, PAGE=k_cache.shape[1], BLOCK=_pow2(KVH * D), ROWS=rows)


@dataclass
class PagedPlan:
    """What a paged-attention launch derives from the step's lengths alone (host work and
    uploads): the same for every layer of a step, so it is made once and reused."""

    tile_row: torch.Tensor  # (tiles,) int32 on the device: the row of each query tile
    tile_q0: torch.Tensor  # (tiles,) its first query within the row
    qsl: torch.Tensor  # (rows + 1,) int32 on the device
    lens: torch.Tensor  # (rows,) int32 on the device
    block_m: int
    block_q: int
    block_n: int
    num_splits: int
    keys_per_split: int
    past_end_bug: bool


def plan_paged_attention(query_start_loc, seq_lens, heads: int, kv_heads: int, page: int, low_precision: bool,
                         device, num_splits=0, past_end_bug=False, block_m=None, block_n=None) -> PagedPlan:
    """Query tiles of BLOCK_Q tokens x G heads per row, and the split count: about two waves of
    programs, long rows split along their keys when tiles alone are too few."""
    G = heads // kv_heads
    qsl = np.asarray(query_start_loc.to("cpu", torch.int64), dtype=np.int64)
    lens = np.asarray(seq_lens.to("cpu", torch.int64), dtype=np.int64)
    qlen = qsl[1:] - qsl[:-1]
    block_m = block_m or max(_pow2(G), 16 if int(qlen.max()) * G <= 16 else 64)
    block_q = max(1, block_m // G)
    block_n = block_n or (64 if low_precision else 32)
    tiles = (qlen + block_q - 1) // block_q
    n_tiles = int(tiles.sum())
    tile_row = np.repeat(np.arange(len(qlen)), tiles)
    tile_q0 = (np.arange(n_tiles) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * block_q
    max_key = int(key_limit(torch.from_numpy(lens), page, past_end_bug).max())
    if num_splits <= 0:
        sms = _sm_count(device) if device.type == "cuda" else 4
        num_splits = max(1, min(triton.cdiv(max_key, 4 * block_n), triton.cdiv(2 * sms, max(n_tiles, 1) * kv_heads)))
    per = triton.cdiv(triton.cdiv(max(max_key, 1), num_splits), block_n) * block_n
    # the four index vectors in one upload (each upload is a copy of its own)
    tile_row_d, tile_q0_d, qsl_d, lens_d = upload_many([tile_row, tile_q0, qsl, lens], device, torch.int32)
    return PagedPlan(tile_row_d, tile_q0_d, qsl_d, lens_d, block_m, block_q, block_n,
                     max(1, triton.cdiv(max_key, per)), per, past_end_bug)


def run_paged_attention(plan: PagedPlan, q, k_cache, v_cache, block_table, scale, new_out, num_warps=None,
                        num_stages=None) -> torch.Tensor:
    """``paged_attention`` (``paged_attention.py``) as Triton launches: one over every query tile
    of every row and KV head (and key split), then with splits one combine. ``new_out(shape,
    dtype)`` allocates outputs (NaN-poisoned in checked runs)."""
    T, H, D = q.shape
    dev = k_cache.device
    out = new_out((T, H, D), torch.float32)
    if T == 0:
        return out
    KVH, page = k_cache.shape[2], k_cache.shape[1]
    low = k_cache.dtype in (torch.bfloat16, torch.float16)
    split = plan.num_splits > 1
    target = new_out((plan.num_splits, T, H, D), torch.float32) if split else out
    lse_part = new_out((plan.num_splits, T, H), torch.float32) if split else out
    qdt = k_cache.dtype if low else torch.float32  # bf16/fp16: straight into the matrix units
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    _paged_attention_kernel[(plan.tile_row.shape[0], KVH, plan.num_splits)](
        q.to(dev, qdt).contiguous(), k_cache, v_cache, table.contiguous(), plan.tile_row, plan.tile_q0, plan.qsl,
        plan.lens, target, lse_part, H * D, D, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.shape[1], plan.keys_per_split, T,
        float(scale) * 1.4426950408889634, H=H, G=H // KVH, D=D, BLOCK_D=_pow2(D), PAGE=page,
        BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, SPLIT=split, LOW_PRECISION=low,
        PAST_END_BUG=plan.past_end_bug, NUM_STAGES=num_stages or (2 if low else 1), num_warps=num_warps or 4)
    if split:
        lse = new_out((T, H), torch.float32)
        combine_splits(target, lse_part, out, lse, T * H, plan.num_splits, D)
    return out
