"""Per-step attention metadata as an engine builds it: batch order, query_start_loc,
seq_lens, and the Mamba2 chunk metadata for prefill rows (seed 000).

Rows are reordered decodes first (query length <= 1 + num_speculative_tokens, with
state), then prefills. Chunk metadata is built two independent ways: per request
from its computed-token count (``chunk_metadata``), and from boundaries on the packed
token axis (``chunk_metadata_varlen``); the ``mamba.chunk_meta`` check compares them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BatchMeta:
    order: list[int]  # plan row index per batch row
    num_decodes: int
    query_start_loc: np.ndarray  # (rows + 1,)
    seq_lens: np.ndarray  # (rows,)
    computed: np.ndarray  # (rows,)


def build_batch(rows: list[tuple[int, int, int]], num_spec: int) -> BatchMeta:
    """rows: (computed tokens, scheduled tokens, drafts) per plan row."""
    decode = [i for i, (c, n, d) in enumerate(rows) if c > 0 and n <= 1 + num_spec and (d > 0 or n == 1)]
    dset = set(decode)
    order = decode + [i for i in range(len(rows)) if i not in dset]
    q = np.array([rows[i][1] for i in order], dtype=np.int64)
    c = np.array([rows[i][0] for i in order], dtype=np.int64)
    qsl = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    return BatchMeta(order, len(decode), qsl, c + q, c)


def chunk_metadata(computed: list[int], query_start_loc: list[int], chunk_size: int,
                   bug_cross_boundary: bool = False):
    """Per prefill row: a first chunk finishing a partly filled chunk, then whole chunks.

    Returns (cu_chunk_seqlen, seq_idx, last_chunk_indices).
    """
    cu, seq_idx, last = [], [], []
    pos = 0
    for r, c0 in enumerate(computed):
        left = query_start_loc[r + 1] - query_start_loc[r]
        if c0 % chunk_size and not bug_cross_boundary:
            first = min(-(-c0 // chunk_size) * chunk_size - c0, left)
            seq_idx.append(r)
            cu.append(pos)
            pos += first
            left -= first
        while left > 0:
            seq_idx.append(r)
            cu.append(pos)
            take = min(chunk_size, left)
            pos += take
            left -= take
        last.append(len(cu) - 1)
    cu.append(pos)
    return cu, seq_idx, last


def chunk_metadata_varlen(computed: list[int], query_start_loc: list[int], chunk_size: int):
    """The same chunks from token boundaries: a chunk starts at every sequence start and at
    every token whose absolute position is a multiple of ``chunk_size``."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    total = int(qsl[-1])
    if total == 0:
        return [0], [], [-1] * (len(qsl) - 1)
    row = np.searchsorted(qsl, np.arange(total), side="right") - 1
    abs_pos = np.asarray(computed, dtype=np.int64)[row] + (np.arange(total) - qsl[row])
    starts = (np.arange(total) == qsl[row]) | (abs_pos % chunk_size == 0)
    cu = np.flatnonzero(starts)
    seq_idx = row[cu]
    last = [int(np.flatnonzero(seq_idx == r)[-1]) if (seq_idx == r).any() else -1 for r in range(len(qsl) - 1)]
    return cu.tolist() + [total], seq_idx.tolist(), last
