"""Fidelity: re-simulate a real engine's recording with our scheduler, compare step by step.

Same requests, prompt token ids, config and model outputs (the recorded sampled
tokens and drafts), so any difference is a difference in scheduling or cache
bookkeeping. A step is identical when the same requests are scheduled with the
same token counts, the same requests are preempted, and every newly admitted
request gets the same prefix hit. Free-block counts and the block ids handed out are
compared as well, group by group, and reported separately with their first differing
steps (they expose bookkeeping drift before it changes a decision).
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
    # the first steps whose free-block count or block ids differ (block ids: per group)
    block_diffs: list[StepDiff] = field(default_factory=list)
    block_ids_equal_by_group: list[int] = field(default_factory=list)
    # steps whose private block copies (partial-block hits) are the engine's, pair for pair; None: the
    # recording predates its ``block_copies`` key
    block_copies_equal: "int | None" = None

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
            "block_ids_equal_steps_by_group": self.block_ids_equal_by_group,
            **({"block_copies_equal_steps": self.block_copies_equal} if self.block_copies_equal is not None else {}),
            "first_diffs": [d.__dict__ for d in self.diffs[:20]],
            "first_block_diffs": [d.__dict__ for d in self.block_diffs[:20]],
        }


def _recorded_view(s: dict) -> dict:
    sched = dict(s["num_scheduled_tokens"])
    hits = {r["id"]: r["num_computed_tokens"] for r in s["scheduled_new_reqs"]}
    blocks = {r["id"]: [list(g) for g in r["block_ids"]] for r in s["scheduled_new_reqs"]}
    for r in s["scheduled_cached_reqs"]:
        if r["new_block_ids"] is not None:
            blocks[r["id"]] = [list(g) for g in r["new_block_ids"]]
    return {"sched": sched, "preempted": sorted(s["preempted_req_ids"]), "hits": hits,
            "free": s["num_free_blocks"], "blocks": blocks,
            "copies": [tuple(c) for c in s["block_copies"]] if "block_copies" in s else None}


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(d.items())) or "-"


def run_fidelity(path: str, keep_diffs: int = 50, keep_block_diffs: int = 5) -> FidelityReport:
    """``keep_block_diffs``: first differing steps listed per kind (free blocks, each group's ids)."""
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
            "copies": list(plan.block_copies),
        }
    recorded = {s["step"]: _recorded_view(s) for s in rec.steps}
    report = FidelityReport(str(path), len(recorded), len(ours), 0, 0)
    ngroups = len(sim.groups)
    names = [" (drafter)" if gr.draft else "" for gr in sim.groups]
    report.block_ids_equal_by_group = [0] * ngroups
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
        if r["copies"] is not None:
            same_copies = r["copies"] == o["copies"]
            report.block_copies_equal = (report.block_copies_equal or 0) + same_copies
            if not same_copies and _room(report, step, "block copies", keep_block_diffs):
                report.block_diffs.append(StepDiff(step, "block copies", str(r["copies"]), str(o["copies"])))
        report.free_blocks_equal += r["free"] == o["free"]
        report.block_ids_equal += r["blocks"] == o["blocks"]
        if r["free"] != o["free"] and _room(report, step, "free blocks", keep_block_diffs):
            report.block_diffs.append(StepDiff(step, "free blocks", str(r["free"]), str(o["free"])))
        for g in range(ngroups):
            rg, og = _group_view(r["blocks"], g), _group_view(o["blocks"], g)
            if rg == og:
                report.block_ids_equal_by_group[g] += 1
            elif _room(report, step, f"block ids, group {g}", keep_block_diffs):
                report.block_diffs.append(StepDiff(step, f"block ids, group {g}{names[g]}", _fmt_rows(rg),
                                                   _fmt_rows(og)))
    return report


def _group_view(blocks: dict, g: int) -> dict:
    """Per request, the block ids a step hands out in group ``g`` (requests with none left out)."""
    return {rid: rows[g] for rid, rows in blocks.items() if g < len(rows) and rows[g]}


def _fmt_rows(d: dict) -> str:
    return ", ".join(f"{k}:[{' '.join(map(str, v))}]" for k, v in sorted(d.items())) or "-"


def _room(report: FidelityReport, step: int, what: str, keep: int) -> bool:
    """Whether another first difference of this kind is listed (``keep`` per kind)."""
    return sum(1 for d in report.block_diffs if d.what.startswith(what)) < keep
