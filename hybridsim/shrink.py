"""Shrinking a failing trace: the smallest trace that still fails the same check.

First the trace is cut right after the step where the check first fails. Then its workload is
delta-debugged: every candidate is re-planned with the trace's own scenario and the committed
tokens recorded in the trace (so every kept request has the same prompt and continuation),
replayed with the same injected bugs, kept if the same check still fails, and cut at that
failure. The passes, repeated while any of them makes progress:

* requests: ddmin over the request set (subsets, then complements, at ever finer granularity);
* steps: what makes steps is each request's tokens and arrival and the scenario's faults, so
  they are delta-debugged too: faults left out or moved earlier, arrivals pulled together,
  outputs cut short (``max_tokens``), prompts cut to a prefix; a candidate is kept when it
  still fails and takes no more steps.

Each accepted candidate is the new baseline; ``progress`` (the CLI shows it with Rich) hears of
every candidate tried.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from pydantic import ValidationError

from .checks import Checks
from .config import Scenario
from .errors import InputError
from .execute import make_executor
from .outputs import RecordedContinuation
from .sched.plan import StepOutcome, StepPlan
from .simulate import Simulation
from .sched.injected import SCHEDULER_BUGS, inject
from .trace import Trace, header_dict, read_trace, trace_in_memory, write_trace
from .trace_verify import CHECK as VERIFY_CHECK, verify_trace
from .workload.base import Workload, WorkloadRequest

Records = list[tuple[StepPlan, StepOutcome]]
Progress = Callable[[str, int, int, int], None]  # (phase, candidates tried, steps, requests)


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


def _first_violation(header: dict, scenario: Scenario, records: Records) -> Optional[int]:
    """Index of the step where the schedule first breaks the engine's rules (``sched.recorded``), or None."""
    tr = Trace(Path("candidate"), header, [(i + 2, p, o) for i, (p, o) in enumerate(records)])
    checks = Checks()
    if verify_trace(tr, scenario, checks):
        return None
    step = checks.tallies[VERIFY_CHECK].first_failure.step
    return next((i for i, (p, _) in enumerate(records) if p.step == step), len(records) - 1)


