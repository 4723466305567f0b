"""The golden traces replayed one by one in one process, with N torch threads (default: torch's).

    python bench/probes/replay_threads.py [THREADS]

Prints the imports, each trace's time and the sum: the serial replay's work with two threads
against one is what bounds ``replay -j 2`` (bench/RESULTS.md, session 22).
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    from pathlib import Path

    import torch

    from hybridsim.golden import GoldenTask, check_one, trace_files
    from hybridsim.hostmem import tune_malloc

    tune_malloc()
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    imports = time.perf_counter() - t0
    kw = dict(check="full", bugs=set(), kernels="reference", device="auto")
    total = 0.0
    for trace in trace_files([Path(__file__).resolve().parents[2] / "traces"]):
        t = time.perf_counter()
        row = check_one(GoldenTask(trace, False, kw))
        dt = time.perf_counter() - t
        total += dt
        print(f"  {trace.name:28s} {dt:6.2f} s  {row.result}")
    print(f"{torch.get_num_threads()} thread(s): imports {imports:.2f} s, replays {total:.2f} s, "
          f"in all {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
