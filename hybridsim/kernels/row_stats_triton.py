"""``segments.row_stats_reference`` as one Triton pass: each row of (got, want) read once, its
max |got - want| and max |want| (NaN and ±inf read as 0) and whether their NaN/±inf positions
differ, in float64. A program takes a piece of a row (``PIECE`` elements, more where a row would need
over 65,535 pieces: a large pair arrives as one row of millions), and the pieces' maxima are reduced
in torch; addresses are int64."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PIECE = 8192  # elements of a row one program reduces (a 16 M-element row: 2,048 programs)
BLOCK = 1024
MAX_PIECES = 65535  # (the grid's second axis)


@triton.jit
def _row_stats_kernel(g, w, out, width, g_row, w_row, piece_len, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """One program a piece of a row: ``row_stats_reference`` over it in one pass (float64 arithmetic),
    into out (rows, pieces, 3)."""
    r = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1).to(tl.int64)
    inf = float("inf")
    diff = tl.zeros([BLOCK], tl.float64)
    top = tl.zeros([BLOCK], tl.float64)
    special = tl.zeros([BLOCK], tl.int32)
    for c0 in range(piece * piece_len, tl.minimum(width, (piece + 1) * piece_len), BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < width
        gv = tl.load(g + r * g_row + c, mask=m, other=0.0)
        if not WIDE:  # (half precision through float32: some builds convert it to float64 no other way)
            gv = gv.to(tl.float32)
        gv = gv.to(tl.float64)
        wv = tl.load(w + r * w_row + c, mask=m, other=0.0)
        special |= (((gv != gv) != (wv != wv)) | ((gv == inf) != (wv == inf))
                    | ((gv == -inf) != (wv == -inf))).to(tl.int32)
        g0 = tl.where((gv == gv) & (tl.abs(gv) != inf), gv, 0.0)
        w0 = tl.where((wv == wv) & (tl.abs(wv) != inf), wv, 0.0)
        diff = tl.maximum(diff, tl.abs(g0 - w0))
        top = tl.maximum(top, tl.abs(w0))
    at = out + (r * tl.num_programs(1) + piece) * 3
    tl.store(at, tl.max(diff, axis=0))
    tl.store(at + 1, tl.max(top, axis=0))
    tl.store(at + 2, tl.max(special, axis=0).to(tl.float64))


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
