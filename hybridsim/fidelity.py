"""Fidelity: re-simulate a real engine's recording with our scheduler, compare step by step.

Same requests, prompt token ids, config and model outputs (the recorded sampled
tokens and drafts), so any difference is a difference in scheduling or cache
bookkeeping. A step is identical when the same requests are scheduled with the
same token counts, the same requests are preempted, and every newly admitted
request gets the same prefix hit. Free-block counts are compared as well and
reported separately (they expose bookkeeping drift before it changes a decision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .simulate import Simulation
from .vllm_recorded import Recording, load_recording


@dataclass
class StepDiff:
    step: int
    what: str
    recorded: str
    ours: str


@dataclass
class FidelityReport:
    recording: str
    steps_recorded: int
    steps_ours: int
    identical_steps: int
    free_blocks_equal: int
    diffs: list[StepDiff] = field(default_factory=list)
    block_ids_equal: int = 0

    @property
    def identical_steps_pct(self) -> float:
        n = max(self.steps_recorded, self.steps_ours)
        return 100.0 * self.identical_steps / n if n else 100.0

    def as_dict(self) -> dict:
        return {
            "recording": self.recording,
            "steps_recorded": self.steps_recorded,
            "steps_ours": self.steps_ours,
            "identical_steps": self.identical_steps,
            "identical_steps_pct": round(self.identical_steps_pct, 3),
            "free_blocks_equal_steps": self.free_blocks_equal,
            "block_ids_equal_steps": self.block_ids_equal,
            "first_diffs": [d.__dict__ for d in self.diffs[:20]],
        }


def _recorded_view(s: dict) -> dict:
    sched = dict(s["num_scheduled_tokens"])
    hits = {r["id"]: r["num_computed_tokens"] for r in s["scheduled_new_reqs"]}
    blocks = {r["id"]: [list(g) for g in r["block_ids"]] for r in s["scheduled_new_reqs"]}
    for r in s["scheduled_cached_reqs"]:
        if r["new_block_ids"] is not None:
            blocks[r["id"]] = [list(g) for g in r["new_block_ids"]]
    return {"sched": sched, "preempted": sorted(s["preempted_req_ids"]), "hits": hits,
            "free": s["num_free_blocks"], "blocks": blocks}


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(d.items())) or "-"


def run_fidelity(path: str, keep_diffs: int = 50) -> FidelityReport:
    rec: Recording = load_recording(path)
    sim = Simulation(rec.scenario, rec.workload, continuation=rec.continuation(), drafter=rec.drafter())
    pool = sim.kv.pool
    ours: dict[int, dict] = {}
    for plan, _ in sim:
        blocks = {s.req_id: [list(g) for g in s.new_block_ids] for s in plan.scheduled
                  if s.new_block_ids is not None}
        ours[plan.step] = {
            "sched": {s.req_id: s.num_scheduled_tokens for s in plan.scheduled},
            "preempted": sorted(plan.preempted),
            "hits": {s.req_id: s.prefix_hit_tokens for s in plan.scheduled if s.is_new},
            "free": pool.num_free,
            "blocks": blocks,
        }
    recorded = {s["step"]: _recorded_view(s) for s in rec.steps}
    report = FidelityReport(str(path), len(recorded), len(ours), 0, 0)
    for step in sorted(set(recorded) | set(ours)):
        r, o = recorded.get(step), ours.get(step)
        if r is None or o is None:
            report.diffs.append(StepDiff(step, "step missing", "present" if r else "absent",
                                         "present" if o else "absent"))
            continue
        same = True
        for key, what in (("sched", "scheduled tokens"), ("preempted", "preempted"), ("hits", "prefix hits")):
            if r[key] != o[key]:
                same = False
                if len(report.diffs) < keep_diffs:
                    fmt = _fmt if isinstance(r[key], dict) else (lambda x: ",".join(x) or "-")
                    report.diffs.append(StepDiff(step, what, fmt(r[key]), fmt(o[key])))
        report.identical_steps += same
        report.free_blocks_equal += r["free"] == o["free"]
        report.block_ids_equal += r["blocks"] == o["blocks"]
    return report
