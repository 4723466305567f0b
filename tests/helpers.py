from __future__ import annotations

from hybridsim.config import parse_scenario
from hybridsim.simulate import Simulation
from hybridsim.workload import build_workload
from hybridsim.workload.base import Workload, WorkloadRequest


def simulate(text: str, workload: Workload | None = None, checker: bool = True):
    """Run a scenario; returns (simulation, [(plan, outcome), ...]); invariants checked every step."""
    from hybridsim.checks import Checks
    from hybridsim.sched.invariants import InvariantChecker

    loaded = parse_scenario(text, "t.yaml")
    wl = workload or build_workload(loaded)
    sim = Simulation(loaded.scenario, wl)
    checks = Checks()
    if checker:
        sim.checker = InvariantChecker(sim.scheduler, checks.get("sched.invariants"))
    records = list(sim)
    sim.checks = checks
    return sim, records


def manual_workload(prompts: list[list[int]], arrivals: list[int], max_tokens: list[int]) -> Workload:
    reqs = [WorkloadRequest(f"r{i}", a, tuple(p), m, 0, 1000 + i)
            for i, (p, a, m) in enumerate(zip(prompts, arrivals, max_tokens))]
    return Workload(reqs, 32000, "manual")


def compile_for_hopper(script: str, *args: str) -> str:
    """Run ``script`` (it builds a kernel for sm_90 with Triton's compiler and prints what it found)
    in a process of its own, without the interpreter the calling test module may run; its stdout.
    Skips where this machine has no Triton NVIDIA tool chain (ptxas)."""
    import os
    import subprocess
    import sys

    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode and ("ptxas" in r.stderr or "No module named 'triton" in r.stderr):
        pytest.skip(f"no Triton NVIDIA tool chain here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
