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
committed after the step, ``acc`` the drafts accepted, ``done`` the requests that finished with this step,
``copies`` the [source, copy] block pairs the worker copies before the step's writes (partial-block
prefix hits; vLLM's ``kv_cache_block_copies``; absent in traces written before it existed: none). Keys at their default
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
        # (a drafter's group, MTP / EAGLE, says so: ``"draft": true``; a group of drafter layers
        # only lists them as its ``layers``, which the executor skips; a group holding target and
        # drafter layers lists the target's as ``layers``, the drafter's as ``draft_layers``)
        "groups": [{"group_id": g.group_id, "kind": g.kind, "block_size": g.block_size,
                    "layers": list(g.layers or g.draft_layers), "mode": g.mode, "num_spec": g.num_spec,
                    **({"draft": True} if g.draft else {}),
                    **({"draft_layers": list(g.draft_layers)} if g.layers and g.draft_layers else {})}
                   for g in groups],
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
    if plan.block_copies:
        out["copies"] = [list(c) for c in plan.block_copies]
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
        self.free_blocks: list[int] | None = None  # a vLLM recording's free-block count after each step

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


def _ints(v) -> bool:
    """A list of integers (JSON true/false are not)."""
    return isinstance(v, list) and all(type(t) is int for t in v)


def _ids(d: dict, key: str, where: str) -> tuple[str, ...]:
    v = d.get(key, ())
    if not (isinstance(v, list) and all(isinstance(x, str) for x in v)) and v != ():
        raise InputError(f"{key!r} must be a list of request ids", where)
    return tuple(v)


def _flag(s: dict, key: str, w: str) -> bool:
    v = s.get(key, 0)
    if v not in (0, 1) or isinstance(v, float):  # (0, 1, false, true)
        raise InputError(f"key {key!r} should be 0 or 1, got {json.dumps(v)[:40]}", w)
    return bool(v)


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
        for g, row in enumerate(blocks or ()):
            if not _ints(row) or row and min(row) < 0:
                k, bad = next((k, b) for k, b in enumerate(row) if type(b) is not int or b < 0)
                raise InputError(f"{rid}: block id {json.dumps(bad)[:40]} (group {g}, entry {k} of its blocks) is not "
                                 "a block id: a non-negative integer, 0 the null block", w)
        prompt = s.get("prompt")
        if prompt is not None and not _ints(prompt):
            raise InputError(f"{rid}: 'prompt' must be a list of token ids (integers)", w)
        hit = s.get("hit", 0)
        if type(hit) is not int or hit < 0:
            raise InputError(f"{rid}: 'hit' must be a number of tokens, got {json.dumps(hit)[:40]}", w)
        spec = s.get("spec", [])
        if not (isinstance(spec, list) and all(type(t) is int and t >= PLACEHOLDER_DRAFT for t in spec)):
            raise InputError("spec must be a list of draft token ids (-1: a placeholder draft)", w)
        sched.append(ScheduledRequest(
            rid, c, n, tuple(tuple(g) for g in blocks) if blocks is not None else None,
            is_new=_flag(s, "new", w), resumed=_flag(s, "resumed", w), prefix_hit_tokens=hit,
            spec_token_ids=tuple(spec),
            prompt_token_ids=tuple(prompt) if prompt is not None else None,
            num_prompt_tokens=len(prompt) if prompt is not None else 0))
    faults = d.get("faults", ())
    if not isinstance(faults, (list, tuple)):
        raise InputError("'faults' must be a list", where)
    plan = StepPlan(step, tuple(sched), _ids(d, "preempted", where), _ids(d, "finished", where),
                    tuple(faults), _ids(d, "forced", where),
                    block_copies=parse_block_copies(d.get("copies", []), "copies", where))
    out = d.get("out", {})
    if not isinstance(out, dict) or not all(_ints(v) for v in out.values()):
        raise InputError("'out' must map request ids to token lists", where)
    acc = d.get("acc", {})
    if not isinstance(acc, dict) or not all(type(v) is int for v in acc.values()):
        raise InputError("'acc' must map request ids to numbers of accepted drafts", where)
    outcome = StepOutcome({k: tuple(v) for k, v in out.items()}, dict(acc), _ids(d, "done", where))
    return plan, outcome


def parse_block_copies(v, key: str, where: str) -> tuple[tuple[int, int], ...]:
    """A step's block copies, [[source, copy], ...] of positive block ids (absent: none)."""
    if not (isinstance(v, list) and all(isinstance(c, list) and len(c) == 2 and all(type(b) is int and b > 0 for b in c)
                                        for c in v)):
        raise InputError(f"{key!r} must be a list of [source, copy] block id pairs (positive integers)", where)
    return tuple((c[0], c[1]) for c in v)


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
    _check_header(header, f"{p}:{ln}")
    steps = []
    for ln, d in it:
        plan, outcome = _parse_step(d, f"{p}:{ln}")
        steps.append((ln, plan, outcome))
    trace = Trace(p, header, steps)
    if check:
        check_accounting(trace)
    return trace


def _check_header(h: dict, where: str) -> None:
    """The header's groups and requests, with the types every reader of a trace relies on."""
    if not isinstance(h["scenario"], dict):
        raise InputError("the header's 'scenario' must be an object", where)
    groups = h["groups"]
    if not isinstance(groups, list) or not groups:
        raise InputError("the header's 'groups' must be a non-empty list of KV cache groups", where)
    for i, g in enumerate(groups):
        w = f"{where} (groups[{i}])"
        if not isinstance(g, dict):
            raise InputError("each group is an object", w)
        if _need(g, "group_id", int, w) != i:
            raise InputError(f"group_id {g['group_id']} should be {i} (groups are numbered in order)", w)
        if _need(g, "kind", str, w) not in ("mamba", "attention", "mla"):
            raise InputError(f"kind {g['kind']!r} is not one of mamba, attention, mla", w)
        if _need(g, "block_size", int, w) < 1:
            raise InputError("block_size should be at least 1", w)
        if not _ints(_need(g, "layers", list, w)):
            raise InputError("layers should be a list of layer indices", w)
        if type(g.get("num_spec", 0)) is not int or g.get("num_spec", 0) < 0:
            raise InputError("num_spec should be a number of draft columns", w)
    reqs = h["requests"]
    if not isinstance(reqs, list):
        raise InputError("the header's 'requests' must be a list", where)
    seen = set()
    for i, r in enumerate(reqs):
        w = f"{where} (requests[{i}])"
        if not isinstance(r, dict):
            raise InputError("each request is an object", w)
        rid = _need(r, "id", str, w)
        if rid in seen:
            raise InputError(f"request id {rid!r} appears twice", w)
        seen.add(rid)
        if _need(r, "arrival_step", int, w) < 0 or _need(r, "max_tokens", int, w) < 1:
            raise InputError("arrival_step should be at least 0 and max_tokens at least 1", w)
        for key in ("output_seed", "priority", "prompt_len"):
            if key in r and type(r[key]) is not int:
                raise InputError(f"key {key!r} should be int, got {type(r[key]).__name__}", w)
        if not 0 <= r.get("output_seed", 0) < 1 << 64:
            raise InputError("output_seed should be a 64-bit seed (0 .. 2**64 - 1)", w)


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
