"""Where a run's time outside its loop goes: `hybridsim run` in this process with the stages before and
after the loop stamped on one clock from the interpreter's start (imports, the scenario and workload, the
kernel list's cache lookups, the executor's setup beside the list's builds, the wait for them, the loop,
the report). A first run on a fresh machine spends 15-18 s outside its loop (nemotron_h_8b_mooncake on
an H200); this says which stage holds it.

    python3 bench/probes/startup_timeline.py scenarios/nemotron_h_8b_mooncake.yaml --kernels triton --device cuda -q

Everything after the script's name is `hybridsim run`'s arguments. Prints the stages, each with its start,
its end and its length, seconds since the interpreter started (``time.perf_counter`` is read as early as
the script runs; the interpreter's own start before that is not counted).
"""
from __future__ import annotations

import os
import sys
import time

T0 = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

STAMPS: list[tuple[str, float, float]] = []


def stamped(owner, name: str, label: str) -> None:
    """``owner.name`` wrapped: its start and end stamped under ``label``."""
    inner = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            STAMPS.append((label, t - T0, time.perf_counter() - T0))

    setattr(owner, name, wrapper)


def main() -> None:
    t = time.perf_counter()
    import torch  # noqa: F401

    STAMPS.append(("import torch", t - T0, time.perf_counter() - T0))
    t = time.perf_counter()
    import hybridsim.cli as cli
    import hybridsim.device.prebuild as pb
    import hybridsim.execute as execute
    import hybridsim.runner as runner

    STAMPS.append(("import hybridsim (cli, runner, execute)", t - T0, time.perf_counter() - T0))
    stamped(runner, "build_workload", "workload built")
    stamped(execute, "make_executor", "executor made (beside the list's builds)")
    stamped(execute.KernelLists, "__init__", "kernel list: looked up, cache checked, builds started")
    stamped(execute.KernelLists, "wait", "waited for the list's builds")
    stamped(pb, "in_cache", "  a listed variant looked up in Triton's cache")
    stamped(runner, "plan_scenario", "plan_scenario (setup, loop, results)")
    stamped(runner.Simulation, "__init__", "simulation set up")
    import hybridsim.engine.executor as executor
    import hybridsim.kernels.timed as timed

    stamped(executor.Executor, "__init__", "  the executor's own setup (layers, caches, oracles)")
    stamped(executor.Executor, "finish", "the loop's last verdicts read")
    stamped(timed, "device_ceilings", "the card's rates measured (the kernel table's floors)")
    try:
        sys.argv = ["hybridsim", "run", *sys.argv[1:]]
        cli.main()
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    end = time.perf_counter() - T0
    merged: dict[str, list] = {}
    for label, a, b in STAMPS:
        m = merged.setdefault(label, [a, b, 0.0, 0])
        m[0], m[1], m[2], m[3] = min(m[0], a), max(m[1], b), m[2] + (b - a), m[3] + 1
    print(f"\nstartup timeline (seconds since this script started; exit {code}, {end:.2f} s in all):", file=sys.stderr)
    if "waited for the list's builds" in merged and "the loop's last verdicts read" in merged:
        loop = (merged["waited for the list's builds"][1], merged["the loop's last verdicts read"][1])
        merged["the loop (from the builds' end to its last verdicts)"] = [*loop, loop[1] - loop[0], 1]
    if "plan_scenario (setup, loop, results)" in merged:
        after = merged["plan_scenario (setup, loop, results)"][1]
        merged["after: the report, the files"] = [after, end, end - after, 1]
    for label, (a, b, total, n) in sorted(merged.items(), key=lambda kv: kv[1][0]):
        calls = f" ({n} calls, {total:.2f} s summed)" if n > 1 else ""
        print(f"  {a:7.2f} -> {b:7.2f}  {b - a:6.2f} s  {label}{calls}", file=sys.stderr)


if __name__ == "__main__":
    main()
