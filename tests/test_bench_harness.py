"""bench/bench_kernels.py's CUDA-graph timings drain the device first.

triton.testing.do_bench_cudagraph calls the benchmarked function eagerly on a fresh stream of
its own before it synchronizes; without a drain those calls read a case's block table and
launch plan before the default stream has written them, and a kernel following stale ids
faults (bench/RESULTS.md; bench/probes/paged_fault.sh shows it on a GPU). Checked here on the
CPU with the CUDA calls replaced by recorders.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

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
