"""Sweep and replay fan-out timings: --workers 1 vs 2 vs a local Ray instance; replay serial vs -j 2.

    python bench/bench_sweep.py [--repeat N] [--skip-replay]

Each configuration runs in a fresh process (``python -m hybridsim ...``), timed from outside, so
interpreter and torch imports, the forkserver's and Ray's start-up are all included, as a user
waits for them. With ``--repeat`` the fastest of N runs counts (the shared CPU has noisy phases).
Ray's start-up and per-cell overhead come from one more in-process run of the library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

REPO = Path(__file__).resolve().parents[1]
GRID = REPO / "scenarios/sweeps/tiny_grid.yaml"


def timed(args: list[str], env: dict | None = None) -> float:
    t0 = perf_counter()
    r = subprocess.run([sys.executable, "-m", "hybridsim", *args], cwd=REPO, capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    wall = perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return wall


def sweep_wall(flags: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            best = min(best, timed(["sweep", str(GRID), "--out", d, "-q", *flags]))
    return best


RAY_PROBE = """
import json, sys, tempfile
from pathlib import Path
from time import perf_counter
from hybridsim.sweep import load_sweep, run_sweep
sw = load_sweep(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    t0 = perf_counter()
    res = run_sweep(sw, Path(d), ray="auto")
    wall = perf_counter() - t0
print(json.dumps({"wall": wall, "start": res.backend_start_s, "cells": len(sw.cells),
                  "cell_s": float(res.frame["wall_s"].sum())}))
"""


def ray_overhead() -> dict:
    r = subprocess.run([sys.executable, "-c", RAY_PROBE, str(GRID)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-ray", action="store_true", help="local pool only (a machine without Ray)")
    a = ap.parse_args()
    w1 = sweep_wall(["--workers", "1"], a.repeat)
    w2 = sweep_wall(["--workers", "2"], a.repeat)
    print(f"sweep {GRID.relative_to(REPO)} (16 cells): --workers 1 {w1:.1f} s, --workers 2 {w2:.1f} s "
          f"({w2 / w1:.2f}x, bar 0.6x)", flush=True)
    if not a.skip_ray:
        ray = sweep_wall(["--ray", "auto"], a.repeat)
        print(f"--ray auto {ray:.1f} s ({ray / w1:.2f}x of --workers 1, bar 0.7x)", flush=True)
        ray_report()
    if not a.skip_replay:
        replay_report(a.repeat)


def ray_report() -> None:
    o = ray_overhead()
    slots = 2
    per_cell = (o["wall"] - o["start"] - o["cell_s"] / slots) / o["cells"]
    print(f"Ray in-process: start-up {o['start']:.1f} s; sweep {o['wall']:.1f} s for {o['cells']} cells of "
          f"{o['cell_s']:.1f} s work in all; overhead per cell {per_cell * 1e3:.0f} ms "
          f"((wall - start-up - work / {slots} slots) / cells)")


def replay_report(repeat: int) -> None:
    serial = min(timed(["replay", "traces/", "--check"]) for _ in range(repeat))
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # (what each -j process runs with)
    serial1 = min(timed(["replay", "traces/", "--check"], one) for _ in range(repeat))
    j2 = min(timed(["replay", "traces/", "--check", "-j", "2"]) for _ in range(repeat))
    print(f"replay traces/ --check: serial {serial:.1f} s, -j 2 {j2:.1f} s ({j2 / serial:.2f}x, bar 0.6x); "
          f"serial with one torch thread {serial1:.1f} s (-j 2 {j2 / serial1:.2f}x of that)")


if __name__ == "__main__":
    main()
