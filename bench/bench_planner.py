"""Planning speed (--check off, no kernels) on the issue's peer workloads, one command each.

    python bench/bench_planner.py decode256      # 256 decoding requests, 500 steady steps
    python bench/bench_planner.py decode64       # 64 decoding requests
    python bench/bench_planner.py spec256        # 256 decoding requests, 3 spec tokens
    python bench/bench_planner.py mooncake2000   # first 2,000 Mooncake conversation requests, lengths x 0.05
    python bench/bench_planner.py mooncake_full --mooncake-full PATH  # all 12,031 requests, lengths x 0.05
    python bench/bench_planner.py spec256_whole  # spec256 from the first step to the last request's end
    python bench/bench_planner.py decode256_whole
    python bench/bench_planner.py all

The hybrid config is the one the vLLM recordings use (block 16, align mode,
prefix caching, one Mamba group + one attention group). Steady-state
workloads time only the steps after every request is decoding; the ``_whole`` variants time
the same workloads from admission to the last request's end (steps/s over the whole run:
work a steady window does not see, such as publishing deferred by requests in bulk mode,
is inside it). Each result is
the median of --repeat runs; the peer figures are vLLM 0.33's own scheduler on
this machine class (issue 2 / SPEC §8). Each line also shows a calibration time
(a fixed pure-Python loop, lower = faster machine phase) so that results taken in
different phases of this shared machine can be told apart.

mooncake2000 reads the repository's slice of the Mooncake conversation trace
(data/mooncake/conversation_trace.jsonl: its first 2,000 requests). mooncake_full needs the
whole trace (12,031 requests, 3 MB; where to get it: data/SOURCES.md), named with
--mooncake-full PATH or the environment variable HYBRIDSIM_MOONCAKE_FULL; without it, ``all``
skips mooncake_full and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from calibration import calibrate  # noqa: E402  (bench/ is on sys.path when run as a script)
from hybridsim.config import parse_scenario  # noqa: E402
from hybridsim.sched.plan import PLACEHOLDER_DRAFT  # noqa: E402
from hybridsim.simulate import Simulation  # noqa: E402
from hybridsim.workload import build_workload  # noqa: E402

MOONCAKE_SLICE = REPO / "data/mooncake/conversation_trace.jsonl"  # the first 2,000 requests
MOONCAKE_FULL_ENV = "HYBRIDSIM_MOONCAKE_FULL"
_mooncake_full: Path | None = Path(os.environ[MOONCAKE_FULL_ENV]) if os.environ.get(MOONCAKE_FULL_ENV) else None

MODEL = """model:
  mamba: {layers: 1, heads: 8, head_dim: 32, d_state: 16, n_groups: 1, conv_kernel: 4, chunk_size: 16,
          state_dtype: float32, conv_dtype: bfloat16}
  attention: {layers: 1, heads: 8, kv_heads: 8, head_dim: 128, dtype: bfloat16}
cache: {block_size: 16, num_blocks: 262144, enable_prefix_caching: true, mamba_cache_mode: align}"""

PEER = {  # vLLM 0.33 scheduler, same 2-core machine class (issue 2)
    "decode256": "60-96 steps/s",
    "decode64": "250-400 steps/s",
    "spec256": "about 60 steps/s",
    "mooncake2000": "2.3-3.7 s (578 steps)",
    "mooncake_full": "(bar: plan in under 30 s)",
    "decode256_whole": "60-96 steps/s (steady)",
    "spec256_whole": "about 60 steps/s (steady)",
}


def decode_scenario(n: int, spec: int) -> str:
    acc = "{kind: bernoulli, rate: 0.7}" if spec else "{kind: none}"
    return f"""name: decode{n}
seed: 1
{MODEL}
scheduler: {{max_num_batched_tokens: 8192, max_num_seqs: {n}, max_model_len: 4096}}
spec_decode: {{num_speculative_tokens: {spec}, acceptance: {acc}}}
workload:
  kind: synthetic
  num_requests: {n}
  arrival: {{kind: fixed, per_step: {n}}}
  prompt_len: {{dist: uniform, min: 100, max: 300}}
  output_len: {{dist: fixed, value: 3000}}
execution: {{max_steps: 100000, check: off}}
"""


def mooncake_full_path() -> Path:
    """The whole Mooncake conversation trace (--mooncake-full or $HYBRIDSIM_MOONCAKE_FULL)."""
    if _mooncake_full is None:
        raise SystemExit(f"mooncake_full needs the whole Mooncake conversation trace (12,031 requests; the "
                         f"repository ships its first 2,000): pass --mooncake-full PATH or set "
                         f"{MOONCAKE_FULL_ENV} (where to get it: data/SOURCES.md)")
    if not _mooncake_full.is_file():
        raise SystemExit(f"mooncake_full: {_mooncake_full} is not a file (the whole Mooncake conversation trace; "
                         "see data/SOURCES.md)")
    return _mooncake_full.resolve()


def mooncake_scenario(limit: int | None) -> str:
    """The Mooncake conversation trace: its first ``limit`` requests from the repository's slice,
    or (``None``) every request of the whole trace named with --mooncake-full."""
    lim = f", limit: {limit}" if limit else ""
    path = MOONCAKE_SLICE if limit is not None and limit <= 2000 else mooncake_full_path()
    return f"""name: mooncake
