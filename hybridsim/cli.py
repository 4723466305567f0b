"""The ``hybridsim`` command: a thin shell over the library (parse, call, render).

Exit codes: 0 all checks passed, 1 a check failed, 2 bad input (scenario,
trace, flags), 3 environment problem. Every error is one message, no traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .errors import EnvironmentProblem, InputError

if TYPE_CHECKING:
    from .sweep.ray_pool import RayBackend
    from .sweep.spec import Sweep

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Simulate and replay LLM-serving schedules for hybrid (Mamba + attention) and MLA models.")

class _Console(Console):
    """Rich's console, but a reader that went away (``hybridsim ... | head``) ends the command with
    141, as a shell reports a process ended by SIGPIPE; Rich's own choice, 1, is our "a check failed".
    What the command wrote to files is kept (sweeps write their parquet on the way out)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stream = sys.stderr if self.stderr else sys.stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())  # (what is still buffered for the closed pipe goes nowhere)
        raise SystemExit(128 + 13)


out = _Console()
err = _Console(stderr=True)


def _version() -> str:
    """The installed package's version (its metadata), else the source tree's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridsim")
    except PackageNotFoundError:
        from . import __version__
        return __version__


def _print_version(value: bool) -> None:
    if value:
        out.print(f"hybridsim {_version()}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Simulate and replay LLM-serving schedules for hybrid (Mamba + attention) and MLA models."""


class CheckMode(str, Enum):
    full = "full"
    sampled = "sampled"
    off = "off"


def _guard(fn: Callable[[], int]) -> None:
    """Run a command body; map our exceptions to one message and an exit code."""
    try:
        code = fn()
    except InputError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)  # (brackets in it are text)
        raise typer.Exit(2)
    except EnvironmentProblem as e:
        err.print(f"[bold red]environment:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(3)
    except torch_oom():  # a device allocation outside the executor's own guard
        err.print("[bold red]environment:[/] out of device memory (the memory plan printed before the run says "
                  "what was expected; make the pool or the batch smaller)", highlight=False)
        raise typer.Exit(3)
    except MemoryError:
        err.print("[bold red]environment:[/] out of memory: the workload or the pool is larger than this "
                  "machine holds (make the scenario smaller)", highlight=False)
        raise typer.Exit(3)
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130)
    except BrokenPipeError:  # (an output streamed to standard output or a pipe whose reader went away)
        out.on_broken_pipe()
    finally:
        out.file = None  # (tables back on standard output: see _check_outputs)
    raise typer.Exit(code)


class _NoDeviceMemoryError(Exception):
    """Stands for torch's out-of-memory error where torch is not loaded: nothing raises it."""


def torch_oom() -> type:
    """torch's out-of-memory error type, without importing torch for commands that do not need it
    (without torch loaded no device ran out of memory: a MemoryError is the host's)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", _NoDeviceMemoryError) if torch is not None else _NoDeviceMemoryError


def _announce(lines: list[str]) -> None:
    """The memory plan, printed before anything is allocated."""
    for line in lines:
        err.print(line, style="dim", highlight=False)


def _writable(path: Optional[Path], flag: str) -> None:
    """Refuse, before any work, an output path that cannot be written (output_files)."""
    from .output_files import check_writable

    check_writable(path, flag)


def _check_outputs(*outputs: tuple[Optional[Path], str], reads: tuple[tuple[Optional[Path], str], ...] = ()) -> None:
    """Every output path checked before any work: writable, no two of them one file, none a file the
    command reads (``reads``: (path, what it is)). One of them may be standard output (``-``, or
    ``/dev/stdout`` piped): then standard output carries that data alone and the tables go to
    standard error."""
    from .output_files import check_distinct, to_stdout

    on_stdout = [flag for path, flag in outputs if to_stdout(path)]
    if len(on_stdout) > 1:
        raise InputError(f"only one output can go to standard output, and {on_stdout[0]} already does",
                         on_stdout[1])
    for path, flag in outputs:
        _writable(path, flag)
    check_distinct(outputs, reads)
    if on_stdout:
        out.file = sys.stderr


def _replay_reads(paths: List[Path], golden: bool) -> tuple[tuple[Path, str], ...]:
    """What a replay reads: each trace named, a folder's traces, and (a golden gate's, or its update's) each
    trace's expected file."""
    from .golden import expected_path, trace_files

    traces = trace_files(paths)
    return tuple((t, "a trace") for t in traces) + (
        tuple((expected_path(t), "an expected file") for t in traces) if golden else ())


