"""``segments.row_stats_reference`` as one Triton pass: each row of (got, want) read once, its
max |got - want| and max |want| (NaN and ±inf read as 0) and whether their NaN/±inf positions
differ, in float64. A program takes a piece of a row (``PIECE`` elements: a large pair arrives as one
row of millions), its maxima are reduced over the pieces in torch; addresses are int64."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PIECE = 8192  # elements of a row one program reduces (a 16 M-element row: 2,048 programs)
BLOCK = 1024


@triton.jit
def _row_stats_kernel(g, w, out, width, g_row, w_row, PIECE: tl.constexpr, BLOCK: tl.constexpr,
                      WIDE: tl.constexpr):
    """One program a piece of a row: ``row_stats_reference`` over it in one pass (float64 arithmetic),
    into out (rows, pieces, 3)."""
    r = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    inf = float("inf")
    diff = tl.zeros([BLOCK], tl.float64)
    top = tl.zeros([BLOCK], tl.float64)
    special = tl.zeros([BLOCK], tl.int32)
    for c0 in range(piece * PIECE, tl.minimum(width, (piece + 1) * PIECE), BLOCK):
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


def row_stats(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``row_stats_reference`` in one Triton launch (a GPU, or the interpreter). g: (rows, width) of
    float64, float32, float16 or bfloat16 (each is exact in float32, then float64); w float64."""
    assert w.dtype == torch.float64 and g.shape == w.shape and g.dim() == 2
    g, w = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, w))
    pieces = max(1, triton.cdiv(g.shape[1], PIECE))
    out = torch.empty(g.shape[0], pieces, 3, dtype=torch.float64, device=g.device)
    if g.shape[0]:
        _row_stats_kernel[(g.shape[0], pieces)](g, w, out, g.shape[1], g.stride(0), w.stride(0), PIECE=PIECE,
                                                BLOCK=BLOCK, WIDE=g.dtype == torch.float64, num_warps=4)
    return out[:, 0] if pieces == 1 else out.amax(1)