seed: 1
{MODEL}
scheduler: {{max_num_batched_tokens: 4096, max_num_seqs: 128, max_model_len: 32768}}
workload: {{kind: trace, format: mooncake, path: {path}{lim},
           length_scale: 0.05, arrival: {{kind: fixed, per_step: 4}}}}
execution: {{max_steps: 1000000, check: off}}
"""


def time_steady(text: str, steps: int) -> dict:
    loaded = parse_scenario(text, "bench")
    sim = Simulation(loaded.scenario, build_workload(loaded))
    it = iter(sim)
    n = loaded.scenario.workload.num_requests
    # warm up until every request is decoding
    while True:
        plan, _ = next(it)
        if len(plan.scheduled) == n and all(s.num_computed_tokens >= sim.scheduler.requests[s.req_id].num_prompt_tokens
                                            for s in plan.scheduled):
            break
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    dt = time.perf_counter() - t0
    return {"steps": steps, "seconds": dt, "steps_per_s": steps / dt}


def time_whole(text: str) -> dict:
    loaded = parse_scenario(text, "bench")
    t0 = time.perf_counter()
    wl = build_workload(loaded)
    t1 = time.perf_counter()
    sim = Simulation(loaded.scenario, wl)
    stats = sim.run()
    t2 = time.perf_counter()
    return {"steps": stats.steps, "requests": stats.requests, "finished": stats.finished,
            "workload_s": t1 - t0, "plan_s": t2 - t1, "seconds": t2 - t0, "plan_steps_per_s": stats.steps / (t2 - t1),
            "prefix_hit_tokens": stats.prefix_hit_tokens, "preemptions": stats.preemptions}


WORKLOADS = {
    "decode256": lambda: time_steady(decode_scenario(256, 0), 500),
    "decode64": lambda: time_steady(decode_scenario(64, 0), 500),
    "spec256": lambda: time_steady(decode_scenario(256, 3), 500),
    "mooncake2000": lambda: time_whole(mooncake_scenario(2000)),
    "mooncake_full": lambda: time_whole(mooncake_scenario(None)),
    "decode256_whole": lambda: time_whole(decode_scenario(256, 0)),
    "spec256_whole": lambda: time_whole(decode_scenario(256, 3)),
}


def small_scenario(name: str, seed: int, num_blocks: int, scheduler: str, workload: str, spec: str = "") -> str:
    """A synthetic workload on the recordings' model with a pool of ``num_blocks`` (for comparing
    plans with the peer, not timed)."""
    return f"""name: {name}
