"""The GQA probe's causal attention in float64 with the scores never in memory: the attention
oracle's arithmetic on a GPU.

The oracle's dense attention in torch (``layers/gqa.py``) projects every key of every row in
float64 (several passes over tensors of tokens x layers x K/V heads x head size) and
materialises every score of a batch, then passes over those five times; on a real-scale step
that is most of the oracle's time. Here a program takes a tile of one row's queries (times the
query heads of one KV head of one layer) and walks the row's keys a block at a time:

* a key's K and V come from its token id: the hidden state is two embedding rows,
  K = rope(x W_K), V = x W_V. Every input is a small integer (|x| <= 16, |W| <= 4, sums below
  2**13, the rope table's integers below 2**10), so these products are exact in float32 on the
  tensor cores (TF32 holds integers below 2**11 exactly; every sum stays below 2**24) and rope's
  two products (below 2**23) and their sum (below 2**24) are exact in float32 too: the same
  values ``GQAStack.keys`` computes in float64;
* so do the queries, once a program before its key loop (from the row's token ids, never from
  memory): W_Q's entries are integers in [-4, 4] as W_K's (``GQAProbe``), so Q = rope(x W_Q) is
  exact the same way in float32, then in float64 times 2**-ROPE_SHIFT: ``GQAStack.queries``'
  values bit for bit (``tile_queries`` writes them out for the tests). A tile's (query, head)
  rows take different query heads: for each head of the group, the rows of that head (the others
  zero) times its W_Q, summed (``_queries``: one nonzero term a row, exact);
* scores and the weighted sum of V run in float64 (``tl.dot`` on float64: the tensor cores'
  DMMA), with a running maximum and sum as in flash attention.

Where the keys are projected depends on how many tiles walk them. A row of one tile (a decode,
a short chunk) projects each key block inside its program: nothing is projected twice. A long
prefill chunk has one tile per few queries, and each would project the same keys again (125
times over for a 1,000-query chunk in groups of 4 heads), so its keys are projected once per
(layer, KV head) into a float32 workspace (exact, by the argument above: float32 holds every K
and V) and its tiles read them from there, the loads pipelined (``num_stages``) as in
``latent_attention_f64``. The workspace is bounded (``WORKSPACE_ELEMS``): long rows go in chunks
whose keys fit it, a row too long for that takes its (layer, KV head) pairs a few at a time, and
a row too long for even one pair projects its keys inside the kernel.

A decode row's program walks every key of its row, one block after another: a row of 12k keys
takes 380 blocks in a row while the step's other programs are long done. So a decode tile's keys
are split (flash-decoding): ranges of about ``DECODE_SPLIT_KEYS`` keys, one program each, each
writing its running maximum, sum and unnormalised accumulator (float64, a bounded buffer:
``PARTIAL_ELEMS``), then one launch merges each tile's ranges into its output.

Layout: row r owns keys ``tokens[k_start[r]:...]`` at positions 0, 1, ... (its committed tokens
from the first) and queries j < q_len[r] at positions ``pos0[r] + j``: query j is the row's own
token at that position (``tokens[k_start[r] + pos0[r] + j]``, causal self-attention) and sees keys
0..pos0[r] + j; its outputs go to ``o[:, q_start[r] + j]`` (o: layers, queries, heads, D, float64,
explicit strides). Query head h reads KV head h // (heads / kv_heads). The reference below is the
oracle's torch form, row by row: the results agree to float64 rounding (sums in another order),
not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..device.transfer import upload, upload_many
from .flash_f64 import row_of_tile, softmax_block
from ..layers.exact import rotation_tables
from ..layers.gqa import V_SHIFT, GQAStack
from ..layers.mla import ROPE_SHIFT, TABLE, TABLE2

# Keys projected in the attention program (rows of one tile, and rows too long for the
# workspace). Tile schedule from bench_oracle (H100): 32 (query, head) rows x 32 keys over 4
# warps, one stage; 8 warps spill less (ptxas) but ran slower, 16-key blocks and a pipelined loop
# (more shared memory) too.
M_LONG = 32  # (query, head) pairs a program takes for rows with many queries
M_SHORT = 16  # for short (decode) rows: the smallest tile a float64 product takes
KEYS_PER_BLOCK = 32
WARPS_LONG = 4  # (8 warps: 29.3 against 22.0 ms on bench_oracle's step, H100; 64-query tiles 35.3 ms)
WARPS_SHORT = 4
STAGES = 1
# Rows of several tiles, over the workspace: (query, head) rows a program takes, keys a block,
# warps, pipeline stages. As latent_attention_f64's per-head schedule (keys in memory, loads three
# deep), with 32 rows: a KV head's query heads share each key load, and twice the rows read the
# workspace half as often. Built for sm_90 at D = 128: 168 registers, no spills, 32 KiB of
# shared memory a stage (a 32-key block of float32 K and V), 104.5 KiB in all. bench_oracle's step
# (H200): 14.64 ms against 21.65 with every tile projecting its keys; 8 warps, 2 stages or 64 rows
# no faster (bench/history/2026-11-27_session30.md).
WORKSPACE = (32, 32, 4, 3)
# keys a projection program writes for one (layer, KV head): 64 over 8 warps (150 registers;
# over 4 warps the four TF32 products spill, 32 keys or 64)
PROJECT_KEYS = 64
PROJECT_WARPS = 8
# Float32 elements of K and V a call keeps at once (256 MiB): half the bytes of the float64
# outputs the executor's oracle packs into one call (ORACLE_SCORES, 2**26 elements,
# engine/attn_exec.py), so the workspace adds at most half again to the oracle's memory. It holds
# every (layer, KV head) of 8,192 keys at Nemotron-H-8B's geometry (4 layers x 8 KV heads x 128);
# a longer row takes its pairs in passes, which costs launches, not work.
WORKSPACE_ELEMS = 1 << 26
# Decode tiles' keys in ranges of this many (a multiple of KEYS_PER_BLOCK), one program each, the
# ranges merged after (``_split_plan``): bench_oracle's 20 decode rows over 1k-12k keys were 640
# programs the longest of which walked 12k keys (4.7 of the step's 14.68 ms, H200); in ranges of
# 1,024 they are 137 x 32 programs of at most 32 key blocks, and the step took 13.32 ms (ranges of
# 256, 512, 2,048: 13.45, 13.32, 13.54)
DECODE_SPLIT_KEYS = 1024
# float64 elements the ranges' partial results of one call may take (128 MiB): (ranges, (layer,
# KV head) pairs, a tile's (query, head) rows, D + 2); a call that would need more takes longer
# ranges (bench_oracle's step takes 70 MiB in ranges of 1,024; in ranges of 512 it would take 134)
PARTIAL_ELEMS = 1 << 24
MERGE_WARPS = 4


def _queries_out(stack, q_start: list[int], q_len: list[int], device) -> torch.Tensor:
    """An output (layers, queries, heads, D) float64 for rows whose queries end at q_start + q_len."""
    n = max((qs + ql for qs, ql in zip(q_start, q_len)), default=0)
    return torch.empty((stack.layers, n, stack.heads, stack.geo.head_dim), dtype=torch.float64, device=device)


def probe_attention_reference(stack, tokens: torch.Tensor, q_start: list[int], q_len: list[int], k_start: list[int],
                              pos0: list[int]) -> torch.Tensor:
    """``probe_attention`` in torch, row by row: each row's keys projected by ``stack.keys``, its
    queries (its tokens at positions pos0..) by ``stack.attend_keys``, which attends (a float64
    ``GQAStack``: the oracle's own torch form). Returns o (layers, queries, heads, D), NaN where no
    row writes."""
    o = _queries_out(stack, q_start, q_len, tokens.device).fill_(float("nan"))
    for qs, ql, ks, p0 in zip(q_start, q_len, k_start, pos0):
        n = p0 + ql
        pos = torch.arange(n, device=tokens.device)
        k, v = stack.keys(tokens[ks:ks + n], pos, n)
        o[:, qs:qs + ql] = stack.attend_keys(k, v, tokens[ks + p0:ks + n], pos[p0:])[:, 0]
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
def _tile_rows(t, layer, kh, tile_row, tile_q0, q_start, q_len, k_start, pos0, so_l, so_t,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr):
    """Tile t's (query, head) rows m = query * GP + head: (its row r, the row's first key slot,
    each tile row's position and head in the group, which are real, their offsets in o, the keys
    the tile sees)."""
    r, i0, qs, ql, ks, p0 = row_of_tile(t, tile_row, tile_q0, q_start, q_len, k_start, pos0)
    m = tl.arange(0, BQ * GP)
    qi = i0 + m // GP
    g = m % GP
    valid = (qi < ql) & (g < G)
    qc = tl.minimum(qi, ql - 1)  # a padding row repeats the tile's last query (finite everywhere)
    gc = tl.minimum(g, G - 1)  # and a padding head the group's last head
    o_off = layer.to(tl.int64) * so_l + (qs + qc).to(tl.int64) * so_t + (kh * G + gc) * D
    return r, ks, p0 + qc, gc, valid, o_off, p0 + tl.minimum(i0 + BQ, ql)  # keys 0..: to its last query


@triton.jit
def _queries(tokens, ks, qpos, gc, emb1, emb2, wq, cc, ss, layer, kh, KVH, HID: tl.constexpr, T1: tl.constexpr,
             T2: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BH: tl.constexpr):
    """Q's two halves (rows x BH, float32 exact integers, rope's factor 1024 not yet undone) of
    rows whose token sits at row position qpos (key slot ks + qpos) and whose query head is
    kh * G + gc: for each head b of the group, the rows of head b's x (the others zero) times
    b's W_Q, summed (TF32 products of small integers, each row's sum one product and zeros:
    exact), then rope. (One product of x in its head's block of G * HID columns by the group's
    W_Q stacked spills: a (G * HID, D / 2) tile and its pointers at once.)"""
    x = _hidden(tokens, ks, qpos, qpos >= 0, emb1, emb2, layer, HID, T1, T2)
    hid = tl.arange(0, HID)
    dh = tl.arange(0, BH)
    wm = (dh < D // 2)[None, :]
    w_row = ((layer.to(tl.int64) * HID + hid) * KVH * G + kh * G) * D  # W_Q (layers, HID, heads, D)
    lo = tl.zeros([x.shape[0], BH], tl.float32)
    hi = tl.zeros([x.shape[0], BH], tl.float32)
    for b in range(G):
        xb = tl.where((gc == b)[:, None], x, 0.0)
        at = wq + (w_row + b * D)[:, None] + dh[None, :]
        lo = tl.dot(xb, tl.load(at, mask=wm, other=0.0), lo)
        hi = tl.dot(xb, tl.load(at + D // 2, mask=wm, other=0.0), hi)
    return _rope(lo, hi, qpos, qpos >= 0, cc, ss, D, BH)


@triton.jit
def _tile_queries(tokens, emb1, emb2, wq, cc, ss, t, layer, kh, KVH, tile_row, tile_q0, q_start, q_len, k_start,
                  pos0, so_l, so_t, HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, G: tl.constexpr,
                  GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BQ: tl.constexpr, K_SHIFT: tl.constexpr):
    """``_tile_rows`` and the tile's queries' two halves, float64 (``GQAStack.queries``' values,
    times rope's 2**-ROPE_SHIFT, K_SHIFT): (r, ks, qpos, valid, o_off, q_lo, q_hi, hi)."""
    r, ks, qpos, gc, valid, o_off, hi = _tile_rows(t, layer, kh, tile_row, tile_q0, q_start, q_len, k_start, pos0,
                                                   so_l, so_t, G, GP, D, BQ)
    q_lo, q_hi = _queries(tokens, ks, qpos, gc, emb1, emb2, wq, cc, ss, layer, kh, KVH, HID, T1, T2, G, D, BH)
    return r, ks, qpos, valid, o_off, q_lo.to(tl.float64) * K_SHIFT, q_hi.to(tl.float64) * K_SHIFT, hi


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, n, qpos, scale, K_SHIFT: tl.constexpr):
    """A key block's scores: q . k exactly (every product and partial sum an integer times 2**-34
    below 2**53), then the power of two rope's table carries and the softmax scale (the torch
    form's values); a key after a query masked (key 0 is seen by every row: the maximum stays finite)."""
    s = (tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))) * K_SHIFT * scale
    return tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))


