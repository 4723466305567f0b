"""Causal attention in float64 over keys and values already in memory, with the scores never
in memory: the MLA oracle's arithmetic on a GPU (``DenseOracle`` with an ``MLAStack``).

The MLA probe's two associations are both grouped attention over exact keys:

* absorbed (decode rows): every query head reads the same key, the latent entry
  [kv_c | k_pe] (576 values for DeepSeek-V3), and the same value, its kv_c part (the first 512
  of them: one load serves both); queries are [q_nope W_UK | q_pe];
* expanded (long prefill chunks): each head has its own key [kv_c W_UK | k_pe] and value
  kv_c W_UV, projected once per step in torch.

The oracle runs its expanded rows here; its decode rows measured faster in torch's padded
batches (``oracle.DenseOracle._expected_latent``).

Keys and values come in float32 or float64 holding exact values (``layers/mla.py``: integers
times powers of two); scores and the weighted sum run in float64 on the tensor cores (DMMA), with
a running maximum and sum as in flash attention. The torch oracle materialises every score of
a padded batch and passes over them several times; here a program takes a tile of (query, head)
pairs of one row, one KV head and one layer, and walks the row's keys a block at a time.

Layout: row r owns queries ``q[:, q_start[r]:q_start[r] + q_len[r]]`` (layers, tokens, heads, DK)
at positions ``pos0[r] + j`` and keys ``k[:, k_start[r] + i]`` (layers, keys, kv heads, DK) at
positions i = 0, 1, ...; query j sees keys 0..pos0[r] + j. Query head h reads KV head
h // (heads / kv heads). ``o`` (layers, tokens, heads, DV) = softmax(scale * q . k) v. The
reference below computes the same in torch, row by row; the two agree to float64 rounding (sums
in another order), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device.transfer import upload, upload_many
from .flash_f64 import row_of_tile, softmax_block

# tile schedules, from bench_oracle (H200): (query, head) rows a program takes, keys a block,
# the width of a score chunk, warps, pipeline stages. Values are accumulated in up to four
# column chunks. Keys shared by a group of heads (the absorbed latent: 576 wide, values 512):
# 16 rows (the smallest tile a float64 product takes; 16 x 512 float64 values over 4 warps is 128
# registers a thread) x 32 keys, 4 warps (8 warps, 32 rows or 16 keys: 1.1-1.9x slower).
SHARED = (16, 32, 64, 4, 1)
# A key per head (the expanded form: 192 wide, values 128, the queries kept in registers):
# 16 rows x 32 keys, 4 warps, the key and value loads pipelined three deep (1.6x faster than
# unpipelined, 2 stages 4% slower than 3; 32 rows 4% slower; 64 rows or 8 warps 1.1-2x).
PER_HEAD = (16, 32, 64, 4, 3)


def latent_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: list[int],
                               q_len: list[int], k_start: list[int], pos0: list[int], scale: float) -> torch.Tensor:
    """``latent_attention`` in torch, row by row, float64. Returns o (layers, tokens, heads, DV),
    NaN where no row writes."""
    L, nq, H, _ = q.shape
    HK = k.shape[2]
    o = torch.full((L, nq, H, v.shape[-1]), float("nan"), dtype=torch.float64, device=q.device)
    for qs, ql, ks, p0 in zip(q_start, q_len, k_start, pos0):
        n = p0 + ql
        kk = k[:, ks:ks + n].double().repeat_interleave(H // HK, dim=2)  # (L, n, H, DK)
        vv = v[:, ks:ks + n].double().repeat_interleave(H // HK, dim=2)
        s = torch.einsum("lqhd,lnhd->lhqn", q[:, qs:qs + ql].double(), kk) * scale
        qpos = torch.arange(p0, n, device=q.device)
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        o[:, qs:qs + ql] = torch.einsum("lhqn,lnhd->lqhd", torch.softmax(s, dim=-1), vv)
    return o


@triton.jit
def _query_chunk(q, q_rows, c, DK: tl.constexpr, DC: tl.constexpr):
    d = c * DC + tl.arange(0, DC)
    return tl.load(q + q_rows[:, None] + d[None, :], mask=(d < DK)[None, :], other=0.0).to(tl.float64)


@triton.jit
def _score_chunk(qc, k_base, k_rows, nm, c, DK: tl.constexpr, DC: tl.constexpr):
    """Columns c*DC.. of the tile's queries times the same columns of the block's keys, in float64."""
    d = c * DC + tl.arange(0, DC)
    kc = tl.load(k_base + k_rows[:, None] + d[None, :], mask=nm[:, None] & (d < DK)[None, :], other=0.0)
    return tl.dot(qc, tl.trans(kc.to(tl.float64)))


@triton.jit
def _value_chunk(p, v_ptr, v_rows, nm, c, DV: tl.constexpr, DVC: tl.constexpr):
    """p (rows x keys) times columns c*DVC.. of the block's values, in float64."""
    d = c * DVC + tl.arange(0, DVC)
    vc = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=nm[:, None] & (d < DV)[None, :], other=0.0)
    return tl.dot(p, vc.to(tl.float64))


