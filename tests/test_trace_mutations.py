"""Golden traces corrupted in many ways: not one corruption passes, none crashes.

Each mutation edits a golden trace's lines (JSON objects) the way a buggy scheduler, a bad
recording or a hand edit would, and the trace goes through what ``hybridsim replay`` does
before it executes anything (``replay.verify_recorded``: read, accounting, ``sched.recorded``).
A corruption must end as bad input (``InputError``, exit 2) or a failed ``sched.recorded``
check (exit 1); any other exception is a crash and fails the test. Every rule of the
verifier is also shown to hold on every golden trace and every vLLM recording in ``data/``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hybridsim.errors import InputError
from hybridsim.replay import verify_recorded
from hybridsim.trace_verify import CHECK, TOKEN_ID_LIMIT

from .conftest import DATA, REPO

TRACES = ["quickstart", "memory_pressure", "vllm_mem_pressure"]
_LINES = {n: [json.loads(x) for x in (REPO / "traces" / f"{n}.jsonl").read_text().splitlines() if x.strip()]
          for n in TRACES}


class NotHere(LookupError):
    """The mutation has nothing to bite on in this trace."""


# ----------------------------------------------------------------------------- finding places


def _groups(lines) -> list[dict]:
    return lines[0]["groups"]


def _is_mamba(lines, g: int) -> bool:
    return _groups(lines)[g]["kind"] == "mamba"


def _steps(lines):
    return list(enumerate(lines))[1:]


def _admissions(lines):
    for i, d in _steps(lines):
        for s in d["sched"]:
            if s.get("new"):
                yield i, d, s


def _with_blocks(lines, g: int):
    for i, d in _steps(lines):
        for s in d["sched"]:
            if "blocks" in s and any(s["blocks"][g]):
                yield i, d, s


def _fresh_col(lines, s: dict, g: int) -> int:
    """A column of an admission's row in group ``g`` holding a fresh (not hit) non-null block."""
    bs = _groups(lines)[g]["block_size"]
    hit = s.get("hit", 0)
    for col, b in enumerate(s["blocks"][g]):
        hit_col = (col == hit // bs - 1) if _is_mamba(lines, g) else col < hit // bs
        if b and not (hit and hit_col):
            return col
    raise NotHere


def _finished(lines):
    """(line index, request) of every 'finished' entry."""
    return [(i, rid) for i, d in _steps(lines) for rid in d.get("finished", ())]


def _first_admission(lines) -> dict[str, int]:
    first = {}
    for i, d, s in _admissions(lines):
        first.setdefault(s["id"], i)
    return first


def _name_latest_admitted(lines, i: int, key: str):
    """Step line ``i`` names, under ``key``, the request admitted last in the trace (one it cannot
    know yet)."""
    first = _first_admission(lines)
    rid = max(first.items(), key=lambda kv: kv[1])[0]
    lines[i].setdefault(key, []).append(rid)
    return lines


def _running_at(lines, i: int) -> set[str]:
    """Requests running when step line ``i`` starts (after its preemptions and 'finished')."""
    run: set[str] = set()
    for j, d in _steps(lines):
        for rid in d.get("preempted", []) + d.get("forced", []):
            run.discard(rid)
        if j == i:
            return run
        for s in d["sched"]:
            if s.get("new"):
                run.add(s["id"])
        for rid in d.get("done", ()):
            run.discard(rid)
    raise NotHere


# ----------------------------------------------------------------------------- the mutations


def double_alloc(g: int):
    """In one step, an admission is given a block another request of the same step holds in group ``g``."""
    def m(lines):
        for i, d, s in _admissions(lines):
            for o in d["sched"]:
                if o is not s and "blocks" in o and any(o["blocks"][g]):
                    try:
                        col = _fresh_col(lines, s, g)
                    except NotHere:
                        continue
                    s["blocks"][g][col] = next(b for b in o["blocks"][g] if b)
                    return lines
        raise NotHere
    return m


def cross_group(lines):
    """A block of group 1 given, in the same step, to another request's row of group 0."""
    for i, d, s in _admissions(lines):
        for o in d["sched"]:
            if o is not s and "blocks" in o and any(o["blocks"][1]):
                s["blocks"][0][_fresh_col(lines, s, 0)] = next(b for b in o["blocks"][1] if b)
                return lines
    raise NotHere


def tail_takes_held_block(lines):
    """A running request's new tail (attention group) takes a block a live request holds."""
    g = next(k for k, gr in enumerate(_groups(lines)) if gr["kind"] != "mamba")
    for i, d in _steps(lines):
        run = _running_at(lines, i)
        for s in d["sched"]:
            if "blocks" in s and not s.get("new") and s["blocks"][g]:
                for j, e in _steps(lines)[: i - 1][::-1]:  # a block handed out earlier to a request still running
                    for o in e["sched"]:
                        if o["id"] in run and o["id"] != s["id"] and "blocks" in o and o["blocks"][g]:
                            s["blocks"][g][-1] = o["blocks"][g][-1]
                            return lines
    raise NotHere


def block_past_pool(lines):
    n = lines[0]["scenario"]["cache"]["num_blocks"]
    i, d, s = next(_with_blocks(lines, 0))
    s["blocks"][-1][-1] = n + 7
    return lines


def block_negative(lines):
    i, d, s = next(_with_blocks(lines, 0))
    s["blocks"][-1][-1] = -1
    return lines


def block_not_an_int(lines):
    i, d, s = next(_with_blocks(lines, 0))
    s["blocks"][-1][-1] = "12"
    return lines


def null_in_attention_row(lines):
    g = next(k for k, gr in enumerate(_groups(lines)) if gr["kind"] != "mamba")
    i, d, s = next(_with_blocks(lines, g))
    s["blocks"][g][-1] = 0
    return lines


def hit_block_never_written(lines):
    """An admission's prefix hit points at a block that holds no cached prefix."""
    g = next(k for k, gr in enumerate(_groups(lines)) if gr["kind"] != "mamba")
    n = lines[0]["scenario"]["cache"]["num_blocks"]
    used: set[int] = set()
    for i, d in _steps(lines):
        for s in d["sched"]:
            if s.get("new") and s.get("hit", 0) >= _groups(lines)[g]["block_size"]:
                spare = [b for b in range(1, n) if b not in used]
                if spare:
                    s["blocks"][g][0] = spare[0]
                    return lines
            for row in s.get("blocks", ()):
                used.update(row)
    raise NotHere


def hit_inflated(lines):
    """An admission claims one block more of prefix hit than the cache holds (its row unchanged)."""
    bs = _groups(lines)[0]["block_size"]
    for i, d, s in _admissions(lines):
        if s["n"] > bs and not s.get("resumed"):
            s["hit"] = s.get("hit", 0) + bs
            s["c"] += bs
            s["n"] -= bs
            return lines
    raise NotHere


def row_too_short(lines):
    """An attention row one block short of the tokens the step computes."""
    g = next(k for k, gr in enumerate(_groups(lines)) if gr["kind"] != "mamba")
    for i, d, s in _admissions(lines):
        if len(s["blocks"][g]) > 1 and s["c"] + s["n"] > (len(s["blocks"][g]) - 1) * _groups(lines)[g]["block_size"]:
            s["blocks"][g].pop()
            return lines
    raise NotHere


def mamba_running_column_missing(lines):
    for i, d, s in _admissions(lines):
        row = s["blocks"][0]
        if row and row[-1]:
            row[-1] = 0
            return lines
    raise NotHere


def block_twice_in_one_row(lines):
    g = next(k for k, gr in enumerate(_groups(lines)) if gr["kind"] != "mamba")
    for i, d, s in _admissions(lines):
        row = s["blocks"][g]
        if len(row) > 1 and not s.get("hit"):
            row[1] = row[0]
            return lines
    raise NotHere


def finish_unknown(lines):
    i, rid = _finished(lines)[0]
    lines[i]["finished"].append("r_nobody")
    return lines


def finish_twice_same_step(lines):
    i, rid = _finished(lines)[0]
    lines[i]["finished"].append(rid)
    return lines


def finish_again_later(lines):
    (i, rid), (j, _) = _finished(lines)[:2]
    if j == i:
        j = i + 1
    lines[j].setdefault("finished", []).append(rid)
    return lines


def finish_running(lines):
    """'finished' names a request that is running (it did not finish with the step before)."""
    for i, d in _steps(lines):
        run = _running_at(lines, i) - set(d.get("finished", ()))
        if run and i > 1:
            d.setdefault("finished", []).append(sorted(run)[0])
            return lines
    raise NotHere


def finish_never_admitted(lines):
    return _name_latest_admitted(lines, 1, "finished")


def done_dropped(lines):
    for i, d in _steps(lines):
        if d.get("done"):
            d["done"].pop()
            if not d["done"]:
                del d["done"]
            return lines
    raise NotHere


def finished_report_dropped(lines):
    i, rid = _finished(lines)[0]
    lines[i]["finished"].remove(rid)
    return lines


def done_not_scheduled(lines):
    """'done' names a request the step did not run (one admitted only later)."""
    return _name_latest_admitted(lines, 2, "done")


def preempt_never_admitted(lines):
    return _name_latest_admitted(lines, 1, "preempted")


def preempt_finished(lines):
    i, rid = _finished(lines)[0]
    lines[i + 1].setdefault("preempted", []).append(rid)
    return lines


def preempt_twice(lines):
    for i, d in _steps(lines):
        if d.get("preempted"):
            d["preempted"].append(d["preempted"][0])
            return lines
    raise NotHere


def forced_not_running(lines):
    return _name_latest_admitted(lines, 1, "forced")


def preempt_unknown(lines):
    lines[2].setdefault("preempted", []).append("r_nobody")
    return lines


def finished_request_returns(lines):
    """A request scheduled again, one token on, in the step after 'finished' reported it."""
    for i, rid in _finished(lines):
        tokens, computed = 0, 0
        for j, d in _steps(lines)[: i - 1]:
            for s in d["sched"]:
                if s["id"] == rid:
                    tokens += len(s.get("prompt", []))
                    out = d.get("out", {}).get(rid, [])
                    acc = d.get("acc", {}).get(rid, len(out) - 1 if out else 0)
                    computed = s["c"] + s["n"] - (len(s.get("spec", [])) - acc if out else 0)
                    tokens += len(out)
        if computed < tokens and i + 1 < len(lines):
            lines[i + 1]["sched"].append({"id": rid, "c": computed, "n": 1})
            if computed + 1 >= tokens:
                lines[i + 1].setdefault("out", {})[rid] = [5]
            return lines
    raise NotHere


def resumed_flag_on_first_admission(lines):
    i, d, s = next(_admissions(lines))
    s["resumed"] = 1
    return lines


def continues_after_preemption(lines):
    """A preempted request continues (not re-admitted) in the next step."""
    for i, d in _steps(lines):
        for rid in d.get("preempted", []):
            lines[i]["sched"] = [s for s in d["sched"] if s["id"] != rid]
            nxt = lines[i + 1]
            for s in nxt["sched"]:
                if s["id"] == rid:
                    s.pop("new", None)
                    s.pop("resumed", None)
                    return lines
            nxt["sched"].append({"id": rid, "c": 0, "n": 1})
            return lines
    raise NotHere


def computed_off_by_one(lines):
    for i, d in _steps(lines):
        for s in d["sched"]:
            if not s.get("new"):
                s["c"] += 1
                return lines
    raise NotHere


def schedules_past_its_tokens(lines):
    for i, d in _steps(lines):
        for s in d["sched"]:
            if not s.get("new") and not s.get("spec"):
                s["n"] += 5
                return lines
    raise NotHere


def steps_out_of_order(lines):
    lines[3], lines[4] = lines[4], lines[3]
    return lines


def scheduled_twice_in_a_step(lines):
    for i, d in _steps(lines):
        if d["sched"]:
            d["sched"].append(copy.deepcopy(d["sched"][0]))
            return lines
    raise NotHere


def seats_over_max(lines):
    lines[0]["scenario"]["scheduler"]["max_num_seqs"] = 1
    return lines


def budget_over_max(lines):
    top = max(sum(s["n"] for s in d["sched"]) for _, d in _steps(lines))
    lines[0]["scenario"]["scheduler"]["max_num_batched_tokens"] = top - 1
    return lines


def too_many_drafts(lines):
    """One draft more than num_speculative_tokens (a decode step with no output change needed)."""
    S = lines[0]["scenario"]["spec_decode"]["num_speculative_tokens"]
    for i, d in _steps(lines):
        for s in d["sched"]:
            out = d.get("out", {}).get(s["id"])
            if not s.get("new") and out and len(out) == 1 and s["n"] == 1 + len(s.get("spec", [])):
                s["spec"] = s.get("spec", []) + [7] * (S + 1 - len(s.get("spec", [])))
                s["n"] = 1 + S + 1
                d.setdefault("acc", {})[s["id"]] = 0
                return lines
    raise NotHere


def accepted_more_than_drafted(lines):
    for i, d in _steps(lines):
        for s in d["sched"]:
            if d.get("out", {}).get(s["id"]):
                d.setdefault("acc", {})[s["id"]] = len(s.get("spec", [])) + 1
                return lines
    raise NotHere


def accepted_draft_not_committed(lines):
    """A step accepts a draft but commits another token in its place."""
    for i, d in _steps(lines):
        for s in d["sched"]:
            out = d.get("out", {}).get(s["id"])
            acc = d.get("acc", {}).get(s["id"], len(out) - 1 if out else 0)
            if out and s.get("spec") and acc >= 1:
                out[0] = out[0] % 1000 + 1 if out[0] % 1000 + 1 != out[0] else out[0] + 1
                return lines
    raise NotHere


def output_token_changed(lines):
    """An output token replaced by another valid one (where the header names the true continuation)."""
    if lines[0]["scenario"]["workload"].get("kind") != "synthetic":
        raise NotHere  # (recorded outputs: no second copy to compare with; the golden digests catch it)
    for i, d in _steps(lines):
        for rid, out in d.get("out", {}).items():
            s = next(x for x in d["sched"] if x["id"] == rid)
            if not s.get("spec"):
                out[-1] = out[-1] % 1000 + 1 if out[-1] % 1000 + 1 != out[-1] else out[-1] + 1
                return lines
    raise NotHere


def _vocab(lines) -> int:
    wl = lines[0]["scenario"]["workload"]
    return wl["vocab_size"] if wl.get("kind") == "synthetic" else TOKEN_ID_LIMIT


def prompt_token_out_of_vocab(lines):
    i, d, s = next(_admissions(lines))
    s["prompt"][3] = _vocab(lines)
    return lines


def prompt_token_negative(lines):
    i, d, s = next(_admissions(lines))
    s["prompt"][0] = -3
    return lines


def output_token_out_of_vocab(lines):
    for i, d in _steps(lines):
        for rid, out in d.get("out", {}).items():
            out[-1] = _vocab(lines) + 11
            return lines
    raise NotHere


def output_token_not_an_int(lines):
    for i, d in _steps(lines):
        for rid, out in d.get("out", {}).items():
            out[-1] = 1.5
            return lines
    raise NotHere


def output_past_max_tokens(lines):
    """The header's max_tokens of a request lowered below what it commits."""
    i, rid = _finished(lines)[0]
    r = next(r for r in lines[0]["requests"] if r["id"] == rid)
    r["max_tokens"] -= 1
    return lines


def types_step_is_text(lines):
    lines[2]["step"] = str(lines[2]["step"])
    return lines


def types_hit_is_text(lines):
    i, d, s = next(_admissions(lines))
    s["hit"] = "0"
    return lines


def types_new_flag_is_text(lines):
    i, d, s = next(_admissions(lines))
    s["new"] = "yes"
    return lines


def types_finished_is_text(lines):
    i, rid = _finished(lines)[0]
    lines[i]["finished"] = rid
    return lines


def types_prompt_holds_text(lines):
    i, d, s = next(_admissions(lines))
    s["prompt"][1] = "hello"
    return lines


def types_acc_is_text(lines):
    for i, d in _steps(lines):
        if d.get("out"):
            d["acc"] = {next(iter(d["out"])): "2"}
            return lines
    raise NotHere


def header_group_without_block_size(lines):
    del lines[0]["groups"][0]["block_size"]
    return lines


def header_request_max_tokens_text(lines):
    lines[0]["requests"][0]["max_tokens"] = "12"
    return lines


def header_groups_not_a_list(lines):
    lines[0]["groups"] = {"0": lines[0]["groups"][0]}
    return lines


def header_output_seed_huge(lines):
    lines[0]["requests"][0]["output_seed"] = 1 << 70
    return lines


def token_id_huge(lines):
    """A prompt token past any integer type an engine holds."""
    i, d, s = next(_admissions(lines))
    s["prompt"][2] = 10 ** 30
    return lines


MUTATIONS = {
    "double_alloc_group0": double_alloc(0),
    "double_alloc_group1": double_alloc(1),
    "double_alloc_group2": double_alloc(2),
    "cross_group": cross_group,
    "tail_takes_held_block": tail_takes_held_block,
    "block_past_pool": block_past_pool,
    "block_negative": block_negative,
    "block_not_an_int": block_not_an_int,
    "null_in_attention_row": null_in_attention_row,
    "hit_block_never_written": hit_block_never_written,
    "hit_inflated": hit_inflated,
    "row_too_short": row_too_short,
    "mamba_running_column_missing": mamba_running_column_missing,
    "block_twice_in_one_row": block_twice_in_one_row,
    "finish_unknown": finish_unknown,
    "finish_twice_same_step": finish_twice_same_step,
    "finish_again_later": finish_again_later,
    "finish_running": finish_running,
    "finish_never_admitted": finish_never_admitted,
    "done_dropped": done_dropped,
    "finished_report_dropped": finished_report_dropped,
    "done_not_scheduled": done_not_scheduled,
    "preempt_never_admitted": preempt_never_admitted,
    "preempt_finished": preempt_finished,
    "preempt_twice": preempt_twice,
    "forced_not_running": forced_not_running,
    "preempt_unknown": preempt_unknown,
    "finished_request_returns": finished_request_returns,
    "resumed_flag_on_first_admission": resumed_flag_on_first_admission,
    "continues_after_preemption": continues_after_preemption,
    "computed_off_by_one": computed_off_by_one,
    "schedules_past_its_tokens": schedules_past_its_tokens,
    "steps_out_of_order": steps_out_of_order,
    "scheduled_twice_in_a_step": scheduled_twice_in_a_step,
    "seats_over_max": seats_over_max,
    "budget_over_max": budget_over_max,
    "too_many_drafts": too_many_drafts,
    "accepted_more_than_drafted": accepted_more_than_drafted,
    "accepted_draft_not_committed": accepted_draft_not_committed,
    "output_token_changed": output_token_changed,
    "prompt_token_out_of_vocab": prompt_token_out_of_vocab,
    "prompt_token_negative": prompt_token_negative,
    "output_token_out_of_vocab": output_token_out_of_vocab,
    "output_token_not_an_int": output_token_not_an_int,
    "output_past_max_tokens": output_past_max_tokens,
    "types_step_is_text": types_step_is_text,
    "types_hit_is_text": types_hit_is_text,
    "types_new_flag_is_text": types_new_flag_is_text,
    "types_finished_is_text": types_finished_is_text,
    "types_prompt_holds_text": types_prompt_holds_text,
    "types_acc_is_text": types_acc_is_text,
    "header_group_without_block_size": header_group_without_block_size,
    "header_request_max_tokens_text": header_request_max_tokens_text,
    "header_groups_not_a_list": header_groups_not_a_list,
    "header_output_seed_huge": header_output_seed_huge,
    "token_id_huge": token_id_huge,
}


def mutate(name: str, kind: str, tmp_path: Path) -> Path:
    """The trace ``name`` with mutation ``kind`` written to a file (``NotHere`` if it does not apply)."""
    lines = copy.deepcopy(_LINES[name])
    try:
        lines = MUTATIONS[kind](lines)
    except (StopIteration, IndexError, KeyError, ValueError) as e:  # (nothing to bite on)
        raise NotHere from e
    assert lines != _LINES[name], kind
    p = tmp_path / f"{name}.{kind}.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return p


def outcome(path: Path) -> tuple[str, str]:
    """("refused", message) for bad input, ("failed", the sched.recorded failure), or ("passed", "")."""
    try:
        v = verify_recorded(path)
    except InputError as e:
        return "refused", str(e)
    if v.ok:
        return "passed", ""
    f = v.checks.tallies[CHECK].first_failure
    assert list(v.checks.tallies)[0] == CHECK
    return "failed", f.message


def test_more_than_thirty_kinds():
    assert len(MUTATIONS) > 30


def test_no_corruption_passes_and_none_crashes(tmp_path):
    applied: dict[str, int] = {k: 0 for k in MUTATIONS}
    results = []
    for name in TRACES:
        for kind in MUTATIONS:
            try:
                p = mutate(name, kind, tmp_path)
            except NotHere:
                continue
            applied[kind] += 1
            got, msg = outcome(p)  # (anything but InputError propagates: a crash fails the test)
            results.append((name, kind, got, msg))
            assert got != "passed", f"{name} with {kind} replays as if nothing were wrong"
            assert str(p) in msg or p.name in msg, (name, kind, msg)  # names the file (and line)
    assert all(applied.values()), [k for k, n in applied.items() if not n]
    assert len(results) >= 3 * 30


# the schedule-only corruptions: what each rule says (sched.recorded, exit 1), and that they all pass
# unchanged on every golden trace and every recording
RULES = {
    "double_alloc_group0": "not free",
    "double_alloc_group1": "not free",
    "cross_group": "not free",
    "tail_takes_held_block": "not free",
    "block_past_pool": "outside the pool",
    "null_in_attention_row": "null block",
    "hit_block_never_written": "holds no cached prefix",
    "hit_inflated": ("holds no cached prefix", "holds no state"),
    "row_too_short": "its row holds",
    "mamba_running_column_missing": "Mamba row holds no block",
    "block_twice_in_one_row": "not free",
    "finish_unknown": "not a request of the header",
    "finish_twice_same_step": "'finished' twice",
    "finish_again_later": "reported finished before",
    "finish_running": "is running",
    "finish_never_admitted": "never admitted",
    "done_dropped": ("did not finish with the step before", "does not finish with it"),
    "finished_report_dropped": "does not report it",
    "done_not_scheduled": "did not run",
    "preempt_never_admitted": "not running",
    "preempt_finished": "not running",
    "preempt_twice": "preempted twice",
    "forced_not_running": "not running",
    "preempt_unknown": "not a request of the header",
    "finished_request_returns": "after it finished",
    "resumed_flag_on_first_admission": "never ran",
    "seats_over_max": "max_num_seqs",
    "budget_over_max": "max_num_batched_tokens",
    "too_many_drafts": "num_speculative_tokens",
    "accepted_draft_not_committed": "accepted",
    "output_token_changed": "true continuation",
    "prompt_token_out_of_vocab": "outside the",
    "prompt_token_negative": "outside the",
    "output_token_out_of_vocab": "outside the",
    "output_past_max_tokens": "max_tokens",
}


@pytest.mark.parametrize("kind", sorted(RULES))
def test_each_rule_fails_on_a_trace_that_breaks_it(kind, tmp_path):
    seen = 0
    for name in TRACES:
        try:
            p = mutate(name, kind, tmp_path)
        except NotHere:
            continue
        got, msg = outcome(p)
        want = RULES[kind] if isinstance(RULES[kind], tuple) else (RULES[kind],)
        assert got == "failed" and any(w in msg for w in want), (name, kind, got, msg)
        assert f"{p}:" in msg  # file and line
        seen += 1
    assert seen


def _every_trace() -> list[Path]:
    return sorted((REPO / "traces").glob("*.jsonl")) + sorted((DATA / "vllm-recorded").rglob("*.jsonl"))


@pytest.mark.parametrize("path", _every_trace(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_rule_holds_on_golden_traces_and_recordings(path):
    v = verify_recorded(path)
    t = v.checks.tallies[CHECK]
    assert v.ok and t.failures == 0 and t.count > 100, t.first_failure
    assert list(v.checks.tallies) == [CHECK]  # (first in the table: nothing else ran yet)


def test_a_recordings_free_block_counts_are_compared(tmp_path):
    """A recording whose free-block count after a step disagrees with its own schedule fails."""
    src = DATA / "vllm-recorded" / "mem_pressure.jsonl"
    lines = src.read_text().splitlines()
    d = json.loads(lines[10])
    d["num_free_blocks"] += 1
    lines[10] = json.dumps(d)
    p = tmp_path / "mem_pressure.jsonl"
    p.write_text("\n".join(lines) + "\n")
    got, msg = outcome(p)
    assert got == "failed" and "free blocks" in msg and f"{p}:11" in msg


def test_replay_stops_before_executing_a_broken_schedule(tmp_path):
    """Through the CLI: exit 1, sched.recorded first in the table with the step, request, group and
    block, and no step executed."""
    from .cli_inproc import hsi as hs

    p = mutate("quickstart", "double_alloc_group2", tmp_path)
    js = tmp_path / "r.json"
    r = hs("replay", p, "--json", js)
    assert r.returncode == 1, r.stderr
    data = json.loads(js.read_text())
    assert [c["name"] for c in data["checks"]] == [CHECK]
    ff = data["checks"][0]["first_failure"]
    assert ff["layer"] == "group 2" and "block" in ff["message"] and ff["request"] and ff["step"] >= 0
    assert "no step was executed" in " ".join(r.stdout.split())


@pytest.mark.parametrize("bug,scenario", [("free_shared_block", "memory_pressure"),
                                          ("attn_hit_not_cut", "align_prefix_hits")])
def test_a_scheduler_bug_is_caught_before_execution(bug, scenario, tmp_path):
    """The two injectable scheduler bugs (sched/injected.py) record traces whose schedules hand out
    blocks another request holds: sched.recorded catches them before any step runs."""
    from hybridsim.config import load_scenario
    from hybridsim.runner import plan_scenario

    trace = tmp_path / f"{bug}.jsonl"
    plan_scenario(load_scenario(REPO / "scenarios" / f"{scenario}.yaml"), record=trace, check="off", bugs={bug})
    got, msg = outcome(trace)
    assert got == "failed" and "it is not free" in msg, msg
    clean = tmp_path / "clean.jsonl"
    plan_scenario(load_scenario(REPO / "scenarios" / f"{scenario}.yaml"), record=clean, check="off")
    assert outcome(clean)[0] == "passed"
