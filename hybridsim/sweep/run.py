"""Run a validated sweep on a backend and stream its rows into DIR/results.csv.

The driver owns the file: workers hand rows back (a failing cell's trace text with it), and
the driver appends each as it arrives, so local and Ray runs write identical files.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import pandas as pd

from ..output_files import make_folder, write_output
from .jobs import DIED, ENVIRONMENT, ERROR, INPUT, OK, Job, Outcome, runs_on_gpu
from .pool import default_workers, run_local, visible_gpus
from .results import ResultsFile, write_parquet
from .spec import Cell, Sweep

if TYPE_CHECKING:
    from .ray_pool import RayBackend

# a cell that did not finish: its outcome word and exit code
_NOT_RUN = {INPUT: ("bad input", 2), ENVIRONMENT: ("environment", 3), ERROR: ("error", 3), DIED: ("died", 3)}

Backend = Callable[[list[Job]], Iterator[Outcome]]


@dataclass
class SweepResult:
    frame: pd.DataFrame  # every row of results.csv (resumed ones included)
    ran: int  # cells run now
    skipped: int  # cells already in results.csv (--resume)
    wall_s: float
    backend: str
    notes: list[str] = field(default_factory=list)
    backend_start_s: float = 0.0  # Ray's start-up, where this run started it

    @property
    def exit_code(self) -> int:
        """The worst cell's: 1 a check failed, 2 a cell refused at run time, 3 environment or a worker died twice."""
        return int(self.frame["exit_code"].max()) if len(self.frame) else 0


@contextmanager
def backend_for(workers: Optional[int], ray: Optional[str | RayBackend],
                per_gpu: int = 1) -> Iterator[tuple[Backend, str, float]]:
    """The local process pool, or Ray: ``ray`` = "auto" for a local instance, a cluster address, or
    a ``RayBackend`` already starting (``ray_pool.start_ray``), which this closes when done.
    ``per_gpu``: jobs that run kernels on a GPU share each GPU this many at a time."""
    if ray is None:
        n = workers or default_workers()
        gpus = visible_gpus()
        on = (f", {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({per_gpu} checked cell{'s' if per_gpu > 1 else ''} "
              "each at a time)") if gpus else ""
        yield (lambda jobs: run_local(jobs, n, gpus=gpus, per_gpu=per_gpu)), \
            f"local pool, {n} worker{'s' if n > 1 else ''}{on}", 0.0
        return
    from .ray_pool import start_ray

    rb = start_ray(ray) if isinstance(ray, str) else ray
    try:
        rb.ready()
        yield (lambda jobs: rb.run(jobs, per_gpu)), f"Ray ({'local instance' if rb.address is None else rb.address})", \
            rb.start_s
    finally:
        rb.close()


def run_sweep(sweep: Sweep, out_dir: Path, *, workers: Optional[int] = None,
              ray: Optional[str | RayBackend] = None, per_gpu: int = 1, resume: bool = False,
              record_failures: bool = False,
              on_start: Optional[Callable[[int, int], None]] = None,
              on_row: Optional[Callable[[dict], None]] = None, cell_fn: Optional[Callable] = None) -> SweepResult:
    """Run every cell not already in DIR/results.csv; ``cell_fn`` replaces ``run_cell`` (tests). ``ray``,
    ``per_gpu``: see ``backend_for``."""
    from .cell import TRACE_KEY, CellTask, run_cell

    results = ResultsFile(out_dir, sweep.keys, resume)
    results.check_cells([c.label for c in sweep.cells])
    todo = [c for c in sweep.cells if c.label not in results.done]
    if on_start is not None:
        on_start(len(todo), len(sweep.cells) - len(todo))
    by_key = {c.label: c for c in todo}
    fn = cell_fn or run_cell
    jobs = [Job(c.label, fn, CellTask(c, tuple(sweep.bugs), record_failures), runs_on_gpu(c.raw.get("execution", {})))
            for c in todo]
    make_folder(out_dir, "--out")
    t0 = perf_counter()
    try:
        with backend_for(workers, ray, per_gpu) as (run, name, start_s):
            for outcome in run(jobs):
                cell = by_key[outcome.key]
                row = _row(cell, outcome)
                text = row.pop(TRACE_KEY, None)
                if text is not None:
                    path = out_dir / "failures" / f"{cell.slug}.jsonl"
                    make_folder(path.parent, "--out")
                    write_output(path, "--out", text)
                    row["trace"] = str(path.relative_to(out_dir))
                results.append(row)
                if on_row is not None:
                    on_row(row)
    finally:  # (interrupted too: results.parquet holds what results.csv holds)
        frame = results.frame()
        note = write_parquet(frame, out_dir) if results.path.exists() else None
    notes = [note] if note else []
    return SweepResult(frame, len(todo), len(sweep.cells) - len(todo), perf_counter() - t0, name, notes, start_s)


def _row(cell: Cell, outcome: Outcome) -> dict[str, Any]:
    row: dict[str, Any] = {"cell": cell.label, **cell.values, "seed": cell.seed}
    if outcome.kind == OK:
        row.update(outcome.value)
    else:
        word, code = _NOT_RUN[outcome.kind]
        row.update({"outcome": word, "exit_code": code, "error": outcome.message})
    row["attempts"] = outcome.attempts
    return row
