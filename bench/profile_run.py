"""Where a checked run's time goes: run a scenario once to compile the kernels, then again
under cProfile with the device synchronised at the end, and print the top functions.

    python3 bench/profile_run.py scenarios/nemotron_h_8b.yaml [--max-steps N] [--warm-steps N]
        [--kernels triton] [--timed 3] [--sync-phases [--time-calls MOD:NAME,...]] [--sync-debug]
        [--cuda-profile-steps A:B [--annotate MOD:NAME,...]]
        [--cuda-profile] [--sort cumulative]

``--timed N`` times N runs without the profiler first (the numbers for a bar: cProfile itself
slows a host-bound loop); ``--sync-debug`` counts the lines where the host waits for the device;
``--time-calls hybridsim.oracle:DenseOracle._expanded_row,...`` splits a synced phase further (each
named callable's own device time, what it calls included; a call made inside another timed call is
counted apart, "within" it, so a callable that both the system and the oracle use splits by caller).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridsim.config import load_scenario  # noqa: E402
from hybridsim.device.builds import built_variants, grown  # noqa: E402
from hybridsim.runner import plan_scenario  # noqa: E402


def once(path: str, max_steps, kernels: str, device: str, progress=None):
    # the previous run's caches go back to the device first: a real-scale run's memory plan must see them free
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    loaded = load_scenario(path)
    if max_steps:
        s = loaded.scenario
        loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"max_steps": max_steps})})
    t0 = perf_counter()
    res = plan_scenario(loaded, kernels=kernels, device=device, progress=progress)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return res, perf_counter() - t0


def _resolve(spec: str):
    """module:Qualified.name -> (the object holding the callable, its name, the callable)."""
    import importlib
    mod, qual = spec.split(":")
    owner = importlib.import_module(mod)
    *path, name = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


_ACTIVE: list[str] = []  # the timed calls under way, outermost first


def _timed_call(spec: str):
    """Replace module:Qualified.name with a wrapper that waits for the device before and after each
    call and adds up the time, keyed by the timed call it ran within (None: none): a callable both the
    system and the oracle use is then split by caller. Returns (spec, owner, name, original,
    {within: [seconds, calls]})."""
    owner, name, orig = _resolve(spec)
    acc: dict = {}

    def timed(*args, **kw):
        within = _ACTIVE[-1] if _ACTIVE else None
        torch.cuda.synchronize()
        t = perf_counter()
        _ACTIVE.append(spec)
        try:
            return orig(*args, **kw)
        finally:
            _ACTIVE.pop()
            torch.cuda.synchronize()
            a = acc.setdefault(within, [0.0, 0])
            a[0] += perf_counter() - t
            a[1] += 1
    setattr(owner, name, timed)
    return spec, owner, name, orig, acc


def _ranged_call(spec: str):
    """Replace module:Qualified.name with a wrapper whose calls are profiler ranges named ``spec``.
    Returns (owner, name, original)."""
    from torch.profiler import record_function
    owner, name, orig = _resolve(spec)

    def ranged(*args, **kw):
        with record_function(spec):
            return orig(*args, **kw)
    setattr(owner, name, ranged)
    return owner, name, orig


def report_compiles(before: dict[str, int]) -> None:
    """Kernel variants built inside the run just timed (``hybridsim/device/builds.py``): a variant
    compiled mid-run is in the figure."""
    grew = grown(before, built_variants())
    print("  kernel variants compiled or loaded inside this run: "
          + (", ".join(f"{k} +{n}" for k, n in grew.items()) if grew else "none"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--warm-steps", type=int, default=None,
                    help="the first run (it compiles the kernels) stops after this many steps")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime", help="pstats order: tottime | cumulative")
    ap.add_argument("--timed", type=int, default=0, help="first, this many runs without the profiler, each timed")
    ap.add_argument("--sync-debug", action="store_true", help="also count the host-device syncs per source line")
    ap.add_argument("--cuda-profile", action="store_true", help="also print device time per operator")
    ap.add_argument("--sync-phases", action="store_true",
                    help="also a run whose phase timers wait for the device at every boundary: each phase's own device time")
    ap.add_argument("--time-calls", default="",
                    help="with --sync-phases: comma-separated module:Qualified.name callables, each call timed with "
                         "the device synced before and after (inclusive of what it calls), in ms a step")
    ap.add_argument("--cuda-profile-steps", default="",
                    help="A:B: device time by kernel over steps A..B-1 only (a run's whole profile is too big to tabulate)")
    ap.add_argument("--annotate", default="",
                    help="with --cuda-profile-steps: comma-separated module:Qualified.name callables, each call a "
                         "profiler range: the table's CUDA total of a range is the device time of what it launched")
    ap.add_argument("--no-cprofile", action="store_true", help="skip the last run, under cProfile")
    a = ap.parse_args()
    if a.time_calls:
        if not a.sync_phases:
            ap.error("--time-calls times calls in the --sync-phases run: give both")
        for spec in a.time_calls.split(","):
            try:
                _resolve(spec)
            except (ValueError, ImportError, AttributeError) as e:
                ap.error(f"--time-calls: {spec!r}: {e} (each as module:Qualified.name, e.g. "
                         "hybridsim.oracle:MambaOracle.check)")
    res, first = once(a.scenario, a.warm_steps or a.max_steps, a.kernels, a.device)
    if a.cuda_profile:  # device time by operator (a third run, so host timings stay clean)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            once(a.scenario, a.max_steps, a.kernels, a.device)
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.top))
    if a.cuda_profile_steps:  # device time by kernel over a window of steps, the device synced at its edges
        from torch.profiler import ProfilerActivity, profile
        first, last = (int(x) for x in a.cuda_profile_steps.split(":"))
        ranges = [_ranged_call(spec) for spec in a.annotate.split(",") if spec]
        activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        window = profile(activities=activities + [ProfilerActivity.CPU] if ranges or not activities else activities)

        clock: dict[int, float] = {}

        def edges(stats) -> None:
            if stats.steps in (first, last) and torch.cuda.is_available():
                torch.cuda.synchronize()
            if stats.steps in (first, last):
                clock[stats.steps] = perf_counter()
            if stats.steps == first:
                window.start()
            elif stats.steps == last:
                window.stop()
        once(a.scenario, a.max_steps or last + 1, a.kernels, a.device, progress=edges)
        for owner, name, orig in ranges:
            setattr(owner, name, orig)
        print(f"device time by kernel, steps {first}..{last - 1} ({last - first} steps):")
        averages = window.key_averages()
        print(averages.table(sort_by="self_cuda_time_total", row_limit=a.top))
        busy = sum(ev.self_device_time_total for ev in averages) / 1e3  # (kernels and copies, microseconds -> ms)
        wall = 1e3 * (clock[last] - clock[first])
        print(f"window: {wall / (last - first):.1f} ms a step on the clock, the device busy {busy / (last - first):.1f} "
              f"ms a step ({100 * busy / wall:.0f}%; kernels on two streams at once count twice)")
        if ranges:
            print(f"device time of what each annotated call launched (CUDA total), steps {first}..{last - 1}:")
            for ev in averages:
                if ev.key in a.annotate.split(","):
                    print(f"  {ev.key}: {ev.count} calls, {ev.device_time_total / 1e3 / (last - first):.1f} ms/step")
    for k in range(a.timed):  # cProfile slows a host-bound loop: these are the honest numbers
        before = built_variants()
        r, _ = once(a.scenario, a.max_steps, a.kernels, a.device)
        print(f"timed run {k + 1}: {r.stats.steps} steps, failures {sum(t.failures for t in r.checks.tallies.values())}; "
              f"whole loop {r.wall_s:.3f} s = {1e3 * r.wall_s / r.stats.steps:.1f} ms/step; "
              + ", ".join(f"{t['phase']} {1e3 * t['total_s'] / r.stats.steps:.1f}" for t in r.timings) + " ms/step")
        report_compiles(before)
    if a.sync_phases and torch.cuda.is_available():
        # the engine's phase timers read the clock after the device has finished what was queued:
        # each phase then holds its own device time, not whichever phase waits for it later
        import hybridsim.device.clock as clk  # (the executor's phases: device/clock.py's PhaseClock)
        import hybridsim.device.verdicts as ve

        def synced() -> float:
            torch.cuda.synchronize()
            return perf_counter()
        mods = (clk, ve)
        for m in mods:
            m.perf_counter = synced
        calls = [_timed_call(spec) for spec in a.time_calls.split(",") if spec]
        before = built_variants()
        r, _ = once(a.scenario, a.max_steps, a.kernels, a.device)
        for m in mods:
            m.perf_counter = perf_counter
        for spec, owner, name, orig, acc in calls:
            setattr(owner, name, orig)
            for within, (sec, n) in acc.items():
                where = f" within {within}" if within else ""
                print(f"  {spec}{where}: {n} calls, {1e3 * sec / r.stats.steps:.1f} ms/step (synced)")
        print(f"synced phases: {r.stats.steps} steps, failures {sum(t.failures for t in r.checks.tallies.values())}; "
              f"whole loop {r.wall_s:.3f} s = {1e3 * r.wall_s / r.stats.steps:.1f} ms/step; "
              + ", ".join(f"{t['phase']} {1e3 * t['total_s'] / r.stats.steps:.1f}" for t in r.timings) + " ms/step")
        report_compiles(before)
    if a.sync_debug:  # a run with torch's sync warnings on: which lines make the host wait
        import collections
        import warnings
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r, _ = once(a.scenario, a.max_steps, a.kernels, a.device)
        torch.cuda.set_sync_debug_mode(0)
        where = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
        print(f"host-device syncs: {len(caught)} in {r.stats.steps} steps")
        for loc, n in where.most_common(a.top):
            print(f"  {n:6d}  {loc}")
    if a.no_cprofile:
        return
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
    pstats.Stats(prof).sort_stats(a.sort).print_stats(a.top)


if __name__ == "__main__":
    main()
