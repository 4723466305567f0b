"""Relative errors of many (got, want) pairs with few launches.

Small pairs (decode rows, merge outputs) are flattened into one vector and reduced per
segment in one pass; a reduction into few segments from millions of elements would
serialise on atomics, so large pairs (prefill rows) are reduced one by one — each is
big enough to fill the device by itself.
"""

from __future__ import annotations

import torch

from ..engine.transfer import upload

LARGE = 1 << 18  # elements: a pair at least this big is reduced on its own


def specials_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: a and b disagree on NaN, +inf or -inf."""
    return ((torch.isnan(a) != torch.isnan(b)) | (torch.isposinf(a) != torch.isposinf(b))
            | (torch.isneginf(a) != torch.isneginf(b)))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the values differ, or one is NaN/±inf where the other is not (NaN equals NaN)."""
    return (torch.nan_to_num(a, 1.0) != torch.nan_to_num(b, 1.0)) | specials_differ(a, b)


def _errors(g: torch.Tensor, w: torch.Tensor, reduce) -> torch.Tensor:
    specials = specials_differ(g, w).double()
    fg, fw = torch.nan_to_num(g, 0.0, 0.0, 0.0), torch.nan_to_num(w, 0.0, 0.0, 0.0)
    diff = reduce((fg - fw).abs())
    return torch.stack([diff, diff / reduce(fw.abs()).clamp_min(1e-30), reduce(specials)], dim=-1)


def rel_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> torch.Tensor:
    """(n, 3) float64 for n pairs: max |got - want| over finite values, that over max |want|, and
    1.0 where the pair's NaN/inf positions differ (else 0)."""
    dev = got[0].device
    out = torch.zeros(len(got), 3, dtype=torch.float64, device=dev)
    small = [i for i, g in enumerate(got) if g.numel() < LARGE]
    for i in (i for i, g in enumerate(got) if g.numel() >= LARGE):
        out[i] = _errors(got[i].double(), want[i].double(), lambda v: v.amax())
    if small:
        g = torch.cat([got[i].reshape(-1).double() for i in small])
        w = torch.cat([want[i].reshape(-1).to(dev, torch.float64) for i in small])
        seg = torch.repeat_interleave(upload(list(range(len(small))), dev),
                                      upload([got[i].numel() for i in small], dev), output_size=g.numel())
        n = len(small)

        def reduce(v: torch.Tensor) -> torch.Tensor:
            return torch.zeros(n, dtype=v.dtype, device=dev).scatter_reduce(0, seg, v, "amax", include_self=True)

        out[upload(small, dev)] = _errors(g, w, reduce)
    return out
