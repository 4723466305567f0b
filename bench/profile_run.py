"""Where a checked run's time goes: run a scenario once to compile the kernels, then again
under cProfile with the device synchronised at the end, and print the top functions.

    python3 bench/profile_run.py scenarios/nemotron_h_8b.yaml [--max-steps N] [--kernels triton]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridsim.config import load_scenario  # noqa: E402
from hybridsim.runner import plan_scenario  # noqa: E402


def once(path: str, max_steps, kernels: str, device: str):
    loaded = load_scenario(path)
    if max_steps:
        s = loaded.scenario
        loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"max_steps": max_steps})})
    t0 = perf_counter()
    res = plan_scenario(loaded, kernels=kernels, device=device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return res, perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--cuda-profile", action="store_true", help="also print device time per operator")
    a = ap.parse_args()
    res, first = once(a.scenario, a.max_steps, a.kernels, a.device)
    if a.cuda_profile:  # device time by operator (a third run, so host timings stay clean)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            once(a.scenario, a.max_steps, a.kernels, a.device)
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.top))
    prof = cProfile.Profile()
    prof.enable()
    res, second = once(a.scenario, a.max_steps, a.kernels, a.device)
    prof.disable()
    steps = res.stats.steps
    print(f"{a.scenario}: {steps} steps; first run {first:.2f} s (compiles), second {second:.2f} s with set-up, "
          f"whole loop {res.wall_s:.2f} s = {1e3 * res.wall_s / steps:.1f} ms/step; "
          f"failures {sum(t.failures for t in res.checks.tallies.values())}")
    for t in res.timings:
        print(f"  {t['phase']}: {t['total_s']:.3f} s")
    if torch.cuda.is_available():
        print(f"  peak device memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