@triton.jit
def _store_halves(out, rows, keep_rows, lo, hi, D: tl.constexpr, BH: tl.constexpr):
    """lo and hi (rows x two halves of D) at out + rows (the rows keep_rows marks)."""
    dh = tl.arange(0, BH)
    at = out + rows[:, None] + dh[None, :]
    keep = keep_rows[:, None] & (dh < D // 2)[None, :]
    tl.store(at, lo, mask=keep)
    tl.store(at + D // 2, hi, mask=keep)


@triton.jit
def _store_tile(o, o_off, valid, acc_lo, acc_hi, l_i, D: tl.constexpr, BH: tl.constexpr, V_SCALE: tl.constexpr):
    _store_halves(o, o_off, valid, acc_lo / l_i[:, None] * V_SCALE, acc_hi / l_i[:, None] * V_SCALE, D, BH)


@triton.jit
def _partial_rows(slot, j, pairs, M: tl.constexpr, D: tl.constexpr):
    """Where (layer, KV head) pair j of range ``slot`` keeps its M (query, head) rows in the
    partial buffer (slots, pairs, M, D + 2): the accumulator's D, then the maximum and the sum."""
    return ((slot.to(tl.int64) * pairs + j) * M + tl.arange(0, M)) * (D + 2)


@triton.jit
def _probe_attention_kernel(tokens, emb1, emb2, wq, wk, wv, cc, ss, o, tile_row, tile_q0, tile_k0, tile_k1, q_start,
                            q_len, k_start, pos0, so_l, so_t, scale_ptr, KVH,
                            HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, G: tl.constexpr,
                            GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BQ: tl.constexpr,
                            BN: tl.constexpr, K_SHIFT: tl.constexpr, V_SCALE: tl.constexpr,
                            PARTIAL: tl.constexpr):
    """One program: BQ queries of one row times the G query heads of one KV head of one layer,
    over all the keys those queries see, the queries projected first, then each key block here.
    PARTIAL: over keys tile_k0[t] to tile_k1[t] (exclusive) only, a range of the tile's keys whose
    first every query of the tile sees (``_split_plan``), its running maximum, sum and accumulator
    (unnormalised) written to slot t of the partial buffer o (``_partial_rows``) for
    ``_merge_ranges_kernel``."""
    t = tl.program_id(0)
    layer = tl.program_id(1) // KVH
    kh = tl.program_id(1) % KVH
    scale = tl.load(scale_ptr)  # float64 (a float argument would arrive as float32: scores of 1e4 would move by 1e-4)
    _, ks, qpos, valid, o_off, q_lo, q_hi, hi = _tile_queries(tokens, emb1, emb2, wq, cc, ss, t, layer, kh, KVH,
                                                              tile_row, tile_q0, q_start, q_len, k_start, pos0,
                                                              so_l, so_t, HID, T1, T2, G, GP, D, BH, BQ, K_SHIFT)
    lo = 0
    if PARTIAL:
        lo = tl.load(tile_k0 + t)
        hi = tl.load(tile_k1 + t)
    m_i = tl.full([BQ * GP], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ * GP], tl.float64)
    acc_lo = tl.zeros([BQ * GP, BH], tl.float64)
    acc_hi = tl.zeros([BQ * GP, BH], tl.float64)
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < hi
        x = _hidden(tokens, ks, n, nm, emb1, emb2, layer, HID, T1, T2)
        k_lo, k_hi = _halves(x, wk, layer, kh, KVH, HID, D, BH)
        k_lo, k_hi = _rope(k_lo, k_hi, n, nm, cc, ss, D, BH)
        s = _scores(q_lo, q_hi, k_lo.to(tl.float64), k_hi.to(tl.float64), n, qpos, scale, K_SHIFT)
        m_new, alpha, p, l_i = softmax_block(s, m_i, l_i)
        v_lo, v_hi = _halves(x, wv, layer, kh, KVH, HID, D, BH)  # (after the scores: fewer registers live)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo.to(tl.float64))
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi.to(tl.float64))
        m_i = m_new
    _, _, _, _, valid, o_off, _ = _tile_rows(t, layer, kh, tile_row, tile_q0, q_start, q_len, k_start, pos0, so_l,
                                             so_t, G, GP, D, BQ)  # (again: not kept over the loop)
    if PARTIAL:
        at = _partial_rows(t, tl.program_id(1), tl.num_programs(1), BQ * GP, D)
        _store_halves(o, at, valid, acc_lo, acc_hi, D, BH)  # (padding rows neither written nor merged)
        tl.store(o + at + D, m_i, mask=valid)
        tl.store(o + at + D + 1, l_i, mask=valid)
    else:
        _store_tile(o, o_off, valid, acc_lo, acc_hi, l_i, D, BH, V_SCALE)


