"""Library entry points behind the CLI: plan a scenario, record its trace, check invariants.

A notebook can call these directly; the CLI only parses flags and renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Callable, Optional

from .checks import Checks
from .device.builds import built_variants, cache_entries, grown
from .config import LoadedScenario, blocks_problem, peak_tokens
from .errors import InputError
from .sched.invariants import NAME as INVARIANTS, InvariantChecker
from .simulate import RunStats, Simulation
from .trace import TraceWriter, header_dict
from .workload import Workload, build_workload


@dataclass
class StepRecord:
    step: int
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    blocks_in_use: int
    preempted: int
    state_copies: int
    step_ms: float


STEP_COLUMNS = [f for f in StepRecord.__dataclass_fields__]


@dataclass
class RunResult:
    scenario_name: str
    stats: RunStats
    checks: Checks
    wall_s: float
    schedule_s: float
    update_s: float
    workload: Workload
    trace_path: Optional[Path] = None
    timings: list[dict] = field(default_factory=list)
    device_timings: Optional[list[dict]] = None  # GPU runs: the executor's phases' device time (device/clock.py)
    oracle_phases: tuple[str, ...] = ()  # which of the executor's phases run the oracles (its layer kinds say)
    check_phases: tuple[str, ...] = ()  # which check rather than run the system: the oracles' and every other check's
    steps: list[StepRecord] = field(default_factory=list)
    kernel_timings: Optional[dict] = None  # GPU runs: per-kernel CUDA-event timings
    executed: bool = False  # steps executed and/or checked: wall_s is not planning alone
    planner: Optional[str] = None  # whose scheduler planned the steps, when not hybridsim's
    memory: Optional[dict] = None  # the memory plan (engine/memory.py) and, on a GPU, the measured peak
    whole_block_hit_tokens: Optional[int] = None  # partial-block hits: the same workload's with whole-block units
    kernel_builds: Optional[dict] = None  # executed runs: kernel variants built inside the loop (device/builds.py)
    kernel_prebuild: Optional[dict] = None  # GPU runs with a listed configuration: variants built before the loop
    kernel_compiles: Optional[int] = None  # entries the loop added to Triton's disk cache: variants it compiled

    @property
    def failed(self) -> bool:
        return self.checks.failed

    @property
    def oracle_device_share(self) -> Optional[float]:
        """The oracle phases' share of the executor phases' device time (GPU runs; None elsewhere)."""
        return phase_share(self.device_timings, self.oracle_phases) if self.device_timings is not None else None

    @property
    def checking_device_share(self) -> Optional[float]:
        """Every checking phase's share (the oracles, cross-checks such as ``mla_paths``, the kernel checks): what is
        left is the system's own work (GPU runs; None elsewhere)."""
        return phase_share(self.device_timings, self.check_phases) if self.device_timings is not None else None

    @property
    def oracle_per_system_work(self) -> Optional[float]:
        """The oracles' device time over the system's own work (GPU runs; None elsewhere)."""
        return (oracle_per_system_work(self.device_timings, self.oracle_phases, self.check_phases)
                if self.device_timings is not None else None)

    def as_dict(self) -> dict:
        steps = max(self.stats.steps, 1)
        return {
            "scenario": self.scenario_name,
            "summary": {**self.stats.as_dict(), **({"whole_block_hit_tokens": self.whole_block_hit_tokens}
                                                    if self.whole_block_hit_tokens is not None else {})},
            "checks": self.checks.as_list(),
            "first_divergence": dict(sorted(self.checks.divergence.items(), key=lambda kv: kv[1])),
            "timings": [
                {"phase": "schedule", "total_s": round(self.schedule_s, 6),
                 "per_step_us": round(1e6 * self.schedule_s / steps, 3)},
                {"phase": "update", "total_s": round(self.update_s, 6),
                 "per_step_us": round(1e6 * self.update_s / steps, 3)},
                *({"phase": f"execute: {t['phase']}", "total_s": t["total_s"]} for t in self.timings),
                {"phase": "wall", "total_s": round(self.wall_s, 6),
                 "steps_per_s": round(self.stats.steps / self.wall_s, 1) if self.wall_s else None},
            ],
            **({"device_timings": self.device_timings,
                **device_shares(self.device_timings, self.oracle_phases, self.check_phases)}
               if self.device_timings is not None else {}),
            "kernel_timings": self.kernel_timings,
            **({"kernel_builds": self.kernel_builds} if self.kernel_builds is not None else {}),
            **({"kernel_prebuild": self.kernel_prebuild} if self.kernel_prebuild is not None else {}),
            **({"kernel_compiles": self.kernel_compiles} if self.kernel_compiles is not None else {}),
            "memory": self.memory,
            **({"plan": self.planner} if self.planner else {}),
        }


