"""Sweep and replay fan-out timings: --workers 1 vs 2 vs a local Ray instance; replay serial vs -j 2.

    python bench/bench_sweep.py [--repeat N] [--skip-replay] [--replay-only]

Each configuration runs in a fresh process (``python -m hybridsim ...``), timed from outside, so
interpreter and torch imports, the forkserver's and Ray's start-up are all included, as a user
waits for them. With ``--repeat`` the fastest of N runs counts (the shared CPU has noisy phases).
Ray's start-up and per-cell overhead come from one more in-process run of the library.
Each replay timing prints the 1-minute load average at its start and the CPU seconds other
processes used while it ran (a run that shared the cores is not a quiet-machine number).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter, sleep

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


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU clock ticks so far), from /proc."""
    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    r = f.read().rsplit(")", 1)[1].split()
                out[int(p)] = (int(r[1]), int(r[11]) + int(r[12]))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _machine_ticks() -> int:
    with open("/proc/stat") as f:
        return sum(int(v) for v in f.readline().split()[1:4])  # user, nice, system


def timed_load(args: list[str], env: dict | None = None) -> tuple[float, str, float]:
    """The wall time, the 1-minute load average at the start, and the CPU seconds that processes
    outside the command's process tree (forkserver and workers included in it) used meanwhile."""
    load = open("/proc/loadavg").read().split()[0]
    m0 = _machine_ticks()
    t0 = perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "hybridsim", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=None if env is None else {**os.environ, **env})
    tree: dict[int, int] = {}  # pid -> its CPU ticks, last seen (every one of them started after t0)
    while p.poll() is None:
        ps = _procs()
        kids, grew = {p.pid}, True
        while grew:
            grew = False
            for pid, (ppid, _) in ps.items():
                if ppid in kids and pid not in kids:
                    kids.add(pid)
                    grew = True
        for pid in kids & ps.keys():
            tree[pid] = ps[pid][1]
        sleep(0.2)
    wall = perf_counter() - t0
    err = p.stderr.read().decode()
    if p.returncode != 0:
        sys.exit(f"{' '.join(args)} exited {p.returncode}:\n{err[-2000:]}")
    # (sampled every 0.2 s: a worker's last moments are missed, enough to tell a quiet run from a shared one)
    other = max(0.0, (_machine_ticks() - m0 - sum(tree.values())) / os.sysconf("SC_CLK_TCK"))
    return wall, load, other


def sweep_wall(flags: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            best = min(best, timed(["sweep", str(GRID), "--out", d, "-q", *flags]))
    return best


RAY_PROBE = """
import json, sys, tempfile
from pathlib import Path
from time import perf_counter, sleep
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
    ap.add_argument("--replay-only", action="store_true", help="replay serial vs -j 2 alone")
    ap.add_argument("--skip-ray", action="store_true", help="local pool only (a machine without Ray)")
    a = ap.parse_args()
    if a.replay_only:
        replay_report(a.repeat)
        return
    configs = {"--workers 1": ["--workers", "1"], "--workers 2": ["--workers", "2"]}
    if not a.skip_ray:
        configs["--ray auto"] = ["--ray", "auto"]
    walls: dict[str, list[float]] = {k: [] for k in configs}
    for i in range(a.repeat):  # (rounds alternate the configurations: a slow phase of the machine hits each)
        for name, flags in configs.items():
            walls[name].append(sweep_wall(flags, 1))
        print(f"  round {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in walls.items()), flush=True)
    w1, w2 = min(walls["--workers 1"]), min(walls["--workers 2"])
    print(f"sweep {GRID.relative_to(REPO)} (16 cells), fastest of {a.repeat}: --workers 1 {w1:.1f} s, --workers 2 "
          f"{w2:.1f} s ({w2 / w1:.2f}x, bar 0.6x)", flush=True)
    if not a.skip_ray:
        ray = min(walls["--ray auto"])
        ratios = sorted(r / w for r, w in zip(walls["--ray auto"], walls["--workers 1"]))
        print(f"--ray auto {ray:.1f} s ({ray / w1:.2f}x of --workers 1, bar 0.7x); round by round "
              f"{', '.join(f'{x:.2f}' for x in ratios)}x", flush=True)
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
    """Serial and -j 2 alternate, so that a busy phase of the shared machine hits both."""
    runs: dict[str, list[tuple[float, str, float]]] = {"serial": [], "-j 2": []}
    for i in range(repeat):
        for name, args in (("serial", ["replay", "traces/", "--check"]),
                           ("-j 2", ["replay", "traces/", "--check", "-j", "2"])):
            wall, load, other = timed_load(args)
            runs[name].append((wall, load, other))
            print(f"  replay traces/ --check {name}: {wall:.1f} s (load average {load} at the start; other "
                  f"processes' CPU meanwhile {other:.1f} s)", flush=True)
    serial, j2 = min(runs["serial"]), min(runs["-j 2"])
    print(f"replay traces/ --check: serial {serial[0]:.1f} s, -j 2 {j2[0]:.1f} s ({j2[0] / serial[0]:.2f}x, "
          f"bar 0.6x); fastest of {repeat}")


if __name__ == "__main__":
    main()
