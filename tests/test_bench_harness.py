"""bench/bench_kernels.py's CUDA-graph timings drain the device first.

triton.testing.do_bench_cudagraph calls the benchmarked function eagerly on a fresh stream of
its own before it synchronizes; without a drain those calls read a case's block table and
launch plan before the default stream has written them, and a kernel following stale ids
faults (bench/history/2026-11-25_sessions-17-20.md, session 18, where the probe that showed it on a GPU,
``git show e516cad:bench/probes/paged_fault.sh``, is described). Checked here on the
CPU with the CUDA calls replaced by recorders.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.testing  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_graph_bench_synchronizes_before_do_bench_cudagraph(monkeypatch):
    bk = _load()
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("synchronize"))

    def fake_graph_bench(fn, rep=20, return_mode="mean", **kw):
        events.append("do_bench_cudagraph")
        return 2.0

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_graph_bench)
    assert bk.graph_bench(lambda: None) == 2.0e-3
    assert events == ["synchronize", "do_bench_cudagraph"]
    events.clear()
    assert bk._gpu_time(lambda: None, graph=True) == 2.0e-3
    assert events == ["synchronize", "do_bench_cudagraph"]


def test_every_graph_timing_goes_through_graph_bench():
    """No call of do_bench_cudagraph outside graph_bench (the MLA and GQA sections both time graphs)."""
    tree = ast.parse(BENCH.read_text())
    callers = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr == "do_bench_cudagraph":
                    callers.append(fn.name)
    # nested functions are walked from their parents too: only graph_bench may contain the call
    assert set(callers) == {"graph_bench"}, callers


def test_bench_rows_report_their_floor_and_flag_what_beats_it():
    """A row's floor comes from the run's traffic accounting and the measured rates; a time under
    the floor is reported as it is (above 100%) and flagged, never clamped."""
    from hybridsim.kernels.ceilings import Ceilings
    from hybridsim.kernels.timed import Traffic

    bk = _load()
    c = Ceilings(read_Bps=5e12, copy_Bps=4e12, matmul_flops=7e14)
    t = Traffic(read=10 ** 9, written=0, flops=10 ** 9)
    row = bk.floor_fields(c, t, 1e9 / 5e12 / 1.05)
    assert row["bound"] == "bandwidth" and row["pct_floor"] == pytest.approx(105.0) and row["above_floor"]
    assert "ABOVE FLOOR" in bk.pct_text(row["pct_floor"]) and "ABOVE" not in bk.pct_text(99.0)
    row = bk.floor_fields(c, Traffic(10 ** 6, 10 ** 6, 10 ** 12), 2e-3)
    assert row["bound"] == "compute" and row["pct_floor"] == pytest.approx(100 * 1e12 / 7e14 / 2e-3)
    assert not row["above_floor"] and row["bytes"] == 2 * 10 ** 6
