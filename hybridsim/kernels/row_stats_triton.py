"""``segments.row_stats_reference`` as one Triton pass: each row of (got, want) read once, its
max |got - want| and max |want| (NaN and ±inf read as 0) and whether their NaN/±inf positions
differ, in float64. A program takes a piece of a row (``PIECE`` elements, more where a row would need
over 65,535 pieces: a large pair arrives as one row of millions), and the pieces' maxima are reduced
in torch; addresses are int64."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

PIECE = 8192  # elements of a row one program reduces (a 16 M-element row: 2,048 programs)
BLOCK = 1024
MAX_PIECES = 65535  # (the grid's second axis)


@triton.jit
def _float64(x, WIDE: tl.constexpr):
    """x in float64, exactly (half precision through float32: some builds convert it to float64 no other way)."""
    if not WIDE:
        x = x.to(tl.float32)
    return x.to(tl.float64)


@triton.jit
def _piece_stats(gp, wp, start, stop, BLOCK: tl.constexpr, WIDE: tl.constexpr, W_WIDE: tl.constexpr):
    """``row_stats_reference`` over elements start..stop-1 of one row (gp, wp: the row's first elements)
    in one pass, float64 arithmetic: (max |g - w|, max |w|, whether the NaN/±inf positions differ)."""
    inf = float("inf")
    diff = tl.zeros([BLOCK], tl.float64)
    top = tl.zeros([BLOCK], tl.float64)
    special = tl.zeros([BLOCK], tl.int32)
    for c0 in range(start, stop, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < stop
        gv = _float64(tl.load(gp + c, mask=m, other=0.0), WIDE)
        wv = _float64(tl.load(wp + c, mask=m, other=0.0), W_WIDE)
        special |= (((gv != gv) != (wv != wv)) | ((gv == inf) != (wv == inf))
                    | ((gv == -inf) != (wv == -inf))).to(tl.int32)
        g0 = tl.where((gv == gv) & (tl.abs(gv) != inf), gv, 0.0)
        w0 = tl.where((wv == wv) & (tl.abs(wv) != inf), wv, 0.0)
        diff = tl.maximum(diff, tl.abs(g0 - w0))
        top = tl.maximum(top, tl.abs(w0))
    return tl.max(diff, axis=0), tl.max(top, axis=0), tl.max(special, axis=0).to(tl.float64)


@triton.jit
def _store_stats(out, r, piece, stats):
    at = out + (r * tl.num_programs(1) + piece) * 3
    tl.store(at, stats[0])
    tl.store(at + 1, stats[1])
    tl.store(at + 2, stats[2])


@triton.jit
def _row_stats_kernel(g, w, out, width, g_row, w_row, piece_len, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """One program a piece of a row of strided (rows, width) tensors, into out (rows, pieces, 3)."""
    r = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1).to(tl.int64)
    stop = tl.minimum(width, (piece + 1) * piece_len)
    _store_stats(out, r, piece, _piece_stats(g + r * g_row, w + r * w_row, piece * piece_len, stop, BLOCK, WIDE, True))


@triton.jit
def _table_rows_kernel(g, w, g_at, w_at, out, width, piece_len, BLOCK: tl.constexpr, WIDE: tl.constexpr,
                       W_WIDE: tl.constexpr, G_ALIGN: tl.constexpr, W_ALIGN: tl.constexpr):
    """One program a piece of row program_id(0) of a table of rows: the row starts g_at[r] elements
    from g and w_at[r] from w (other tensors' rows, reached from the first one's pointer; multiples of
    G_ALIGN and W_ALIGN elements: 16 bytes where every row allows, so the loads stay wide)."""
    r = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1).to(tl.int64)
    g0 = tl.multiple_of(tl.load(g_at + r), G_ALIGN)
    w0 = tl.multiple_of(tl.load(w_at + r), W_ALIGN)
    stop = tl.minimum(width, (piece + 1) * piece_len)
    _store_stats(out, r, piece, _piece_stats(g + g0, w + w0, piece * piece_len, stop, BLOCK, WIDE, W_WIDE))


def split(width: int) -> tuple[int, int]:
    """A row's piece length (a multiple of ``BLOCK``, at least ``PIECE``) and its number of pieces
    (1 to ``MAX_PIECES``)."""
    piece_len = max(PIECE, triton.cdiv(triton.cdiv(width, MAX_PIECES), BLOCK) * BLOCK)
    return piece_len, max(1, triton.cdiv(width, piece_len))


def row_stats(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``row_stats_reference`` in one Triton launch (a GPU, or the interpreter). g: (rows, width) of
    float64, float32, float16 or bfloat16 (each is exact in float32, then float64); w float64."""
    assert w.dtype == torch.float64 and g.shape == w.shape and g.dim() == 2
    g, w = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, w))
    piece_len, pieces = split(g.shape[1])
    out = torch.empty(g.shape[0], pieces, 3, dtype=torch.float64, device=g.device)
    if g.shape[0]:
        _row_stats_kernel[(g.shape[0], pieces)](g, w, out, g.shape[1], g.stride(0), w.stride(0), piece_len,
                                                BLOCK=BLOCK, WIDE=g.dtype == torch.float64, num_warps=4)
    return out[:, 0] if pieces == 1 else out.amax(1)