def phase_rows(seconds: dict[str, float]) -> list[dict]:
    """Phases' times ({phase: seconds}) as ``--json`` rows: [{"phase", "total_s"}]."""
    return [{"phase": k, "total_s": round(v, 6)} for k, v in seconds.items()]


def phase_share(phases: list[dict], of: tuple[str, ...]) -> Optional[float]:
    """The share of the phases' total time ([{"phase", "total_s"}]) in the phases ``of``; None with no time at all."""
    total = sum(d["total_s"] for d in phases)
    return sum(d["total_s"] for d in phases if d["phase"] in of) / total if total > 0 else None


def oracle_per_system_work(phases: list[dict], oracle_phases: tuple[str, ...],
                           check_phases: tuple[str, ...]) -> Optional[float]:
    """The oracles' device time over the system's own work (every phase that checks nothing): a measure
    that, unlike a share of the loop, does not rise when another check or the system gets faster; None
    where the system did no work."""
    system = sum(d["total_s"] for d in phases if d["phase"] not in check_phases)
    return sum(d["total_s"] for d in phases if d["phase"] in oracle_phases) / system if system > 0 else None


def device_shares(phases: list[dict], oracle_phases: tuple[str, ...], check_phases: tuple[str, ...]) -> dict:
    """The oracles' and every check's share of the phases' device time, and the oracles' time over the
    system's own work, as a run's and a replay's ``--json`` give them."""
    return {"oracle_device_share": phase_share(phases, oracle_phases),
            "checking_device_share": phase_share(phases, check_phases),
            "oracle_per_system_work": oracle_per_system_work(phases, oracle_phases, check_phases)}


def check_workload_fits(loaded: LoadedScenario, wl: Workload) -> None:
    """A workload is only known once built (a trace's once loaded): its longest request must fit
    the pool, the run must last until its first request arrives, and a ``preempt`` fault must name
    its requests (one naming no request would preempt nothing, silently)."""
    s = loaded.scenario
    if not wl.requests:
        raise InputError("the workload has no requests", loaded.where("workload"))
    ids = {r.req_id for r in wl.requests}
    for i, f in enumerate(s.faults):
        unknown = [rid for rid in getattr(f, "requests", ()) if rid not in ids]
        if unknown:
            raise InputError(f"faults.{i}.requests: {', '.join(map(repr, unknown))} "
                             f"{'is' if len(unknown) == 1 else 'are'} not a request of this workload "
                             f"({_id_span(wl)})", loaded.where("faults", i, "requests"))
    problem = blocks_problem(s, max(peak_tokens(s, len(r.prompt), r.max_tokens) for r in wl.requests))
    if problem:
        raise InputError(f"cache.num_blocks: {problem}", loaded.where("cache", "num_blocks"))
    first = min(r.arrival_step for r in wl.requests)
    if first >= s.execution.max_steps:  # (a run of no steps: every check would pass having compared nothing)
        raise InputError(f"execution.max_steps: the run stops at step {s.execution.max_steps:,}, before the first "
                         f"request arrives (step {first:,}); nothing would run", loaded.where("execution", "max_steps"))


def _id_span(wl: Workload) -> str:
    """The workload's request ids, shortly: 'r0 .. r23' where they run so, else the first few."""
    ids = [r.req_id for r in wl.requests]
    if ids == [f"r{i}" for i in range(len(ids))]:
        return f"{ids[0]} .. {ids[-1]}" if len(ids) > 1 else ids[0]
    return ", ".join(ids[:4]) + (f", ... ({len(ids):,} requests)" if len(ids) > 4 else "")


