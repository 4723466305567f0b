"""Cache tensors for the executor: Mamba state pages, attention K/V pages, MLA latent pages.

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


def block_table(plan, reqs, blocks: BlockMap, group: int, block_size: int, pad_cols: int = 0) -> torch.Tensor:
    """A step's block table of one group as cache rows (host, int64): a row per scheduled request,
    the columns its computed and scheduled tokens cover, padded with the null row (0) to the
    longest row plus ``pad_cols``."""
    rows = []
    for s, r in zip(plan.scheduled, reqs):
        ncols = -(-(s.num_computed_tokens + s.num_scheduled_tokens) // block_size)
        rows.append([blocks.row(b) for b in r.rows[group][:ncols]])
    width = max(1, max(len(row) for row in rows) + pad_cols)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)


class PagedTensor:
    """``capacity`` NaN-filled pages of ``page_shape``; with ``slots`` the pages of every slot are
    stacked, (slots, pages, ...), so one launch can reach them all."""

    def __init__(self, page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, capacity: int,
                 slots: int | None = None):
        self.page_shape = page_shape
        lead = () if slots is None else (slots,)
        self.data = torch.full((*lead, capacity, *page_shape), float("nan"), dtype=dtype, device=device)


NAN_BITS = 0x7FC07FC0  # a NaN as float32, and each 16-bit half a NaN as bfloat16 and float16


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class PageArena:
    """The pages a hybrid model's layer kinds share, as the engine shares its KV-cache tensors:
    slot j holds the j-th layer of every KV-cache group, and a block's page in a slot belongs to
    whichever group holds the block (a block id is in one group's row at a time). A Mamba
    page (conv window, then temporal state) and an attention page (K, then V) are typed views
    of the same bytes, so a block handed to two groups at once corrupts both, as it would in
    the engine. Filled with ``NAN_BITS``: unwritten elements read NaN in every dtype."""

    ALIGN = 32  # views start on 128-byte boundaries inside a page

    def __init__(self, slots: int, capacity: int, page_bytes: int, device: torch.device):
        elems = -(-page_bytes // (4 * self.ALIGN)) * self.ALIGN
        self.data = torch.empty(slots, capacity, elems, dtype=torch.float32, device=device)
        self.data.view(torch.int32).fill_(NAN_BITS)
        self.slots, self.capacity = slots, capacity

    @classmethod
    def aligned(cls, elems: int) -> int:
        return -(-elems // cls.ALIGN) * cls.ALIGN

    def float32_view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """(slots, capacity, *shape) float32 at ``offset`` float32 elements into every page."""
        return self.data[:, :, offset:offset + _numel(shape)].view(self.slots, self.capacity, *shape)

    def slot_view(self, slot: int, offset_bytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """(capacity, *shape) of ``dtype`` at ``offset_bytes`` into every page of one slot."""
        raw = self.data[slot].view(dtype)
        start = offset_bytes // raw.element_size()
        return raw[:, start:start + _numel(shape)].view(self.capacity, *shape)


class MambaStateCache:
    """Every Mamba state page: conv windows (slots, pages, R, dim) and temporal states
    (slots, pages, H, P, N), float32 (the probe's residues are exact in it). A slot is shared
    by the i-th layers of every Mamba group, as the engine shares its KV-cache tensors; with an
    ``arena`` the pages are views into it (shared with attention layers), else allocated here."""

    def __init__(self, slots: int, conv_rows: int, dim: int, temporal_shape: tuple[int, ...],
                 device: torch.device, blocks: BlockMap, arena: "PageArena | None" = None):
        if arena is None:
            self.conv = PagedTensor((conv_rows, dim), torch.float32, device, blocks.capacity, slots)
            self.temporal = PagedTensor(temporal_shape, torch.float32, device, blocks.capacity, slots)
            return
        self.conv = _View(arena.float32_view(0, (conv_rows, dim)))
        self.temporal = _View(arena.float32_view(PageArena.aligned(conv_rows * dim), temporal_shape))

    @staticmethod
    def page_elems(conv_rows: int, dim: int, temporal_shape: tuple[int, ...]) -> int:
        """float32 elements of one state page inside an arena (the temporal state aligned)."""
        return PageArena.aligned(conv_rows * dim) + _numel(temporal_shape)


class _View:
    """A PagedTensor's interface over a view of an arena."""

    def __init__(self, data: torch.Tensor):
        self.data = data
