"""Cache tensors for the executor: Mamba state pages and MLA latent pages.

Block ids from the scheduler can be large (the recorded engine had 262,144), but a
run touches few of them, so physical ids are remapped to dense rows on first use
and the tensors grow by doubling. Row 0 is the null block: never written by a
correct run, and filled with NaN so that reading it shows up in every check.
"""

from __future__ import annotations

import torch


class BlockMap:
    """Physical block id -> dense row (0 for the null block)."""

    def __init__(self):
        self.rows: dict[int, int] = {0: 0}

    def row(self, block: int) -> int:
        r = self.rows.get(block)
        if r is None:
            r = self.rows[block] = len(self.rows)
        return r

    def __len__(self) -> int:
        return len(self.rows)


class PagedTensor:
    """A tensor of pages (dense rows) that grows as new block ids appear; with ``layers`` the
    pages of every layer are stacked, (layers, pages, ...), so one launch can reach them all."""

    def __init__(self, page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, blocks: BlockMap,
                 layers: int | None = None):
        self.page_shape = page_shape
        self.dtype = dtype
        self.device = device
        self.blocks = blocks
        self.lead = () if layers is None else (layers,)
        self.data = torch.full((*self.lead, 8, *page_shape), float("nan"), dtype=dtype, device=device)

    def ensure(self) -> torch.Tensor:
        need = len(self.blocks)
        axis = len(self.lead)
        if need > self.data.shape[axis]:
            cap = self.data.shape[axis]
            while cap < need:
                cap *= 2
            grown = torch.full((*self.lead, cap, *self.page_shape), float("nan"), dtype=self.dtype,
                               device=self.device)
            grown.narrow(axis, 0, self.data.shape[axis]).copy_(self.data)
            self.data = grown
        return self.data


class MambaStateCache:
    """Every Mamba layer's state pages: conv windows (layers, pages, R, dim) and temporal
    states (layers, pages, H, P, N), stacked so a step's copies for all layers are one launch."""

    def __init__(self, layers: int, conv_rows: int, dim: int, temporal_shape: tuple[int, ...],
                 device: torch.device, blocks: BlockMap):
        self.conv = PagedTensor((conv_rows, dim), torch.float32, device, blocks, layers)
        self.temporal = PagedTensor(temporal_shape, torch.float32, device, blocks, layers)
