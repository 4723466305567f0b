"""Golden traces: replay every trace of a folder and compare with its ``NAME.expected.json``.

The expected file holds what a behaviour change would move: steps and requests,
per-check comparison counts and failures, and digests of the final caches and of
every checked output. ``update`` rewrites the files deliberately and says what changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError, not_json, read_text

if TYPE_CHECKING:
    from .replay import ReplayResult
    from .sweep.ray_pool import RayBackend


def expected_of(res: ReplayResult) -> dict:
    return {
        "trace": res.path.name,
        "steps": res.steps,
        "requests": res.requests,
        # (``sched.recorded`` judges the trace itself, not the engine: its failures fail the gate below,
        # its count moves only with the trace)
        "checks": {t.name: {"count": t.count, "failures": t.failures} for t in res.checks.tallies.values()
                   if t.name != "sched.recorded"},
        "digests": res.digests,
    }


def _diff(want: dict, got: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(want) | set(got)):
        a, b = want.get(key), got.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(_diff(a, b, name + "."))
        elif a != b:
            short = lambda v: (v[:12] + "…") if isinstance(v, str) and len(v) > 16 else v  # noqa: E731
            out.append(f"{name}: {short(a)} -> {short(b)}")
    return out


@dataclass
class GoldenRow:
    trace: str
    steps: int
    comparisons: int
    result: str  # pass | FAIL | updated | unchanged | no expected file | bad input (with keep_going)
    differences: list[str] = field(default_factory=list)
    first_failures: dict[str, str] = field(default_factory=dict)  # failing check -> its first divergence
    wall_s: float = 0.0


def traces_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise InputError("not a folder", str(folder))
    found = sorted(p for p in folder.glob("*.jsonl"))
    if not found:
        raise InputError("no *.jsonl traces in this folder", str(folder))
    return found


def trace_files(paths: list[Path]) -> list[Path]:
    """The traces named: files as given, folders as every ``*.jsonl`` in them."""
    files = []
    for p in paths:
        if p.is_dir():
            files.extend(traces_in(p))
        elif p.is_file():
            files.append(p)
        else:
            raise InputError("no such trace file or folder", str(p))
    return files


def expected_path(trace: Path) -> Path:
    """A golden trace's expected file: ``NAME.expected.json`` beside ``NAME.jsonl``."""
    return trace.with_name(trace.name.removesuffix(".jsonl") + ".expected.json")


def _read_expected(path: Path) -> dict:
    from .safe_load import load_json

    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise not_json(e, f"{path}:{e.lineno}") from None
    except (ValueError, RecursionError):  # (a number too long, nested too deeply: safe_load names them)
        return load_json(text, str(path))


def check_traces(paths: list[Path], update: bool = False, jobs: int = 1, ray: str | RayBackend | None = None,
                 per_gpu: int = 1, keep_going: bool = False, **replay_kw) -> list[GoldenRow]:
    """Replay each trace (files, or folders of them) and compare it with its NAME.expected.json;
    with ``jobs`` > 1 or ``ray``, the traces fan out over processes or Ray tasks (rows in trace order).
    ``ray``, ``per_gpu``: see ``sweep.run.backend_for``. A trace that is bad input stops the gate with
    its message; with ``keep_going`` (a JUnit report wants every trace) it is a row of its own."""
    traces = trace_files(paths)
    if jobs <= 1 and ray is None:
        return [_checked(GoldenTask(t, update, replay_kw), keep_going) for t in traces]
    return _fan_out(traces, update, jobs, ray, per_gpu, replay_kw, keep_going)


def _checked(task: GoldenTask, keep_going: bool) -> GoldenRow:
    if not keep_going:
        return check_one(task)
    try:
        return check_one(task)
    except InputError as e:
        return bad_input_row(task.trace, str(e))


def bad_input_row(trace: Path, message: str) -> GoldenRow:
    return GoldenRow(trace.name, 0, 0, "bad input", [message])


