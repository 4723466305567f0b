"""Choosing where and how steps execute: device, kernel provider, injected bugs, checks."""

from __future__ import annotations

from time import perf_counter
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
            if announce is not None:  # (said up front too: the quickstart's steps take minutes so)
                announce(["the Triton kernels run under Triton's interpreter on this CPU: correct, and slow "
                          "(minutes where the reference takes seconds; --kernels reference is the fast CPU path)"])
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


class KernelLists:
    """A run's kernel variants ahead of its loop (``device/prebuild.py``): the list recorded for its
    configuration, from the user's ``--kernel-variants`` file or the package's, built in worker
    processes (``prebuild.Prebuild``) while the executor is set up; after the loop, the user's file's
    list for it set to what the run used. Only where kernels are built: on a GPU."""

    def __init__(self, s: Scenario, kernels: str, device: str, check: str, bugs: set[str],
                 user_file=None, user_lists: Optional[dict] = None):
        """``user_lists``: the user's file as ``prebuild.read_lists`` read it (the caller reads it before
        any work: a file that is not a list is bad input even where nothing executes)."""
        from .device import prebuild as pb

        self.user_file = user_file
        self.key = None
        self.running = None
        self.done = None  # (every listed variant was in Triton's cache already)
        self.label = s.name
        dev = resolve_device(device)
        if torch.device(dev).type != "cuda":
            return
        try:
            import triton
        except ImportError:  # (no Triton: nothing is built, ahead or inside the loop)
            return

        major, minor = torch.cuda.get_device_capability(torch.device(dev))
        if kernels == "auto":
            kernels = "triton"
        self.key = pb.entry_key(pb.config_key(s.model_dump(mode="json"), kernels, check, bugs), triton.__version__,
                                ["cuda", 10 * major + minor, 32])
        sources = [(user_lists, str(user_file))] if user_lists is not None else []
        entries, source = pb.lookup(self.key, sources + [(pb.read_lists(pb.SHIPPED, "kernel lists"), str(pb.SHIPPED))])
        t0 = perf_counter()
        missing = [e for e in entries if not pb.in_cache(e)]  # (a machine that ran this before: nothing to build)
        cached = len(entries) - len(missing)
        if missing:
            self.running = pb.Prebuild(missing, source, cached=cached)
        elif entries:
            self.done = pb.PrebuildReport(len(entries), 0, cached=cached, seconds=perf_counter() - t0, source=source)

    def wait(self):
        """The prebuild's report (None where nothing was listed): call before the loop."""
        if self.running is None:
            return self.done
        report, self.running = self.running.wait(), None
        return report

    def beside(self, make: Callable[[], Executor], notes: list[str]):
        """``make()`` (the executor) while the listed variants build, then wait for them: the executor
        and the prebuild's report (its note added to ``notes`` where it has one). Where ``make`` fails,
        the builds not started are dropped."""
        try:
            ex = make()
        except BaseException:
            self.abandon()
            raise
        report = self.wait()
        note = report.note() if report is not None else None
        if note:
            notes.append(note)
        return ex, report

    def abandon(self) -> None:
        """The run stops before its loop: builds not started are dropped, those under way end on their own."""
        if self.running is not None:
            self.running.abandon()
            self.running = None

    def record(self) -> str | None:
        """The user's file's list for this configuration set to the variants this process holds; the
        note saying so."""
        if self.user_file is None:
            return None
        if self.key is None:
            return (f"--kernel-variants: nothing recorded in {self.user_file}: kernel variants are built on a GPU "
                    "(this run executed on the CPU)")
        from .device import prebuild as pb
        from .output_files import write_output

        held = pb.loaded_variants()
        doc, new, gone = pb.with_variants(pb.read_lists(self.user_file), self.key, self.label, held)
        write_output(self.user_file, "--kernel-variants", pb.dumps(doc))
        return (f"--kernel-variants: {len(held):,} kernel variants listed for this configuration in {self.user_file}, "
                f"the ones this run used ({new:,} new" + (f", {gone:,} no longer used dropped" if gone else "") + ")")
