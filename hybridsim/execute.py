"""Choosing where and how steps execute: device, kernel provider, injected bugs, checks."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .checks import Checks
from .config import Scenario
from .engine.executor import Executor, GroupInfo
from .errors import EnvironmentProblem, InputError
from .kernels import get_kernels

# name -> (what it breaks, the check expected to catch it)
BUGS: dict[str, tuple[str, str]] = {
    "stale_state_index": ("requests force-preempted by reset_prefix_cache keep their old state index "
                          "(resumed ids not cleaned up)", "ssm.running_state"),
    "no_conv_shift_on_accept": ("conv windows are copied without the accept-bias shift", "ssm.running_state"),
    "temporal_without_bias": ("the temporal state is copied from the running column, ignoring the accept bias",
                              "ssm.running_state"),
    "align_precopy_skipped": ("align mode never copies the state into the new running block", "ssm.output"),
    "chunk_crosses_boundary": ("Mamba2 prefill chunks ignore the chunk_size grid of absolute positions",
                               "mamba.chunk_meta"),
    "rejected_state_kept": ("after a partly rejected draft run, the state after the last draft is kept",
                            "ssm.running_state"),
    "int32_block_offset": ("state-page addresses computed as block_id x page_bytes in 32-bit arithmetic: "
                           "pages past 2 GiB wrap onto other pages", "ssm.running_state"),
    "ctx_chunk_unaligned": ("MLA prefill context chunks start off page boundaries", "mla.output"),
    "lse_base2": ("partial attentions merged with exp2 against natural-log lse", "mla.output"),
    "lse_unmasked": ("an empty context partial (lse -inf) is merged without sanitising", "mla.output"),
    "attn_hit_not_cut": ("the attention group keeps the blocks of its own, longer prefix hit instead of cutting "
                         "them back to the Mamba-aligned hit: the request recomputes into blocks others hold",
                         "attn.cached_blocks"),
    "free_shared_block": ("freeing a request's attention blocks ignores the reference count: a block another "
                          "request still holds goes back to the free queue and is handed out again",
                          "attn.cached_blocks"),
    "slot_off_by_one": ("the slot mapping sends the first token of each block through the previous block-table "
                        "column", "attn.output"),
    "rejected_kv_visible": ("the step after a partly rejected draft run still counts the rejected drafts in the "
                            "row's sequence length: its queries see K/V past the row's end", "attn.output"),
    "paged_attn_past_end": ("the paged-attention loop runs one block-table column past the row's last block "
                            "without masking it", "attn.output"),
}


def resolve_device(requested: str) -> str:
    if requested == "cuda" and not torch.cuda.is_available():
        raise EnvironmentProblem("--device cuda: no CUDA GPU is visible to torch on this machine")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def resolve_kernels(requested: str, notes: list[str]):
    try:
        return get_kernels(requested)
    except ImportError as e:
        raise EnvironmentProblem(f"--kernels {requested}: {e}") from None


def check_bugs(names: list[str]) -> set[str]:
    unknown = [n for n in names if n not in BUGS]
    if unknown:
        raise InputError(f"unknown bug {unknown[0]!r}; `hybridsim run --list-bugs` lists them", "--inject-bug")
    return set(names)


_BUG_LAYERS = {"ssm": "mamba", "mamba": "mamba", "attn": "attention", "mla": "mla"}  # check prefix -> layer kind
_LAYER_NAMES = {"mamba": "Mamba", "attention": "GQA attention", "mla": "MLA"}


def inapplicable_bugs(s: Scenario, bugs: set[str]) -> list[str]:
    """One sentence per bug in a layer kind the model does not have: such a bug changes nothing."""
    geo = s.geometry()
    have = [kind for kind in ("mamba", "attention", "mla") if getattr(geo, kind) is not None]
    out = []
    for name in sorted(bugs):
        kind = _BUG_LAYERS[BUGS[name][1].split(".")[0]]
        if kind not in have:
            out.append(f"{name} breaks {_LAYER_NAMES[kind]} layers, and scenario {s.name!r} has none (its layers: "
                       f"{', '.join(_LAYER_NAMES[k] for k in have)})")
    return out


def check_bugs_apply(s: Scenario, bugs: set[str], where: str = "--inject-bug") -> None:
    """A bug that could change nothing in this model makes a run that passes and proves nothing:
    refused (exit 2), naming the kinds of layer the model has."""
    missing = inapplicable_bugs(s, bugs)
    if missing:
        raise InputError(f"{missing[0]}; `hybridsim run --list-bugs` says what each bug breaks", where)


def groups_from_specs(groups) -> list[GroupInfo]:
    out = []
    for g in groups:
        if (g.get("draft", False) if isinstance(g, dict) else g.draft):
            continue  # the drafter's own layers (MTP / EAGLE): blocks planned, nothing to execute
        if isinstance(g, dict):
            out.append(GroupInfo(g["group_id"], g["kind"], g["block_size"], tuple(g["layers"])))
        else:
            out.append(GroupInfo(g.group_id, g.kind, g.block_size, tuple(g.layers)))
    return out


def make_executor(s: Scenario, groups, checks: Checks, check: str, bugs: set[str], kernels: str,
                  device: str, notes: list[str], where: str = "scenario",
                  announce: Optional[Callable[[list[str]], None]] = None, digests: bool = False,
                  capacity: Optional[int] = None) -> Executor:
    """The executor for a scenario, after its memory plan was added up, announced and found to fit.
    ``capacity``: cache pages to hold (a replay knows how many distinct blocks its trace uses);
    by default ``cache.num_blocks``."""
    from .engine.memory import check_fits, plan_memory

    unit = s.cache.prefix_match_unit
    if unit is not None and unit < s.cache.block_size:
        raise InputError(f"cache.prefix_match_unit: {unit} is below block_size ({s.cache.block_size}); partial-block "
                         "prefix hits are planned but not executed yet (the executor does not copy a partly hit "
                         "block): plan with --check off (or execution.check: off)", where)
    dev = resolve_device(device)
    on_gpu = torch.device(dev).type == "cuda"
    if kernels == "auto":  # the Triton kernels where they are fast, the reference elsewhere
        kernels = "triton" if on_gpu else "reference"
    k = resolve_kernels(kernels, notes)
    checked = k.name != "reference"
    if checked:
        k.poison = True  # every output buffer NaN-filled before its launch: unwritten elements fail
        if not torch.cuda.is_available():
            notes.append("Triton kernels run under TRITON_INTERPRET=1 (no GPU): correct, not fast")
    timer = None
    if on_gpu:
        from .kernels.timed import TimedKernels
        k = timer = TimedKernels(k, torch.device(dev))
    if checked:
        from .kernels.checked import CheckedKernels
        k = CheckedKernels(k, checks)
    specs = groups_from_specs(groups)
    capacity = min(capacity or s.cache.num_blocks, s.cache.num_blocks)
    plan = plan_memory(s, specs, torch.device(dev), checked_kernels=checked, pages=capacity)
    if announce is not None:
        announce(plan.lines())
    check_fits(plan, s, where)
    ex = Executor(s, specs, k, checks, check, bugs, dev, oracle_scan=oracle_scan_for(torch.device(dev)),
                  digests=digests, capacity=capacity)
    ex.kernel_timer = timer
    ex.memory_plan = plan
    return ex


def oracle_scan_for(device: torch.device):
    """The oracle's probe scan: Triton on a GPU (the torch form holds every state at once), the
    torch form on a CPU — which also keeps it apart from a Triton system under test there."""
    if device.type == "cuda":
        from .kernels.probe_scan_triton import scan_triton
        return scan_triton
    from .kernels.probe_scan import scan_reference
    return scan_reference
