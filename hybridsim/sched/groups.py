"""KV cache groups: which layers share a block table, and their block sizes.

Mirrors the engine's grouping (research/vllm-hybrid.md §1.4): layers are
bucketed by kind; every group holds ``group_size`` layers and has its own block
table; all groups draw block ids from one shared pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..model import ModelGeometry


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupSpec:
    group_id: int
    kind: Literal["attention", "mla", "mamba"]
    block_size: int
    layers: tuple[int, ...]  # indices into the model's layers of this kind
    mode: str = "none"  # mamba cache mode (mamba groups only)
    num_spec: int = 0  # extra per-request state blocks for drafts (mamba only)
    # the draft model's (MTP / EAGLE) attention layers: blocks from the same pool and part of
    # prefix hits, but no layer of the target model (the executor skips this group)
    draft: bool = False
    lookahead: int = 0  # slots past the scheduled tokens the draft model writes (attention kinds)

    @property
    def is_mamba(self) -> bool:
        return self.kind == "mamba"

    def peak_blocks(self, tokens: int, max_model_len: int = 1 << 62) -> int:
        """Most blocks one request holds in this group at once, or must find free to be
        admitted, when its blocks cover at most ``tokens`` tokens (``config.peak_tokens``)."""
        if not self.is_mamba:
            return cdiv(min(tokens + self.lookahead, max(max_model_len, tokens)), self.block_size)
        if self.mode == "none":
            return 1 + self.num_spec
        if self.mode == "all":  # (admission's room for the whole sequence; running, it holds fewer)
            return cdiv(tokens, self.block_size) + self.num_spec
        # align: previous state + prefill checkpoint + running + drafts
        return min(cdiv(tokens, self.block_size), 3) + self.num_spec


def plan_groups(geo: ModelGeometry, block_size: int, max_model_len: int, mode: str,
                num_spec: int, draft_layers: int = 0, lookahead: int = 0) -> list[GroupSpec]:
    """The target model's groups, then (``draft_layers``: an MTP or EAGLE drafter) one group
    of the draft model's attention layers, last, flagged ``draft`` as vLLM flags
    ``is_eagle_group``. ``lookahead``: slots every attention group allocates past the
    scheduled tokens for the draft model's writes."""
    buckets: list[tuple[str, int]] = []
    if geo.mamba is not None:
        buckets.append(("mamba", geo.mamba.layers))
    if geo.attention is not None:
        buckets.append(("attention", geo.attention.layers))
    if geo.mla is not None:
        buckets.append(("mla", geo.mla.layers))
    counts = [n for _, n in buckets]
    group_size = min(counts)
    if max(counts) < 1.5 * min(counts):
        group_size = max(counts)
    groups: list[GroupSpec] = []
    for kind, n in buckets:
        num_groups = cdiv(n, group_size)
        for g in range(num_groups):
            layers = tuple(range(g, n, num_groups))  # strided, as upstream
            if kind == "mamba":
                bs = max_model_len if mode == "none" else block_size
                groups.append(GroupSpec(len(groups), kind, bs, layers, mode, num_spec))
            else:
                groups.append(GroupSpec(len(groups), kind, block_size, layers, lookahead=lookahead))
    if draft_layers:
        groups.append(GroupSpec(len(groups), "attention", block_size, tuple(range(draft_layers)), draft=True,
                                lookahead=lookahead))
    if len(groups) > 64:  # prefix keys carry the group id in 6 bits
        raise ValueError(f"{len(groups)} KV cache groups; at most 64 are supported")
    return groups
