from __future__ import annotations

import torch

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


def mla_decode_case(B: int, nq: int, H: int, L: int, R: int, page: int, lens: list[int], dtype: torch.dtype,
                    gen: torch.Generator, device="cpu"):
    """An MLA decode call's inputs: a latent cache whose rows' pages lie in shuffled order, every page no
    row names NaN (a read past a row's end reaches the outputs), and fresh random queries: q_lat (B, nq, H,
    L), q_pe (B, nq, H, R), cache (pages, page, L + R) in ``dtype``, block table (B, most blocks), on ``device``."""
    max_blocks = max(-(-n // page) for n in lens)
    pages = B * max_blocks + 3
    cache = torch.full((pages, page, L + R), float("nan"), dtype=dtype)
    table = torch.zeros(B, max_blocks, dtype=torch.int64)
    perm = torch.randperm(pages - 1, generator=gen) + 1
    k = 0
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            table[b, j] = perm[k]
            cache[perm[k]] = torch.randn(page, L + R, generator=gen).to(dtype)
            k += 1
    q_lat = torch.randn(B, nq, H, L, generator=gen)
    q_pe = torch.randn(B, nq, H, R, generator=gen)
    return q_lat.to(device), q_pe.to(device), cache.to(device), table.to(device)
