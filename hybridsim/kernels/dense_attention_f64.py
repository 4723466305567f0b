"""The GQA probe's causal attention in float64 with neither keys nor scores in memory: the
attention oracle's arithmetic on a GPU.

The oracle's dense attention in torch (``layers/gqa.py``) projects every key of every row in
float64 (several passes over tensors of tokens x layers x K/V heads x head size) and
materialises every score of a batch, then passes over those five times; on a real-scale step
that is most of the oracle's time. Here one program takes a tile of one row's queries (times the
query heads of one KV head of one layer) and walks the row's keys a block at a time:

* the block's K and V are projected from its token ids in the program: the hidden state is two
  embedding rows, K = rope(x W_K), V = x W_V. Every input is a small integer (|x| <= 16,
  |W| <= 4, sums below 2**13, the rope table's integers below 2**10), so these products are
  exact in float32 on the tensor cores (TF32 holds integers below 2**11 exactly; every sum stays
  below 2**24) and rope's two products and sum are exact in float32 too: the same values
  ``GQAStack.keys`` computes in float64;
* scores and the weighted sum of V run in float64 (``tl.dot`` on float64: the tensor cores'
  DMMA), with a running maximum and sum as in flash attention.

Layout: row r owns queries ``q[:, q_start[r]:q_start[r] + q_len[r]]`` (layers, tokens, heads, D,
float64, already projected) at positions ``pos0[r] + j`` and keys ``tokens[k_start[r]:...]`` at
positions 0, 1, ... (its committed tokens from the first); query j sees keys 0..pos0[r] + j.
Query head h reads KV head h // (heads / kv_heads). The reference below is the oracle's torch
form, row by row: the results agree to float64 rounding (sums in another order), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device.transfer import upload, upload_many
from .flash_f64 import row_of_tile, softmax_block
from ..layers.exact import rotation_tables
from ..layers.gqa import V_SHIFT
from ..layers.mla import ROPE_SHIFT, TABLE, TABLE2

# tile schedule, from bench_oracle (H100): 32 (query, head) rows x 32 keys over 4 warps, one stage;
# 8 warps spill less (ptxas) but ran slower, 16-key blocks and a pipelined loop (more shared memory) too
M_LONG = 32  # (query, head) pairs a program takes for rows with many queries
M_SHORT = 16  # for short (decode) rows: the smallest tile a float64 product takes
KEYS_PER_BLOCK = 32
WARPS_LONG = 4  # (8 warps: 29.3 against 22.0 ms on bench_oracle's step, H100; 64-query tiles 35.3 ms)
WARPS_SHORT = 4
STAGES = 1


def probe_attention_reference(stack, q: torch.Tensor, tokens: torch.Tensor, q_start: list[int], q_len: list[int],
                              k_start: list[int], pos0: list[int]) -> torch.Tensor:
    """``probe_attention`` in torch, row by row: each row's keys projected by ``stack.keys`` and its
    queries attended by ``stack.attention`` (a float64 ``GQAStack``: the oracle's own torch form).
    Returns o like q (NaN where no row writes)."""
    o = torch.full_like(q, float("nan"))
    for qs, ql, ks, p0 in zip(q_start, q_len, k_start, pos0):
        n = p0 + ql
        k, v = stack.keys(tokens[ks:ks + n], torch.arange(n, device=tokens.device), n)
        qpos = torch.arange(p0, n, device=q.device)[None]
        o[:, qs:qs + ql] = stack.attention(q[:, qs:qs + ql][:, None], k[:, None], v[:, None], qpos)[:, 0]
    return o


@triton.jit
def _hidden(tokens, ks, n, nm, emb1, emb2, layer, HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr):
    """The hidden states (BN, HID) of the keys at row positions n: two embedding rows each."""
    tok = tl.load(tokens + ks + n, mask=nm, other=0)
    hid = tl.arange(0, HID)
    lay = layer.to(tl.int64)
    return (tl.load(emb1 + ((lay * T1 + tok % T1) * HID)[:, None] + hid[None, :])
            + tl.load(emb2 + ((lay * T2 + (tok // T1) % T2) * HID)[:, None] + hid[None, :]))


@triton.jit
def _halves(x, w, layer, kh, KVH, HID: tl.constexpr, D: tl.constexpr, BH: tl.constexpr):
    """x W (two halves of D) for KV head kh: exact integers in float32."""
    hid = tl.arange(0, HID)
    dh = tl.arange(0, BH)
    wmask = (dh < D // 2)[None, :]
    w_row = ((layer.to(tl.int64) * HID + hid) * KVH + kh) * D
    lo = tl.dot(x, tl.load(w + w_row[:, None] + dh[None, :], mask=wmask, other=0.0))
    hi = tl.dot(x, tl.load(w + w_row[:, None] + D // 2 + dh[None, :], mask=wmask, other=0.0))
    return lo, hi


@triton.jit
def _rope(k_lo, k_hi, n, nm, cc, ss, D: tl.constexpr, BH: tl.constexpr):
    """Rotate-half rope at positions n with the integer tables [cos | cos] and [-sin | sin]."""
    dh = tl.arange(0, BH)
    m = nm[:, None] & (dh < D // 2)[None, :]
    rot = n.to(tl.int64)[:, None] * D + dh[None, :]
    c = tl.load(cc + rot, mask=m, other=0.0)
    return k_lo * c + k_hi * tl.load(ss + rot, mask=m, other=0.0), k_hi * c + k_lo * tl.load(ss + rot + D // 2, mask=m,
                                                                                           other=0.0)


@triton.jit
def _probe_attention_kernel(q, tokens, emb1, emb2, wk, wv, cc, ss, o, tile_row, tile_q0, q_start, q_len, k_start,
                            pos0, sq_l, sq_t, scale_ptr, KVH,
                            HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, G: tl.constexpr,
                            GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BQ: tl.constexpr,
                            BN: tl.constexpr, K_SHIFT: tl.constexpr, V_SCALE: tl.constexpr):
    """One program: BQ queries of one row times the G query heads of one KV head of one layer
    (tile rows m = query * GP + head), over all the keys those queries see."""
    t = tl.program_id(0)
    layer = tl.program_id(1) // KVH
    kh = tl.program_id(1) % KVH
    scale = tl.load(scale_ptr)  # float64 (a float argument would arrive as float32: scores of 1e4 would move by 1e-4)
    r, i0, qs, ql, ks, p0 = row_of_tile(t, tile_row, tile_q0, q_start, q_len, k_start, pos0)
    m = tl.arange(0, BQ * GP)
    qi = i0 + m // GP
    g = m % GP
    valid = (qi < ql) & (g < G)
    qc = tl.minimum(qi, ql - 1)  # a padding row repeats the tile's last query (finite everywhere)
    qpos = p0 + qc
    dh = tl.arange(0, BH)
    hm = dh < D // 2
    q_off = layer.to(tl.int64) * sq_l + (qs + qc).to(tl.int64) * sq_t + (kh * G + tl.minimum(g, G - 1)) * D
    q_lo = tl.load(q + q_off[:, None] + dh[None, :], mask=hm[None, :], other=0.0)
    q_hi = tl.load(q + q_off[:, None] + D // 2 + dh[None, :], mask=hm[None, :], other=0.0)
    m_i = tl.full([BQ * GP], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ * GP], tl.float64)
    acc_lo = tl.zeros([BQ * GP, BH], tl.float64)
    acc_hi = tl.zeros([BQ * GP, BH], tl.float64)
    hi = p0 + tl.minimum(i0 + BQ, ql)  # keys 0..hi-1: up to the tile's last query
    for n0 in range(0, hi, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < hi
        x = _hidden(tokens, ks, n, nm, emb1, emb2, layer, HID, T1, T2)
        k_lo, k_hi = _halves(x, wk, layer, kh, KVH, HID, D, BH)
        k_lo, k_hi = _rope(k_lo, k_hi, n, nm, cc, ss, D, BH)
        # q . k exactly (every product and partial sum an integer times 2**-34 below 2**53), then
        # the power of two rope's table carries and the softmax scale: the torch form's values
        s = (tl.dot(q_lo, tl.trans(k_lo.to(tl.float64))) + tl.dot(q_hi, tl.trans(k_hi.to(tl.float64)))) \
            * K_SHIFT * scale
        s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))  # key 0 is seen by every row: m stays finite
        m_new, alpha, p, l_i = softmax_block(s, m_i, l_i)
        v_lo, v_hi = _halves(x, wv, layer, kh, KVH, HID, D, BH)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo.to(tl.float64))
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi.to(tl.float64))
        m_i = m_new
    out = o + q_off[:, None] + dh[None, :]
    keep = valid[:, None] & hm[None, :]
    tl.store(out, acc_lo / l_i[:, None] * V_SCALE, mask=keep)
    tl.store(out + D // 2, acc_hi / l_i[:, None] * V_SCALE, mask=keep)


def probe_attention(stack32, q: torch.Tensor, tokens: torch.Tensor, q_start: list[int], q_len: list[int],
                    k_start: list[int], pos0: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """``probe_attention_reference`` in one launch per tile size (Triton: a GPU, or the
    interpreter). ``stack32``: the layers' tables in float32 (``GQAStack(..., torch.float32)``);
    q (layers, queries, heads, D) float64; tokens (keys,) int64. Rows of few queries take the small
    tile, the rest the large one; the heaviest tiles (most keys) start first. ``out``: where to
    write (every row's queries are written)."""
    assert q.dtype == torch.float64 and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]
    assert stack32.emb1.dtype == torch.float32
    L, _, H, D = q.shape
    KVH = stack32.geo.kv_heads
    G = H // KVH
    GP = triton.next_power_of_2(G)
    HID = stack32.emb1.shape[-1]
    assert D % 2 == 0 and HID == triton.next_power_of_2(HID) and HID >= 16
    o = torch.empty_like(q) if out is None else out
    dev = q.device
    cc, ss = rotation_tables(D, max(p0 + ql for p0, ql in zip(pos0, q_len)), dev, torch.float32)
    meta = upload_many([q_start, q_len, k_start, pos0], dev)
    scale = upload([float(stack32.scale)], dev, torch.float64)
    short_q = max(1, M_SHORT // GP)
    for short in (True, False):
        bq = short_q if short else max(1, M_LONG // GP)
        tiles = []  # (keys seen, row, first query)
        for r, (ql, p0) in enumerate(zip(q_len, pos0)):
            if ql > 0 and (ql <= short_q) == short:
                tiles += [(p0 + min(i0 + bq, ql), r, i0) for i0 in range(0, ql, bq)]
        if not tiles:
            continue
        tiles.sort(reverse=True)
        ids = upload_many([[r for _, r, _ in tiles], [i0 for _, _, i0 in tiles]], dev)
        _probe_attention_kernel[(len(tiles), L * KVH)](
            q, tokens, stack32.emb1, stack32.emb2, stack32.w_k, stack32.w_v, cc, ss, o, ids[0], ids[1],
            meta[0], meta[1], meta[2], meta[3], q.stride(0), q.stride(1), scale, KVH,
            HID=HID, T1=TABLE, T2=TABLE2, G=G, GP=GP, D=D, BH=max(16, triton.next_power_of_2(D // 2)), BQ=bq,
            BN=KEYS_PER_BLOCK, K_SHIFT=2.0 ** -ROPE_SHIFT, V_SCALE=2.0 ** -V_SHIFT,
            num_warps=WARPS_SHORT if short else WARPS_LONG, num_stages=STAGES)
    return o