@triton.jit
def _store_chunk(o_ptr, o_rows, keep, acc, l_i, c, DV: tl.constexpr, DVC: tl.constexpr):
    d = c * DVC + tl.arange(0, DVC)
    tl.store(o_ptr + o_rows[:, None] + d[None, :], acc / l_i[:, None], mask=keep[:, None] & (d < DV)[None, :])


@triton.jit
def store_chunks(o_ptr, o_rows, keep, acc0, acc1, acc2, acc3, l_i, DV: tl.constexpr, DVC: tl.constexpr,
                 NV: tl.constexpr):
    """The NV value chunks' accumulators over the running sum, into o's rows ``o_rows`` where ``keep``."""
    _store_chunk(o_ptr, o_rows, keep, acc0, l_i, 0, DV, DVC)
    if NV > 1:
        _store_chunk(o_ptr, o_rows, keep, acc1, l_i, 1, DV, DVC)
    if NV > 2:
        _store_chunk(o_ptr, o_rows, keep, acc2, l_i, 2, DV, DVC)
    if NV > 3:
        _store_chunk(o_ptr, o_rows, keep, acc3, l_i, 3, DV, DVC)


@triton.jit
def _latent_attention_kernel(q, k, v, o, tile_row, tile_q0, tile_h0, q_start, q_len, k_start, pos0,
                             sq_l, sq_t, sq_h, sk_l, sk_t, sk_h, sv_l, sv_t, sv_h, so_l, so_t, so_h, scale_ptr,
                             HK, G: tl.constexpr, BG: tl.constexpr, BQ: tl.constexpr, DK: tl.constexpr,
                             DC: tl.constexpr, NQC: tl.constexpr, DV: tl.constexpr, DVC: tl.constexpr,
                             NV: tl.constexpr, BN: tl.constexpr):
    """One program: BQ queries of one row times BG query heads (from tile_h0) of KV head
    program_id(1) % HK's group, of layer program_id(1) // HK (tile rows m = query * BG + head)."""
    t = tl.program_id(0)
    layer = (tl.program_id(1) // HK).to(tl.int64)
    kh = tl.program_id(1) % HK
    scale = tl.load(scale_ptr)  # float64 (a float argument would arrive as float32)
    r, i0, qs, ql, ks, p0 = row_of_tile(t, tile_row, tile_q0, q_start, q_len, k_start, pos0)
    g0 = tl.load(tile_h0 + t)
    m = tl.arange(0, BQ * BG)
    qi = i0 + m // BG
    g = g0 + m % BG
    valid = (qi < ql) & (g < G)
    qc = tl.minimum(qi, ql - 1)  # padding rows repeat a real query and head (finite everywhere)
    head = kh * G + tl.minimum(g, G - 1)
    qpos = p0 + qc
    q_rows = layer * sq_l + (qs + qc).to(tl.int64) * sq_t + head.to(tl.int64) * sq_h
    k_base = k + layer * sk_l + kh.to(tl.int64) * sk_h
    v_base = v + layer * sv_l + kh.to(tl.int64) * sv_h
    m_i = tl.full([BQ * BG], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ * BG], tl.float64)
    acc0 = tl.zeros([BQ * BG, DVC], tl.float64)
    acc1 = tl.zeros([BQ * BG, DVC], tl.float64)
    acc2 = tl.zeros([BQ * BG, DVC], tl.float64)
    acc3 = tl.zeros([BQ * BG, DVC], tl.float64)
    hi = p0 + tl.minimum(i0 + BQ, ql)  # keys 0..hi-1: up to the tile's last query
    if NQC <= 4:
        q0 = _query_chunk(q, q_rows, 0, DK, DC)
        q1 = q0
        q2 = q0
        q3 = q0
        if NQC > 1:
            q1 = _query_chunk(q, q_rows, 1, DK, DC)
        if NQC > 2:
            q2 = _query_chunk(q, q_rows, 2, DK, DC)
        if NQC > 3:
            q3 = _query_chunk(q, q_rows, 3, DK, DC)
    for n0 in range(0, hi, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < hi
        k_rows = (ks + n).to(tl.int64) * sk_t
        if NQC <= 4:  # the tile's queries stay in registers
            s = _score_chunk(q0, k_base, k_rows, nm, 0, DK, DC)
            if NQC > 1:
                s += _score_chunk(q1, k_base, k_rows, nm, 1, DK, DC)
            if NQC > 2:
                s += _score_chunk(q2, k_base, k_rows, nm, 2, DK, DC)
            if NQC > 3:
                s += _score_chunk(q3, k_base, k_rows, nm, 3, DK, DC)
        else:  # too wide to keep (the absorbed latent): each chunk loaded again for every key block
            s = tl.zeros([BQ * BG, BN], tl.float64)
            for c in tl.static_range(0, NQC):
                s += _score_chunk(_query_chunk(q, q_rows, c, DK, DC), k_base, k_rows, nm, c, DK, DC)
        s = tl.where(n[None, :] <= qpos[:, None], s * scale, float("-inf"))  # key 0 is seen by all: m stays finite
        m_new, alpha, p, l_i = softmax_block(s, m_i, l_i)
        v_rows = (ks + n).to(tl.int64) * sv_t
        acc0 = acc0 * alpha[:, None] + _value_chunk(p, v_base, v_rows, nm, 0, DV, DVC)
        if NV > 1:
            acc1 = acc1 * alpha[:, None] + _value_chunk(p, v_base, v_rows, nm, 1, DV, DVC)
        if NV > 2:
            acc2 = acc2 * alpha[:, None] + _value_chunk(p, v_base, v_rows, nm, 2, DV, DVC)
        if NV > 3:
            acc3 = acc3 * alpha[:, None] + _value_chunk(p, v_base, v_rows, nm, 3, DV, DVC)
        m_i = m_new
    o_rows = layer * so_l + (qs + qc).to(tl.int64) * so_t + head.to(tl.int64) * so_h
    store_chunks(o, o_rows, valid, acc0, acc1, acc2, acc3, l_i, DV, DVC, NV)


def latent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: list[int], q_len: list[int],
                     k_start: list[int], pos0: list[int], scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``latent_attention_reference`` in one launch (Triton: a GPU, or the interpreter).
    q (layers, tokens, heads, DK), k (layers, keys, kv heads, DK) and v (layers, keys, kv heads,
    DV) float32 or float64 (v may be a view of k: the latent's kv_c part), last axis contiguous;
    float32 ones must hold their values exactly. The heaviest tiles (most keys) start first.
    ``out``: where to write."""
    assert q.dtype in (torch.float32, torch.float64) and q.stride(-1) == 1 and k.stride(-1) == 1 \
        and v.stride(-1) == 1
    L, nq, H, DK = q.shape
    HK, DV = k.shape[2], v.shape[-1]
    assert H % HK == 0 and k.shape[-1] == DK and v.shape[:3] == k.shape[:3]
    G = H // HK
    rows, keys_per_block, score_chunk, warps, stages = SHARED if G > 1 else PER_HEAD
    BG = min(triton.next_power_of_2(G), rows)
    BQ = rows // BG
    DVC = max(16, triton.next_power_of_2(triton.cdiv(DV, 4)))
    o = torch.empty((L, nq, H, DV), dtype=torch.float64, device=q.device) if out is None else out
    dev = q.device
    tiles = []  # (keys seen, row, first query, first head of the group)
    for r, (ql, p0) in enumerate(zip(q_len, pos0)):
        tiles += [(p0 + min(i0 + BQ, ql), r, i0, g0) for i0 in range(0, ql, BQ) for g0 in range(0, G, BG)]
    if not tiles:
        return o
    tiles.sort(reverse=True)
    ids = upload_many([[x[1] for x in tiles], [x[2] for x in tiles], [x[3] for x in tiles]], dev)
    meta = upload_many([q_start, q_len, k_start, pos0], dev)
    scale_t = upload([float(scale)], dev, torch.float64)
    _latent_attention_kernel[(len(tiles), L * HK)](
        q, k, v, o, ids[0], ids[1], ids[2], meta[0], meta[1], meta[2], meta[3],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), scale_t, HK,
        G=G, BG=BG, BQ=BQ, DK=DK, DC=score_chunk, NQC=triton.cdiv(DK, score_chunk), DV=DV, DVC=DVC,
        NV=triton.cdiv(DV, DVC), BN=keys_per_block, num_warps=warps, num_stages=stages)
    return o