class _Shrinker:
    """The candidate workloads tried and the best one so far."""

    def __init__(self, scenario: Scenario, groups, bugs: set[str], check: str, streams: dict, vocab: int,
                 max_tests: int, progress: Optional[Progress]):
        self.scenario, self.groups, self.bugs, self.check = scenario, groups, bugs, check
        self.streams, self.vocab = streams, vocab
        self.max_tests, self.progress = max_tests, progress
        self.tests = 0
        self.reqs: list[WorkloadRequest] = []
        self.records: Records = []

    @property
    def spent(self) -> bool:
        return self.tests >= self.max_tests

    def attempt(self, reqs: list[WorkloadRequest], phase: str, scenario: Optional[Scenario] = None) -> Optional[Records]:
        """The candidate re-planned and replayed: its records cut at the check's first failure, or None."""
        self.tests += 1
        if self.progress is not None:
            self.progress(phase, self.tests, len(self.records), len(self.reqs))
        scenario = scenario or self.scenario
        wl = Workload(sorted(reqs, key=lambda r: r.arrival_step), self.vocab, "shrink")
        sim = Simulation(scenario, wl, continuation=RecordedContinuation(self.streams, self.vocab))
        sched_bugs = self.bugs & set(SCHEDULER_BUGS)
        if sched_bugs:  # (a scheduler bug plans every candidate too)
            inject(sim.kv, sched_bugs)
        recs: Records = []
        limit = 4 * max(len(self.records), 1) + 64  # (a candidate that runs far longer cannot win)
        for plan, outcome in sim:
            recs.append((plan, outcome))
            if len(recs) > limit:
                return None
        if self.check == VERIFY_CHECK:
            header = header_dict(scenario.model_dump(mode="json"), [], wl.requests, "shrink") | {"groups": self.groups}
            i = _first_violation(header, scenario, recs)
        else:
            _, i = _first_failure(scenario, self.groups, recs, self.bugs, self.check)
        return None if i is None else recs[: i + 1]

    def take(self, reqs: list[WorkloadRequest], phase: str, fewer_steps_only: bool = False,
             scenario: Optional[Scenario] = None) -> bool:
        """Try a candidate; it becomes the baseline if it fails the same check in no more steps
        (``fewer_steps_only``: in fewer)."""
        if self.spent:
            return False
        got = self.attempt(reqs, phase, scenario)
        if got is None or len(got) > len(self.records) or fewer_steps_only and len(got) == len(self.records):
            return False
        self.reqs, self.records = list(reqs), got
        if scenario is not None:
            self.scenario = scenario
        return True

    def faults(self) -> bool:
        """The scenario's faults: each left out, else moved to half its step."""
        fs = list(self.scenario.faults)
        for i, f in enumerate(fs):
            for cand in (fs[:i] + fs[i + 1:], fs[:i] + [f.model_copy(update={"at_step": f.at_step // 2})] + fs[i + 1:]):
                if cand != fs and self.take(self.reqs, "faults", True, self.scenario.model_copy(update={"faults": cand})):
                    return True
        return False

    # ------------------------------------------------------------------ passes
    def ddmin_requests(self) -> bool:
        """Zeller's ddmin over the request set: subsets first, then complements."""
        changed = False
        n = 2
        while len(self.reqs) >= 2 and not self.spent:
            reqs = self.reqs
            size = -(-len(reqs) // n)
            chunks = [reqs[i:i + size] for i in range(0, len(reqs), size)]
            reduced = False
            for chunk in chunks:  # a subset alone
                if len(chunk) < len(reqs) and self.take(chunk, "requests"):
                    n, reduced = 2, True
                    break
            if not reduced:
                for chunk in chunks:  # a complement
                    keep = [r for r in reqs if r not in chunk]
                    if keep and self.take(keep, "requests"):
                        n, reduced = max(n - 1, 2), True
                        break
            if reduced:
                changed = True
                continue
            if n >= len(reqs):
                break
            n = min(len(reqs), n * 2)
        return changed

    def arrivals(self) -> bool:
        """Pull arrivals together: all at the first one, else every gap halved."""
        reqs = self.reqs
        first = min(r.arrival_step for r in reqs)
        for cand in ([replace(r, arrival_step=first) for r in reqs],
                     [replace(r, arrival_step=first + (r.arrival_step - first) // 2) for r in reqs]):
            if cand != reqs and self.take(cand, "arrivals", fewer_steps_only=True):
                return True
        return False

    def lengths(self) -> bool:
        """Per request: outputs, then prompts, cut to the shortest of a few lengths that still fails."""
        changed = False
        for k in range(len(self.reqs)):
            for field_, floor in (("max_tokens", 1), ("prompt", 1)):
                if self.spent or k >= len(self.reqs):
                    return changed
                r = self.reqs[k]
                now = r.max_tokens if field_ == "max_tokens" else len(r.prompt)
                for size in sorted({floor, now // 4, now // 2, 3 * now // 4} - {now}):
                    if size < floor:
                        continue
                    cut = replace(r, max_tokens=size) if field_ == "max_tokens" else replace(r, prompt=r.prompt[:size])
                    cand = self.reqs[:k] + [cut] + self.reqs[k + 1:]
                    if self.take(cand, "outputs" if field_ == "max_tokens" else "prompts"):
                        changed = True
                        break
        return changed


def shrink_trace(path: str | Path, out: str | Path, check: Optional[str] = None,
                 bugs: Optional[set[str]] = None, max_tests: int = 300,
                 progress: Optional[Progress] = None) -> ShrinkResult:
    tr = read_trace(path)
    header = tr.header
    bugs = set(bugs if bugs is not None else header.get("inject_bug", ()))
    try:
        scenario = Scenario.model_validate(header["scenario"])
    except ValidationError as e:  # (as replay says it)
        raise InputError(f"the header's scenario is invalid: {e.errors()[0]['msg']}", f"{path}:1") from None
    groups = header["groups"]
    records: Records = [(p, o) for _, p, o in tr.steps]
    wanted, ran = check, {VERIFY_CHECK}
    idx = _first_violation(header, scenario, records)  # (a schedule no engine makes is its first failure:
    if idx is not None:  # nothing of it is executed, as in a replay)
        if wanted not in (None, VERIFY_CHECK):
            raise InputError(f"--check {wanted}: the trace's recorded schedule breaks the engine's rules "
                             f"({VERIFY_CHECK}), so no step of it is executed; shrink it with --check {VERIFY_CHECK}",
                             str(path))
        check = VERIFY_CHECK
    else:
        check, idx = _first_failure(scenario, groups, records, bugs, None if wanted == VERIFY_CHECK else wanted, ran)
        if wanted == VERIFY_CHECK:
            check = None
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
    top = 1 + max([max(p) for p in prompts.values()] + [max(v) for v in streams.values() if v] + [15])
    # (the scenario's own vocabulary where it covers the tokens: a seeded continuation past the
    # recorded outputs is then the workload's true one)
    vocab = max(top, getattr(scenario.workload, "vocab_size", top))
    admitted = [rid for rid in meta if rid in prompts and any(s.req_id == rid for p, _ in records for s in p.scheduled)]
    reqs = [WorkloadRequest(rid, meta[rid]["arrival_step"], tuple(prompts[rid]), meta[rid]["max_tokens"],
                            meta[rid].get("priority", 0), meta[rid].get("output_seed", 0)) for rid in admitted]
    sh = _Shrinker(scenario, groups, bugs, check, streams, vocab, max_tests, progress)
    sh.reqs, sh.records = reqs, records
    first = sh.attempt(reqs, "re-plan")  # re-planned form of the truncated trace (same requests)
    replanned = first is not None and len(first) <= len(records)
    if replanned:
        sh.records = first
        while not sh.spent:
            progress_made = sh.ddmin_requests()
            progress_made |= sh.faults()
            progress_made |= sh.arrivals()
            progress_made |= sh.lengths()
            if not progress_made:
                break
    kept = sh.reqs if replanned else reqs
    source = f"hybridsim shrink {Path(path).name} ({check})"
    scenario_json = header["scenario"]
    if sh.scenario is not scenario:  # (faults left out or moved)
        scenario_json = scenario_json | {"faults": [f.model_dump(mode="json") for f in sh.scenario.faults]}
    shrunk = header_dict(scenario_json, [], sorted(kept, key=lambda r: r.arrival_step), source,
                         tuple(sorted(bugs))) | {"groups": groups}
    # the shrunk trace must itself be consistent (checked before it is written: ``out`` may be a pipe)
    trace_in_memory(out, shrunk, ((i + 2, p, o) for i, (p, o) in enumerate(sh.records)))
    write_trace(out, shrunk, sh.records)
    return ShrinkResult(check, before_steps, len(sh.records), before_reqs, len(kept), sh.tests, Path(out))
