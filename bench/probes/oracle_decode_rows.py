"""The MLA oracle's decode rows at deepseek_v3_mooncake's own shapes: the scenario is planned (``hybridsim run
--check off --record``, no execution), the decode rows of steps A..B-1 taken with random token ids of their
lengths, and each step's rows checked by the oracle on the GPU: torch's padded float64 batches (the default)
against the float64 latent kernel (``absorbed_kernel``). Prints ms a step, the rows' float64 floor at a given
rate (``bench_oracle``'s count: absorbing the queries and unabsorbing the outputs included), and the two paths' agreement (history/2026-11-28_session34.md).

    python3 bench/probes/oracle_decode_rows.py [--steps 60:90] [--f64-rate 57.5e12] [--profile 5]

``--profile N``: also the device kernels of N steps of each path, by their summed time (torch.profiler).
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
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # (bench_oracle: a row's float64 work)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hybridsim.layers.exact import prepare_rope  # noqa: E402
from hybridsim.layers.mla import MLAProbe  # noqa: E402
from hybridsim.oracle import MLAOracle  # noqa: E402
from hybridsim.presets import build_preset  # noqa: E402
from bench_oracle import mla_row_ops  # noqa: E402

SCENARIO = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios", "deepseek_v3_mooncake.yaml")


def decode_rows(first: int, last: int) -> dict[int, list[tuple[int, int]]]:
    """(computed tokens, scheduled tokens) of every row of at most 16 tokens, by step, from the planned trace."""
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "plan.jsonl")
        subprocess.run([sys.executable, "-m", "hybridsim.cli", "run", SCENARIO, "--check", "off", "--record", trace,
                        "-q"], check=True, capture_output=True)
        steps = {}
        with open(trace) as f:
            next(f)  # (the header)
            for line in f:
                rec = json.loads(line)
                if first <= rec["step"] < last:
                    steps[rec["step"]] = [(s["c"], s["n"]) for s in rec["sched"] if s["n"] <= 16]
    return steps


def profile(oracle, steps: list) -> None:
    """The device kernels of these steps, by summed time (the twelve largest)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for r in steps:
            oracle.expected(r)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70)
    print(f"    device kernels over {len(steps)} steps:\n" + "\n".join("      " + ln for ln in table.splitlines()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="60:90")
    ap.add_argument("--f64-rate", type=float, default=57.5e12, help="the card's float64 matrix rate (bench_oracle)")
    ap.add_argument("--profile", type=int, default=0, help="steps whose device kernels are listed, each path")
    a = ap.parse_args()
    first, last = map(int, a.steps.split(":"))
    steps = decode_rows(first, last)
    geo = build_preset("deepseek-v3").mla.model_copy(update={"layers": 8})
    probes = [MLAProbe(geo, layer, seed=22) for layer in range(geo.layers)]
    dev = torch.device("cuda")
    for dt in (torch.float32, torch.float64):
        prepare_rope(geo.qk_rope_head_dim, 16384, dev, dt)
    g = np.random.default_rng(0)
    rows = {s: [(g.integers(0, 32000, size=c + k).astype(np.int64), c, k) for c, k in v] for s, v in steps.items()}
    flops = sum(2 * geo.layers * min(mla_row_ops(geo, c, k)) for v in steps.values() for c, k in v) / len(steps)
    print(f"steps {first}..{last - 1}: {sum(map(len, steps.values())) / len(steps):.1f} decode rows a step, "
          f"{flops / 1e9:.0f} GFLOP a step in each row's cheaper association (bench_oracle's count): "
          f"{flops / a.f64_rate * 1e3:.2f} ms at {a.f64_rate / 1e12:.1f} TFLOP/s")
    outs = {}
    for kernel in (False, True):
        oracle = MLAOracle(probes, dev, fused=True, absorbed_kernel=kernel)
        for _ in range(2):  # (builds and warms)
            oracle.expected(next(iter(rows.values())))
        times = []
        for r in rows.values():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = oracle.expected(r)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        outs[kernel] = o
        if a.profile:
            profile(oracle, list(rows.values())[:a.profile])
        print(f"  {'latent kernel' if kernel else 'torch batches'}: {1e3 * np.mean(times):.2f} ms a step "
              f"(min {1e3 * min(times):.2f}, max {1e3 * max(times):.2f})", flush=True)
    err = max(float(((x - y).abs() / y.abs().clamp(min=1e-3)).max()) for x, y in zip(outs[True], outs[False]))
    print(f"  the last step's outputs, kernel against torch: max rel diff {err:.1e}")


if __name__ == "__main__":
    main()
