"""The reference MLA decode (``ReferenceKernels.mla_decode``: what ``kernel.mla_decode`` re-runs for every
decode row) at deepseek_v3_mooncake-like decode shapes, computed in float32 (as the check runs it), in
float64 (the queries given as float64) and with TF32 products: time and distance from float64
(history/2026-11-28_session34.md). Needs a CUDA device.

    python3 bench/probes/reference_decode_precision.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from hybridsim.device.matmul import matmul_tf32  # noqa: E402
from hybridsim.kernels.reference import ReferenceKernels  # noqa: E402

K = ReferenceKernels()


def inputs(B: int, lo: int, hi: int, dev: str = "cuda"):
    """B decode rows of 2 queries, 128 heads, lengths drawn from [lo, hi), a bf16 latent cache of 64-token
    pages in shuffled block rows: (q_lat, q_pe, cache, table, lengths, the longest)."""
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(lo, hi, (B,), generator=g)
    n = int(lens.max())
    per_row = -(-n // 64)
    blocks = B * per_row + 8
    cache = (torch.randn(blocks, 64, 576, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    table = torch.randperm(blocks, generator=g)[:B * per_row].view(B, per_row).to(dev)
    q_lat = torch.randn(B, 2, 128, 512, generator=g).to(dev)
    q_pe = torch.randn(B, 2, 128, 64, generator=g).to(dev)
    return q_lat, q_pe, cache, table, lens.to(dev), n


def main() -> None:
    for B, lo, hi in [(32, 500, 5000), (24, 1000, 12000), (64, 200, 3000)]:  # rows, their lengths
        q_lat, q_pe, cache, table, seq, n = inputs(B, lo, hi)
        lens = seq.cpu()

        def f32():
            return K.mla_decode(q_lat, q_pe, cache, table, seq, 512, 0.07, max_seq_len=n)

        def f64():
            return K.mla_decode(q_lat.double(), q_pe.double(), cache, table, seq, 512, 0.07, max_seq_len=n)

        def tf32():
            with matmul_tf32():
                return f32()

        exact = f64()[0]
        rel = lambda o: float((o.double() - exact).abs().amax() / exact.abs().amax())  # noqa: E731
        times = {name: triton.testing.do_bench(fn, warmup=3, rep=30) for name, fn in
                 (("float32", f32), ("float64", f64), ("TF32", tf32))}
        print(f"B={B} lengths {lo}-{hi} (longest {n}, padding {B * n / int(lens.sum()):.2f}x): "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items())
              + f"; max rel diff from float64: float32 {rel(f32()[0]):.1e}, TF32 {rel(tf32()[0]):.1e}", flush=True)


if __name__ == "__main__":
    main()
