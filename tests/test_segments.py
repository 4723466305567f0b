"""rel_errors (stacked, two-level reductions) against the per-pair definition."""

from __future__ import annotations

import pytest
import torch

from hybridsim.kernels import segments
from hybridsim.kernels.segments import rel_errors


def _one(g: torch.Tensor, w: torch.Tensor) -> list[float]:
    g, w = g.double().reshape(-1), w.double().reshape(-1)
    special = bool(((g.isnan() != w.isnan()) | (g.isposinf() != w.isposinf()) | (g.isneginf() != w.isneginf())).any())
    fg, fw = torch.nan_to_num(g, 0.0, 0.0, 0.0), torch.nan_to_num(w, 0.0, 0.0, 0.0)
    diff = float((fg - fw).abs().max()) if g.numel() else 0.0
    top = float(fw.abs().max()) if g.numel() else 0.0
    return [diff, diff / max(top, 1e-30), float(special)]


@pytest.mark.parametrize("batch,large", [(1 << 24, 1 << 18), (50, 1 << 18), (1 << 24, 20)])
def test_rel_errors_equal_the_per_pair_definition(monkeypatch, batch, large):
    """50: many stacked passes and pairs larger than a pass alone; 20: many pairs reduced alone."""
    monkeypatch.setattr(segments, "BATCH", batch)
    monkeypatch.setattr(segments, "LARGE", large)
    gen = torch.Generator().manual_seed(3)
    got, want = [], []
    for k in range(40):
        shape = [(int(torch.randint(0, 9, (1,), generator=gen)), 4, 3), (int(torch.randint(1, 30, (1,), generator=gen)),),
                 (2, 5), ()][k % 4]
        w = torch.randn(shape, generator=gen, dtype=torch.float64)
        g = (w + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)).float() if k % 3 else w.float()
        if k % 7 == 0 and g.numel():
            g.view(-1)[0] = float("nan")
        if k % 11 == 0 and g.numel():
            g.view(-1)[-1] = float("inf")
            w.view(-1)[-1] = float("inf")
        got.append(g)
        want.append(w)
    res = rel_errors(got, want).tolist()
    assert res == [_one(g, w) for g, w in zip(got, want)]
    assert any(r[2] == 1.0 for r in res) and any(r[0] > 0 for r in res)