Rows = tuple[torch.Tensor, int, int]  # a tensor read as rows: (it, how many rows, elements from one row to the next)


def rows_of(t: torch.Tensor, width: int) -> Rows:
    """t read as rows of ``width`` contiguous elements, for ``table_row_stats``: t itself where it is
    contiguous (no new tensor: a step checks hundreds of pairs, and each costs the host time), else a
    view, or a copy where the rows are not contiguous."""
    if t.is_contiguous():
        return t, t.numel() // width, width
    r = t.reshape(-1, width)
    if width > 1 and r.stride(1) != 1:
        r = r.contiguous()
    return r, r.shape[0], r.stride(0)


def _row_starts(parts: list[Rows]) -> tuple[np.ndarray, int]:
    """Each part's rows' first elements, in elements from the first part's (int64), and the largest power
    of two up to 16 bytes dividing them all."""
    first = parts[0][0]
    base, size = first.data_ptr(), first.element_size()
    n = len(parts)
    off = np.fromiter(((t.data_ptr() - base) // size for t, _, _ in parts), np.int64, n)
    rows = np.fromiter((r for _, r, _ in parts), np.int64, n)
    step = np.fromiter((st for _, _, st in parts), np.int64, n)
    k = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
    at = np.repeat(off, rows) + k * np.repeat(step, rows)
    align = 16 // size
    while align > 1 and (base % 16 or (at % align).any()):
        align //= 2
    return at, align


def table_row_stats(got: list[Rows], want: list[Rows], width: int) -> torch.Tensor:
    """``row_stats`` of many pairs in one launch, nothing copied: got[i], want[i] the same number of rows
    of ``width`` elements (``rows_of``), got all of one dtype and want all of one (each read in float64
    exactly, as ``row_stats`` reads got), all on one device. Returns (sum of the rows, 3) float64, pair
    after pair."""
    from ..device.transfer import upload_many
    g0, w0 = got[0][0], want[0][0]
    assert width > 0 and all(g[1] == w[1] and g[0].dtype == g0.dtype and w[0].dtype == w0.dtype
                             for g, w in zip(got, want))
    assert all(x.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16) for x in (g0, w0))
    rows = sum(g[1] for g in got)
    piece_len, pieces = split(width)
    out = torch.empty(rows, pieces, 3, dtype=torch.float64, device=g0.device)
    if rows:
        (g_at, g_align), (w_at, w_align) = _row_starts(got), _row_starts(want)
        g_at_d, w_at_d = upload_many([g_at, w_at], g0.device)
        _table_rows_kernel[(rows, pieces)](g0, w0, g_at_d, w_at_d, out, width, piece_len, BLOCK=BLOCK,
                                           WIDE=g0.dtype == torch.float64, W_WIDE=w0.dtype == torch.float64,
                                           G_ALIGN=g_align, W_ALIGN=w_align, num_warps=4)
    return out[:, 0] if pieces == 1 else out.amax(1)
