"""How far a GPU-bound checked run is from its device time: the whole loop with the verdicts
read 1 or 4 steps late, with and without the timing spins (kernels/timed.py).

    python3 bench/probes/verdict_lag.py scenarios/deepseek_v3.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hybridsim.engine.executor as ex_mod  # noqa: E402
import hybridsim.kernels.timed as timed  # noqa: E402
from hybridsim.config import load_scenario  # noqa: E402
from hybridsim.engine.verdicts import Verdicts  # noqa: E402
from hybridsim.runner import plan_scenario  # noqa: E402


def run(path: str):
    res = plan_scenario(load_scenario(path), kernels="triton", device="cuda")
    torch.cuda.synchronize()
    return res


def main() -> None:
    path = sys.argv[1]
    run(path)  # compile
    first, every = timed.TIME_FIRST, timed.TIME_EVERY
    for lag in (1, 4):
        for spins in (True, False):
            ex_mod.Verdicts = lambda _lag, n=lag: Verdicts(n)
            timed.TIME_FIRST, timed.TIME_EVERY = (first, every) if spins else (0, 10 ** 9)
            for _ in range(2):
                r = run(path)
                ph = {t["phase"]: t["total_s"] for t in r.timings}
                print(f"lag {lag} spins {'on ' if spins else 'off'}: {1e3 * r.wall_s / r.stats.steps:.1f} ms/step "
                      f"(verdict wait {1e3 * ph.get('verdicts', 0) / r.stats.steps:.1f})", flush=True)


if __name__ == "__main__":
    main()
