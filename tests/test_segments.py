"""rel_errors (stacked, two-level reductions) against the per-pair definition, and its per-row
reduction as a Triton kernel (``row_stats_triton``) against the torch one."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels import segments  # noqa: E402
from hybridsim.kernels.row_stats_triton import row_stats  # noqa: E402
from hybridsim.kernels.segments import rel_errors, row_stats_reference  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")


def _one(g: torch.Tensor, w: torch.Tensor) -> list[float]:
    g, w = g.double().reshape(-1), w.double().reshape(-1)
    special = bool(((g.isnan() != w.isnan()) | (g.isposinf() != w.isposinf()) | (g.isneginf() != w.isneginf())).any())
    fg, fw = torch.nan_to_num(g, 0.0, 0.0, 0.0), torch.nan_to_num(w, 0.0, 0.0, 0.0)
    diff = float((fg - fw).abs().max()) if g.numel() else 0.0
    top = float(fw.abs().max()) if g.numel() else 0.0
    return [diff, diff / max(top, 1e-30), float(special)]


def _mixed_pairs(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """40 pairs of mixed shapes (empty, 1-D, 2-D, 3-D, 0-d), NaN and ±inf on one side or both."""
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
        got.append(g.to(device))
        want.append(w.to(device))
    return got, want


def _pairs_errors(monkeypatch, batch: int, large: int, device: str) -> None:
    monkeypatch.setattr(segments, "BATCH", batch)
    monkeypatch.setattr(segments, "LARGE", large)
    got, want = _mixed_pairs(device)
    res = rel_errors(got, want).tolist()
    assert res == [_one(g.cpu(), w.cpu()) for g, w in zip(got, want)]
    assert any(r[2] == 1.0 for r in res) and any(r[0] > 0 for r in res)


def _viewed_pairs(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pairs that are views: rows starting off 16-byte boundaries (one element into a buffer), rows with
    a stride (every other row of a buffer), rows not contiguous (a transpose: copied), widths of one."""
    gen = torch.Generator().manual_seed(9)
    big_w = torch.randn(4000, generator=gen, dtype=torch.float64)
    big_g = (big_w + 1e-4 * torch.randn(4000, generator=gen, dtype=torch.float64)).float()
    big_g[17] = float("nan")
    want = [big_w[1:61].view(5, 4, 3), big_w[100:400].view(30, 10)[::2], big_w[500:530].view(5, 6).t(),
            big_w[700:707], big_w[800:1400].view(3, 200)]
    got = [big_g[1:61].view(5, 4, 3), big_g[100:400].view(30, 10)[::2], big_g[500:530].view(5, 6).t(),
           big_g[700:707], big_g[800:1400].view(3, 200)]
    return [g.to(device) if device != "cpu" else g for g in got], [w.to(device) if device != "cpu" else w for w in want]


