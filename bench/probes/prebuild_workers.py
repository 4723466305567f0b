"""How fast a kernel variants list builds ahead of a run's loop (``hybridsim/device/prebuild.py``), by
the kind of worker: processes forked from the run's own process (what a run uses since session 43:
nothing imported again), threads in it (Triton's compiler holding the interpreter for much of each
build), processes from a fork server that imports the kernels' modules first (session 36's), or one at
a time. Each mode runs in a fresh process (torch and hybridsim imported first, as in a run) with an
empty Triton cache; one list of the package's (by its label), each variant once.

    python3 bench/probes/prebuild_workers.py [--label nemotron-h-8b-mooncake] [--workers 16] [--modes processes,threads,forkserver,serial]

Prints seconds per mode and the slowest variants. Needs Triton's NVIDIA tool chain, no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def child(label: str, mode: str, workers: int) -> dict:
    import torch  # noqa: F401  (imported before the clock, as a run has it)

    from hybridsim.device import prebuild as pb

    lists = pb.read_lists(pb.SHIPPED, "the package's lists")
    entries = next(lst["variants"] for lst in lists.values() if lst["label"] == label)
    t0 = time.perf_counter()
    if mode in ("processes", "threads"):  # (what a run does: processes forked from it, or threads)
        report = pb.Prebuild(entries, "probe", workers=workers, kind=mode).wait()
        failed, slowest = report.failed, report.slowest
    elif mode == "forkserver":  # (session 36's processes: a fork server that imports the kernels' modules first)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("forkserver")
        modules = sorted({e["kernel"].partition(":")[0] for e in entries})
        ctx.set_forkserver_preload(["triton", "triton.compiler", *modules])
        with ProcessPoolExecutor(workers, mp_context=ctx) as ex:
            results = list(ex.map(pb.build, entries))
        failed = [why for why, _ in results if why]
        slowest = sorted(((e["kernel"], t) for e, (_, t) in zip(entries, results)), key=lambda kt: -kt[1])[:5]
    else:
        results = [pb.build(e) for e in entries]
        failed = [why for why, _ in results if why]
        slowest = sorted(((e["kernel"], t) for e, (_, t) in zip(entries, results)), key=lambda kt: -kt[1])[:5]
    return {"mode": mode, "variants": len(entries), "failed": failed, "seconds": time.perf_counter() - t0,
            "slowest": [[k.split(":")[1], round(t, 2)] for k, t in slowest]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="nemotron-h-8b-mooncake")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--modes", default="processes,threads,serial")  # (also: forkserver)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.label, a.child, a.workers)))
        return
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            r = subprocess.run([sys.executable, __file__, "--label", a.label, "--workers", str(a.workers),
                                "--child", mode], capture_output=True, text=True,
                               env={**os.environ, "TRITON_CACHE_DIR": cache})
            if r.returncode:
                print(f"{mode}: failed\n{r.stderr[-2000:]}")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{a.label}: {res['variants']} variants, {mode:9} ({a.workers} workers): {res['seconds']:6.2f} s, "
                  f"{len(res['failed'])} failed; slowest {res['slowest']}", flush=True)


if __name__ == "__main__":
    main()