seed: {seed}
{MODEL.replace("num_blocks: 262144", f"num_blocks: {num_blocks}")}
scheduler: {{{scheduler}}}
{f"spec_decode: {{{spec}}}" if spec else ""}
workload:
  kind: synthetic
{workload}
execution: {{max_steps: 100000, check: off}}
"""


def pressure_scenario() -> str:
    """A small pool (160 blocks) under chunked prefill, shared prefixes and recompute preemption."""
    return small_scenario("pressure", 3, 160, "max_num_batched_tokens: 256, max_num_seqs: 16, max_model_len: 4096",
                          """  num_requests: 60
  arrival: {kind: fixed, per_step: 3}
  prompt_len: {dist: uniform, min: 100, max: 640}
  output_len: {dist: uniform, min: 5, max: 60}
  shared_prefix: {len: 320, fraction: 0.5}""")


def padding_scenario() -> str:
    """Drafts on and most prompts one token past a cached block-multiple prefix: admissions with
    one token to compute, padded to uniform draft rows or not depending on what else runs (vLLM
    0.33's pad_spec_decode; docs/fidelity.md point 12)."""
    return small_scenario("padding", 5, 400, "max_num_batched_tokens: 96, max_num_seqs: 12, max_model_len: 1024",
                          """  num_requests: 80
  arrival: {kind: poisson, rate_per_step: 1.5}
  prompt_len: {dist: uniform, min: 33, max: 33}
  output_len: {dist: uniform, min: 4, max: 40}
  shared_prefix: {len: 32, fraction: 0.8}""",
                          "num_speculative_tokens: 3, acceptance: {kind: bernoulli, rate: 0.6}")


PEER_WORKLOADS = {  # what bench/peer_vllm.py replays: (scenario, steady steps timed or 0: the whole run)
    "decode256": (lambda: decode_scenario(256, 0), 500),
    "decode64": (lambda: decode_scenario(64, 0), 500),
    "spec256": (lambda: decode_scenario(256, 3), 500),
    "mooncake2000": (lambda: mooncake_scenario(2000), 0),
    "mooncake_full": (lambda: mooncake_scenario(None), 0),
    "pressure": (pressure_scenario, 0),
    "padding": (padding_scenario, 0),
}


def accepted_rounds(sim: Simulation) -> dict[str, list[int]]:
    """Per request, the drafts our acceptance model accepts in each verification round, so that
    the peer's drafts are right exactly as often and its plans can be compared (runs ``sim``)."""
    accepted: dict[str, list[int]] = {}
    for plan, out in sim:
        for row in plan.scheduled:
            if row.spec_token_ids and row.spec_token_ids[0] != PLACEHOLDER_DRAFT:  # (padding is no round)
                accepted.setdefault(row.req_id, []).append(out.accepted[row.req_id])
    return accepted


def export_peer_workload(name: str, path: Path) -> None:
    """Write what the vLLM peer needs to run the same workload (bench/peer_vllm.py): the
    scheduler and cache config, and per request its arrival step, prompt, max tokens and the
    true continuation our simulated model commits (so both see the same output tokens)."""
    make, steady = PEER_WORKLOADS[name]
    loaded = parse_scenario(make(), "bench")
    s = loaded.scenario
    sim = Simulation(s, build_workload(loaded))
    reqs = [{"id": r.req_id, "arrival_step": r.arrival_step, "prompt": list(r.prompt_ids),
             "max_tokens": r.max_tokens, "outputs": sim.outputs.tokens(r, 0, r.max_tokens + 8)}
            for r in sim.requests]
    accepted = accepted_rounds(sim) if s.spec_decode.num_speculative_tokens else {}  # (runs it)
    path.write_text(json.dumps({
        "workload": name, "steady_steps": steady, "block_size": s.cache.block_size,
        "num_blocks": s.cache.num_blocks, "mamba_cache_mode": s.cache.mamba_cache_mode,
        "max_num_batched_tokens": s.scheduler.max_num_batched_tokens, "max_num_seqs": s.scheduler.max_num_seqs,
        "max_model_len": s.scheduler.max_model_len, "num_speculative_tokens": s.spec_decode.num_speculative_tokens,
        "accepted": accepted, "requests": reqs}))
    print(f"{name}: {len(reqs)} requests written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=[*WORKLOADS, *(w for w in PEER_WORKLOADS if w not in WORKLOADS), "all"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--export", type=Path, metavar="PATH",
                    help="write the workload for bench/peer_vllm.py (the vLLM peer) instead of timing it")
    ap.add_argument("--mooncake-full", type=Path, metavar="PATH",
                    help=f"the whole Mooncake conversation trace for mooncake_full (default: ${MOONCAKE_FULL_ENV}; "
                         "the repository ships only its first 2,000 requests)")
    args = ap.parse_args()
    global _mooncake_full
    if args.mooncake_full is not None:
        _mooncake_full = args.mooncake_full
    if args.export:
        if args.workload not in PEER_WORKLOADS:
            ap.error(f"--export: one of {', '.join(PEER_WORKLOADS)}")
        export_peer_workload(args.workload, args.export)
        return
    if args.workload not in WORKLOADS and args.workload != "all":
        ap.error(f"{args.workload} is for comparing plans with the peer (--export), not timed")
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    if args.workload == "all" and _mooncake_full is None:
        names.remove("mooncake_full")
        print(f"mooncake_full skipped: it needs the whole Mooncake conversation trace (--mooncake-full PATH or "
              f"${MOONCAKE_FULL_ENV}; see data/SOURCES.md)", flush=True)
    results = {}
    for name in names:
        cal = calibrate()
        reps = [WORKLOADS[name]() for _ in range(args.repeat if name != "mooncake_full" else 1)]
        cal = min(cal, calibrate())
        key = ("steps_per_s" if "steps_per_s" in reps[0] else "plan_steps_per_s" if name.endswith("_whole")
               else "seconds")
        med = statistics.median(r[key] for r in reps)
        best = reps[0]
        results[name] = {**best, key: med, "runs": [round(r[key], 3) for r in reps], "peer": PEER[name],
                         "calibration_ms": round(cal * 1e3, 1)}
        shown = (f"{med:.2f} s ({best['steps']} steps)" if key == "seconds" else f"{med:,.0f} steps/s"
                 + (f" ({best['steps']} steps)" if key == "plan_steps_per_s" else ""))
        print(f"{name:14s} {shown:>28s}   runs {results[name]['runs']}   calibration {cal * 1e3:.0f} ms   "
              f"peer vLLM: {PEER[name]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "python": platform.python_version(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
