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

import torch

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
    T, H, D = q.shape
    K = k_cache.shape[2]
    G = H // K
    bs = k_cache.shape[1]
    dev = q.device
    qsl = query_start_loc.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    B = len(lens)
    out = torch.empty(T, H, D, dtype=torch.float32, device=dev)
    if T == 0:
        return out
    table = block_table.to(dev, torch.int64)
    width = table.shape[1] * bs
    qlen = [qsl[r + 1] - qsl[r] for r in range(B)]
    limit = key_limit(torch.tensor(lens, dtype=torch.int64), bs, past_end_bug).tolist()
    order = sorted((r for r in range(B) if qlen[r]), key=lambda r: (qlen[r], limit[r]), reverse=True)
    start = 0
    while start < len(order):  # rows batched with padding, scores within SCORE_ELEMS
        mq, mk = qlen[order[start]], min(max(limit[order[start]], 1), width)
        end = start + 1
        while end < len(order) and (end - start + 1) * mq * H * max(mk, min(limit[order[end]], width)) <= SCORE_ELEMS:
            mk = max(mk, min(limit[order[end]], width))
            end += 1
        rows = order[start:end]
        start = end
        r_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        q0 = torch.tensor([qsl[r] for r in rows], dtype=torch.int64, device=dev)
        ql = torch.tensor([qlen[r] for r in rows], dtype=torch.int64, device=dev)
        sl = torch.tensor([lens[r] for r in rows], dtype=torch.int64, device=dev)
        lim = torch.tensor([limit[r] for r in rows], dtype=torch.int64, device=dev)
        t = torch.arange(mq, device=dev)
        tok = q0[:, None] + torch.minimum(t[None, :], ql[:, None] - 1)  # padding repeats the last query
        qq = q[tok].float().view(len(rows), mq, K, G, D)
        kpos = torch.arange(mk, device=dev)
        blocks = table[r_t][:, kpos // bs]  # (b, mk)
        inside = (kpos[None, :] < lim[:, None])[..., None, None]
        # keys past what a row reads may hold anything (NaN pages): zeroed so they weigh nothing
        kk = torch.where(inside, k_cache[blocks, kpos % bs].float(), torch.zeros((), device=dev))
        vv = torch.where(inside, v_cache[blocks, kpos % bs].float(), torch.zeros((), device=dev))
        s = torch.einsum("bqkgd,bnkd->bqkgn", qq, kk) * scale
        qpos = sl[:, None] - ql[:, None] + t[None, :]  # (b, mq)
        visible = kpos[None, None, :] <= qpos[:, :, None]
        if past_end_bug:
            first = ((sl + bs - 1) // bs * bs)[:, None, None]
            visible = visible | ((kpos[None, None, :] >= first) & (kpos[None, None, :] < lim[:, None, None]))
        s = s.masked_fill(~visible[:, :, None, None, :], NEG_INF)
        o = torch.einsum("bqkgn,bnkd->bqkgd", torch.softmax(s, dim=-1), vv).reshape(len(rows), mq, H, D)
        valid = t[None, :] < ql[:, None]
        out[tok[valid]] = o[valid]
    return out
