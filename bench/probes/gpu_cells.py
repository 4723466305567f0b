"""What a checked sweep cell costs on a GPU, and where: a fresh process per cell against a warm one.

    python3 bench/probes/gpu_cells.py [--old PATH]   # PATH: another hybridsim tree to sweep with too

Prints: the GPUs the local pool sees; the wall time of `hybridsim run` on the tiny grid's base in
fresh processes; the same cell run twice in one process (the first pays CUDA's context and loading
the Triton kernels, the second not); the tiny grid swept with 4 workers (this tree with --per-gpu 1 and 4, and PATH's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "scenarios" / "sweeps" / "tiny_base.yaml"
GRID = REPO / "scenarios" / "sweeps" / "tiny_grid.yaml"


def timed(cmd: list[str], env: dict, cwd: Path = REPO) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    lines = (r.stdout + r.stderr).strip().splitlines()
    said = [ln for ln in lines if ln.startswith("sweep:")] or lines[-1:] or [""]
    return time.perf_counter() - t0, f"exit {r.returncode}: {said[0][:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="another hybridsim source tree to sweep with too")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    from hybridsim.sweep.pool import visible_gpus

    print("visible_gpus:", visible_gpus(), "| /proc/driver/nvidia/gpus:",
          os.listdir("/proc/driver/nvidia/gpus") if os.path.isdir("/proc/driver/nvidia/gpus") else None)
    for i in range(0 if os.environ.get("SKIP_CELLS") else 2):
        s, tail = timed([sys.executable, "-m", "hybridsim", "run", str(BASE), "-q"], env)
        print(f"fresh process {i + 1}: hybridsim run tiny_base.yaml: {s:.2f} s ({tail})")
    code = ("import sys, time\n"
            "t0 = time.perf_counter(); import hybridsim.runner, hybridsim.execute, torch; t1 = time.perf_counter()\n"
            "from hybridsim.sweep import load_sweep\n"
            "from hybridsim.sweep.cell import CellTask, run_cell\n"
            "cell = load_sweep(sys.argv[1]).cells[0]\n"
            "print(f'imports {t1 - t0:.2f} s')\n"
            "for i in range(3):\n"
            "    t = time.perf_counter(); row = run_cell(CellTask(cell)); torch.cuda.synchronize()\n"
            "    print(f'cell run {i + 1} in one process: {time.perf_counter() - t:.2f} s ({row[\"outcome\"]}, '\n"
            "          f'{row[\"checks_run\"]} checks, device {torch.cuda.get_device_name(0)})')\n"
            "cells = load_sweep(sys.argv[1]).cells\n"
            "for threads in (1, torch.get_num_threads()):\n"
            "    torch.set_num_threads(threads)\n"
            "    for p in range(2):\n"
            "        ts = []\n"
            "        for c in cells:\n"
            "            t = time.perf_counter(); run_cell(CellTask(c)); torch.cuda.synchronize()\n"
            "            ts.append(time.perf_counter() - t)\n"
            "        print(f'all {len(cells)} cells, {threads} torch threads, pass {p + 1}: {sum(ts):.2f} s; '\n"
            "              + ' '.join(f'{x:.2f}' for x in ts))\n")
    if not os.environ.get("SKIP_CELLS"):  # (SKIP_CELLS=1: the sweeps only)
        r = subprocess.run([sys.executable, "-c", code, str(GRID)], capture_output=True, text=True, env=env, cwd=REPO)
        print(r.stdout.strip() or r.stderr[-2000:])
    trees = [("this tree", REPO)] + ([("--old", args.old.resolve())] if args.old else [])
    runs = [("this tree", REPO, ["--per-gpu", "1"]), ("this tree", REPO, ["--per-gpu", "4"])]
    runs += [("--old", args.old.resolve(), [])] if args.old else []
    for workers in ("4",):
        for name, tree, extra in runs:
            e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
            with tempfile.TemporaryDirectory() as out:
                s, tail = timed([sys.executable, "-m", "hybridsim", "sweep", str(GRID), "--out", out + "/o",
                                 "--workers", workers, *extra], e, cwd=tree)
                print(f"sweep tiny_grid --workers {workers} {' '.join(extra)} ({name}): {s:.1f} s ({tail})")
                import csv
                with open(out + "/o/results.csv") as f:
                    walls = [float(row["wall_s"]) for row in csv.DictReader(f)]
                print("  cells' wall_s, as they finished:", " ".join(f"{w:.2f}" for w in walls))


if __name__ == "__main__":
    main()
