"""Cache tensors for the executor: Mamba state pages and MLA latent pages.

Block ids come from the scheduler (or a recorded engine) and are remapped to dense rows
on first use; every tensor is allocated once, at its planned size (``cache.num_blocks``
rows), before the first step — ``engine/memory.py`` adds them up first. Row 0 is the null
block: never written by a correct run, and filled with NaN (as is every page nothing has
written yet) so that reading it shows up in every check.
"""

from __future__ import annotations

import torch

from ..errors import InputError


class BlockMap:
    """Physical block id -> dense row (0 for the null block), at most ``capacity`` rows."""

    def __init__(self, capacity: int):
        self.rows: dict[int, int] = {0: 0}
        self.capacity = capacity

    def row(self, block: int) -> int:
        r = self.rows.get(block)
        if r is None:
            if len(self.rows) >= self.capacity:
                raise InputError(f"more distinct block ids than cache.num_blocks ({self.capacity}): block {block} "
                                 "has no page")
            r = self.rows[block] = len(self.rows)
        return r

    def __len__(self) -> int:
        return len(self.rows)


class PagedTensor:
    """``capacity`` NaN-filled pages of ``page_shape``; with ``slots`` the pages of every slot are
    stacked, (slots, pages, ...), so one launch can reach them all."""

    def __init__(self, page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, capacity: int,
                 slots: int | None = None):
        self.page_shape = page_shape
        lead = () if slots is None else (slots,)
        self.data = torch.full((*lead, capacity, *page_shape), float("nan"), dtype=dtype, device=device)


class MambaStateCache:
    """Every Mamba state page: conv windows (slots, pages, R, dim) and temporal states
    (slots, pages, H, P, N), float32 (the probe's residues are exact in it). A slot is shared
    by the i-th layers of every Mamba group, as the engine shares its KV-cache tensors."""

    def __init__(self, slots: int, conv_rows: int, dim: int, temporal_shape: tuple[int, ...],
                 device: torch.device, blocks: BlockMap):
        self.conv = PagedTensor((conv_rows, dim), torch.float32, device, blocks.capacity, slots)
        self.temporal = PagedTensor(temporal_shape, torch.float32, device, blocks.capacity, slots)
