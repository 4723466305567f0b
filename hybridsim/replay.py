"""Replay: execute a recorded step trace exactly as recorded, with the same checks as ``run``.

The trace's token accounting is verified before any kernel runs; a trace that does
not add up is rejected with the line number of the first inconsistency. Then the recorded
schedule is held to the engine's rules (``trace_verify``, the ``sched.recorded`` check); a
schedule that breaks one is a failed check, and none of its steps is executed. A vLLM scheduler
recording is converted in memory first (what ``hybridsim convert`` would write) and replayed
the same way, with a note saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Callable, Optional

from pydantic import ValidationError

from .checks import Checks
from .config import Scenario
from .errors import InputError
from .bugs import check_bugs_apply, inapplicable_bugs
from .execute import KernelLists, make_executor
from .runner import device_shares, phase_rows
from .trace import Trace, read_trace
from .trace_verify import CHECK as VERIFY_CHECK, verify_trace
from .vllm_recorded import is_vllm_recording

CONVERTED_NOTE = "vLLM recording converted in memory (`hybridsim convert` writes the trace)"


@dataclass
class ReplayResult:
    path: Path
    steps: int
    requests: int
    checks: Checks
    wall_s: float
    notes: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    digests: dict = field(default_factory=dict)
    kernel_timings: Optional[dict] = None  # GPU runs: per-kernel CUDA-event timings
    memory: Optional[dict] = None  # the memory plan and, on a GPU, the measured peak
    device_timings: Optional[dict] = None  # GPU replays: the executor's phases' device time (device/clock.py)
    oracle_phases: tuple[str, ...] = ()  # which of those run the oracles, and which check (as ``RunResult``'s)
    check_phases: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.checks.failed

    def as_dict(self) -> dict:
        dev = phase_rows(self.device_timings) if self.device_timings is not None else None
        return {"trace": str(self.path), "summary": {"steps": self.steps, "requests": self.requests,
                                                     "wall_s": round(self.wall_s, 6), "notes": self.notes},
                "checks": self.checks.as_list(),
                "first_divergence": dict(sorted(self.checks.divergence.items(), key=lambda kv: kv[1])),
                "timings": phase_rows(self.timings),
                **({"device_timings": dev, **device_shares(dev, self.oracle_phases, self.check_phases)}
                   if dev is not None else {}),
                "kernel_timings": self.kernel_timings, "memory": self.memory}


@dataclass
class Verified:
    """A trace read, its accounting proved, and its schedule held to the engine's rules."""

    trace: Trace
    scenario: Scenario
    checks: Checks  # ``sched.recorded`` first
    ok: bool
    seconds: float  # the schedule's verification
    notes: list[str]


def verify_recorded(path: str | Path) -> Verified:
    """What ``replay_trace`` does before it executes anything: read the trace (a vLLM recording is
    converted in memory), then verify its schedule. Bad input raises ``InputError``; a broken rule
    is a failed ``sched.recorded`` check (``ok`` False)."""
    notes: list[str] = []
    if is_vllm_recording(path):  # (``read_trace`` would refuse it: convert it here, in memory)
        from .convert import recording_trace
        tr = recording_trace(path)
        notes.append(CONVERTED_NOTE)
    else:
        tr = read_trace(path)  # raises InputError (with line) on any accounting inconsistency
    if not tr.steps:  # (every check would pass having compared nothing)
        raise InputError("the trace has no steps after its header: nothing to replay", str(path))
    try:
        scenario = Scenario.model_validate(tr.header["scenario"])
    except ValidationError as e:
        raise InputError(f"the header's scenario is invalid: {e.errors()[0]['msg']}", f"{path}:1") from None
    checks = Checks()
    t0 = perf_counter()
    ok = verify_trace(tr, scenario, checks)  # (first: ``sched.recorded`` leads the checks table)
    return Verified(tr, scenario, checks, ok, perf_counter() - t0, notes)


