"""The peer side of issue 2's speed bar: vLLM 0.33's own V1 scheduler, driven offline.

Runs in an environment with vLLM 0.33 installed (see bench/peer_setup.sh; not the project's
venv), on a workload exported by the planner benchmark, so both sides plan the same requests:

    .venv/bin/python bench/bench_planner.py mooncake2000 --export /tmp/mooncake2000.json
    .peer-venv/bin/python bench/peer_vllm.py /tmp/mooncake2000.json --repeat 5

The driver is ``hybridsim.engines.vllm`` (the planner of ``hybridsim run --scheduler vllm``); this
script times it and writes its plans. What is driven: ``vllm.v1.core.sched.scheduler.Scheduler``
with its real KV cache manager (one Mamba2 group in align mode with one prefill-checkpoint block, one full-attention
group, block 16, prefix caching with the engine's default sha256 block hashes), the
engine core's loop (add the step's arrivals, ``schedule``, ``update_from_output``, drafts
through ``update_draft_token_ids``), and a fake model that commits the same true
continuation our simulated model does. Drafts (spec workloads) are right as often as
ours, round by round (the export carries how many drafts our acceptance model accepts in each
of a request's verification rounds). The model and structured-output configs are stand-ins holding only what
the scheduler reads (no model weights or tokenizer exist here); vLLM's own structured-output
manager returns at once for requests without structured output, as the stand-in does.

Timed like the planner benchmark: whole workloads (mooncake2000) from building the
scheduler and the requests (block hashing included) to the last step; steady workloads
over their 500 steps once every request decodes. Each line shows the calibration
(bench/calibration.py) so that it can be set beside hybridsim's figures of the same phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # (hybridsim, when the venv has no install of it)
from calibration import calibrate  # noqa: E402

# the driver itself lives in the package (``run --scheduler vllm`` plans with it)
from hybridsim.engines.vllm import StandIn, make_scheduler, run_once  # noqa: E402,F401 (peer_layouts imports make_scheduler from here)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", type=Path, nargs="+",
                    help="files written by bench_planner.py NAME --export PATH (or bench/peer_fuzz.py write)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per workload (0: none, plans only)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--steps", type=Path, metavar="PATH",
                    help="also write every step's plan of one more (untimed) run, for bench/peer_compare.py")
    ap.add_argument("--steps-dir", type=Path, metavar="DIR",
                    help="as --steps, for each workload: DIR/<workload file's stem>.steps.json")
    ap.add_argument("--record", type=Path, metavar="PATH",
                    help="also write a recording (data/vllm-recorded/README.md's format) of one workload")
    ap.add_argument("--max-steps", type=int, default=0, metavar="N",
                    help="with --steps/--steps-dir: stop after N steps (for a workload the engine never finishes)")
    args = ap.parse_args()
    if len(args.workload) > 1 and (args.steps or args.json or args.record):
        ap.error("--steps, --record and --json take one workload (use --steps-dir for several)")
    if args.repeat < 0:
        ap.error("--repeat: 0 or more")
    if args.max_steps < 0:
        ap.error("--max-steps: 0 (no limit) or more")
    try:
        import vllm
    except ImportError:
        raise SystemExit("error: vllm is not installed in this Python (see bench/peer_setup.sh)")
    for path in args.workload:
        w = json.loads(path.read_text())
        if args.repeat:
            time_workload(w, args.repeat, args.json)
        if args.record:
            lines: list = []
            run_once(dict(w, steady_steps=0), None, args.max_steps, lines)
            lines.append({"type": "summary", "steps": len(lines) - 2})
            args.record.write_text("".join(json.dumps(x) + "\n" for x in lines))
            print(f"  {w['workload']}: {len(lines) - 3} steps recorded to {args.record}")
        steps = args.steps or (args.steps_dir / f"{path.stem}.steps.json" if args.steps_dir else None)
        if steps:
            log: list = []
            res = run_once(dict(w, steady_steps=0), log, args.max_steps)
            steps.write_text(json.dumps({"vllm": vllm.__version__, "workload": w["workload"], "steps": log,
                                         "stalled": res["stalled"],
                                         # (cut at --max-steps: the comparison stops there too)
                                         **({"cut_at": args.max_steps}
                                            if args.max_steps and len(log) >= args.max_steps else {})}))
            print(f"  {w['workload']}: {len(log)} steps written to {steps}"
                  + (" (stalled: nothing scheduled for 1,000 steps)" if res["stalled"] else ""))


def time_workload(w: dict, repeat: int, json_path: Path | None) -> None:
    import vllm
    cal = calibrate()
    runs = [run_once(w) for _ in range(repeat)]
    cal = min(cal, calibrate())
    key = "steps_per_s" if w["steady_steps"] else "seconds"
    med = statistics.median(r[key] for r in runs)
    shown = f"{med:,.1f} steps/s" if key == "steps_per_s" else f"{med:.3f} s ({runs[0]['steps']} steps)"
    extra = f"   prefix-hit tokens {runs[0]['prefix_hit_tokens']:,}" if "prefix_hit_tokens" in runs[0] else ""
    print(f"vLLM {vllm.__version__} {w['workload']:14s} {shown:>22s}   runs {[round(r[key], 3) for r in runs]}   "
          f"calibration {cal * 1e3:.0f} ms{extra}")
    if StandIn.read_missing:
        print(f"  (config attributes the scheduler read as None: {', '.join(sorted(StandIn.read_missing))})")
    if json_path:
        json_path.write_text(json.dumps({"vllm": vllm.__version__, "workload": w["workload"], key: med,
                                         "runs": [round(r[key], 4) for r in runs], "calibration_ms": round(cal * 1e3, 1),
                                         **{k: v for k, v in runs[0].items() if k not in (key,)}}, indent=2))


if __name__ == "__main__":
    main()