def plan_scenario(loaded: LoadedScenario, *, record: Optional[Path] = None, check: Optional[str] = None,
                  progress: Optional[Callable[[RunStats], None]] = None, execute: Optional[bool] = None,
                  bugs: Optional[set[str]] = None, kernels: Optional[str] = None,
                  device: Optional[str] = None, announce: Optional[Callable[[list[str]], None]] = None,
                  scheduler: Optional[str] = None, kernel_variants: Optional[Path] = None) -> RunResult:
    """Plan a scenario; with checks on, also execute every step and compare with the oracle.
    ``scheduler``: whose scheduler plans (default the scenario's ``execution.scheduler``): ours, or
    ``vllm``, the installed vLLM's own (``engines.vllm_live``), checked the same way.
    ``kernel_variants``: a kernel variants file (``device/prebuild.py``): on a GPU the variants it lists
    for this configuration are built before the loop, and its list for it becomes the ones the run used."""
    s = loaded.scenario
    user_lists = None
    if kernel_variants is not None:  # (bad input before any work, executed or not)
        from .device.prebuild import read_lists
        user_lists = read_lists(kernel_variants)
    scheduler = scheduler or s.execution.scheduler
    if scheduler != s.execution.scheduler:  # (a trace's header says whose plan it holds)
        s = loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"scheduler": scheduler})})
    check = check or s.execution.check
    execute = (check != "off") if execute is None else execute
    planner = None
    if scheduler == "vllm":
        from .engines.support import require_vllm, vllm_refusals
        vllm_refusals(loaded, bugs)
        planner = f"vLLM {require_vllm()} scheduler (live)"
    if bugs:
        from .bugs import check_bugs_apply
        check_bugs_apply(s, bugs)
    wl = build_workload(loaded)
    check_workload_fits(loaded, wl)
    checks = Checks()
    if planner is not None:
        from .engines.vllm_live import VllmPlanner
        sim = VllmPlanner(s, wl, loaded.source, checks)
    else:
        sim = Simulation(s, wl)
    if bugs and planner is None:
        from .sched.injected import inject
        inject(sim.kv, bugs)
    notes: list[str] = []
    executor = None
    lists = prebuilt = None
    if execute:
        from .execute import KernelLists, make_executor
        lists = KernelLists(s, kernels or s.execution.kernels, device or s.execution.device, check, bugs or set(),
                            kernel_variants, user_lists)
        executor, prebuilt = lists.beside(
            lambda: make_executor(s, sim.groups, checks, check, bugs or set(), kernels or s.execution.kernels,
                                  device or s.execution.device, notes, where=loaded.where("cache", "num_blocks"),
                                  announce=announce), notes)
    if check != "off" and planner is not None:  # (vLLM's plans: what any engine's plans must satisfy)
        from .engines.vllm_live import PLAN_CHECK, PlanChecker
        sim.checker = PlanChecker(sim, checks.get(PLAN_CHECK))
    elif check != "off":
        checker = InvariantChecker(sim.scheduler, checks.get(INVARIANTS))
        sim.checker = checker
        sim.check_every = 1 if check == "full" else 16
    writer = None
    if record is not None:
        writer = TraceWriter(record, header_dict(s.model_dump(mode="json"), sim.groups, wl.requests,
                                                 f"hybridsim run {loaded.source}"
                                                 + (f" (plan: {planner})" if planner else ""), tuple(bugs or ())))
    records: list[StepRecord] = []
    pool = sim.kv.pool
    usable = pool.num_blocks - 1
    builds_before = built_variants() if executor is not None else None
    cached_before = cache_entries() if executor is not None else None
    t0 = last = perf_counter()
    try:
        for plan, outcome in sim:
            if writer is not None:
                writer.write(plan, outcome)
            if executor is not None:
                executor.step(plan, outcome)
            now = perf_counter()
            records.append(StepRecord(plan.step, sim.last_tokens[0], sim.last_tokens[1], len(sim.scheduler.running),
                                      len(sim.scheduler.waiting), usable - pool.num_free, len(plan.preempted),
                                      executor.last_copies if executor is not None else 0, 1e3 * (now - last)))
            last = now
            if progress is not None:
                progress(sim.stats)
        if executor is not None:
            executor.finish()  # (the last step's verdicts, read one step late on a GPU)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    wall = perf_counter() - t0
    builds = grown(builds_before, built_variants()) if builds_before is not None else None
    cached_after = cache_entries() if cached_before is not None else None
    if writer is not None:
        writer.close()
    res = RunResult(s.name, sim.stats, checks, wall, sim.schedule_s, sim.update_s, wl, record, steps=records,
                    executed=executor is not None or check != "off", planner=planner)
    from .units import whole_block_hit_tokens
    res.whole_block_hit_tokens = whole_block_hit_tokens(s, wl)  # (planning only: after the timed loop)
    if executor is not None:
        res.timings = phase_rows(executor.timings)
        dev = executor.device_timings
        res.oracle_phases = executor.oracle_phases
        res.check_phases = executor.check_phases
        if dev is not None:
            res.device_timings = phase_rows(dev)
        if executor.kernel_timer is not None:
            res.kernel_timings = executor.kernel_timer.summary()
        res.memory = executor.memory_report()
        res.kernel_builds = builds
        if builds and cached_after is not None:
            res.kernel_compiles = len(cached_after - cached_before)
        res.kernel_prebuild = prebuilt.as_dict() if prebuilt is not None else None
    if lists is not None:  # (after the kernel table's ceilings, whose probe is a kernel variant too)
        recorded = lists.record()
        if recorded:
            notes.append(recorded)
        elif res.kernel_compiles and prebuilt is None:
            notes.append(f"the loop compiled {res.kernel_compiles:,} kernel cache entries (variants and launchers); no "
                         "list of them exists for this configuration: `--kernel-variants FILE` records one, and a run "
                         "of this configuration given it builds them before its loop, in parallel, on a fresh machine")
    elif kernel_variants is not None:
        notes.append(f"--kernel-variants: nothing recorded in {kernel_variants}: the run executed no step (checks off)")
    sim.stats.notes.extend(notes)
    return res
