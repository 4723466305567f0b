"""The MLA oracle's digit kernel alone (``digit_attention_f64.digit_attention``) on one DeepSeek-V3 prefill
chunk of one layer: 1,024 queries over 3,000 cached keys and themselves, 128 heads, random digits and int32
values. Times each tile given (``triton.testing.do_bench``) against the first, or with ``--once`` runs one
tile three times for ncu (history/2026-11-28_session34.md):

    python3 bench/probes/digit_probe.py 16,64,4,2 16,32,4,3 16,64,4,2v [--json FILE]
    ncu --clock-control none -k regex:_digit_attention_kernel --launch-skip 2 --launch-count 1 \\
        python3 bench/probes/digit_probe.py --once 16,64,4,2

A tile is queries, keys a block, warps, stages; a trailing ``v`` passes the values as float64, ``d`` as int8
digits (the weights then integers, the values' products on the int8 tensor cores).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from hybridsim.kernels import digit_attention_f64 as da  # noqa: E402

N_Q, CTX, HEADS = 1024, 3000, 128


def inputs(device: str, small: bool = False):
    """qd, kd, kr, v (int32 and float64) for one chunk; ``small``: 20 queries over 40 keys, 2 heads."""
    nq, ctx, heads = (20, 40, 2) if small else (N_Q, CTX, HEADS)
    g = torch.Generator().manual_seed(0)
    nk = ctx + nq
    qd = torch.randint(-128, 128, (nq, heads, 2 * 128 + 3 * 64), generator=g, dtype=torch.int8)
    kd = torch.randint(-128, 128, (nk, heads, 3 * 128), generator=g, dtype=torch.int8)
    kr = torch.randint(-128, 128, (nk, 3 * 64), generator=g, dtype=torch.int8)
    v = torch.randint(-da.digit_capacity(da.V_DIGITS), da.digit_capacity(da.V_DIGITS), (nk, heads, 128), generator=g,
                      dtype=torch.int32)
    return [t.to(device) for t in (qd, kd, kr, v, v.double(), da.value_digits_reference(v))], nq, ctx


def run(x, nq: int, ctx: int, values: str):
    qd, kd, kr, v, v64, vd = x
    vals = {"v": v64, "d": vd}.get(values, v)
    return da.digit_attention(qd, kd, kr, vals, [0], [nq], [0], [ctx], 0.07, 2.0 ** -36,
                              2.0 ** -40, unit_value=2.0 ** -20)


def parse(spec: str):
    """'16,64,4,2' and a trailing v (values as float64) or d (values as int8 digits, integer weights)."""
    return tuple(int(t) for t in spec.rstrip("vd").split(",")), spec[-1] if spec[-1] in "vd" else ""


def main() -> None:
    args = sys.argv[1:]
    specs = [a for a in args if a[:1].isdigit()] or [",".join(map(str, da.TILE))]
    small = "--small" in args  # (the interpreter: a smoke run of this script, no timing)
    x, nq, ctx = inputs("cpu" if small else "cuda", small)
    default = da.TILE
    if "--once" in args:
        da.TILE, vals = parse(specs[0])
        for _ in range(3):
            run(x, nq, ctx, vals)
        if not small:
            torch.cuda.synchronize()
        return
    pairs = HEADS * (N_Q * CTX + N_Q * (N_Q + 1) // 2)
    ref, results = None, []
    for spec in specs:
        da.TILE, vals = parse(spec)
        try:
            o = run(x, nq, ctx, vals)
            ms = 0.0 if small else triton.testing.do_bench(lambda: run(x, nq, ctx, vals), warmup=50, rep=400)
        finally:
            da.TILE = default
        ref = o if ref is None else ref
        diff = float(((o - ref).abs() / ref.abs().clamp(min=1e-300)).max())
        rate = f", {pairs / ms / 1e6:.1f} G (query, key) pairs a head a second" if ms else ""
        print(f"tile {spec}: {ms:.3f} ms{rate}, max rel diff vs the first {diff:.1e}", flush=True)
        results.append({"tile": spec, "ms": ms, "rel_diff_vs_first": diff})
    if "--json" in args:
        with open(args[args.index("--json") + 1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
