"""One cell, run where a worker runs it: plan, execute, check; a row of plain values back.

The driver imports this module only to name ``run_cell`` to its workers (pickled by reference), so
it stays light: torch and the engine load where a cell runs (the forkserver preloads them once,
``pool.PRELOAD``; a Ray worker on its first cell). A driver that never imports torch reaches Ray's
start-up, or its first result, about a second sooner. A row holds only values that are the same on
every run of the cell, except the timing columns (``TIMINGS``).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, Optional

from .spec import Cell

if TYPE_CHECKING:
    from ..runner import RunResult

TIMINGS = ("plan_s", "wall_s", "kernel_medians_us")  # differ run to run; every other column does not
TRACE_KEY = "_trace"  # a failing cell's recorded trace text (the driver writes it)


@dataclass(frozen=True)
class CellTask:
    cell: Cell
    bugs: tuple[str, ...] = ()
    record_failures: bool = False


def first_divergence(res: RunResult) -> str:
    """The earliest failure over all checks: ``step 12 r3 ssm.output``."""
    firsts = [(t.first_failure.step, t.first_failure.request or "", t.name)
              for t in res.checks.tallies.values() if t.first_failure is not None]
    if not firsts:
        return ""
    step, request, name = min(firsts)
    return f"step {step} {request} {name}".replace("  ", " ")


def _kernel_medians(res: RunResult) -> str:
    kt = res.kernel_timings
    if not kt:
        return ""
    return ";".join(f"{k['kernel']}={k['median_us']:.1f}" for k in sorted(kt["kernels"], key=lambda k: k["kernel"]))


def run_cell(task: CellTask) -> dict[str, Any]:
    """Run a cell; the row's measured columns (its grid columns are the driver's)."""
    from ..runner import plan_scenario

    t0 = perf_counter()
    trace: Optional[Path] = None
    tmp = None
    if task.record_failures:
        tmp = tempfile.TemporaryDirectory(prefix="hybridsim-cell-")
        trace = Path(tmp.name) / "cell.jsonl"
    try:
        res = plan_scenario(task.cell.loaded(), record=trace, bugs=set(task.bugs))
        failed = res.failed or res.stats.stalled
        row: dict[str, Any] = {
            "outcome": "FAIL" if failed else "pass",
            "exit_code": 1 if failed else 0,
            "steps": res.stats.steps,
            "requests": res.stats.requests,
            "finished": res.stats.finished,
            "checks_run": sum(t.count for t in res.checks.tallies.values()),
            "checks_failed": sum(t.failures for t in res.checks.tallies.values()),
            "failed_checks": " ".join(t.name for t in res.checks.tallies.values() if t.failures),
            "first_divergence": first_divergence(res) or ("stalled" if res.stats.stalled else ""),
            "preemptions": res.stats.preemptions,
            "prefix_hit_tokens": res.stats.prefix_hit_tokens,
            "peak_blocks": res.stats.peak_blocks_in_use,
            "plan_s": round(res.schedule_s + res.update_s, 4),
            "wall_s": round(perf_counter() - t0, 4),
            "kernel_medians_us": _kernel_medians(res),
        }
        if failed and trace is not None:
            row[TRACE_KEY] = trace.read_text()
        return row
    finally:
        if tmp is not None:
            tmp.cleanup()