@dataclass(frozen=True)
class GoldenTask:
    trace: Path
    update: bool
    replay_kw: dict


def check_one(task: GoldenTask) -> GoldenRow:
    """One trace against its expected file (a job of its own when traces fan out)."""
    from .replay import replay_trace  # (here: a driver that fans traces out never loads the engine)

    trace, update = task.trace, task.update
    res = replay_trace(trace, strict_bugs=False, **task.replay_kw)
    got = expected_of(res)
    exp_path = expected_path(trace)
    comparisons = sum(t.count for t in res.checks.tallies.values())
    failing = sorted((t for t in res.checks.tallies.values() if t.first_failure is not None),
                     key=lambda t: (t.name != "sched.recorded", t.first_failure.step))  # (earliest first)
    first = {t.name: _divergence(t) for t in failing}
    if update:
        old = _read_expected(exp_path) if exp_path.exists() else None
        diffs = ["created"] if old is None else _diff(old, got)
        from .output_files import write_output
        write_output(exp_path, "--update-expected", json.dumps(got, indent=2, sort_keys=True) + "\n")
        return GoldenRow(trace.name, res.steps, comparisons, "updated" if diffs else "unchanged", diffs)
    if not exp_path.exists():
        return GoldenRow(trace.name, res.steps, comparisons, "no expected file",
                         [f"run with --update-expected to create {exp_path.name}"], first, res.wall_s)
    want = _read_expected(exp_path)
    diffs = _diff(want, got)
    failed = [f"{t.name}: {t.failures} failures" for t in res.checks.tallies.values() if t.failures]
    return GoldenRow(trace.name, res.steps, comparisons, "FAIL" if diffs or failed else "pass", diffs + failed,
                     first, res.wall_s)


def _divergence(tally) -> str:
    """A check's first failure in one line: where (step, request) and what."""
    f = tally.first_failure
    return f"step {f.step}" + (f", request {f.request}" if f.request is not None else "") + f": {f.message}"


def _cost(trace: Path) -> int:
    """A trace's replay time, roughly: its size. (On the golden traces, two workers given them largest
    first finish about 1% after two given them longest first by measured time;
    bench/history/2026-11-25_sessions-17-20.md, issue 27's second pass.)"""
    try:
        return trace.stat().st_size
    except OSError:
        return 0


def _fan_out(traces: list[Path], update: bool, jobs: int, ray: str | RayBackend | None, per_gpu: int,
             replay_kw: dict, keep_going: bool = False) -> list[GoldenRow]:
    """The traces as jobs of the sweep backends: a bad trace is the same one message (exit 2) as
    serially; a trace whose worker died twice is a row of its own (``died``, exit 3)."""
    from .errors import EnvironmentProblem
    from .sweep.jobs import DIED, ENVIRONMENT, INPUT, OK, Job, runs_on_gpu
    from .sweep.run import backend_for

    gpu = runs_on_gpu(replay_kw)
    todo = [Job(str(i), check_one, GoldenTask(t, update, replay_kw), gpu) for i, t in enumerate(traces)]
    todo.sort(key=lambda j: -_cost(traces[int(j.key)]))  # longest first: the last to finish is a short one
    rows: dict[int, GoldenRow] = {}
    with backend_for(jobs, ray, per_gpu) as (run, _, _):
        for o in run(todo):
            i = int(o.key)
            if o.kind == OK:
                rows[i] = o.value
            elif o.kind == INPUT and keep_going:
                rows[i] = bad_input_row(traces[i], o.message)
            elif o.kind == INPUT:
                raise InputError(o.message)
            elif o.kind == ENVIRONMENT:
                raise EnvironmentProblem(o.message)
            else:
                rows[i] = GoldenRow(traces[i].name, 0, 0, "died" if o.kind == DIED else "error", [o.message])
    return [rows[i] for i in range(len(traces))]