def replay_trace(path: str | Path, *, check: str = "full", bugs: Optional[set[str]] = None,
                 kernels: str = "reference", device: str = "auto",
                 announce: Optional[Callable[[list[str]], None]] = None, strict_bugs: bool = True,
                 progress: Optional[Callable[[int, int], None]] = None) -> ReplayResult:
    """``strict_bugs``: a bug in a layer kind this trace's model lacks is bad input (one trace named);
    else (a folder, a golden gate) a note on this trace. ``progress``: called after each step with
    (steps done, steps in all)."""
    v = verify_recorded(path)
    if check != "off":  # (a recording from before block copies were recorded: its partial hits cannot execute)
        _refuse_uncopied_hits(v.trace.steps, v.scenario.cache.block_size, path)
    tr, scenario, checks, notes, t_verify = v.trace, v.scenario, v.checks, v.notes, v.seconds
    if not v.ok:  # (executing a schedule the engine could not have made proves nothing more)
        notes.append(f"the recorded schedule breaks the engine's rules ({VERIFY_CHECK}): no step was executed")
        return ReplayResult(Path(path), len(tr.steps), len(tr.requests), checks, t_verify, notes,
                            {"verify schedule": t_verify})
    recorded_bugs = tr.header.get("inject_bug")
    if recorded_bugs and not bugs:
        notes.append(f"this trace was recorded with --inject-bug {' '.join(recorded_bugs)}; replay with the same "
                     "flags to reproduce its failure")
    if bugs and strict_bugs:
        check_bugs_apply(scenario, bugs)
    elif bugs:
        notes += [f"--inject-bug: {m}: it changes nothing in this trace" for m in inapplicable_bugs(scenario, bugs)]
    lists = KernelLists(scenario, kernels, device, check, bugs or set())  # (on a GPU: the package's list, if any)
    ex, _ = lists.beside(lambda: make_executor(scenario, tr.header["groups"], checks, check, bugs or set(), kernels,
                                               device, notes, where=f"{path}:1", announce=announce, digests=True,
                                               capacity=_distinct_blocks(tr.steps)), notes)
    t0 = perf_counter()
    for i, (ln, plan, outcome) in enumerate(tr.steps, 1):
        try:
            ex.step(plan, outcome)
        except InputError as e:  # (what the executor finds wrong in a step: the trace's file and line)
            if e.where is None:
                e.where = f"{path}:{ln}"
            raise
        if progress is not None:
            progress(i, len(tr.steps))
    ex.finish()
    wall = perf_counter() - t0
    return ReplayResult(Path(path), len(tr.steps), len(tr.requests), checks, wall, notes,
                        {"verify schedule": t_verify, **ex.timings},
                        ex.state_digests(), ex.kernel_timer.summary() if ex.kernel_timer is not None else None,
                        ex.memory_report(), ex.device_timings, ex.oracle_phases, ex.check_phases)


def _refuse_uncopied_hits(steps, block_size: int, path) -> None:
    """Hits inside a block hand out private copies that the worker fills (``StepPlan.block_copies``).
    A trace or recording with such hits and not one copy was written before copies were recorded:
    executing it would read unfilled pages, so it is refused rather than failed."""
    if any(plan.block_copies for _, plan, _ in steps):
        return
    for _, plan, _ in steps:
        for s in plan.scheduled:
            if s.is_new and s.prefix_hit_tokens % block_size:
                raise InputError(f"step {plan.step}: {s.req_id} hits {s.prefix_hit_tokens} tokens, inside a "
                                 f"{block_size}-token block, but the file records no block copies (written before "
                                 "they were recorded: re-record it with bench/peer_vllm.py --record, or "
                                 "`hybridsim run --record`); replay it with --check off", str(path))


def _distinct_blocks(steps) -> int:
    """Pages a replay needs: the distinct block ids the trace hands out, and the null block (a
    recorded engine's pool is often far larger than what its trace touches)."""
    seen: set[int] = set()
    for _, plan, _ in steps:
        for pair in plan.block_copies:  # (a running request's copy is in no row)
            seen.update(pair)
        for s in plan.scheduled:
            if s.new_block_ids is not None:
                for row in s.new_block_ids:
                    seen.update(row)
    seen.add(0)
    return len(seen)
