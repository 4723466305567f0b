"""KV cache groups: which layers share a block table, and their block sizes.

The layout is formed the way vLLM 0.33 forms it (docs/fidelity.md, "KV-cache groups";
research/vllm-hybrid.md §1.4), in one place for planning, recording, conversion, replay and
execution: every layer, the target model's in their order and then the drafter's (MTP /
EAGLE), is keyed by its cache spec; layers of one spec form a bucket, buckets are split into
groups of ``group_size`` layers by strided assignment, and a group holding any drafter layer
is flagged ``draft`` (the engine's ``is_eagle_group``). All groups draw block ids from one
shared pool. A recording's layout is taken as recorded (``explicit_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Sequence

from ..model import ModelGeometry

if TYPE_CHECKING:  # (typing only: config imports this module lazily)
    from ..config import Scenario

Kind = Literal["attention", "mla", "mamba"]
# a layer pattern's letters: one per layer of the target model, in model order
PATTERN_KINDS: dict[str, Kind] = {"M": "mamba", "A": "attention", "L": "mla"}
MAX_GROUPS = 64  # prefix keys carry the group id in 6 bits


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupSpec:
    group_id: int
    kind: Kind
    block_size: int
    layers: tuple[int, ...]  # the target model's layers of this kind in the group (indices among them)
    mode: str = "none"  # mamba cache mode (mamba groups only)
    num_spec: int = 0  # extra per-request state blocks for drafts (mamba only)
    # the group holds draft-model (MTP / EAGLE) layers, as vLLM flags ``is_eagle_group``: their
    # blocks come from the same pool and take part in prefix hits, but the executor runs no
    # draft model (a group of drafter layers only is skipped; a mixed one runs its target layers)
    draft: bool = False
    lookahead: int = 0  # slots past the scheduled tokens the draft model writes (attention kinds)
    draft_layers: tuple[int, ...] = ()  # the drafter's layers in the group (indices among them)

    @property
    def is_mamba(self) -> bool:
        return self.kind == "mamba"

    @property
    def num_layers(self) -> int:
        """Layers sharing the group's block table, target and drafter together."""
        return len(self.layers) + len(self.draft_layers)

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


@dataclass(frozen=True)
class GroupLayout:
    """One group before block sizes: its kind and which layers share its block table."""

    kind: Kind
    layers: tuple[int, ...]  # target layers of this kind (indices among the target's layers of the kind)
    draft_layers: tuple[int, ...] = ()  # drafter layers (indices among the drafter's layers)


def default_pattern(geo: ModelGeometry) -> str:
    """The layer order a model without ``layer_pattern`` is taken to have: its Mamba layers
    first, then attention, then MLA (the order of every preset's first layers of a kind)."""
    return "".join(letter * (getattr(geo, kind).layers if getattr(geo, kind) is not None else 0)
                   for letter, kind in PATTERN_KINDS.items())


def pattern_problem(pattern: str, geo: ModelGeometry) -> Optional[str]:
    """Why ``pattern`` cannot be ``geo``'s layer pattern (None if it can)."""
    bad = sorted(set(pattern) - set(PATTERN_KINDS))
    if bad:
        return f"unknown layer letter {bad[0]!r}: use M (Mamba), A (attention), L (MLA)"
    for letter, kind in PATTERN_KINDS.items():
        section = getattr(geo, kind)
        want = section.layers if section is not None else 0
        if pattern.count(letter) != want:
            return (f"{pattern.count(letter)} {letter} layers, but the model has {want} {kind} layers "
                    f"(model.{kind}.layers)")
    return None


def drafter_key(pattern: str, method: str) -> tuple[str, Kind]:
    """(spec key, kind) of a drafter's layers: an MTP layer is built like the target's attention
    (the same spec: it shares the target's bucket; MLA when the target has MLA and no GQA
    attention); an EAGLE head is a model of its own (another spec, a bucket of its own)."""
    if method == "mtp":
        kind: Kind = "mla" if "L" in pattern and "A" not in pattern else "attention"
        return kind, kind
    return "eagle", "attention"


