"""Shrinking a failing trace: the smallest trace that still fails the same check.

First the trace is cut right after the step where the check first fails. Then
requests are removed by delta debugging: each candidate subset is re-planned with
the trace's own scenario and the committed tokens recorded in the trace (so every
kept request has the same prompt and continuation), replayed with the same injected
bugs, and kept if the check still fails; every kept candidate is cut again at its
first failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from .checks import Checks
from .config import Scenario
from .errors import InputError
from .execute import make_executor
from .outputs import RecordedContinuation
from .sched.plan import StepOutcome, StepPlan
from .simulate import Simulation
from .trace import header_dict, read_trace, trace_in_memory, write_trace
from .workload.base import Workload, WorkloadRequest

Records = list[tuple[StepPlan, StepOutcome]]


class _Stop(Exception):
    pass


@dataclass
class ShrinkResult:
    check: str
    steps_before: int
    steps_after: int
    requests_before: int
    requests_after: int
    tests: int
    out: Path


def _first_failure(scenario: Scenario, groups, records: Records, bugs: set[str],
                   check: Optional[str], ran: Optional[set[str]] = None) -> tuple[Optional[str], Optional[int]]:
    """(check, index of the step) of the first failure, stopping the replay there; ``ran``
    collects the names of the checks that compared something."""
    checks = Checks()
    ex = make_executor(scenario, groups, checks, "full", bugs, "reference", "cpu", [])
    try:
        for i, (plan, outcome) in enumerate(records):
            ex.step(plan, outcome)
            failing = [t for t in checks.tallies.values() if t.failures and (check is None or t.name == check)]
            if failing:
                return failing[0].name, i
        return None, None
    finally:
        if ran is not None:
            ran.update(t.name for t in checks.tallies.values() if t.count)


def shrink_trace(path: str | Path, out: str | Path, check: Optional[str] = None,
                 bugs: Optional[set[str]] = None, max_tests: int = 200) -> ShrinkResult:
    tr = read_trace(path)
    header = tr.header
    bugs = set(bugs if bugs is not None else header.get("inject_bug", ()))
    try:
        scenario = Scenario.model_validate(header["scenario"])
    except ValidationError as e:  # (as replay says it)
        raise InputError(f"the header's scenario is invalid: {e.errors()[0]['msg']}", f"{path}:1") from None
    groups = header["groups"]
    records: Records = [(p, o) for _, p, o in tr.steps]
    wanted, ran = check, set()
    check, idx = _first_failure(scenario, groups, records, bugs, wanted, ran)
    if check is None:
        with_bugs = f" with --inject-bug {', '.join(sorted(bugs))}" if bugs else ""
        if wanted is not None and wanted not in ran:
            raise InputError(f"--check {wanted}: no such check ran on this trace (ran: {', '.join(sorted(ran))})",
                             str(path))
        raise InputError((f"check {wanted} never fails on the trace" if wanted else "the trace passes every check")
                         + with_bugs + "; nothing to shrink", str(path))
    before_steps, before_reqs = len(records), len(header["requests"])
    records = records[: idx + 1]
    # the workload, with every request's committed tokens as its continuation
    prompts, streams = {}, {}
    for plan, outcome in [(p, o) for _, p, o in tr.steps]:
        for s in plan.scheduled:
            if s.prompt_token_ids is not None:
                prompts.setdefault(s.req_id, s.prompt_token_ids)
        for rid, toks in outcome.sampled.items():
            streams.setdefault(rid, []).extend(toks)
    meta = {r["id"]: r for r in header["requests"]}
    vocab = 1 + max([max(p) for p in prompts.values()] + [max(v) for v in streams.values() if v] + [15])
    admitted = [rid for rid in meta if rid in prompts and any(s.req_id == rid for p, _ in records for s in p.scheduled)]

    def workload(ids: list[str]) -> Workload:
        reqs = [WorkloadRequest(rid, meta[rid]["arrival_step"], tuple(prompts[rid]), meta[rid]["max_tokens"],
                                meta[rid].get("priority", 0), meta[rid].get("output_seed", 0)) for rid in ids]
        return Workload(reqs, vocab, "shrink")

    tests = 0

    def attempt(ids: list[str]) -> Optional[Records]:
        nonlocal tests
        tests += 1
        sim = Simulation(scenario, workload(ids), continuation=RecordedContinuation(streams, vocab))
        recs: Records = []
        for plan, outcome in sim:
            recs.append((plan, outcome))
        _, i = _first_failure(scenario, groups, recs, bugs, check)
        return None if i is None else recs[: i + 1]

    current_ids = admitted
    current = records
    first = attempt(current_ids)  # re-planned form of the truncated trace (same requests)
    if first is not None and len(first) <= len(current):
        current = first
    n = 2
    while len(current_ids) >= 2 and tests < max_tests:
        size = -(-len(current_ids) // n)
        chunks = [current_ids[i:i + size] for i in range(0, len(current_ids), size)]
        reduced = False
        for chunk in chunks:
            keep = [r for r in current_ids if r not in chunk]
            if not keep:
                continue
            got = attempt(keep)
            if got is not None:
                current_ids, current, reduced = keep, got, True
                n = max(n - 1, 2)
                break
        if not reduced:
            if n >= len(current_ids):
                break
            n = min(len(current_ids), n * 2)
    kept = set(current_ids) if current is not records else set(admitted)
    wl = workload([r for r in meta if r in kept])
    source = f"hybridsim shrink {Path(path).name} ({check})"
    shrunk = header_dict(header["scenario"], [], wl.requests, source, tuple(sorted(bugs))) | {"groups": groups}
    # the shrunk trace must itself be consistent (checked before it is written: ``out`` may be a pipe)
    trace_in_memory(out, shrunk, ((i + 2, p, o) for i, (p, o) in enumerate(current)))
    write_trace(out, shrunk, current)
    return ShrinkResult(check, before_steps, len(current), before_reqs, len(wl.requests), tests, Path(out))
