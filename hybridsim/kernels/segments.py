"""Relative errors of many (got, want) pairs with few launches.

On a GPU the pairs of one row width (a row: everything after the first axis, e.g. one token's heads x
dims) and dtype are reduced in two levels: each row by one Triton launch over a table of every pair's
rows where they lie (``row_stats_triton.table_row_stats``: each element read once, nothing copied),
then the rows' maxima per pair by one segmented reduction; a step's checks are then a few launches.
In torch the per-row reduction took about a dozen passes over float64 working copies (NaN/inf masks,
cleaned copies, differences): 24.5 ms a step of ``deepseek_v3_mooncake``'s oracle on an H200.

On a CPU small pairs are stacked on the row axis (a copy) and reduced the same two levels, and a large
pair (a prefill chunk's outputs) where it lies; ``row_stats_reference`` is the per-row reduction there.
"""

from __future__ import annotations

import torch

from ..device.transfer import upload

LARGE = 1 << 18  # elements: an exact comparison at least this big is decided at once (checked.py)
BATCH = 1 << 24  # elements of one stacked pass (float64 working copies of this many, a few at once)


def specials_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: a and b disagree on NaN, +inf or -inf."""
    return ((torch.isnan(a) != torch.isnan(b)) | (torch.isposinf(a) != torch.isposinf(b))
            | (torch.isneginf(a) != torch.isneginf(b)))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the values differ, or one is NaN/±inf where the other is not (NaN equals NaN)."""
    return (torch.nan_to_num(a, 1.0) != torch.nan_to_num(b, 1.0)) | specials_differ(a, b)


def segment_ids(sizes: list[int], dev) -> torch.Tensor:
    """(sum(sizes),) on ``dev``: element j of segment i is i (for segmented reductions)."""
    return torch.repeat_interleave(upload(list(range(len(sizes))), dev), upload(sizes, dev), output_size=sum(sizes))


def rel_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> torch.Tensor:
    """(n, 3) float64 for n pairs: max |got - want| over finite values, that over max |want|, and
    1.0 where the pair's NaN/inf positions differ (else 0)."""
    dev = got[0].device
    out = torch.zeros(len(got), 3, dtype=torch.float64, device=dev)
    if dev.type == "cuda":
        return _table_errors(got, want, out)
    kinds: dict = {}  # pairs that stack: the same row width and dtypes
    for i, (g, w) in enumerate(zip(got, want)):
        if g.numel() >= LARGE:  # big enough to fill the device alone: reduced where it lies, no copy
            out[i] = _stacked_errors(got, want, [i], g.numel(), dev)[0]
        elif g.numel():
            width = g[0].numel() if g.dim() >= 2 else 1
            kinds.setdefault((width, g.dtype, w.dtype), []).append(i)
    for (width, _, _), idx in kinds.items():
        batch: list[int] = []
        size = 0
        for i in idx:
            if batch and size + got[i].numel() > BATCH:
                out[upload(batch, dev)] = _stacked_errors(got, want, batch, width, dev)
                batch, size = [], 0
            batch.append(i)
            size += got[i].numel()
        out[upload(batch, dev)] = _stacked_errors(got, want, batch, width, dev)
    return out


def _table_errors(got: list[torch.Tensor], want: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``rel_errors`` on a GPU: the pairs of one row width and dtypes reduced by one launch over a table of
    their rows (``row_stats_triton.table_row_stats``: nothing stacked or copied), then each pair's rows
    by one segmented maximum. A step's checks are then a few launches, where a launch a pair took 9.6 ms
    a step of ``deepseek_v3_mooncake`` on an H100 (synced, session 33); the host's work a pair is a few
    attribute reads (its rows' starts in one numpy pass)."""
    from .row_stats_triton import rows_of, table_row_stats  # (Triton only where it runs: importing it sets its mode)
    dev = out.device
    kinds: dict = {}
    for i, (g, w) in enumerate(zip(got, want)):
        n = g.numel()
        if n:  # (a want of another dtype is read as it is: a float64 copy of a prefill chunk's is gigabytes)
            kinds.setdefault((n // g.shape[0] if g.dim() >= 2 else 1, g.dtype, w.dtype), []).append(i)
    for (width, _, _), idx in kinds.items():
        gs = [rows_of(got[i], width) for i in idx]
        ws = [rows_of(want[i] if want[i].device == dev else want[i].to(dev), width) for i in idx]
        out[upload(idx, dev)] = _pair_errors(table_row_stats(gs, ws, width), [g[1] for g in gs], dev)
    return out


def row_stats_reference(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(rows, 3) float64 for g, w (rows, width): per row max |g - w| and max |w| with NaN and
    ±inf read as 0, and 1.0 where the two differ in a NaN, +inf or -inf position (else 0)."""
    specials = specials_differ(g, w).any(-1).double()
    fg, fw = torch.nan_to_num(g, 0.0, 0.0, 0.0), torch.nan_to_num(w, 0.0, 0.0, 0.0)
    return torch.stack([(fg - fw).abs().amax(-1), fw.abs().amax(-1), specials], dim=-1)


def _stacked_errors(got, want, idx: list[int], width: int, dev) -> torch.Tensor:
    """A CPU's reduction of pairs ``idx`` (stacked, or one where it lies)."""
    # (got keeps its dtype: the subtraction promotes to float64 element by element, no copy)
    if len(idx) == 1:  # (a view: nothing copied)
        g, w = got[idx[0]].reshape(-1, width), want[idx[0]].reshape(-1, width).to(dev, torch.float64)
    else:
        g = torch.cat([got[i].reshape(-1, width) for i in idx])
        w = torch.cat([want[i].reshape(-1, width) for i in idx]).to(dev, torch.float64)
    diff = (g - w).abs().amax(-1)
    if bool(diff.max() < float("inf")):
        # the usual case, known at once where reading back costs nothing: every difference is finite, so
        # both sides are (inf - inf and NaN give NaN, inf - x gives inf): no NaN/inf to mask or match
        per_row = torch.stack([diff, w.abs().amax(-1), torch.zeros_like(diff)], dim=-1)
    else:
        per_row = row_stats_reference(g, w)
    return _pair_errors(per_row, [got[i].numel() // width for i in idx], dev)


def _pair_errors(per_row: torch.Tensor, rows: list[int], dev) -> torch.Tensor:
    """Rows' (max |g - w|, max |w|, NaN/inf differ) of consecutive pairs of ``rows`` rows each -> each
    pair's (max |g - w|, that over max |w|, NaN/inf differ): (pairs, 3)."""
    if len(rows) == 1:
        per_pair = per_row.amax(0, keepdim=True)
    else:
        seg = segment_ids(rows, dev)
        per_pair = torch.zeros(len(rows), 3, dtype=torch.float64, device=dev).scatter_reduce_(
            0, seg[:, None].expand(-1, 3), per_row, "amax")
    diff, top, spec = per_pair.unbind(-1)
    return torch.stack([diff, diff / top.clamp_min(1e-30), spec], dim=-1)
