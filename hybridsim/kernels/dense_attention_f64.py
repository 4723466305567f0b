"""Causal attention in float64 with no scores in memory: the attention oracle's arithmetic on a GPU.

The oracle's dense attention (``layers/gqa.py``) materialises every score of a batch in float64 and
passes over them five times (product, scale, mask, softmax, product): on a real-scale step that is
half a billion scores and most of the oracle's time. This kernel takes the same q, k and v and
keeps a tile's scores in registers, one pass over the keys with a running maximum and sum, as
flash attention does, in float64 throughout (``tl.dot`` on float64 runs on the tensor cores'
DMMA on Ampere and Hopper).

Layout: a launch's rows are packed. Row r owns queries ``q[:, q_start[r]:q_start[r] + q_len[r]]``
at positions ``pos0[r] + j`` and keys ``k[:, k_start[r]:...]`` at positions 0, 1, ... (its keys
are its committed tokens from the first); query j sees keys 0..pos0[r] + j. q and o are
(layers, tokens, heads, D), k and v (layers, tokens, kv_heads, D); query head h reads KV head
h // (heads / kv_heads). The reference below is the same arithmetic in torch, row by row: the
results agree to float64 rounding (the sums run in another order), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device.transfer import upload_many

NEG_INF = float("-inf")
M_LONG = 32  # (query, head) pairs a program takes for rows with many queries
M_SHORT = 16  # for short (decode) rows: the smallest tile a float64 product takes
KEYS_PER_BLOCK = 32


def causal_attention_f64_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: list[int],
                                   q_len: list[int], k_start: list[int], pos0: list[int], scale: float) -> torch.Tensor:
    """The definition, row by row: softmax(q k^T * scale, causal) v in float64. Returns o like q."""
    H, KVH = q.shape[2], k.shape[2]
    group = H // KVH
    o = torch.full_like(q, float("nan"))
    for qs, ql, ks, p0 in zip(q_start, q_len, k_start, pos0):
        n = p0 + ql
        qq = q[:, qs:qs + ql]  # (L, ql, H, D)
        kk = k[:, ks:ks + n].repeat_interleave(group, dim=2)  # (L, n, H, D)
        vv = v[:, ks:ks + n].repeat_interleave(group, dim=2)
        s = torch.einsum("lqhd,lnhd->lhqn", qq, kk) * scale
        qpos = torch.arange(p0, n, device=q.device)
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos[:, None], NEG_INF)
        o[:, qs:qs + ql] = torch.einsum("lhqn,lnhd->lqhd", torch.softmax(s, dim=-1), vv)
    return o


@triton.jit
def _dense_f64_kernel(q, k, v, o, tile_row, tile_q0, q_start, q_len, k_start, pos0,
                      sq_l, sq_t, sk_l, sk_t, scale, KVH,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      BQ: tl.constexpr, BN: tl.constexpr):
    """One program: BQ queries of one row times the G query heads of one KV head of one layer
    (rows m = query * GP + head of the tile), over all the keys those queries see."""
    t = tl.program_id(0)
    layer = tl.program_id(1) // KVH
    kh = tl.program_id(1) % KVH
    r = tl.load(tile_row + t)
    i0 = tl.load(tile_q0 + t)
    qs = tl.load(q_start + r)
    ql = tl.load(q_len + r)
    ks = tl.load(k_start + r)
    p0 = tl.load(pos0 + r)
    m = tl.arange(0, BQ * GP)
    qi = i0 + m // GP
    g = m % GP
    valid = (qi < ql) & (g < G)
    qc = tl.minimum(qi, ql - 1)  # a padding row repeats the tile's last query (finite everywhere)
    qpos = p0 + qc
    d = tl.arange(0, BD)
    dm = d < D
    q_off = layer.to(tl.int64) * sq_l + (qs + qc).to(tl.int64) * sq_t + (kh * G + tl.minimum(g, G - 1)) * D
    qt = tl.load(q + q_off[:, None] + d[None, :], mask=dm[None, :], other=0.0)
    m_i = tl.full([BQ * GP], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ * GP], tl.float64)
    acc = tl.zeros([BQ * GP, BD], tl.float64)
    hi = p0 + tl.minimum(i0 + BQ, ql)  # keys 0..hi-1: up to the tile's last query
    base = layer.to(tl.int64) * sk_l + kh * D
    for n0 in range(0, hi, BN):
        n = n0 + tl.arange(0, BN)
        k_off = base + (ks + n).to(tl.int64) * sk_t
        kv_mask = (n < hi)[:, None] & dm[None, :]
        kt = tl.load(k + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(qt, tl.trans(kt)) * scale
        s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))  # key 0 is seen by every row: m stays finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, vt)
        m_i = m_new
    tl.store(o + q_off[:, None] + d[None, :], acc / l_i[:, None], mask=valid[:, None] & dm[None, :])


def causal_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: list[int], q_len: list[int],
                         k_start: list[int], pos0: list[int], scale: float, num_warps: int = 4,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_attention_f64_reference`` as one pass over each row's keys (Triton: a GPU, or the
    interpreter). Rows of few queries take the small tile, the rest the large one; the heaviest
    tiles (most keys) start first. ``out``: where to write (every row's queries are written)."""
    assert q.dtype == k.dtype == v.dtype == torch.float64
    assert q.stride(-1) == k.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and k.stride(-2) == k.shape[-1]
    assert v.stride() == k.stride()
    L, _, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    GP = triton.next_power_of_2(G)
    o = torch.empty_like(q) if out is None else out
    dev = q.device
    meta = upload_many([q_start, q_len, k_start, pos0], dev)
    for m_tile in (M_SHORT, M_LONG):
        bq = max(1, m_tile // GP)
        tiles = []  # (keys seen, row, first query)
        for r, (ql, p0) in enumerate(zip(q_len, pos0)):
            if ql == 0 or (ql <= max(1, M_SHORT // GP)) != (m_tile == M_SHORT):
                continue
            tiles += [(p0 + min(i0 + bq, ql), r, i0) for i0 in range(0, ql, bq)]
        if not tiles:
            continue
        tiles.sort(reverse=True)
        ids = upload_many([[r for _, r, _ in tiles], [i0 for _, _, i0 in tiles]], dev)
        _dense_f64_kernel[(len(tiles), L * KVH)](
            q, k, v, o, ids[0], ids[1], meta[0], meta[1], meta[2], meta[3],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(scale), KVH,
            G=G, GP=GP, D=D, BD=triton.next_power_of_2(D), BQ=bq, BN=KEYS_PER_BLOCK, num_warps=num_warps)
    return o