@INTERPRETER
def test_table_errors_equal_the_per_pair_definition():
    """The GPU's path under the interpreter: every pair's rows reduced by one launch over a table of
    where they lie (shifted, strided, transposed views among them), then per pair."""
    got, want = _viewed_pairs("cpu")
    res = segments._table_errors(got, want, torch.full((len(got), 3), float("nan"), dtype=torch.float64)).tolist()
    assert res == [_one(g, w) for g, w in zip(got, want)]
    assert res[0][2] == 1.0 and all(r[0] > 0 for r in res[1:])
    got, want = _mixed_pairs("cpu")  # the stacked path's pairs, through the table
    res = segments._table_errors(got, want, torch.zeros(len(got), 3, dtype=torch.float64)).tolist()
    assert res == [_one(g, w) for g, w in zip(got, want)]
    # wants of other dtypes (a path's float32 outputs, half-precision ones) are read as they are, exactly
    narrow = [w.to(dt) for w, dt in zip(want, [torch.float32, torch.bfloat16, torch.float16, torch.float32] * 10)]
    res = segments._table_errors(got, narrow, torch.zeros(len(got), 3, dtype=torch.float64)).tolist()
    assert res == [_one(g, w) for g, w in zip(got, narrow)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_rel_errors_on_the_gpu_over_views():
    got, want = _viewed_pairs("cuda")
    assert rel_errors(got, want).tolist() == [_one(g.cpu(), w.cpu()) for g, w in zip(got, want)]


@pytest.mark.parametrize("batch,large", [(1 << 24, 1 << 18), (50, 1 << 18), (1 << 24, 20)])
def test_rel_errors_equal_the_per_pair_definition(monkeypatch, batch, large):
    """50: many stacked passes and pairs larger than a pass alone; 20: many pairs reduced alone."""
    _pairs_errors(monkeypatch, batch, large, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,large", [(1 << 24, 1 << 18), (50, 1 << 18), (1 << 24, 20)])
def test_rel_errors_on_the_gpu_equal_the_per_pair_definition(monkeypatch, batch, large):
    """The GPU's path: every pair's rows by the Triton kernel over a table of rows (the stacked path's
    limits do not apply there: nothing is stacked)."""
    _pairs_errors(monkeypatch, batch, large, "cuda")


def _rows(dtype, rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """want (float64) and got near it in dtype, with NaN and ±inf sprinkled on both sides: some
    where both agree, some where only one side has them, some rows clean."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, width, generator=gen, dtype=torch.float64) * 100
    g = (w + torch.randn(rows, width, generator=gen, dtype=torch.float64)).to(dtype)
    for value in (float("nan"), float("inf"), float("-inf")):
        for side in ((g,), (w,), (g, w)):
            r, c = (int(x) for x in torch.randint(0, rows, (1,), generator=gen).tolist() + torch.randint(
                0, width, (1,), generator=gen).tolist())
            for t in side:
                t[r, c] = value
    return g, w


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("width", [1, 700, 2500, 20000])  # one element; a ragged block; blocks; pieces of a row
def test_row_stats_kernel_equals_the_torch_reduction(monkeypatch, dtype, width):
    """Exact: a maximum of exactly computed float64 differences is the same whatever the order; the
    output poisoned first (a row left unwritten shows)."""
    _row_stats_case(monkeypatch, dtype, width, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("width", [1, 700, 2500, 16384, 40000])
def test_row_stats_kernel_on_the_gpu(monkeypatch, dtype, width):
    _row_stats_case(monkeypatch, dtype, width, "cuda")


@INTERPRETER
def test_row_stats_kernel_with_longer_pieces(monkeypatch):
    """A row that would need more pieces than the grid's axis allows takes longer pieces."""
    from hybridsim.kernels import row_stats_triton
    monkeypatch.setattr(row_stats_triton, "MAX_PIECES", 2)
    assert row_stats_triton.split(20000) == (10240, 2)
    _row_stats_case(monkeypatch, torch.bfloat16, 20000, "cpu")
    monkeypatch.setattr(row_stats_triton, "MAX_PIECES", 65535)
    for width in (1, 8192, 8193, 1 << 29, (1 << 29) + 1, 3 << 30):
        piece_len, pieces = row_stats_triton.split(width)
        assert piece_len % row_stats_triton.BLOCK == 0 and piece_len >= row_stats_triton.PIECE
        assert 1 <= pieces <= 65535 and (pieces - 1) * piece_len < width <= pieces * piece_len


def _row_stats_case(monkeypatch, dtype, width: int, device: str) -> None:
    g, w = _rows(dtype, 37 if width < 5000 or device != "cpu" else 7, width, seed=width)  # (the interpreter is slow)
    g, w = g.to(device), w.to(device)
    want = row_stats_reference(g, w)
    with monkeypatch.context() as m:
        empty = torch.empty
        m.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
        got = row_stats(g, w)
    assert torch.equal(got, want)
    assert want[:, 2].sum() > 0 and (want[:, 2] == 0).any()  # rows with differing specials and rows without
    # a strided view (every other column) reads what it is given
    assert torch.equal(row_stats(g[:, ::2], w[:, ::2]), row_stats_reference(g[:, ::2], w[:, ::2]))

