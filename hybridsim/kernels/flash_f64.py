"""Pieces the float64 attention kernels share (``dense_attention_f64``: the GQA oracle, keys
projected inside it or, for long rows, once into a workspace; ``latent_attention_f64``: the MLA
oracle, keys in memory): where a tile's row and queries are, and the running softmax of flash
attention."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_of_tile(t, tile_row, tile_q0, q_start, q_len, k_start, pos0):
    """Tile t's row r and first query i0, and the row's first query slot, query count, first key
    slot and first query position: (r, i0, qs, ql, ks, p0)."""
    r = tl.load(tile_row + t)
    return (r, tl.load(tile_q0 + t), tl.load(q_start + r), tl.load(q_len + r), tl.load(k_start + r),
            tl.load(pos0 + r))


@triton.jit
def softmax_block(s, m_i, l_i):
    """A key block's scores s (rows x keys) folded into the running maximum m_i and sum l_i:
    (new maximum, the factor earlier partial sums take, the block's weights, new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)
