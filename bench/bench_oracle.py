"""The GQA attention oracle on the GPU at Nemotron-H-8B's attention geometry (4 layers, 32 heads,
8 KV heads, head size 128), on one step shaped like the Mooncake run's average step: two prefill
chunks (one over cached context) and 20 speculative decode rows of 3 committed tokens over 1k-12k
tokens of context.

Two paths, the same values: the padded batches of dense float64 attention in torch (keys and
scores in memory), and the fused path (float64 kernels with no query or score in memory,
``kernels/dense_attention_f64.py``: each query tile projects its queries from their token ids, a
decode row projects each key block from its token ids inside its program, a prefill chunk's keys
are projected once into a float32 workspace that its query tiles read, loads pipelined), with
the workspace tiles' schedule swept, once with no workspace (every tile projecting its keys: the
path before it), and with the decode rows' key ranges (``DECODE_SPLIT_KEYS``) swept, once
unsplit (one program walking all of a decode tile's keys: the path before them). Both are also
compared with the CPU's float64 on a sample of rows. The floor is the step's float64 FLOPs (QK^T
and PV of every (query, key) pair a causal row computes) at the card's measured float64 matmul
rate (an 8192-cube ``torch.mm``), or the traffic of q, k, v and o, whichever is larger: a lower
bound (the queries' and keys' projection, exact integer products on TF32, and the workspace's
float32 traffic are not in it). Last, the MLA oracle on a
DeepSeek-V3 step against its floors: the torch path and the fused one with float64 scores
(``kernels/latent_attention_f64.py``) or exact scores from int8 digits
(``kernels/digit_attention_f64.py``, its tiles swept).

    python3 bench/bench_oracle.py [--out results.json] [--gqa-only | --mla-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hybridsim.kernels import dense_attention_f64 as fused  # noqa: E402
from hybridsim.kernels import digit_attention_f64 as digits  # noqa: E402
from hybridsim.kernels import latent_attention_f64 as lat  # noqa: E402
from hybridsim.kernels.ceilings import best_seconds, measure  # noqa: E402
from hybridsim.layers.exact import prepare_rope  # noqa: E402
from hybridsim.layers.gqa import GQAProbe  # noqa: E402
from hybridsim.layers.mla import MLAProbe  # noqa: E402
from hybridsim.oracle import WEIGHTS_SHARE, GQAOracle, MLAOracle  # noqa: E402
from hybridsim.presets import build_preset  # noqa: E402

ORACLE_SCORES = 1 << 26  # as the executor sizes the GQA oracle's batches (engine/attn_exec.py)


def step_rows(seed: int = 0) -> list[tuple[np.ndarray, int, int]]:
    g = np.random.default_rng(seed)
    shape = [(3000, 1024), (0, 1000)] + [(int(c), 3) for c in np.linspace(1000, 12000, 20)]
    return [(g.integers(0, 10 ** 6, size=c + k).astype(np.int64), c, k) for c, k in shape]


def mla_row_ops(geo, c: int, k: int) -> tuple[int, int]:
    """A row's multiply-adds a layer in float64 (k queries after c cached tokens, causal), in the absorbed
    and the expanded association (``MLAStack.expands``' two counts, over the row's (query, key) pairs)."""
    H, Lr, R, N, V = geo.heads, geo.kv_lora_rank, geo.qk_rope_head_dim, geo.qk_nope_head_dim, geo.v_head_dim
    n, p = c + k, k * c + k * (k + 1) // 2
    return (k * H * (N * Lr + Lr * V) + p * H * (2 * Lr + R),
            n * H * Lr * (N + V) + p * H * (N + R + V))


def mla_step(f64: float, sweep: bool = True) -> list[dict]:
    """The MLA oracle (torch, and the fused kernels) at DeepSeek-V3's geometry with the scenario's 8
    layers, on a step shaped like ``deepseek_v3_mooncake``'s: two prefill chunks and 26 rows of 2
    committed tokens (one draft) over 1k-12k. The fused path's expanded rows (the prefill chunks)
    with float64 scores (``latent_attention_f64``, the path before session 32) and with exact scores
    from int8 digits (``digit_attention_f64``, its tiles swept). Floors: float64's, each row's FLOPs
    in its cheaper association (``MLAStack.expands``' count) at the measured float64 matmul rate;
    the digits', the same with the expanded rows' scores as int8 products (15 digit pairs: 2 x 3 of
    the nope part, 3 x 3 of the rope part) and their key expansion (two int8 products,
    ``MLAStack.expanded_nope_ints``) at the measured int8 rate (``torch._int_mm``), their values'
    products in float64. Returns one result per path and schedule."""
    geo = build_preset("deepseek-v3").mla.model_copy(update={"layers": 8})
    probes = [MLAProbe(geo, layer, seed=22) for layer in range(geo.layers)]
    g = np.random.default_rng(1)
    shape = [(3000, 1024), (0, 1000)] + [(int(c), 2) for c in np.linspace(1000, 12000, 26)]
    rows = [(g.integers(0, 10 ** 6, size=c + k).astype(np.int64), c, k) for c, k in shape]
    H, Lr, R, N, V = geo.heads, geo.kv_lora_rank, geo.qk_rope_head_dim, geo.qk_nope_head_dim, geo.v_head_dim
    i8 = int8_rate()
    flops, digit_floor, digit_values_floor = 0, 0.0, 0.0
    for _, c, k in rows:
        n, p = c + k, k * c + k * (k + 1) // 2
        absorbed, expanded = mla_row_ops(geo, c, k)
        flops += 2 * geo.layers * min(absorbed, expanded)
        if expanded < absorbed:
            int8_ops = 2 * n * H * Lr * (N + V) + p * H * (6 * N + 9 * R)  # key expansion, scores' digit pairs
            digit_floor += 2 * geo.layers * (p * H * V / f64 + int8_ops / i8)
            digit_values_floor += 2 * geo.layers * (int8_ops + p * H * V * 12) / i8  # (4 x 3 digit pairs)
        else:
            digit_floor += 2 * geo.layers * absorbed / f64
            digit_values_floor += 2 * geo.layers * absorbed / f64
    floor = flops / f64
    print(f"MLA oracle, DeepSeek-V3 x 8 layers, {len(rows)} rows: {flops / 1e12:.2f} TFLOP in the cheaper "
          f"associations, floor {floor * 1e3:.2f} ms (float64 scores), {digit_floor * 1e3:.2f} ms (int8 digit "
          f"scores), {digit_values_floor * 1e3:.2f} ms (and values; int8 {i8 / 1e12:.0f} T op/s)")
    want = None
    results = []
    # (scores, the expanded rows' tile): float64 ones (queries x keys, score chunk, warps, stages), or
    # exact ones from int8 digits (queries x keys, warps, stages); absorbed rows by torch's padded batches
    cases = [None, ("float64", lat.PER_HEAD), ("digit scores", digits.TILE)] + [("digits", t) for t in (
        digits.TILE, (16, 32, 4, 2), (16, 64, 4, 1), (16, 64, 4, 3), (16, 128, 4, 1), (16, 128, 4, 2),
        (16, 64, 8, 2))[:None if sweep else 1]]
    default = (lat.PER_HEAD, digits.TILE)
    for case in cases:
        if case is None:
            name = "torch: padded batches, scores in memory"
        elif case[0] == "float64":
            name = "fused: float64 scores, expanded {}x{}/{}/{}w/{}s".format(*case[1])
        elif case[0] == "digit scores":
            name = "fused: int8 digit scores, float64 values, expanded {}x{}/{}w/{}s".format(*case[1])
        else:
            name = "fused: int8 digit scores and values, expanded {}x{}/{}w/{}s".format(*case[1])
        ref = {None: floor, "float64": floor, "digit scores": digit_floor}.get(case and case[0], digit_values_floor)
        try:
            if case is not None and case[0].startswith("digit"):
                digits.TILE = case[1]
            oracle = MLAOracle(probes, torch.device("cuda"), fused=case is not None,
                               digit_scores=case is not None and case[0].startswith("digit"),
                               digit_values=case is not None and case[0] == "digits",
                               weights_within=2e-2 * WEIGHTS_SHARE)  # (a bf16 run's, as deepseek_v3's)
            assert case is None or oracle.digit_values == (case[0] == "digits")
            got = oracle.expected(rows)
            if want is None:
                want = got
            err = max(float(((g - w).abs() / w.abs().clamp(min=1e-3)).max()) for g, w in zip(got, want))
            t = best_seconds(lambda: oracle.expected(rows), runs=2, reps=2)
            # where it goes: the prefill chunks alone, the decode rows alone
            t_prefill = best_seconds(lambda: oracle.expected(rows[:2]), runs=2, reps=2)
            t_decode = best_seconds(lambda: oracle.expected(rows[2:]), runs=2, reps=2)
        except Exception as e:  # a schedule the compiler rejects is reported, not fatal
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        finally:
            lat.PER_HEAD, digits.TILE = default
        print(f"  {name:64s} {t * 1e3:8.2f} ms (prefill chunks alone {t_prefill * 1e3:.2f}, decode rows alone "
              f"{t_decode * 1e3:.2f})  {100 * ref / t:5.1f}% of its floor  max rel diff vs torch {err:.1e}", flush=True)
        results.append({"case": "MLA oracle, " + name, "ms": t * 1e3, "prefill_ms": t_prefill * 1e3,
                        "decode_ms": t_decode * 1e3, "flops": flops, "floor_ms": ref * 1e3,
                        "pct_floor": 100 * ref / t, "max_rel_diff_vs_torch": err})
    return results


def int8_rate(n: int = 8192) -> float:
    """int8 products with int32 sums (``torch._int_mm``), operations (2 per product) a second."""
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-128, 128, (n, n), dtype=torch.int8, device="cuda")
    # (b column-major, cuBLASLt's int8 layout: row-major took a path 7x slower on an H200)
    return 2 * n ** 3 / best_seconds(lambda: torch._int_mm(a, b.t()), runs=3, reps=3)


def fp64_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.float64, device="cuda")
    b = torch.randn(n, n, dtype=torch.float64, device="cuda")
    return 2 * n ** 3 / best_seconds(lambda: a @ b, runs=3, reps=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mla-only", action="store_true", help="only the MLA oracle's step")
    ap.add_argument("--gqa-only", action="store_true", help="only the GQA oracle's step")
    ap.add_argument("--no-sweep", action="store_true", help="the MLA step's digit path at its default tile only")
    a = ap.parse_args()
    if a.mla_only:
        f64 = fp64_rate()
        print(f"{torch.cuda.get_device_name()}, {date.today()}: float64 matmul {f64 / 1e12:.1f} TFLOP/s")
        res = mla_step(f64, not a.no_sweep)
        if a.out:
            a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": str(date.today()),
                                         "fp64_flops": f64, "cases": res}, indent=2))
        return
    geo = build_preset("nemotron-h-8b").attention
    probes = [GQAProbe(geo, layer, seed=21) for layer in range(geo.layers)]
    prepare_rope(geo.head_dim, 16384, torch.device("cuda"), torch.float64)
    rows = step_rows()
    pairs = sum(k * c + k * (k + 1) // 2 for _, c, k in rows)
    flops = 4 * pairs * geo.layers * geo.heads * geo.head_dim
    keys, queries = sum(c + k for _, c, k in rows), sum(k for _, _, k in rows)
    read = 8 * geo.layers * geo.head_dim * (2 * keys * geo.kv_heads + queries * geo.heads)  # k, v, q
    written = 8 * geo.layers * geo.head_dim * queries * geo.heads  # o
    rates, f64 = measure(torch.device("cuda"), nbytes=2 ** 30), fp64_rate()
    floor = max(flops / f64, rates.floor(read, written).seconds)
    dev = torch.cuda.get_device_name()
    print(f"{dev}, {date.today()}: float64 matmul {f64 / 1e12:.1f} TFLOP/s; {rates.line()}")
    print(f"step: {len(rows)} rows, {queries} queries, {keys} keys, {pairs / 1e6:.2f} M (query, key) pairs, "
          f"{flops / 1e9:.0f} GFLOP; floor {floor * 1e3:.2f} ms")
    torch_path = GQAOracle(probes, torch.device("cuda"), ORACLE_SCORES, fused=False)
    want = torch_path.expected(rows)
    # a third opinion on a sample: the CPU's float64 (every decode row, the short prefill's first 64 queries)
    sample = [i for i, (_, c, k) in enumerate(rows) if k <= 4] + [1]
    cpu_rows = [(t, c, k) if k <= 4 else (t[: c + 64], c, 64) for t, c, k in (rows[i] for i in sample)]
    on_cpu = GQAOracle(probes, torch.device("cpu"), ORACLE_SCORES, work_bound=True).expected(cpu_rows)
    results = []

    def rel(got, ref) -> float:
        return max(float(((g.cpu() - r.cpu()).abs() / r.cpu().abs().clamp(min=1e-3)).max()) for g, r in zip(got, ref))

    def timed(name: str, oracle) -> None:
        got = oracle.expected(rows)
        err = rel(got, want)
        err_cpu = rel([got[i][:, :cpu_rows[j][2]] for j, i in enumerate(sample)], on_cpu)
        t = best_seconds(lambda: oracle.expected(rows), runs=3, reps=3)
        t_prefill = best_seconds(lambda: oracle.expected(rows[:2]), runs=3, reps=3)  # the two prefill chunks alone
        pct = 100 * floor / t
        results.append({"case": name, "ms": t * 1e3, "prefill_ms": t_prefill * 1e3, "TFLOP_s": flops / t / 1e12,
                        "pct_floor": pct, "max_rel_diff_vs_torch": err, "max_rel_diff_vs_cpu_sample": err_cpu})
        print(f"  {name:60s} {t * 1e3:8.2f} ms (prefill chunks alone {t_prefill * 1e3:.2f})  "
              f"{flops / t / 1e12:6.1f} TFLOP/s  {pct:5.1f}% of floor  "
              f"max rel diff: vs the torch path {err:.1e}, vs the CPU on a sample {err_cpu:.1e}"
              + ("  ABOVE FLOOR" if pct > 100 else ""))

    timed("torch: padded batches, scores in memory", torch_path)
    # the workspace tiles' schedule ((query, head) rows x keys, warps, stages) and the workspace's
    # bound; a bound of 0 leaves every row to the tiles that project their own keys; then the
    # decode tiles' key ranges, a range longer than any row leaving each tile one program (unsplit);
    # their partial results' bound raised for these (ranges of 512 keys would take 134 MiB here)
    default = (fused.WORKSPACE, fused.WORKSPACE_ELEMS, fused.DECODE_SPLIT_KEYS)
    partial_elems = fused.PARTIAL_ELEMS
    unsplit = 1 << 40
    sweep = [default] + [(w, fused.WORKSPACE_ELEMS, fused.DECODE_SPLIT_KEYS) for w in (
        (32, 32, 8, 3), (32, 32, 4, 2), (16, 32, 4, 3), (64, 32, 8, 3))] + [(fused.WORKSPACE, 0, default[2])] + [
        (fused.WORKSPACE, fused.WORKSPACE_ELEMS, k) for k in (unsplit, 256, 512, 1024, 2048) if k != default[2]]
    for sched, bound, split in sweep:
        fused.WORKSPACE, fused.WORKSPACE_ELEMS, fused.DECODE_SPLIT_KEYS = sched, bound, split
        fused.PARTIAL_ELEMS = partial_elems if split == default[2] else 1 << 26
        name = ("fused: every tile projecting its keys (no workspace)" if bound == 0 else
                "fused: decode tiles unsplit (one program walks a tile's keys)" if split == unsplit else
                f"fused: decode tiles' keys in ranges of {split}" if split != default[2] else
                "fused: workspace tiles {} rows x {} keys, {} warps, {} stage(s)".format(*sched))
        try:
            timed(name, GQAOracle(probes, torch.device("cuda"), ORACLE_SCORES, fused=True))
        except Exception as e:  # a schedule the compiler rejects is reported, not fatal
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}")
    fused.WORKSPACE, fused.WORKSPACE_ELEMS, fused.DECODE_SPLIT_KEYS = default
    fused.PARTIAL_ELEMS = partial_elems
    if not a.gqa_only:
        results += mla_step(f64, not a.no_sweep)
    if a.out:
        a.out.write_text(json.dumps({"device": dev, "date": str(date.today()), "fp64_flops": f64,
                                     **rates.as_dict(), "flops": flops, "floor_ms": floor * 1e3,
                                     "cases": results}, indent=2))


if __name__ == "__main__":
    main()