class _Throttle:
    """A progress bar refreshed at most four times a second (a refresh costs more than a fast step)."""

    def __init__(self) -> None:
        self.last = 0.0

    def due(self, force: bool = False) -> bool:
        now = time.perf_counter()
        if force or now - self.last > 0.25:
            self.last = now
            return True
        return False


def _write_json(path: Path, data: dict, flag: str = "--json") -> None:
    from .output_files import write_output

    write_output(path, flag, json.dumps(data, indent=2) + "\n")


@app.command()
def run(
    scenario: Optional[Path] = typer.Argument(None, help="scenario YAML file"),
    check: Optional[CheckMode] = typer.Option(None, help="full | sampled | off (default: the scenario's)"),
    record: Optional[Path] = typer.Option(None, "--record", help="write the step trace (JSONL) here"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write summary, checks and timings as JSON"),
    csv_dir: Optional[Path] = typer.Option(None, "--csv", help="write steps.csv and checks.csv into this folder"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write the step timeline (PNG)"),
    max_steps: Optional[int] = typer.Option(None, min=1, help="override execution.max_steps"),
    kernels: Optional[str] = typer.Option(None, help="auto | reference | triton | vllm | a plugin provider (default: the scenario's; "
                                                     "auto = triton on a GPU, reference on a CPU)"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda (default: the scenario's)"),
    scheduler: Optional[str] = typer.Option(None, help="hybridsim | vllm: whose scheduler plans the steps (default: "
                                                       "the scenario's; vllm = the installed vLLM's own, driven live)"),
    inject_bug: List[str] = typer.Option([], "--inject-bug", help="switch on a known-wrong variant (repeatable)"),
    list_bugs: bool = typer.Option(False, "--list-bugs", help="list the injectable bugs and exit"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no tables, only errors"),
    kernel_variants: Optional[Path] = typer.Option(
        None, "--kernel-variants", help="a kernel variants list (JSON): on a GPU, build the variants it lists for "
                                        "this configuration before the loop, in parallel; then list there the ones "
                                        "this run used (the file is made if missing)"),
) -> None:
    """Simulate a scenario step by step, execute every step and check it against the oracle."""
    if list_bugs:
        _print_bugs()
        raise typer.Exit(0)
    if scenario is None:
        err.print("[bold red]error:[/] run needs a SCENARIO file (or --list-bugs)")
        raise typer.Exit(2)

    def body() -> int:
        from .config import load_scenario
        from .report import checks_table, kernel_timings_table, print_tables, summary_table, timings_table
        from .bugs import check_bugs
        from .runner import plan_scenario

        bugs = check_bugs(inject_bug)
        _check_kernels(kernels)
        _check_choice(device, ("auto", "cpu", "cuda"), "--device")
        from .engines import SCHEDULERS
        _check_choice(scheduler, SCHEDULERS, "--scheduler")
        outputs = ((record, "--record"), (json_out, "--json"), (plot, "--plot"), (kernel_variants, "--kernel-variants"))
        _check_outputs(*outputs, reads=((scenario, "the scenario"),))
        if kernel_variants is not None and str(kernel_variants) == "-":  # (its contents: plan_scenario reads them)
            raise InputError("a file, read and then written, not standard output", "--kernel-variants")
        from .output_files import check_folder
        check_folder(csv_dir, "--csv")
        loaded = load_scenario(scenario)
        trace_path = getattr(loaded.scenario.workload, "path", None)
        if trace_path is not None:  # (the workload's trace: read too)
            from .output_files import check_distinct
            check_distinct(outputs, [(loaded.resolve_path(trace_path), "the workload's trace")])
        announce = None if quiet else _announce
        if max_steps is not None:
            s = loaded.scenario
            loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"max_steps": max_steps})})
        progress = None
        if not quiet and out.is_terminal:
            executing = (check.value if check else loaded.scenario.execution.check) != "off"
            progress = Progress(TextColumn("running and checking" if executing else "planning"), BarColumn(),
                                MofNCompleteColumn(), TextColumn("requests finished, step {task.fields[step]}"),
                                TimeElapsedColumn(), console=out, transient=True)
        if progress is not None:
            with progress:
                task = progress.add_task("plan", total=None, step=0)
                throttle = _Throttle()

                def tick(stats) -> None:
                    # (a checked step can take seconds on a CPU: refreshed by time, not only every 64 steps)
                    if throttle.due(stats.steps % 64 == 0):
                        progress.update(task, completed=stats.finished, total=stats.requests, step=stats.last_step)
                res = plan_scenario(loaded, record=record, check=check.value if check else None, progress=tick,
                                    bugs=bugs, kernels=kernels, device=device, announce=announce,
                                    scheduler=scheduler, kernel_variants=kernel_variants)
        else:
            res = plan_scenario(loaded, record=record, check=check.value if check else None, bugs=bugs,
                                kernels=kernels, device=device, announce=announce, scheduler=scheduler,
                                kernel_variants=kernel_variants)
        if json_out is not None:
            _write_json(json_out, res.as_dict())
        if csv_dir is not None:
            from .export import write_csv
            write_csv(csv_dir, res.steps, res.checks)
        if plot is not None:
            from .export import plot_timeline
            plot_timeline(res.steps, plot, f"{res.scenario_name}: step timeline")
        if not quiet:
            tables = [summary_table(res)]
            if res.checks.tallies:
                tables.append(checks_table(res))
            tables.append(timings_table(res))
            if res.kernel_timings:
                tables.append(kernel_timings_table(res.kernel_timings))
            print_tables(out, *tables)
            for note in res.stats.notes:
                out.print(f"[yellow]note:[/] {note}")
        return 1 if res.failed or res.stats.stalled else 0

    _guard(body)


@app.command()
def replay(
    traces: List[Path] = typer.Argument(..., help="hybridsim step traces (JSONL), or folders of them"),
    golden: bool = typer.Option(False, "--check",
                                help="compare every trace with its NAME.expected.json; exit 1 on any difference"),
    update_expected: bool = typer.Option(False, "--update-expected",
                                         help="rewrite the NAME.expected.json files and say what changed"),
    check_mode: CheckMode = typer.Option(CheckMode.full, "--check-mode", help="full | sampled | off"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write summary, checks and timings as JSON"),
    junit: Optional[Path] = typer.Option(None, "--junit", help="with --check: write the verdicts as JUnit XML for CI "
                                                             "(one test case per trace; bad traces are errors)"),
    kernels: str = typer.Option("reference", help="reference | triton | auto (reference by default: the golden "
                                                   "digests are the reference provider's)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    inject_bug: List[str] = typer.Option([], "--inject-bug", help="switch on a known-wrong variant (repeatable)"),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="with --check: replay this many traces at once, "
                                                             "each in its own process"),
    ray: Optional[str] = typer.Option(None, "--ray", help="with --check: replay the traces as Ray tasks "
                                                           "(auto, or a cluster ADDRESS)"),
    per_gpu: int = typer.Option(1, "--per-gpu", min=1, help="with -j or --ray: traces replayed on one GPU at a "
                                                            "time, each in a worker that keeps its CUDA context"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no tables, only errors"),
) -> None:
    """Execute recorded step traces exactly as recorded, with every check; with --check, gate on golden files."""

    def body() -> int:
        if (jobs > 1 or ray is not None) and (golden or update_expected):
            from .sweep.jobs import exit_on_signals
            exit_on_signals()  # (workers stopped, exit 143)
            if ray is None:
                from .sweep.pool import warm_up
                warm_up()  # (the workers' imports overlap this process's own)
        from .bugs import check_bugs
        from .report import golden_table, kernel_timings_table, replay_table

        bugs = check_bugs(inject_bug)
        _check_kernels(kernels)
        _check_choice(device, ("auto", "cpu", "cuda"), "--device")
        _check_outputs((json_out, "--json"), (junit, "--junit"), reads=_replay_reads(traces, golden or update_expected))
        if junit is not None and not golden:
            raise InputError("writes the golden gate's verdicts: use it with --check", "--junit")
        if update_expected:  # the expected files are what full checks of the reference kernels find
            clash = [flag for flag, on in ((f"--check-mode {check_mode.value}", check_mode != CheckMode.full),
                                           ("--inject-bug", bool(bugs)), (f"--kernels {kernels}", kernels != "reference"))
                     if on]
            if clash:
                raise InputError("records what full checks of the reference kernels find, so it does not take "
                                 f"{' or '.join(clash)} (nothing was rewritten)", "--update-expected")
        kw = dict(check=check_mode.value, bugs=bugs, kernels=kernels, device=device)
        from .golden import check_traces, trace_files
        fanned = [flag for flag, on in (("-j", jobs > 1), ("--ray", ray is not None)) if on]
        if fanned and not (golden or update_expected):
            raise InputError("fans out golden checks: use it with --check or --update-expected", fanned[0])
        if per_gpu > 1 and not fanned:
            raise InputError("shares GPUs among traces replayed at once: use it with -j or --ray", "--per-gpu")
        if ray is not None and jobs > 1:
            raise InputError("give -j (local processes) or --ray (Ray decides), not both", "-j")
        if ray is not None and not ray.strip():
            raise InputError("give auto or a cluster address", "--ray")
        if golden or update_expected:  # (fanned out, this process never loads the engine: its workers do)
            from .sweep.ray_pool import ray_in_background

            files = trace_files(traces)  # (a missing trace is refused before Ray starts)
            with ray_in_background(ray) as backend:  # (starting while the replay engine is named)
                rows = check_traces(files, update=update_expected, jobs=jobs, ray=backend, per_gpu=per_gpu,
                                    keep_going=junit is not None, **kw)
            out.print(golden_table(rows, update_expected))
            if json_out is not None:
                _write_json(json_out, {"traces": [r.__dict__ for r in rows]})
            if junit is not None:
                from .junit import junit_xml
                from .output_files import write_output
                write_output(junit, "--junit", junit_xml(rows, files))
            if any(r.result in ("died", "error") for r in rows):
                return 3
            bad = [r for r in rows if r.result == "bad input"]  # (only with --junit: else the first stops the gate)
            for r in bad:
                err.print(f"[bold red]error:[/] {escape(r.differences[0])}", highlight=False)
            if bad:
                return 2
            return 0 if update_expected else (1 if any(r.result != "pass" for r in rows) else 0)
        from .replay import replay_trace

        files = trace_files(traces)
        if quiet or not out.is_terminal:
            results = [replay_trace(t, announce=None if quiet else _announce, strict_bugs=len(files) == 1, **kw)
                       for t in files]
        else:  # (a long trace replays for minutes: its steps as they go)
            results = []
            with Progress(TextColumn("replaying {task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("steps"), TimeElapsedColumn(), console=out, transient=True) as bar:
                for t in files:
                    task = bar.add_task(t.name, total=None)
                    throttle = _Throttle()

                    def tick(done: int, steps: int, task=task, throttle=throttle) -> None:
                        if throttle.due(done == steps):
                            bar.update(task, completed=done, total=steps)
                    results.append(replay_trace(t, announce=_announce, strict_bugs=len(files) == 1, progress=tick,
                                                **kw))
        if json_out is not None:
            data = [r.as_dict() for r in results]
            _write_json(json_out, data[0] if len(data) == 1 else {"traces": data})
        if not quiet:
            for r in results:
                out.print(replay_table(r))
                if r.kernel_timings:
                    out.print(kernel_timings_table(r.kernel_timings))
                for note in sorted(set(r.notes)):
                    out.print(f"[yellow]note:[/] {note}")
        return 1 if any(r.failed for r in results) else 0

    _guard(body)


@app.command()
def sweep(
    sweep_file: Path = typer.Argument(..., help="sweep YAML: base scenario, grid, zip, seeds, exclude"),
    out_dir: Path = typer.Option(..., "--out", help="folder for results.csv / results.parquet (and failures/)"),
    workers: Optional[int] = typer.Option(None, "--workers", "-j", min=1, help="local processes (default: the cores)"),
    ray: Optional[str] = typer.Option(None, "--ray", help="run cells as Ray tasks: auto (start or join a local "
                                                           "instance) or a cluster ADDRESS"),
    per_gpu: int = typer.Option(1, "--per-gpu", min=1, help="cells run on one GPU at a time, each in a worker "
                                                            "that keeps its CUDA context (each plans its memory on "
                                                            "the whole card: raise it for small cells only)"),
    resume: bool = typer.Option(False, "--resume", help="skip the cells already in results.csv"),
    record_failures: bool = typer.Option(False, "--record-failures",
                                         help="write each failing cell's trace to DIR/failures/ (for shrink)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or tables, only errors"),
) -> None:
    """Run a grid of scenario variants x seeds in parallel; one row per cell in DIR/results.csv."""

    def body() -> int:
        if ray is not None and workers is not None:
            raise InputError("give --workers (local pool) or --ray (Ray decides), not both", "--workers")
        if ray is not None and not ray.strip():
            raise InputError("give auto or a cluster address", "--ray")
        from .output_files import check_folder
        check_folder(out_dir, "--out")  # (before any work: a folder that cannot be made is exit 2)
        from .sweep.jobs import exit_on_signals
        exit_on_signals()  # (workers stopped, results.parquet written, exit 143)
        if ray is None:
            from .sweep.pool import warm_up
            warm_up()  # (the workers' imports overlap this process's own, and validation)
        from .sweep import load_sweep

        sw = load_sweep(sweep_file)  # every cell built and validated before anything runs
        from .sweep.ray_pool import ray_in_background

        with ray_in_background(ray) as backend:  # (starting while this process imports and sets up the rest)
            return _run_sweep(sw, backend)

    def _run_sweep(sw: Sweep, backend: Optional[RayBackend]) -> int:
        from .sweep import run_sweep
        from .sweep.report import failing_table, outcome_table, slowest_table

        progress = None
        if not quiet and out.is_terminal:
            progress = Progress(TextColumn("cells"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[failed]} failing"), TimeElapsedColumn(), console=out,
                                transient=True)
        task = None

        def started(todo: int, skipped: int) -> None:
            nonlocal task
            if not quiet:
                err.print(f"{len(sw.cells)} cells" + (f", {skipped} already in results.csv (--resume)" if skipped
                                                      else ""), style="dim", highlight=False)
            if progress is not None:
                progress.start()
                task = progress.add_task("sweep", total=todo, failed=0)

        failed = 0

        def row_done(row: dict) -> None:
            nonlocal failed
            failed += row["exit_code"] != 0
            if progress is not None and task is not None:
                progress.update(task, advance=1, failed=failed)

        try:
            res = run_sweep(sw, out_dir, workers=workers, ray=backend, per_gpu=per_gpu, resume=resume,
                            record_failures=record_failures, on_start=started, on_row=row_done)
        finally:
            if progress is not None:
                progress.stop()
        if not quiet:
            out.print(f"sweep: {len(res.frame)} cells, {res.ran} run now on {res.backend} in {res.wall_s:.1f} s"
                      + (f" (Ray start-up {res.backend_start_s:.1f} s)" if res.backend_start_s else "")
                      + (f", {res.skipped} resumed" if res.skipped else ""), highlight=False)
            print_tables = [outcome_table(res.frame, "cells by outcome"), slowest_table(res.frame)]
            bad = failing_table(res.frame)
            if bad is not None:
                print_tables.append(bad)
            for t in print_tables:
                out.print(t)
            out.print(f"rows: {out_dir / 'results.csv'}", highlight=False)
            for note in res.notes:
                out.print(f"[yellow]note:[/] {escape(note)}")
        return res.exit_code

    _guard(body)


def _check_kernels(value: Optional[str]) -> None:
    from .kernel_registry import provider_names

    _check_choice(value, ("auto", *provider_names()), "--kernels")


def _check_choice(value: Optional[str], allowed: tuple[str, ...], flag: str) -> None:
    if value is not None and value not in allowed:
        raise InputError(f"{value!r} is not one of {', '.join(allowed)}", flag)


def _print_bugs() -> None:
    out.print(bugs_table())


def bugs_table():
    """The injectable bugs with what each breaks and the check that catches it (``run --list-bugs``)."""
    from rich.table import Table

    from .bugs import BUGS

    t = Table(title="injectable bugs (--inject-bug NAME)", title_justify="left")
    t.add_column("name", no_wrap=True)  # (names whole at 80 columns: the description wraps)
    t.add_column("what it breaks", overflow="fold")
    t.add_column("caught by", no_wrap=True)
    for name, (what, check) in BUGS.items():
        t.add_row(name, what, check)
    return t


@app.command()
def shrink(
    trace: Path = typer.Argument(..., help="a trace that fails a check (e.g. recorded with --inject-bug)"),
    out_path: Path = typer.Option(..., "--out", help="where to write the shrunk trace"),
    check_name: Optional[str] = typer.Option(None, "--check", help="the check that must keep failing "
                                             "(default: the first one that fails)"),
    inject_bug: List[str] = typer.Option([], "--inject-bug", help="bugs to replay with (default: the trace's own)"),
) -> None:
    """Delta-debug a failing trace down to the smallest one that still fails the same check."""

    def body() -> int:
        from .bugs import check_bugs
        from .shrink import shrink_trace

        bugs = check_bugs(inject_bug) if inject_bug else None
        _check_outputs((out_path, "--out"), reads=((trace, "the trace"),))
        with err.status("shrinking: replaying the trace to its first failure") as status:
            def progress(phase: str, tests: int, steps: int, reqs: int) -> None:
                status.update(f"shrinking ({phase}): candidate {tests}; smallest failing so far: {steps} steps, "
                              f"{reqs} requests")
            r = shrink_trace(trace, out_path, check_name, bugs, progress=progress)
        out.print(f"{r.check} still fails in {out_path}: steps {r.steps_before} -> {r.steps_after}, "
                  f"requests {r.requests_before} -> {r.requests_after} ({r.tests} candidate traces tried)")
        return 0

    _guard(body)


@app.command()
def validate(files: List[Path] = typer.Argument(..., help="scenario YAML files and/or trace JSONL files")) -> None:
    """Check scenarios (schema and cross-field rules) and traces (format, token accounting, and the
    schedule held to the engine's rules, as replay does before it executes: exit 1 where it breaks one)."""

    def body() -> int:
        from .config import load_scenario
        from .replay import CONVERTED_NOTE, verify_recorded
        from .trace_verify import CHECK
        from .workload import build_workload
        from .runner import check_workload_fits

        broken = 0
        for f in files:
            if f.suffix in (".jsonl", ".json"):
                v = verify_recorded(f)
                tr, tally = v.trace, v.checks.tallies[CHECK]
                kind = "vLLM recording" if CONVERTED_NOTE in v.notes else "hybridsim trace"
                what = f"{len(tr.steps)} steps, {len(tr.requests)} requests, token accounting consistent"
                if v.ok:
                    out.print(f"[green]ok[/] {f}: {kind}, {what}, the schedule keeps the engine's rules "
                              f"({tally.count:,} {CHECK} checks)")
                else:
                    broken += 1
                    first = tally.first_failure
                    out.print(f"[red]broken[/] {f}: {what}, but the schedule breaks the engine's rules "
                              f"({CHECK}), first at step {first.step}: {first.message}", highlight=False)
                for note in v.notes:
                    out.print(f"   [yellow]note:[/] {note}")
            else:
                loaded = load_scenario(f)
                s = loaded.scenario
                wl = build_workload(loaded)
                check_workload_fits(loaded, wl)
                geo = s.geometry()
                out.print(f"[green]ok[/] {f}: scenario {s.name!r}, model {geo.name}, "
                          f"{len(wl.requests)} requests ({wl.total_prompt_tokens:,} prompt tokens, {wl.source}), "
                          f"cache mode {s.cache.resolved_mode()}, block {s.cache.block_size}, "
                          f"{s.cache.num_blocks} blocks")
                for note in wl.notes:
                    out.print(f"   [yellow]note:[/] {note}")
                why = s.cannot_execute()
                if why:
                    out.print(f"   [yellow]note:[/] {why}")
        return 1 if broken else 0

    _guard(body)


@app.command()
def presets(num_spec: int = typer.Option(0, "--spec-tokens", min=0,
                                         help="draft tokens (widen the conv window, as upstream)"),
            draft_layers: int = typer.Option(1, "--draft-layers", min=1,
                                             help="the MTP / EAGLE drafter's layers in the groups shown")) -> None:
    """List the model presets with their state and KV sizes, KV-cache groups and where each came from."""

    def body() -> int:
        from .presets import PRESETS, build_preset
        from .report import presets_table

        rows = [(build_preset(n), PRESETS[n]["source"]) for n in PRESETS]
        out.print(presets_table(rows, num_spec))
        _print_preset_layouts(draft_layers)
        out.print("[bold]sources[/]")
        for name, spec in PRESETS.items():
            out.print(f"  [bold]{name}[/]: {spec['source']}" + (f" [dim]({spec['note']})[/]" if "note" in spec else ""),
                      highlight=False)
        return 0

    _guard(body)


def _print_preset_layouts(draft_layers: int) -> None:
    """Each preset's KV-cache groups as vLLM 0.33 forms them (sched/groups.py), with and
    without a drafter: COUNT× KIND[target layers+drafter layers]."""
    from .presets import PRESETS, build_preset
    from .sched.groups import preset_layouts

    out.print("[bold]KV-cache groups[/] (as vLLM 0.33 forms them; layers Mamba, attention, MLA in that order; "
              "COUNT× KIND[layers per group])")
    for name in PRESETS:
        out.print(f"  [bold]{name}[/]", highlight=False)
        for label, line in preset_layouts(build_preset(name), draft_layers):
            out.print(f"    {label}: {line}", highlight=False)


@app.command()
def fidelity(
    recordings: List[Path] = typer.Argument(..., help="vLLM recordings (data/vllm-recorded/*.jsonl)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the reports as JSON"),
) -> None:
    """Re-simulate recordings of the real vLLM scheduler and compare step by step."""

    def body() -> int:
        from .fidelity import run_fidelity
        from .report import fidelity_table

        _check_outputs((json_out, "--json"), reads=tuple((r, "a recording") for r in recordings))
        reports = [run_fidelity(str(r)) for r in recordings]
        for rep in reports:
            out.print(fidelity_table(rep))
        if json_out is not None:
            data = [r.as_dict() for r in reports]
            _write_json(json_out, data[0] if len(data) == 1 else {"recordings": data})
        return 0

    _guard(body)


@app.command()
def convert(
    recording: Path = typer.Argument(..., help="a vLLM recording"),
    out_path: Path = typer.Option(..., "--out", help="hybridsim trace to write"),
) -> None:
    """Convert a vLLM scheduler recording into a hybridsim step trace."""

    def body() -> int:
        from .convert import convert_recording

        _check_outputs((out_path, "--out"), reads=((recording, "the recording"),))
        n = convert_recording(recording, out_path)
        out.print(f"wrote {out_path}: {n} steps")
        return 0

    _guard(body)


kernels_app = typer.Typer(help="Kernel providers: list them and the ops each supplies, or check one.",
                          invoke_without_command=True, no_args_is_help=False)
app.add_typer(kernels_app, name="kernels")


@kernels_app.callback()
def kernels_list(ctx: typer.Context) -> None:
    """List the kernel providers (built in, and plugins of the entry-point group hybridsim.kernels) and
    whose code each op runs."""
    if ctx.invoked_subcommand is not None:
        return

    def body() -> int:
        from .kernels_cli import providers_table

        out.print(providers_table())
        return 0

    _guard(body)


@kernels_app.command("check")
def kernels_check(
    provider: str = typer.Argument(..., help="a provider name (`hybridsim kernels` lists them)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    op: List[str] = typer.Option([], "--op", help="check only this op (repeatable)"),
    quick: bool = typer.Option(False, "--quick", help="fewer, smaller cases"),
    seed: int = typer.Option(0, "--seed", help="seed of the random inputs"),
) -> None:
    """Run every op of a provider against the reference on adversarial inputs; exit 1 on any failure."""

    def body() -> int:
        from .kernels_cli import check_provider

        _check_choice(device, ("auto", "cpu", "cuda"), "--device")
        return check_provider(provider, device, tuple(op), quick, seed, out)

    _guard(body)


def main() -> None:  # console-script entry point
    from .hostmem import tune_malloc

    tune_malloc()  # (a checked CPU replay reuses its freed tensors' pages: hostmem.py)
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
