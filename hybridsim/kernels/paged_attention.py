"""Paged GQA attention in plain torch: the semantics the Triton kernels must match.

Layout as the engines keep it: one K and one V cache per layer, ``(num_blocks, block_size,
kv_heads, head_dim)`` each (any page stride: a page may live inside a larger shared page).
A step's queries are packed on one token axis; row r owns tokens
``query_start_loc[r]:query_start_loc[r+1]`` and has ``seq_lens[r]`` keys in its block row,
its queries being the last ones (bottom-right causal: query t of a row of q queries sits at
position ``seq_len - q + t`` and sees keys up to there). That one rule covers prefill
chunks over cached context, decodes and speculative verification rows.

Lengths are host tensors: the launch grid of a kernel depends on them.
"""

from __future__ import annotations

import numpy as np
import torch

from ..device.transfer import upload_many
from .batching import worth_merging

NEG_INF = float("-inf")
SCORE_ELEMS = 1 << 25  # the reference materialises scores of at most this many elements at once


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> None:
    """Write key/value (n, kv_heads, D) of n tokens at slots (n,) = block * block_size + offset."""
    bs = k_cache.shape[1]
    s = slots.to(k_cache.device, torch.int64)
    blk, off = s // bs, s % bs
    k_cache[blk, off] = key.to(k_cache.device, k_cache.dtype)
    v_cache[blk, off] = value.to(v_cache.device, v_cache.dtype)


def key_limit(seq_len: torch.Tensor, block_size: int, past_end_bug: bool) -> torch.Tensor:
    """Keys a row reads: its sequence; with the injected bug also the whole next table column."""
    if not past_end_bug:
        return seq_len
    return (seq_len + block_size - 1) // block_size * block_size + block_size


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    past_end_bug: bool = False) -> torch.Tensor:
    """q (T, heads, D) -> out (T, heads, D) float32, computed in float32 from the cache's values.

    ``past_end_bug`` (an injectable bug): every row also attends to the keys of the table
    column after its last block, as a decode path whose loop runs one block too far would.
    """
    return paged_attention_layers([q], [(k_cache, v_cache)], block_table, query_start_loc, seq_lens, scale,
                                  past_end_bug)[0]


def paged_attention_layers(qs: list[torch.Tensor], caches: list[tuple[torch.Tensor, torch.Tensor]],
                           block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, past_end_bug: bool = False) -> list[torch.Tensor]:
    """``paged_attention`` of several layers that share the rows and the block table (the layers
    of one KV-cache group in a step): layer l's queries ``qs[l]`` over its caches ``caches[l]``.
    Every index is built once on the host and the layers go through each product together. Rows
    share a padded batch within ``SCORE_ELEMS``; on a CPU only where that costs less than apart
    (``kernels/batching.py``)."""
    L = len(qs)
    T, H, D = qs[0].shape
    K = caches[0][0].shape[2]
    G = H // K
    bs = caches[0][0].shape[1]
    dev = qs[0].device
    qsl = query_start_loc.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    B = len(lens)
    out = torch.empty(L, T, H, D, dtype=torch.float32, device=dev)
    if T == 0:
        return list(out)
    table = block_table.to(dev, torch.int64)
    width = table.shape[1] * bs
    qlen = [qsl[r + 1] - qsl[r] for r in range(B)]
    limit = key_limit(torch.tensor(lens, dtype=torch.int64), bs, past_end_bug).tolist()
    order = sorted((r for r in range(B) if qlen[r]), key=lambda r: (qlen[r], limit[r]), reverse=True)
    q_all = torch.stack(qs) if L > 1 else qs[0][None]
    qsl_h, qlen_h, lens_h, limit_h = (np.asarray(v, dtype=np.int64) for v in (qsl, qlen, lens, limit))
    work_bound = dev.type == "cpu"
    elems = lambda b, q, n: b * n * L * (q * H + 2 * K * D)  # noqa: E731  (scores, and each row's K and V)
    start = 0
    while start < len(order):  # rows batched with padding, scores within SCORE_ELEMS
        mq, mk = qlen[order[start]], min(max(limit[order[start]], 1), width)
        end = start + 1
        while end < len(order):
            q2, k2 = qlen[order[end]], min(max(limit[order[end]], 1), width)
            b, mk2 = end - start + 1, max(mk, k2)
            if L * b * mq * H * mk2 > SCORE_ELEMS:
                break
            if work_bound and not worth_merging(elems(b, mq, mk2), elems(b - 1, mq, mk) + elems(1, q2, k2),
                                                L * b * mq * H * mk2):
                break
            mk = mk2
            end += 1
        rows = np.asarray(order[start:end], dtype=np.int64)
        start = end
        b = len(rows)
        ql = qlen_h[rows]
        t = np.arange(mq)
        valid = t[None, :] < ql[:, None]  # (b, mq)
        tok = qsl_h[rows][:, None] + np.minimum(t[None, :], ql[:, None] - 1)  # padding: the last query
        # one upload: rows, their lengths and limits, the queries' tokens, where valid outputs go
        r_t, ql_t, sl, lim, tok_t, src, dst = upload_many(
            [rows, ql, lens_h[rows], limit_h[rows], tok.reshape(-1), np.flatnonzero(valid.reshape(-1)), tok[valid]],
            dev)
        qq = q_all[:, tok_t].float().view(L, b, mq, K, G, D)
        kpos_t = torch.arange(mk, device=dev)
        blocks = table[r_t][:, kpos_t // bs]  # (b, mk)
        inside = (kpos_t[None, :] < lim[:, None])[None, ..., None, None]
        # keys past what a row reads may hold anything (NaN pages): zeroed so they weigh nothing
        zero = torch.zeros((), device=dev)
        kk = torch.where(inside, torch.stack([kc[blocks, kpos_t % bs] for kc, _ in caches]).float(), zero)
        vv = torch.where(inside, torch.stack([vc[blocks, kpos_t % bs] for _, vc in caches]).float(), zero)
        s = torch.einsum("lbqkgd,lbnkd->lbqkgn", qq, kk) * scale
        tq = torch.arange(mq, device=dev)
        qpos = sl[:, None] - ql_t[:, None] + tq[None, :]  # (b, mq)
        visible = kpos_t[None, None, :] <= qpos[:, :, None]
        if past_end_bug:
            first = ((sl + bs - 1) // bs * bs)[:, None, None]
            visible = visible | ((kpos_t[None, None, :] >= first) & (kpos_t[None, None, :] < lim[:, None, None]))
        s = s.masked_fill(~visible[None, :, :, None, None, :], NEG_INF)
        o = torch.einsum("lbqkgn,lbnkd->lbqkgd", torch.softmax(s, dim=-1), vv).reshape(L, b * mq, H, D)
        out[:, dst] = o[:, src]
    return list(out)
