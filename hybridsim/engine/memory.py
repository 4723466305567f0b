"""What a checked run will allocate, added up before anything is allocated.

Every tensor the executor and the oracle hold for the whole run is sized from the
scenario alone: the Mamba state pages, the attention K/V pages (one arena shared with the
Mamba states in a hybrid model, as the engine shares them) and the MLA latent caches
(``cache.num_blocks`` pages each), the oracle's per-request states (``max_num_seqs``), and the per-step
buffers (``max_num_batched_tokens``). A run that cannot fit is refused before the first
step: with exit 2 naming ``cache.num_blocks`` when a smaller pool would fit, with exit 3
naming the device when nothing would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import Scenario
from ..errors import EnvironmentProblem, InputError
from ..model import DTYPE_BYTES

GiB = float(1 << 30)


@dataclass
class MemoryItem:
    name: str
    bytes: int
    detail: str
    per_block: int = 0  # bytes that scale with cache.num_blocks


@dataclass
class MemoryPlan:
    device: str
    items: list[MemoryItem] = field(default_factory=list)
    available: Optional[int] = None  # free bytes on the device, when known
    pages: int = 0  # cache pages the plan holds (the per-block items scale with it)

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    def lines(self) -> list[str]:
        free = f", {self.available / GiB:,.1f} GiB free" if self.available is not None else ""
        out = [f"memory plan on {self.device}: {self.total / GiB:,.2f} GiB{free}"]
        out += [f"  {i.name}: {i.bytes / GiB:,.3f} GiB ({i.detail})" for i in self.items]
        return out

    def as_dict(self) -> dict:
        return {"device": self.device, "total_bytes": self.total, "available_bytes": self.available,
                "items": [{"name": i.name, "bytes": i.bytes, "detail": i.detail} for i in self.items]}


def mamba_page(s: Scenario) -> tuple[int, int, tuple[int, ...]]:
    """(conv rows, conv dim, temporal shape) of one Mamba state page as the executor holds it."""
    m = s.geometry().mamba
    H, P = (1, m.heads * m.head_dim) if m.kind == "mamba1" else (m.heads, m.head_dim)
    return m.conv_rows(s.spec_decode.num_speculative_tokens), m.conv_dim(), (H, P, m.d_state)


def arena_layout(s: Scenario, groups) -> Optional[tuple[int, int]]:
    """(slots, page bytes) of the pages Mamba and attention layers share, or None when the model
    has not both. Slot j is the j-th layer of every group; a page fits the larger kind."""
    geo = s.geometry()
    if geo.mamba is None or geo.attention is None:
        return None
    from .cache import MambaStateCache

    slots = max(len(g.layers) for g in groups if g.kind in ("mamba", "attention"))
    bs = next(g.block_size for g in groups if g.kind == "attention")
    page = max(4 * MambaStateCache.page_elems(*mamba_page(s)), geo.attention.page_bytes(bs))
    return slots, page


def free_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda":  # (what torch's allocator holds unused, left by an earlier run here, is ours too)
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + idle
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan_memory(s: Scenario, groups, device: torch.device, checked_kernels: bool = False,
                pages: Optional[int] = None) -> MemoryPlan:
    """What the run holds for its whole length, and an estimate of its largest step's transients
    (these scale with ``max_num_batched_tokens``); ``checked_kernels`` adds the reference's staging."""
    from ..kernels.checked import STAGED_PAGES
    from ..kernels.paged_attention import SCORE_ELEMS as PAGED_SCORES
    from ..kernels.reference import PARTIAL_SCORE_ELEMS, SCORE_ELEMS as DECODE_SCORES
    from ..layers.mla import TABLE as MLA_TABLE, TABLE2 as MLA_TABLE2
    from ..oracle import MLA_ORACLE_ELEMS, STATE_DTYPE, fused_by_default
    from .attn_exec import ORACLE_SCORES, oracle_memo_bytes

    geo = s.geometry()
    plan = MemoryPlan(str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})")
    blocks = plan.pages = pages or s.cache.num_blocks  # cache pages held (a replay: those its trace uses)
    seqs = s.scheduler.max_num_seqs
    budget = s.scheduler.max_num_batched_tokens
    S = s.spec_decode.num_speculative_tokens
    arena = arena_layout(s, groups)
    if arena is not None:
        slots, page = arena
        a = geo.attention
        plan.items.append(MemoryItem("state + K/V pages (shared)", slots * blocks * page,
                                     f"{slots} slots x {blocks:,} blocks x {page / 2**20:,.2f} MiB pages, each a Mamba "
                                     f"state or one attention layer's K/V ({a.dtype}) as the engine shares them",
                                     per_block=slots * page))
    elif geo.attention is not None:
        a = geo.attention
        bs = next(gr.block_size for gr in groups if gr.kind == "attention")
        page = a.page_bytes(bs)
        plan.items.append(MemoryItem("attention K/V caches", a.layers * blocks * page,
                                     f"{a.layers} layers x {blocks:,} blocks x {page / 2**10:,.1f} KiB pages, {a.dtype}",
                                     per_block=a.layers * page))
    if geo.attention is not None:
        a = geo.attention
        hd = a.heads * a.head_dim
        kvd = a.kv_heads * a.head_dim
        step = (budget * a.layers * (hd + 2 * kvd) * 4  # every layer's Q, K, V of the step
                + 2 * budget * a.layers * hd * 4  # every layer's outputs until the check, and a split's partials
                + 6 * 4 * min(PAGED_SCORES, seqs * 16 * a.heads * s.scheduler.max_model_len))  # reference scores
        if fused_by_default(device):  # float64 kernels: scores never in memory (oracle.DenseOracle)
            from ..kernels.dense_attention_f64 import DECODE_SPLIT_KEYS, M_SHORT, PARTIAL_ELEMS, WORKSPACE_ELEMS
            oracle = 8 * a.layers * budget * hd  # the step's outputs (the kernels project the queries in each tile)
            what = ("float64 outputs (queries, and for rows of one query tile keys and scores, stay inside the "
                    "kernels; longer rows' keys: the key workspace)")
            # rows of several query tiles (at most min(seqs, budget / 2): two queries or more each) keep
            # every layer's float32 K and V, projected once, bounded by the kernel's WORKSPACE_ELEMS
            keys = s.scheduler.max_model_len * min(seqs, max(1, budget // 2))
            workspace = MemoryItem("attention oracle key workspace (at most)",
                                   4 * min(WORKSPACE_ELEMS, a.layers * 2 * kvd * keys),
                                   f"float32 K/V of long prefill chunks, every layer, projected once for all their "
                                   f"query tiles (at most {WORKSPACE_ELEMS * 4 / 2**20:,.0f} MiB: more keys take their "
                                   f"(layer, KV head) pairs in passes)")
            # decode rows (at most min(seqs, budget)) split their keys into ranges, each range's
            # running maximum, sum and accumulator in float64 for every (layer, KV head) and
            # (query, head) row of its tile, bounded by the kernel's PARTIAL_ELEMS
            tile_rows = max(M_SHORT, 1 << (a.heads // a.kv_heads - 1).bit_length())
            ranges = min(seqs, budget) * -(-s.scheduler.max_model_len // DECODE_SPLIT_KEYS)
            partials = MemoryItem("attention oracle split partials (at most)",
                                  8 * min(PARTIAL_ELEMS, ranges * a.layers * a.kv_heads * tile_rows * (a.head_dim + 2)),
                                  f"float64 partial results of decode rows' key ranges (about {DECODE_SPLIT_KEYS:,} "
                                  f"keys each), merged after (at most {PARTIAL_ELEMS * 8 / 2**20:,.0f} MiB: more "
                                  f"take longer ranges)")
        else:
            oracle = (a.layers * budget * hd * 8
                      + 5 * 8 * min(ORACLE_SCORES, budget * a.heads * s.scheduler.max_model_len * a.layers)
                      + a.layers * 2 * kvd * 8 * s.scheduler.max_model_len)  # a long row's K/V, projected once
            what = "float64 K/V (a whole row's, for a long one), scores and outputs"
            workspace = partials = None
        plan.items.append(MemoryItem("attention step transients (estimate)", step,
                                     f"largest step of {budget:,} tokens: projections, outputs, reference scores"))
        plan.items.append(MemoryItem("attention oracle (estimate)", oracle, what))
        plan.items += [item for item in (workspace, partials) if item is not None]
        memo = oracle_memo_bytes(s, device)
        if memo:
            plan.items.append(MemoryItem("attention oracle key memo (at most)", memo,
                                         f"float64 K/V of up to {s.scheduler.max_num_seqs} live requests' tokens"))
    if geo.mamba is not None:
        m = geo.mamba
        conv_rows, dim, (H, P, N) = mamba_page(s)
        if arena is None:
            slots = max(len(g.layers) for g in groups if g.kind == "mamba")
            page = 4 * (conv_rows * dim + H * P * N)
            plan.items.append(MemoryItem("Mamba state cache", slots * blocks * page,
                                         f"{slots} slots x {blocks:,} blocks x {page / 2**20:,.2f} MiB pages, float32",
                                         per_block=slots * page))
        state = 4 * (m.conv_kernel - 1) * dim + STATE_DTYPE.itemsize * H * P * m.d_state
        plan.items.append(MemoryItem("Mamba oracle states", m.layers * seqs * state,
                                     f"{m.layers} layers x {seqs} requests (max_num_seqs), int16 residues"))
        # on a GPU the chunked scan's pre-pass holds a launch's B and C as int8 digits (two a value)
        bc = budget * m.layers * 2 * m.n_groups * m.d_state * 2 if device.type == "cuda" else 0
        plan.items.append(MemoryItem("Mamba step buffers", m.layers * 4 * (budget * H * P + 2 * seqs * (
            m.conv_kernel - 1) * dim) + bc, f"outputs of {budget:,} tokens and starting windows, every layer"
                                     + (", and the chunked scan's B and C" if bc else "")))
        if checked_kernels:
            plan.items.append(MemoryItem("checked state copies", 2 * STAGED_PAGES * page,
                                         f"the reference's copy of at most {STAGED_PAGES} touched pages"))
    unit = s.cache.prefix_match_unit
    if checked_kernels and unit is not None and unit < s.cache.block_size:
        plan.items.append(_block_copy_staging(s, groups, arena))
    if geo.mla is not None:
        g = geo.mla
        bs = next(gr.block_size for gr in groups if gr.kind == "mla")
        page = bs * g.entry_dim() * DTYPE_BYTES[g.dtype]
        plan.items.append(MemoryItem("MLA latent caches", g.layers * blocks * page,
                                     f"{g.layers} layers x {blocks:,} blocks x {page / 2**10:,.1f} KiB pages, {g.dtype}",
                                     per_block=g.layers * page))
        H, L, R, N, V, Ly = g.heads, g.kv_lora_rank, g.qk_rope_head_dim, g.qk_nope_head_dim, g.v_head_dim, g.layers
        work = min(s.execution.mla_workspace_tokens, s.scheduler.max_model_len)
        out = budget * H * V
        step = (2 * Ly * out * 4  # every layer's outputs (both paths on prefill rows) until the check
                + 3 * out * 8  # the check's float64 copies of its largest comparison
                + budget * H * (N + R) * 20 + 3 * budget * H * L * 4  # one layer: queries, absorbed, decoded
                + work * H * (N + R + V) * 8 + budget * H * (N + R + V) * 8  # up-projected context and tokens
                + 3 * 4 * min(PARTIAL_SCORE_ELEMS, budget * H * max(budget, work)))  # the prefill path's scores
        if checked_kernels:  # the reference decode's scores and partials
            step += 6 * 4 * min(DECODE_SCORES, seqs * (1 + S) * H * s.scheduler.max_model_len)
        # outputs; scores, probabilities and (batches that up-project keys) k_nope and v with their
        # rearranged copies, each at most one budget; the per-token key tables
        oracle = (Ly * out * 8 + 5 * 8 * min(MLA_ORACLE_ELEMS, budget * H * s.scheduler.max_model_len * Ly)
                  + Ly * (MLA_TABLE + MLA_TABLE2) * g.entry_dim() * 8)
        plan.items.append(MemoryItem("MLA step transients (estimate)", int(1.15 * step),
                                     f"largest step of {budget:,} tokens: outputs, queries, up-projections, scores; "
                                     "15% allocator margin"))
        # on a GPU a long chunk's per-head keys (float32, a group of heads at a time within the same
        # budget) take the place of its scores: the same bound holds (oracle.DenseOracle._expected_latent)
        what = ("float64 expected outputs, decode rows' scores or a long chunk's per-head keys, key tables"
                if fused_by_default(device) else "float64 expected outputs, scores, key tables")
        plan.items.append(MemoryItem("MLA oracle (estimate)", oracle, what))
    plan.available = free_bytes(device)
    return plan


def _block_copy_staging(s: Scenario, groups, arena) -> MemoryItem:
    """Partial-block hits under checked kernels: a block_copy batch's staged pages for the
    reference, the kernel's destination pages read back, and the comparison's two float copies."""
    from ..kernels.checked import BLOCK_COPY_STAGED

    geo = s.geometry()
    if arena is not None:
        page = arena[1]
    else:
        conv_rows, dim, (H, P, N) = mamba_page(s) if geo.mamba is not None else (0, 0, (0, 0, 0))
        page = 4 * (conv_rows * dim + H * P * N)
        if geo.mla is not None:
            bs = next(gr.block_size for gr in groups if gr.kind == "mla")
            page = max(page, bs * geo.mla.entry_dim() * DTYPE_BYTES[geo.mla.dtype])
    return MemoryItem("checked block copies", 3 * BLOCK_COPY_STAGED * page,
                      f"the reference's copy of at most {BLOCK_COPY_STAGED} touched pages, and the comparison's")


def check_fits(plan: MemoryPlan, s: Scenario, where: str) -> None:
    """Refuse a run that cannot fit: exit 2 naming cache.num_blocks if fewer blocks would fit,
    else exit 3 naming the device."""
    if plan.available is None or plan.total <= plan.available:
        return
    per_block = sum(i.per_block for i in plan.items)
    fixed = plan.total - per_block * (plan.pages or s.cache.num_blocks)
    need = f"the run needs {plan.total / GiB:,.1f} GiB on {plan.device} but {plan.available / GiB:,.1f} GiB are free"
    if per_block and plan.available > fixed:
        fit = int((plan.available - fixed) // per_block)
        if fit >= 2:
            raise InputError(f"cache.num_blocks: {need}; at most {fit:,} blocks fit ({per_block / 2**20:,.1f} MiB of "
                             f"cache per block)", where)
    raise EnvironmentProblem(f"{plan.device}: {need}, and the per-request and per-step buffers alone need "
                             f"{fixed / GiB:,.1f} GiB; run it on a larger device or shrink the model or the batch")
