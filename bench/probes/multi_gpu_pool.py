"""The local pool on a machine with several GPUs: does each GPU job get a GPU of its own, do the
GPU workers spread over the GPUs, and what does the tiny grid take with them?

    python3 bench/probes/multi_gpu_pool.py

Prints, per job, the CUDA_VISIBLE_DEVICES it was given, the UUID of the one device it saw, and
its worker's pid; then the tiny grid swept with --per-gpu 1 and 2 (wall time, backend line).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def which_gpu(seconds: float) -> tuple:
    """A job: a small matmul on the GPU it was given; what it saw."""
    import torch

    x = torch.randn(2048, 2048, device="cuda")
    t0 = time.time()
    while time.time() - t0 < seconds:
        x = (x @ x).tanh()
    torch.cuda.synchronize()
    return (os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(),
            str(torch.cuda.get_device_properties(0).uuid), os.getpid())


def main() -> None:
    from hybridsim.sweep.jobs import Job
    from hybridsim.sweep.pool import run_local, visible_gpus

    gpus = visible_gpus()
    print("visible_gpus:", gpus)
    jobs = [Job(str(i), which_gpu, 1.0, gpu=True) for i in range(2 * len(gpus) + 1)]
    t0 = time.perf_counter()
    for o in sorted(run_local(jobs, workers=8), key=lambda o: int(o.key)):
        print(f"job {o.key}: {o.kind} {o.value if o.kind == 'ok' else o.message}")
    print(f"{len(jobs)} jobs in {time.perf_counter() - t0:.1f} s")
    grid = REPO / "scenarios" / "sweeps" / "tiny_grid.yaml"
    for per_gpu in ("1", "2"):
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "hybridsim", "sweep", str(grid), "--out", out + "/o",
                                "--workers", "8", "--per-gpu", per_gpu], capture_output=True, text=True, cwd=REPO)
            said = [ln for ln in r.stdout.splitlines() if ln.startswith("sweep:")] or r.stderr.splitlines()[-3:]
            print(f"tiny_grid --workers 8 --per-gpu {per_gpu}: {time.perf_counter() - t:.1f} s, exit {r.returncode}: "
                  + " ".join(said))


if __name__ == "__main__":
    main()