@triton.jit
def _queries_kernel(tokens, emb1, emb2, wq, cc, ss, o, tile_row, tile_q0, q_start, q_len, k_start, pos0, so_l, so_t,
                    KVH, HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                    D: tl.constexpr, BH: tl.constexpr, BQ: tl.constexpr, K_SHIFT: tl.constexpr):
    """One program: the queries ``_probe_attention_kernel``'s program for the same tile would
    project, written to o where its outputs would go (``tile_queries``: the tests' check)."""
    t = tl.program_id(0)
    layer = tl.program_id(1) // KVH
    kh = tl.program_id(1) % KVH
    _, _, _, valid, o_off, q_lo, q_hi, _ = _tile_queries(tokens, emb1, emb2, wq, cc, ss, t, layer, kh, KVH, tile_row,
                                                         tile_q0, q_start, q_len, k_start, pos0, so_l, so_t, HID, T1,
                                                         T2, G, GP, D, BH, BQ, K_SHIFT)
    _store_halves(o, o_off, valid, q_lo, q_hi, D, BH)


@triton.jit
def _merge_ranges_kernel(part, o, tile_row, tile_q0, tile_first, tile_ranges, slots, q_start, q_len, k_start, pos0,
                         so_l, so_t, KVH, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                         BQ: tl.constexpr, V_SCALE: tl.constexpr):
    """One program: a split tile's (query, head) rows for one (layer, KV head): the partial
    results of its key ranges (tile_ranges[t] of them, in the partial buffer's slots
    slots[tile_first[t]]..) merged as flash attention merges key blocks (each range's maximum is
    finite: every query of the tile sees a key of each range), then normalised and stored as
    ``_store_tile`` does."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    _, _, _, _, valid, o_off, _ = _tile_rows(t, j // KVH, j % KVH, tile_row, tile_q0, q_start, q_len, k_start, pos0,
                                             so_l, so_t, G, GP, D, BQ)
    first = tl.load(tile_first + t)
    m_i = tl.full([BQ * GP], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ * GP], tl.float64)
    acc_lo = tl.zeros([BQ * GP, BH], tl.float64)
    acc_hi = tl.zeros([BQ * GP, BH], tl.float64)
    for i in range(first, first + tl.load(tile_ranges + t)):
        at = _partial_rows(tl.load(slots + i), j, tl.num_programs(1), BQ * GP, D)
        m_s = tl.load(part + at + D, mask=valid, other=0.0)
        m_new = tl.maximum(m_i, m_s)
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(m_s - m_new)
        a_lo, a_hi = _load_halves(part, at, valid, D, BH)
        l_i = l_i * alpha + tl.load(part + at + D + 1, mask=valid, other=1.0) * w  # (padding rows: no 0 / 0)
        acc_lo = acc_lo * alpha[:, None] + a_lo * w[:, None]
        acc_hi = acc_hi * alpha[:, None] + a_hi * w[:, None]
        m_i = m_new
    _store_tile(o, o_off, valid, acc_lo, acc_hi, l_i, D, BH, V_SCALE)


@triton.jit(do_not_specialize=["pair0"])  # (0 or a multiple of a pass's pairs: one variant)
def _project_keys_kernel(tokens, emb1, emb2, wk, wv, cc, ss, k_ws, v_ws, blk_row, blk_n0, q_len, k_start, pos0,
                         w_start, slab, pair0, KVH,
                         HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, D: tl.constexpr,
                         BH: tl.constexpr, BN: tl.constexpr):
    """One program: K (after rope) and V of BN keys of one row (from row position blk_n0) for one
    (layer, KV head), pair pair0 + program_id(1), into that pair's slab of the workspace
    (program_id(1) * slab elements in; row r's keys from key slot w_start[r]): exact in float32."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    layer = (pair0 + j) // KVH
    kh = (pair0 + j) % KVH
    r = tl.load(blk_row + b)
    n = tl.load(blk_n0 + b) + tl.arange(0, BN)
    nm = n < tl.load(pos0 + r) + tl.load(q_len + r)
    x = _hidden(tokens, tl.load(k_start + r), n, nm, emb1, emb2, layer, HID, T1, T2)
    k_lo, k_hi = _halves(x, wk, layer, kh, KVH, HID, D, BH)
    k_lo, k_hi = _rope(k_lo, k_hi, n, nm, cc, ss, D, BH)
    v_lo, v_hi = _halves(x, wv, layer, kh, KVH, HID, D, BH)
    dh = tl.arange(0, BH)
    at = (j.to(tl.int64) * slab + (tl.load(w_start + r) + n) * D)[:, None] + dh[None, :]
    keep = nm[:, None] & (dh < D // 2)[None, :]
    tl.store(k_ws + at, k_lo, mask=keep)
    tl.store(k_ws + at + D // 2, k_hi, mask=keep)
    tl.store(v_ws + at, v_lo, mask=keep)
    tl.store(v_ws + at + D // 2, v_hi, mask=keep)


@triton.jit
def _load_halves(ws, rows, nm, D: tl.constexpr, BH: tl.constexpr):
    """A key block's two halves of D from the workspace (exact float32), in float64 (or rows of
    the partial buffer, float64 already)."""
    dh = tl.arange(0, BH)
    at = ws + rows[:, None] + dh[None, :]
    m = nm[:, None] & (dh < D // 2)[None, :]
    return tl.load(at, mask=m, other=0.0).to(tl.float64), tl.load(at + D // 2, mask=m, other=0.0).to(tl.float64)


@triton.jit(do_not_specialize=["pair0"])  # (0 or a multiple of a pass's pairs: one variant)
def _workspace_attention_kernel(tokens, emb1, emb2, wq, cc, ss, k_ws, v_ws, o, tile_row, tile_q0, q_start, q_len,
                                k_start, pos0, w_start, so_l, so_t, slab, pair0, scale_ptr, KVH,
                                HID: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                                BQ: tl.constexpr, BN: tl.constexpr, K_SHIFT: tl.constexpr, V_SCALE: tl.constexpr):
    """``_probe_attention_kernel`` over keys ``_project_keys_kernel`` wrote: (layer, KV head)
    pair pair0 + program_id(1), its keys in slab program_id(1) of the workspace (the queries
    projected here, as there)."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    layer = (pair0 + j) // KVH
    kh = (pair0 + j) % KVH
    scale = tl.load(scale_ptr)  # float64 (a float argument would arrive as float32)
    r, _, qpos, valid, o_off, q_lo, q_hi, hi = _tile_queries(tokens, emb1, emb2, wq, cc, ss, t, layer, kh, KVH,
                                                             tile_row, tile_q0, q_start, q_len, k_start, pos0,
                                                             so_l, so_t, HID, T1, T2, G, GP, D, BH, BQ, K_SHIFT)
    base = j.to(tl.int64) * slab + tl.load(w_start + r) * D
    m_i = tl.full([BQ * GP], float("-inf"), tl.float64)
    l_i = tl.zeros([BQ * GP], tl.float64)
    acc_lo = tl.zeros([BQ * GP, BH], tl.float64)
    acc_hi = tl.zeros([BQ * GP, BH], tl.float64)
    for n0 in range(0, hi, BN):
        n = n0 + tl.arange(0, BN)
        nm = n < hi
        rows = base + n.to(tl.int64) * D
        k_lo, k_hi = _load_halves(k_ws, rows, nm, D, BH)
        s = _scores(q_lo, q_hi, k_lo, k_hi, n, qpos, scale, K_SHIFT)
        m_new, alpha, p, l_i = softmax_block(s, m_i, l_i)
        v_lo, v_hi = _load_halves(v_ws, rows, nm, D, BH)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi)
        m_i = m_new
    _, _, _, _, valid, o_off, _ = _tile_rows(t, layer, kh, tile_row, tile_q0, q_start, q_len, k_start, pos0, so_l,
                                             so_t, G, GP, D, BQ)  # (again: not kept over the loop)
    _store_tile(o, o_off, valid, acc_lo, acc_hi, l_i, D, BH, V_SCALE)


@dataclass
class _Call:
    """What every launch of one ``probe_attention`` call shares."""

    stack: GQAStack  # float32 tables
    tokens: torch.Tensor
    o: torch.Tensor  # (layers, queries, heads, D) float64
    cc: torch.Tensor  # rope's tables, float32
    ss: torch.Tensor
    meta: list[torch.Tensor]  # q_start, q_len, k_start, pos0 on the device
    scale: torch.Tensor  # float64, on the device
    q_len: list[int]
    pos0: list[int]
    G: int
    GP: int

    @property
    def kv_heads(self) -> int:
        return self.stack.geo.kv_heads

    @property
    def pairs(self) -> int:
        """(layer, KV head) pairs: the launches' second axis."""
        return self.stack.layers * self.kv_heads

    @property
    def D(self) -> int:
        return self.stack.geo.head_dim

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def sizes(self) -> dict:
        """The constexpr sizes every kernel takes."""
        return dict(D=self.D, BH=max(16, triton.next_power_of_2(self.D // 2)))

    def queries(self) -> tuple[list, dict]:
        """What a kernel projecting queries takes: its first arguments (the token ids, the tables
        and rope's) and the tables' constexpr sizes."""
        st = self.stack
        return ([self.tokens, st.emb1, st.emb2, st.w_q, self.cc, self.ss],
                dict(HID=st.emb1.shape[-1], T1=TABLE, T2=TABLE2, K_SHIFT=2.0 ** -ROPE_SHIFT))

    def o_strides(self) -> tuple[int, int]:
        return self.o.stride(0), self.o.stride(1)


def _tiles(c: _Call, rows: list[int], bq: int, extra: list | None = None) -> tuple[int, list[torch.Tensor]]:
    """Tiles of bq queries of the rows, the heaviest (most keys) first: their count, and on the
    device their rows and first queries (and ``extra``'s lists, in the same upload)."""
    tiles = sorted(((c.pos0[r] + min(i0 + bq, c.q_len[r]), r, i0) for r in rows for i0 in range(0, c.q_len[r], bq)),
                   reverse=True)
    ids = upload_many([[r for _, r, _ in tiles], [i0 for _, _, i0 in tiles]] + (extra or []), c.device)
    return len(tiles), ids


def _launch_projecting(c: _Call, n_tiles: int, tiles: list[torch.Tensor], out: torch.Tensor, bq: int, warps: int,
                       partial: bool = False) -> None:
    """``_probe_attention_kernel`` over n_tiles tiles of bq queries (tiles: their rows, first
    queries, and with ``partial`` their key ranges' first and last keys), writing to out."""
    st = c.stack
    (tokens, emb1, emb2, wq, cc, ss), q_sizes = c.queries()
    _probe_attention_kernel[(n_tiles, c.pairs)](
        tokens, emb1, emb2, wq, st.w_k, st.w_v, cc, ss, out, *tiles, *c.meta, *c.o_strides(), c.scale, c.kv_heads,
        G=c.G, GP=c.GP, BQ=bq, BN=KEYS_PER_BLOCK, V_SCALE=2.0 ** -V_SHIFT, PARTIAL=partial, num_warps=warps,
        num_stages=STAGES, **q_sizes, **c.sizes())


def _attend_projecting(c: _Call, rows: list[int], bq: int, warps: int) -> None:
    """The rows in tiles of bq queries, each projecting its keys (one launch)."""
    n_tiles, ids = _tiles(c, rows, bq)
    _launch_projecting(c, n_tiles, ids + ids, c.o, bq, warps)  # (no key ranges: the first two stand in)


def _split_plan(c: _Call, rows: list[int], bq: int, split: int,
                bound: int) -> tuple[int, list[tuple[int, int, list[tuple[int, int]]]]] | None:
    """The key ranges of the rows' tiles of bq queries: a tile whose first query sits at
    position f (and whose keys end at hi, after its last query's) takes ranges from keys 0,
    split, 2 split, ... up to f, the last one to hi: every query of the tile sees every key of
    each range but the last, and its own key in the last (each range's maximum is finite; the
    last range, 1 to split + bq - 1 keys, holds the tile's queries' causal mask). ``split``
    doubled while the ranges' partial results (pairs x bq x GP x (D + 2) float64 each) would
    exceed ``bound`` elements. Returns (the split, [(row, first query, [(first key, end)])]), or
    None where every tile takes a single range (nothing to merge)."""
    tiles = [(r, i0) for r in rows for i0 in range(0, c.q_len[r], bq)]
    per_range = c.pairs * bq * c.GP * (c.D + 2)
    while True:
        n = [(c.pos0[r] + i0) // split + 1 for r, i0 in tiles]
        if max(n) == 1:
            return None
        if sum(n) * per_range <= bound:
            break
        split *= 2
    plan = []
    for (r, i0), n_r in zip(tiles, n):
        starts = list(range(0, n_r * split, split))
        plan.append((r, i0, list(zip(starts, starts[1:] + [c.pos0[r] + min(i0 + bq, c.q_len[r])]))))
    return split, plan


def _attend_split(c: _Call, rows: list[int], bq: int, warps: int) -> None:
    """Decode rows in tiles of bq queries, each tile's keys in ranges (``_split_plan``): a
    program per (range, (layer, KV head)) writing its partial results, the longest ranges first
    (one launch), then one merging each tile's ranges into its output. Where every tile takes a
    single range: ``_attend_projecting`` (where some tile takes several, a tile of one range goes
    with them: its merge reads and writes its rows once, the cost of a second launch's start)."""
    plan = _split_plan(c, rows, bq, DECODE_SPLIT_KEYS, PARTIAL_ELEMS)
    if plan is None:
        _attend_projecting(c, rows, bq, warps)
        return
    _, tiles = plan
    ranges = sorted(((k1 - k0, u, r, i0, k0, k1) for u, (r, i0, rs) in enumerate(tiles) for k0, k1 in rs),
                    reverse=True)
    slots = sorted(range(len(ranges)), key=lambda i: ranges[i][1])  # the launch's ranges, tile by tile
    first = [0] * len(tiles)
    for u, (_, _, rs) in enumerate(tiles[:-1]):
        first[u + 1] = first[u] + len(rs)
    ids = upload_many([[x[i] for x in ranges] for i in (2, 3, 4, 5)]
                      + [[r for r, _, _ in tiles], [i0 for _, i0, _ in tiles], first, [len(rs) for _, _, rs in tiles],
                         slots], c.device)
    part = torch.empty((len(ranges), c.pairs, bq * c.GP, c.D + 2), dtype=torch.float64, device=c.device)
    _launch_projecting(c, len(ranges), ids[:4], part, bq, warps, partial=True)
    _merge_ranges_kernel[(len(tiles), c.pairs)](
        part, c.o, *ids[4:], *c.meta, *c.o_strides(), c.kv_heads,
        G=c.G, GP=c.GP, BQ=bq, V_SCALE=2.0 ** -V_SHIFT, num_warps=MERGE_WARPS, **c.sizes())


def _workspace_plan(n: list[int], rows: list[int], pairs: int, per_pair: int,
                   bound: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Long rows (row r has n[r] keys, each ``per_pair`` workspace elements per (layer, KV head))
    in workspace chunks of at most ``bound`` elements: (rows, pairs a pass) per chunk, every pair
    at once where the rows fit (as many rows a chunk as fit), else a row alone with as many pairs
    a pass as fit; and the rows too long for even one pair (they project their keys in the
    attention kernel)."""
    chunks: list[tuple[list[int], int]] = []
    too_long: list[int] = []
    group: list[int] = []
    keys = 0
    for r in rows:
        if n[r] * per_pair > bound:
            too_long.append(r)
        elif n[r] * per_pair * pairs > bound:
            chunks.append(([r], bound // (n[r] * per_pair)))
        else:
            if group and (keys + n[r]) * per_pair * pairs > bound:
                chunks.append((group, pairs))
                group, keys = [], 0
            group.append(r)
            keys += n[r]
    if group:
        chunks.append((group, pairs))
    return chunks, too_long


def _attend_workspace(c: _Call, rows: list[int], step: int) -> None:
    """The rows' keys projected into a float32 workspace (2, step pairs, the rows' keys, D), then
    attended over in tiles, ``step`` (layer, KV head) pairs a pass."""
    rows_per_tile, bn, warps, stages = WORKSPACE
    st = c.stack
    D = c.D
    n = {r: c.pos0[r] + c.q_len[r] for r in rows}
    w_start = [0] * len(c.q_len)  # each row's first key slot in the workspace
    at = 0
    for r in rows:
        w_start[r], at = at, at + n[r]
    blocks = [(r, n0) for r in rows for n0 in range(0, n[r], PROJECT_KEYS)]
    n_tiles, ids = _tiles(c, rows, max(1, rows_per_tile // c.GP),
                          [w_start, [r for r, _ in blocks], [n0 for _, n0 in blocks]])
    ws = torch.empty((2, step, at, D), dtype=torch.float32, device=c.device)
    # tiles are the launches' first axis (the fastest), so the programs running at once read few
    # pairs' keys, which stay in L2 (bench_oracle's step on an H100: 253 tiles a pair, about 264
    # programs resident, one pair's 5 MiB at a time)
    q_args, q_sizes = c.queries()
    for pair0 in range(0, c.pairs, step):
        pairs = min(step, c.pairs - pair0)
        _project_keys_kernel[(len(blocks), pairs)](
            c.tokens, st.emb1, st.emb2, st.w_k, st.w_v, c.cc, c.ss, ws[0], ws[1], ids[3], ids[4], c.meta[1],
            c.meta[2], c.meta[3], ids[2], at * D, pair0, c.kv_heads,
            HID=st.emb1.shape[-1], T1=TABLE, T2=TABLE2, BN=PROJECT_KEYS, num_warps=PROJECT_WARPS, **c.sizes())
        _workspace_attention_kernel[(n_tiles, pairs)](
            *q_args, ws[0], ws[1], c.o, ids[0], ids[1], *c.meta, ids[2], *c.o_strides(), at * D, pair0,
            c.scale, c.kv_heads, G=c.G, GP=c.GP, BQ=max(1, rows_per_tile // c.GP), BN=bn,
            V_SCALE=2.0 ** -V_SHIFT, num_warps=warps, num_stages=stages, **q_sizes, **c.sizes())


def _call(stack32, tokens: torch.Tensor, q_start: list[int], q_len: list[int], k_start: list[int],
          pos0: list[int], out: torch.Tensor | None) -> _Call:
    """What every launch of a call shares, its output allocated where ``out`` is None."""
    assert stack32.emb1.dtype == torch.float32 and tokens.dtype == torch.int64
    G = stack32.heads // stack32.geo.kv_heads
    D, HID = stack32.geo.head_dim, stack32.emb1.shape[-1]
    assert D % 2 == 0 and HID == triton.next_power_of_2(HID) and HID >= 16
    assert all(w.is_contiguous() for w in (stack32.emb1, stack32.emb2, stack32.w_q, stack32.w_k, stack32.w_v))
    o = _queries_out(stack32, q_start, q_len, tokens.device) if out is None else out
    assert o.dtype == torch.float64 and o.shape[0] == stack32.layers and o.shape[2:] == (stack32.heads, D)
    assert o.stride(-1) == 1 and o.stride(-2) == D and o.shape[1] >= max(qs + ql for qs, ql in zip(q_start, q_len))
    dev = tokens.device
    cc, ss = rotation_tables(D, max(p0 + ql for p0, ql in zip(pos0, q_len)), dev, torch.float32)
    return _Call(stack32, tokens, o, cc, ss, upload_many([q_start, q_len, k_start, pos0], dev),
                 upload([float(stack32.scale)], dev, torch.float64), q_len, pos0, G, triton.next_power_of_2(G))


def probe_attention(stack32, tokens: torch.Tensor, q_start: list[int], q_len: list[int], k_start: list[int],
                    pos0: list[int], out: torch.Tensor | None = None, *,
                    workspace_elems: int | None = None) -> torch.Tensor:
    """``probe_attention_reference`` in a few launches (Triton: a GPU, or the interpreter).
    ``stack32``: the layers' tables in float32 (``GQAStack(..., torch.float32)``); tokens (keys,)
    int64: row r's keys from k_start[r], its q_len[r] queries its own tokens at positions pos0[r]..,
    projected inside the kernels as its keys are. Returns o (layers, queries, heads, D) float64
    (``out`` if given, any strides with heads and D contiguous), row r's queries at
    o[:, q_start[r]:q_start[r] + q_len[r]] (every row's queries are written). Rows of few queries
    take the small tile and rows of one large tile the large one, each projecting its keys; rows
    of several large tiles attend over keys projected once into a workspace of at most
    ``workspace_elems`` float32 elements (default ``WORKSPACE_ELEMS``); the small tiles' keys are
    split into ranges of about ``DECODE_SPLIT_KEYS``, merged after (``_attend_split``). The
    heaviest tiles (most keys) of a launch start first."""
    c = _call(stack32, tokens, q_start, q_len, k_start, pos0, out)
    short_q, long_q = max(1, M_SHORT // c.GP), max(1, M_LONG // c.GP)
    short = [r for r, ql in enumerate(q_len) if 0 < ql <= short_q]
    one_tile = [r for r, ql in enumerate(q_len) if short_q < ql <= long_q]
    several = [r for r, ql in enumerate(q_len) if ql > max(short_q, long_q)]
    n = [p0 + ql for p0, ql in zip(pos0, q_len)]
    bound = WORKSPACE_ELEMS if workspace_elems is None else workspace_elems
    chunks, too_long = _workspace_plan(n, several, c.pairs, 2 * c.D, bound)
    if short:
        _attend_split(c, short, short_q, WARPS_SHORT)
    if one_tile or too_long:
        _attend_projecting(c, one_tile + too_long, long_q, WARPS_LONG)
    for rows, step in chunks:
        _attend_workspace(c, rows, step)
    return c.o


def tile_queries(stack32, tokens: torch.Tensor, q_start: list[int], q_len: list[int], k_start: list[int],
                 pos0: list[int], bq: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The queries the attention kernels project in their tiles of bq queries (``_tile_queries``,
    the same code), written out as ``probe_attention`` writes its outputs (padding rows not
    written): ``GQAStack.queries``' float64 values of the same tokens and positions, bit for bit
    (the tests' check; the oracle never keeps queries in memory)."""
    c = _call(stack32, tokens, q_start, q_len, k_start, pos0, out)
    n_tiles, ids = _tiles(c, [r for r, ql in enumerate(q_len) if ql > 0], bq)
    q_args, q_sizes = c.queries()
    _queries_kernel[(n_tiles, c.pairs)](*q_args, c.o, *ids, *c.meta, *c.o_strides(), c.kv_heads,
                                        G=c.G, GP=c.GP, BQ=bq, num_warps=WARPS_LONG, **q_sizes, **c.sizes())
    return c.o