def form_layout(pattern: str, method: str = "ngram", draft_layers: int = 0) -> list[GroupLayout]:
    """The engine's groups for a target layer pattern and a drafter (vLLM 0.33,
    ``kv_cache_planning.get_kv_cache_groups``, layer-outer cache layout):

    - a model without Mamba whose target layers are all of one kind puts every layer, the
      drafter's too, in one group (``_get_kv_cache_groups_uniform_spec`` / ``_uniform_type``);
    - otherwise layers are bucketed by spec in the order they are listed, the target's first
      (``_get_kv_cache_groups_uniform_page_size``); the group size is the smallest bucket, or
      the largest when it is under 1.5 times the smallest; each bucket of n layers makes
      cdiv(n, size) groups, group i taking the bucket's layers i, i + groups, ... (the last
      groups one short when n is not a multiple: the engine's padding layers);
    - a group holding any drafter layer is the drafter's (``is_eagle_group``)."""
    n_target: dict[Kind, int] = {}
    listed: list[tuple[str, Kind, bool, int]] = []  # (spec key, kind, drafter's, index among its kind)
    for letter in pattern:
        kind = PATTERN_KINDS[letter]
        listed.append((kind, kind, False, n_target.get(kind, 0)))
        n_target[kind] = n_target.get(kind, 0) + 1
    if draft_layers and method != "ngram":
        key, kind = drafter_key(pattern, method)
        listed += [(key, kind, True, j) for j in range(draft_layers)]
    if not listed:
        raise ValueError("a model needs at least one layer")
    if "mamba" not in n_target and len(n_target) == 1:
        kind = next(iter(n_target))
        return [GroupLayout(kind, tuple(i for _, _, d, i in listed if not d),
                            tuple(i for _, _, d, i in listed if d))]
    buckets: dict[str, list[tuple[Kind, bool, int]]] = {}
    for key, kind, drafted, index in listed:
        buckets.setdefault(key, []).append((kind, drafted, index))
    sizes = [len(b) for b in buckets.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    out = []
    for bucket in buckets.values():
        count = cdiv(len(bucket), size)
        for g in range(count):
            members = bucket[g::count]
            out.append(GroupLayout(members[0][0], tuple(i for _, d, i in members if not d),
                                   tuple(i for _, d, i in members if d)))
    return out


def split_layers(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Layer indices for groups holding ``counts`` layers of one kind: the engine's strided
    assignment when the counts are its (each bucket split evenly, the last groups one short),
    else consecutive runs."""
    n, k = sum(counts), len(counts)
    strided = [tuple(range(g, n, k)) for g in range(k)]
    if [len(x) for x in strided] == list(counts):
        return strided
    out, at = [], 0
    for c in counts:
        out.append(tuple(range(at, at + c)))
        at += c
    return out


def explicit_layout(groups: Sequence[tuple[Kind, int, int]]) -> list[GroupLayout]:
    """A layout given group by group as (kind, target layers, drafter layers), as a recording
    lists it; layer indices as ``split_layers`` assigns them."""
    target: dict[str, list[tuple[int, ...]]] = {}
    for kind in PATTERN_KINDS.values():
        mine = [n for k, n, _ in groups if k == kind]
        target[kind] = split_layers(mine) if mine else []
    drafts = split_layers([d for _, _, d in groups])
    taken: dict[str, int] = {}
    out = []
    for (kind, _, _), draft in zip(groups, drafts):
        i = taken.get(kind, 0)
        taken[kind] = i + 1
        out.append(GroupLayout(kind, target[kind][i], draft))
    return out


def groups_from_layout(layout: Sequence[GroupLayout], block_size: int, max_model_len: int, mode: str,
                       num_spec: int, lookahead: int = 0) -> list[GroupSpec]:
    """Block sizes and per-group settings for a layout. One page size for every group: Mamba
    pages are padded up to the attention page (``unify_kv_cache_spec_page_size`` pads, never
    resizes, a Mamba page), so every attention-like group keeps ``block_size``; a Mamba group's
    block is ``max_model_len`` tokens in mode none (one block holds a request's state)."""
    if len(layout) > MAX_GROUPS:
        raise ValueError(f"{len(layout)} KV cache groups; at most {MAX_GROUPS} are supported")
    out = []
    for gid, g in enumerate(layout):
        if g.kind == "mamba":
            bs = max_model_len if mode == "none" else block_size
            out.append(GroupSpec(gid, "mamba", bs, g.layers, mode, num_spec, draft=bool(g.draft_layers),
                                 draft_layers=g.draft_layers))
        else:
            out.append(GroupSpec(gid, g.kind, block_size, g.layers, draft=bool(g.draft_layers),
                                 lookahead=lookahead, draft_layers=g.draft_layers))
    return out


def plan_groups(geo: ModelGeometry, block_size: int, max_model_len: int, mode: str,
                num_spec: int, draft_layers: int = 0, lookahead: int = 0, method: str = "mtp",
                pattern: Optional[str] = None) -> list[GroupSpec]:
    """The groups the engine forms for ``geo`` (``pattern``: its layer order; default
    ``default_pattern``) and a drafter of ``draft_layers`` layers (``method`` mtp or eagle).
    ``lookahead``: slots every attention group allocates past the scheduled tokens for the
    draft model's writes."""
    layout = form_layout(pattern or default_pattern(geo), method, draft_layers)
    return groups_from_layout(layout, block_size, max_model_len, mode, num_spec, lookahead)


def scenario_layout(s: "Scenario") -> list[GroupLayout]:
    """A scenario's layout: as given (``model.kv_cache_groups``, a recording's), else formed
    from its layer pattern and drafter."""
    sd = s.spec_decode
    if s.model.kv_cache_groups is not None:
        return explicit_layout([(g.kind, g.layers, g.draft_layers) for g in s.model.kv_cache_groups])
    return form_layout(s.model.layer_pattern or default_pattern(s.geometry()), sd.method, sd.draft_layers)


def scenario_groups(s: "Scenario") -> list[GroupSpec]:
    """The KV cache groups of a scenario: what planning, recording, replay and execution use."""
    return groups_from_layout(scenario_layout(s), s.cache.block_size, s.scheduler.max_model_len,
                              s.cache.resolved_mode(), s.spec_decode.num_speculative_tokens,
                              s.spec_decode.lookahead_slots)


def layout_problem(s: "Scenario") -> Optional[tuple[tuple, str]]:
    """Why a scenario's layer pattern or explicit groups do not fit its model and drafter
    (key path, message), or None."""
    geo = s.geometry()
    if s.model.layer_pattern is not None:
        problem = pattern_problem(s.model.layer_pattern, geo)
        if problem:
            return ("model", "layer_pattern"), problem
    if s.model.kv_cache_groups is not None:
        for kind in PATTERN_KINDS.values():
            section = getattr(geo, kind)
            want = section.layers if section is not None else 0
            have = sum(g.layers for g in s.model.kv_cache_groups if g.kind == kind)
            if have != want:
                return ("model", "kv_cache_groups"), (f"the groups hold {have} {kind} layers, the model has {want}")
        drafts = sum(g.draft_layers for g in s.model.kv_cache_groups)
        if drafts != s.spec_decode.draft_layers:
            return ("model", "kv_cache_groups"), (f"the groups hold {drafts} drafter layers, spec_decode has "
                                                   f"{s.spec_decode.draft_layers}")
        if len(s.model.kv_cache_groups) > MAX_GROUPS:
            return ("model", "kv_cache_groups"), f"{len(s.model.kv_cache_groups)} groups; at most {MAX_GROUPS}"
    elif len(scenario_layout(s)) > MAX_GROUPS:
        return ("model",), f"the engine would form {len(scenario_layout(s))} KV cache groups; at most {MAX_GROUPS}"
    return None


def describe_layout(layout: Sequence[GroupLayout]) -> str:
    """A layout in a line: runs of alike groups as ``COUNT× KIND[TARGET LAYERS+DRAFTER LAYERS draft]``
    in group order (``hybridsim presets``)."""
    runs: list[list] = []
    for g in layout:
        key = (g.kind, len(g.layers), len(g.draft_layers))
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    parts = []
    for (kind, n, d), count in runs:
        inside = "+".join(x for x in (str(n) if n else "", f"{d} draft" if d else "") if x)
        parts.append(f"{count}× {kind}[{inside}]")
    return ", ".join(parts)


def preset_layouts(geo: ModelGeometry, draft_layers: int = 1) -> list[tuple[str, str]]:
    """(drafter, layout line) of a model with no drafter, an MTP and an EAGLE drafter of
    ``draft_layers`` layers, as the engine forms them."""
    pattern = default_pattern(geo)
    n = f"{draft_layers} layer{'s' if draft_layers > 1 else ''}"
    return [(label, describe_layout(form_layout(pattern, method, k)))
            for label, method, k in (("no drafter", "ngram", 0), (f"MTP ({n})", "mtp", draft_layers),
                                     (f"EAGLE ({n})", "eagle", draft_layers))]
