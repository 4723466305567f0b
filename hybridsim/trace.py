"""Step traces (JSONL): writer, reader, and the token-accounting check.

Line 1 is the header::

    {"format": "hybridsim-trace", "version": 1, "source": "...",
     "scenario": {...resolved scenario...},
     "groups": [{"group_id": 0, "kind": "mamba", "block_size": 16, "layers": [0, 1]}, ...],
     "requests": [{"id": "r0", "arrival_step": 0, "prompt_len": 91, "max_tokens": 12}, ...]}

Every further line is one step::

    {"step": 3,
     "sched": [{"id": "r2", "c": 64, "n": 12, "new": 1, "hit": 64, "prompt": [...],
                "blocks": [[0, 0, 0, 7], [1, 2, 3, 4]]},
               {"id": "r0", "c": 99, "n": 4, "spec": [5, 9, 31]}],
     "preempted": [], "finished": [], "faults": [], "forced": [],
     "out": {"r0": [5, 9, 12]}, "acc": {"r0": 2}}

``c`` is num_computed_tokens before the step, ``n`` the tokens scheduled
(drafts included), ``blocks`` the new tail of each KV group's block row (the
whole row for ``new`` requests), ``spec`` the draft tokens (-1: a placeholder draft, padding that is
computed and never accepted; see ``sched.plan.PLACEHOLDER_DRAFT``), ``out`` the tokens
committed after the step, ``acc`` the drafts accepted, ``done`` the requests that finished with this step. Keys at their default
(empty, 0, false) are left out. The writer is deterministic: same plans, same bytes.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import IO, Iterator

from .errors import InputError, not_text
from .output_files import Output
from .safe_load import bounded_lines, load_json
from .sched.groups import GroupSpec
from .sched.plan import PLACEHOLDER_DRAFT, ScheduledRequest, StepOutcome, StepPlan
from .workload.base import WorkloadRequest

FORMAT = "hybridsim-trace"
VERSION = 3  # 2: align-mode prefill checkpoints at vLLM 0.33's position (sched.plan.prefill_checkpoint);
# 3: and in vLLM 0.33's column (sched.plan.checkpoint_at)


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def header_dict(scenario_json: dict, groups: list[GroupSpec], requests: list[WorkloadRequest],
                source: str, inject_bug: tuple[str, ...] = ()) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": source,
        **({"inject_bug": sorted(inject_bug)} if inject_bug else {}),
        "scenario": scenario_json,
        # (a drafter's group, MTP / EAGLE, says so: ``"draft": true``; the executor skips it)
        "groups": [{"group_id": g.group_id, "kind": g.kind, "block_size": g.block_size,
                    "layers": list(g.layers), "mode": g.mode, "num_spec": g.num_spec,
                    **({"draft": True} if g.draft else {})} for g in groups],
        "requests": [{"id": r.req_id, "arrival_step": r.arrival_step, "prompt_len": len(r.prompt),
                      "max_tokens": r.max_tokens, "output_seed": r.output_seed,
                      **({"priority": r.priority} if r.priority else {})}
                     for r in requests],
    }


def step_dict(plan: StepPlan, outcome: StepOutcome) -> dict:
    sched = []
    for s in plan.scheduled:
        d: dict = {"id": s.req_id, "c": s.num_computed_tokens, "n": s.num_scheduled_tokens}
        if s.is_new:
            d["new"] = 1
            d["hit"] = s.prefix_hit_tokens
            if s.resumed:
                d["resumed"] = 1
            if s.prompt_token_ids is not None:
                d["prompt"] = list(s.prompt_token_ids)
        if s.new_block_ids is not None:
            d["blocks"] = [list(g) for g in s.new_block_ids]
        if s.spec_token_ids:
            d["spec"] = list(s.spec_token_ids)
        sched.append(d)
    out: dict = {"step": plan.step, "sched": sched}
    for key, val in (("preempted", plan.preempted), ("finished", plan.finished), ("faults", plan.faults),
                     ("forced", plan.forced_preempted)):
        if val:
            out[key] = list(val)
    if outcome.sampled:
        out["out"] = {k: list(v) for k, v in outcome.sampled.items()}
    if outcome.accepted:
        out["acc"] = dict(outcome.accepted)
    if outcome.finished:
        out["done"] = list(outcome.finished)
    return out


class TraceWriter:
    """Writes to ``path`` as ``output_files`` writes every output: a regular file through a
    temporary file, renamed on close (an interrupted run never leaves a truncated trace where a good
    one was); a pipe, a device or standard output (``-``) streamed."""

    def __init__(self, path: str | Path, header: dict, flag: str = "--record"):
        self.path = Path(path)
        self.out = Output(path, flag)
        self.out.open()
        self.out.write(_dumps(header) + "\n")

    def write(self, plan: StepPlan, outcome: StepOutcome) -> None:
        self.out.write(_dumps(step_dict(plan, outcome)) + "\n")

    def close(self) -> None:
        self.out.commit()

    def abort(self) -> None:
        self.out.abort()


# ----------------------------------------------------------------------------- reading


class Trace:
    def __init__(self, path: Path, header: dict, steps: list[tuple[int, StepPlan, StepOutcome]]):
        self.path = path
        self.header = header
        self.steps = steps  # (line number, plan, outcome)

    @property
    def requests(self) -> list[dict]:
        return self.header["requests"]


def _need(d: dict, key: str, typ, where: str):
    if key not in d:
        raise InputError(f"missing key {key!r}", where)
    v = d[key]
    if not isinstance(v, typ) or isinstance(v, bool) and typ is int:
        raise InputError(f"key {key!r} should be {getattr(typ, '__name__', typ)}, got {type(v).__name__}", where)
    return v


def _parse_step(d: dict, where: str) -> tuple[StepPlan, StepOutcome]:
    step = _need(d, "step", int, where)
    sched = []
    for i, s in enumerate(_need(d, "sched", list, where)):
        w = f"{where} (sched[{i}])"
        if not isinstance(s, dict):
            raise InputError("each scheduled entry is an object", w)
        rid = _need(s, "id", str, w)
        c = _need(s, "c", int, w)
        n = _need(s, "n", int, w)
        blocks = s.get("blocks")
        if blocks is not None and not (isinstance(blocks, list) and all(isinstance(g, list) for g in blocks)):
            raise InputError("blocks must be a list of lists (one per KV group)", w)
        prompt = s.get("prompt")
        spec = s.get("spec", [])
        if not (isinstance(spec, list) and all(type(t) is int and t >= PLACEHOLDER_DRAFT for t in spec)):
            raise InputError("spec must be a list of draft token ids (-1: a placeholder draft)", w)
        sched.append(ScheduledRequest(
            rid, c, n, tuple(tuple(g) for g in blocks) if blocks is not None else None,
            is_new=bool(s.get("new")), resumed=bool(s.get("resumed")), prefix_hit_tokens=int(s.get("hit", 0)),
            spec_token_ids=tuple(spec),
            prompt_token_ids=tuple(prompt) if prompt is not None else None,
            num_prompt_tokens=len(prompt) if prompt is not None else 0))
    plan = StepPlan(step, tuple(sched), tuple(d.get("preempted", ())), tuple(d.get("finished", ())),
                    tuple(d.get("faults", ())), tuple(d.get("forced", ())))
    out = d.get("out", {})
    if not isinstance(out, dict):
        raise InputError("'out' must map request ids to token lists", where)
    outcome = StepOutcome({k: tuple(v) for k, v in out.items()}, dict(d.get("acc", {})),
                          tuple(d.get("done", ())))
    return plan, outcome


def _lines(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        f = path.open()
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", str(path)) from None
    ln = 0
    with f:
        try:
            for ln, line in bounded_lines(f, str(path)):  # (hostile lines refused: safe_load)
                if not line.strip():
                    continue
                d = load_json(line, f"{path}:{ln}")
                if not isinstance(d, dict):
                    raise InputError("each line is a JSON object", f"{path}:{ln}")
                yield ln, d
        except UnicodeDecodeError as e:  # (a binary file; ``ln``: the last line read whole)
            raise not_text(e, str(path), f", after line {ln}" if ln else "") from None


def read_trace(path: str | Path, check: bool = True) -> Trace:
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", str(p))
    return _read(p, _lines(p), check)


def trace_in_memory(path: str | Path, header: dict, records, check: bool = True) -> Trace:
    """The trace that ``write_trace(path, header, ...)`` then ``read_trace(path)`` would give, built
    without a file. ``records`` yields (line number, plan, outcome): the line that messages about a
    step name (e.g. the line of the source the step came from)."""
    lines = ((ln, json.loads(_dumps(step_dict(plan, outcome)))) for ln, plan, outcome in records)
    return _read(Path(path), itertools.chain([(1, json.loads(_dumps(header)))], lines), check)


def _read(p: Path, it: Iterator[tuple[int, dict]], check: bool) -> Trace:
    try:
        ln, header = next(it)
    except StopIteration:
        raise InputError("empty trace", str(p)) from None
    if header.get("format") != FORMAT:
        hint = " (a vLLM recording? use `hybridsim convert` first)" if header.get("type") == "config" else ""
        raise InputError(f"line 1 is not a hybridsim trace header{hint}", f"{p}:{ln}")
    if header.get("version") != VERSION:
        old = {1: "placed align-mode prefill checkpoints where the engine does not (prefills whose length is a "
                  "multiple of the block size, resumed requests)",
               2: "kept a resumed request's align-mode checkpoint state in another column than the engine does "
                  "(prefills that end on a block boundary)"}.get(header.get("version"))
        why = (f"; version {header.get('version')} {old}, so its plans do not execute as recorded: re-record it "
               "from its scenario with `hybridsim run SCENARIO --check off --record`" if old else "")
        raise InputError(f"trace version {header.get('version')!r} is not supported (this is {VERSION}){why}",
                         f"{p}:{ln}")
    for key in ("scenario", "groups", "requests"):
        if key not in header:
            raise InputError(f"header is missing {key!r}", f"{p}:{ln}")
    steps = []
    for ln, d in it:
        plan, outcome = _parse_step(d, f"{p}:{ln}")
        steps.append((ln, plan, outcome))
    trace = Trace(p, header, steps)
    if check:
        check_accounting(trace)
    return trace


def check_accounting(trace: Trace) -> None:
    """Reject a trace whose token bookkeeping does not add up, naming the first bad line.

    Per request it tracks committed tokens and computed tokens through every
    step: a scheduled request must continue exactly where it stopped (or start
    fresh at its prefix hit when new/resumed), never schedule past its tokens
    plus drafts, and commit tokens only when its chunk reached the end.
    """
    p = trace.path
    groups = len(trace.header["groups"])
    max_len = trace.header["scenario"].get("scheduler", {}).get("max_model_len", 1 << 30)
    known = {r["id"]: r for r in trace.header["requests"]}
    tokens: dict[str, int] = {}
    computed: dict[str, int] = {}
    last_step = -1
    for ln, plan, outcome in trace.steps:
        where = f"{p}:{ln}"
        if plan.step <= last_step:
            raise InputError(f"step {plan.step} does not follow step {last_step}", where)
        last_step = plan.step
        for rid in plan.preempted + plan.forced_preempted:
            computed.pop(rid, None)
        seen = set()
        for s in plan.scheduled:
            rid = s.req_id
            if rid in seen:
                raise InputError(f"request {rid} scheduled twice in one step", where)
            seen.add(rid)
            if rid not in known:
                raise InputError(f"request {rid} is not in the header's request list", where)
            if s.num_scheduled_tokens < 1:
                raise InputError(f"request {rid} scheduled {s.num_scheduled_tokens} tokens", where)
            if s.new_block_ids is not None and len(s.new_block_ids) != groups:
                raise InputError(f"request {rid} has block ids for {len(s.new_block_ids)} groups, "
                                 f"the header has {groups}", where)
            if s.is_new:
                if rid not in tokens:
                    if s.prompt_token_ids is None:
                        raise InputError(f"first admission of {rid} carries no prompt", where)
                    tokens[rid] = len(s.prompt_token_ids)
                if s.num_computed_tokens != s.prefix_hit_tokens:
                    raise InputError(f"new request {rid} starts at {s.num_computed_tokens}, "
                                     f"its prefix hit is {s.prefix_hit_tokens}", where)
                if rid in computed:
                    raise InputError(f"request {rid} admitted while already running", where)
            else:
                if rid not in computed:
                    raise InputError(f"request {rid} continues but was never admitted (or was preempted)", where)
                if s.num_computed_tokens != computed[rid]:
                    raise InputError(f"request {rid} continues at {s.num_computed_tokens} tokens, "
                                     f"the trace had it at {computed[rid]}", where)
            c, n = s.num_computed_tokens, s.num_scheduled_tokens
            have = tokens[rid] + len(s.spec_token_ids)
            if c + n > have:
                raise InputError(f"request {rid} schedules up to token {c + n} but has only {have} "
                                 f"(tokens plus drafts)", where)
            if c + n > max_len:
                raise InputError(f"request {rid} goes past max_model_len ({max_len})", where)
            out = outcome.sampled.get(rid, ())
            reached_end = c + n >= tokens[rid]
            if out and not reached_end:
                raise InputError(f"request {rid} commits tokens before its prefill finished", where)
            if reached_end and not out:
                raise InputError(f"request {rid} finished a chunk at its end but committed no token", where)
            if len(out) > len(s.spec_token_ids) + 1:
                raise InputError(f"request {rid} commits {len(out)} tokens from {len(s.spec_token_ids)} drafts",
                                 where)
            acc = outcome.accepted.get(rid, len(out) - 1 if out else 0)
            if acc > len(s.spec_token_ids) or acc < 0:
                raise InputError(f"request {rid} accepted {acc} of {len(s.spec_token_ids)} drafts", where)
            if out and len(out) > acc + 1:
                raise InputError(f"request {rid} commits {len(out)} tokens but accepted {acc} drafts", where)
            if PLACEHOLDER_DRAFT in s.spec_token_ids[:acc]:
                raise InputError(f"request {rid} accepted {acc} drafts, placeholder drafts (-1) among them", where)
            rejected = len(s.spec_token_ids) - acc if out else 0
            computed[rid] = c + n - max(rejected, 0)
            tokens[rid] += len(out)
        for rid in outcome.sampled:
            if rid not in seen:
                raise InputError(f"output for {rid}, which was not scheduled", where)


def read_trace_requests(path: str | Path) -> Iterator[tuple[WorkloadRequest, int]]:
    """The workload a trace was recorded from: requests with their prompts (for re-planning)."""
    trace = read_trace(path, check=False)
    prompts: dict[str, tuple[int, ...]] = {}
    for _, plan, _ in trace.steps:
        for s in plan.scheduled:
            if s.prompt_token_ids is not None and s.req_id not in prompts:
                prompts[s.req_id] = s.prompt_token_ids
    for r in trace.requests:
        if r["id"] not in prompts:
            continue  # never admitted in the trace
        yield WorkloadRequest(r["id"], r["arrival_step"], prompts[r["id"]], r["max_tokens"],
                              r.get("priority", 0), r.get("output_seed", 0)), 1


def write_trace(path: str | Path, header: dict, records: list[tuple[StepPlan, StepOutcome]],
                flag: str = "--out") -> None:
    w = TraceWriter(path, header, flag)
    try:
        for plan, outcome in records:
            w.write(plan, outcome)
    except BaseException:
        w.abort()
        raise
    w.close()


__all__ = ["TraceWriter", "read_trace", "trace_in_memory", "check_accounting", "header_dict", "step_dict",
           "write_trace", "Trace"]
