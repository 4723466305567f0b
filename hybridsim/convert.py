"""Convert a vLLM scheduler recording into a hybridsim step trace (same steps, our format)."""

from __future__ import annotations

from pathlib import Path

from .sched.plan import ScheduledRequest, StepOutcome, StepPlan
from .simulate import kv_groups
from .trace import Trace, header_dict, trace_in_memory, write_trace
from .vllm_recorded import load_recording


def recording_records(rec) -> list[tuple[StepPlan, StepOutcome]]:
    prompts = {r["id"]: tuple(r["prompt_token_ids"]) for r in rec.requests}
    admitted: set[str] = set()
    return [recorded_step(s, prompts, admitted) for s in rec.steps]


def recorded_step(s: dict, prompts: dict[str, tuple[int, ...]], admitted: set[str]) -> tuple[StepPlan, StepOutcome]:
    """One step line of a recording as our plan and outcome. ``admitted``: the requests admitted
    by earlier lines (updated). Also read, when a line has them (the live driver,
    ``engines.vllm``, writes them): ``faults`` and ``forced`` (the plan's), ``accepted`` (drafts
    the verifier accepted, before any length cap) and ``finished_this_step``."""
    sched = []
    spec = s.get("scheduled_spec_decode_tokens") or {}
    # the engine schedules running requests before waiting ones
    for r in s["scheduled_cached_reqs"]:
        nb = r["new_block_ids"]
        sched.append(ScheduledRequest(
            r["id"], r["num_computed_tokens"], s["num_scheduled_tokens"][r["id"]],
            tuple(tuple(g) for g in nb) if nb is not None and any(nb) else None,
            spec_token_ids=tuple(spec.get(r["id"], ()))))
    for r in s["scheduled_new_reqs"]:
        first = r["id"] not in admitted
        admitted.add(r["id"])
        sched.append(ScheduledRequest(
            r["id"], r["num_computed_tokens"], s["num_scheduled_tokens"][r["id"]],
            tuple(tuple(g) for g in r["block_ids"]), is_new=True,
            # (the peer driver's recordings have no "resumed": a request seen before is)
            resumed=bool(r.get("resumed", not first)),
            prefix_hit_tokens=r["num_computed_tokens"],
            prompt_token_ids=prompts[r["id"]] if first else None,
            num_prompt_tokens=len(prompts[r["id"]]), spec_token_ids=tuple(spec.get(r["id"], ()))))
    plan = StepPlan(s["step"], tuple(sched), tuple(s["preempted_req_ids"]), tuple(s["finished_req_ids"]),
                    tuple(s.get("faults") or ()), tuple(s.get("forced") or ()),
                    block_copies=tuple((a, b) for a, b in s.get("block_copies", ())))
    sampled = {k: tuple(v) for k, v in (s.get("sampled_token_ids") or {}).items() if v}
    accepted = s.get("accepted")
    if accepted is None:
        accepted = {k: len(sampled.get(k, ())) - 1 for k in spec if sampled.get(k)}
    return plan, StepOutcome(sampled, accepted, tuple(s.get("finished_this_step") or ()))


def _header(rec, src: str | Path) -> dict:
    return header_dict(rec.scenario.model_dump(mode="json"), kv_groups(rec.scenario), rec.workload.requests,
                       f"vllm {rec.config.get('vllm_version')} recording {Path(src).name}")


def convert_recording(src: str | Path, dst: str | Path) -> int:
    rec = load_recording(src)
    header, records = _header(rec, src), recording_records(rec)
    _as_trace(src, rec, header, records)  # it must pass our own accounting check before anything is written
    write_trace(dst, header, records)
    return len(records)


def recording_trace(src: str | Path) -> Trace:
    """A vLLM recording as the trace ``convert`` would write, built in memory (``replay`` runs
    recordings through this)."""
    rec = load_recording(src)
    tr = _as_trace(src, rec, _header(rec, src), recording_records(rec))
    tr.free_blocks = [s["num_free_blocks"] for s in rec.steps]  # (``trace_verify`` holds the schedule to them)
    return tr


def _as_trace(src: str | Path, rec, header: dict, records: list) -> Trace:
    # step i of the trace is the recording's step line i: errors name the recording's own line
    return trace_in_memory(src, header, ((ln, plan, outcome) for ln, (plan, outcome) in zip(rec.step_lines, records)))
