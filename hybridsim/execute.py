"""Choosing where and how steps execute: device, kernel provider, injected bugs, checks."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .checks import Checks
from .config import Scenario
from .engine.executor import Executor, GroupInfo
from .errors import EnvironmentProblem, InputError
from .kernel_registry import get_kernels

def resolve_device(requested: str) -> str:
    if requested == "cuda" and not torch.cuda.is_available():
        raise EnvironmentProblem("--device cuda: no CUDA GPU is visible to torch on this machine")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def resolve_kernels(requested: str, notes: list[str]):
    try:
        return get_kernels(requested)
    except KeyError:
        from .kernel_registry import provider_names
        raise InputError(f"no kernel provider {requested!r} (this environment has: auto, "
                         f"{', '.join(provider_names())}; `hybridsim kernels` lists them)", "--kernels") from None
    except ImportError as e:
        raise EnvironmentProblem(f"--kernels {requested}: {e}") from None


def provenance_notes(k) -> list[str]:
    """Whose code each op of a provider that mixes sources ran (the vLLM provider's bindings and
    their fallbacks), with its calls: one note per op, engine ops first."""
    from .kernel_registry import op_sources

    counts = getattr(k, "call_counts", None)
    if counts is None:
        return []
    calls = counts()
    out = [f"--kernels {k.name}: {k.stand_in}"] if getattr(k, "stand_in", None) else []
    for op, src in sorted(op_sources(k).items(), key=lambda kv: not kv[1].startswith("vLLM")):
        engine, own = calls.get(op, (0, 0))
        if not engine and not own:
            continue
        made = f"{engine:,} calls ran the engine's kernel" + (f", {own:,} hybridsim's op" if own else "")
        if src.startswith("vLLM"):
            why = "; ".join(f"{w}: {c:,}" for w, c in getattr(k, "fallback_reasons", {}).items()) if op == "state_copy" else ""
            out.append(f"--kernels {k.name}: {op}: {src} ({made}"
                       + (f"; hybridsim's op ran for {why or 'calls asking for an injected bug'})" if own else ")"))
        else:
            out.append(f"--kernels {k.name}: {op}: {src} ({own:,} calls)")
    return out


def groups_from_specs(groups) -> list[GroupInfo]:
    out = []
    for g in groups:
        if isinstance(g, dict):
            # (a trace header: a drafter's group without ``draft_layers`` holds drafter layers only)
            target = () if g.get("draft", False) and "draft_layers" not in g else tuple(g["layers"])
            info = GroupInfo(g["group_id"], g["kind"], g["block_size"], target)
        else:
            info = GroupInfo(g.group_id, g.kind, g.block_size, tuple(g.layers))
        if not info.layers:
            continue  # the drafter's own layers (MTP / EAGLE): blocks planned, nothing to execute
        out.append(info)  # (a group of target and drafter layers: its target layers run on its blocks)
    return out


def make_executor(s: Scenario, groups, checks: Checks, check: str, bugs: set[str], kernels: str,
                  device: str, notes: list[str], where: str = "scenario",
                  announce: Optional[Callable[[list[str]], None]] = None, digests: bool = False,
                  capacity: Optional[int] = None) -> Executor:
    """The executor for a scenario, after its memory plan was added up, announced and found to fit.
    ``capacity``: cache pages to hold (a replay knows how many distinct blocks its trace uses);
    by default ``cache.num_blocks``."""
    from .engine.memory import check_fits, plan_memory

    dev = resolve_device(device)
    on_gpu = torch.device(dev).type == "cuda"
    if kernels == "auto":  # the Triton kernels where they are fast, the reference elsewhere
        kernels = "triton" if on_gpu else "reference"
    k = resolve_kernels(kernels, notes)
    provider = k
    checked = k.name != "reference"
    if checked:
        k.poison = True  # every output buffer NaN-filled before its launch: unwritten elements fail
        if not torch.cuda.is_available() and any(c.__name__ == "TritonKernels" for c in type(k).__mro__):
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
    ex.finish_notes = lambda: notes.extend(provenance_notes(provider))  # (read at the run's end: call counts)
    return ex


def oracle_scan_for(device: torch.device):
    """The oracle's probe scan: Triton on a GPU (the torch form holds every state at once), the
    torch form on a CPU — which also keeps it apart from a Triton system under test there."""
    if device.type == "cuda":
        from .kernels.probe_scan_triton import scan_triton
        return scan_triton
    from .kernels.probe_scan import scan_reference
    return scan_reference
