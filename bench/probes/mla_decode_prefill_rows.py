"""The MLA decode kernel over a prefill chunk's queries: the calls ``mla.paths`` makes (the executor sends
every prefill row through the decode path too, to compare its two paths; engine/mla_exec.py). DeepSeek-V3
shapes (128 heads, 512 + 64 latent, bf16, page 64) through ``TritonKernels.mla_decode`` (``auto``: the
Gluon split kernel on Hopper), timed as the bench's decode rows are (CUDA graphs). The FLOP count is the
causal work only (query i of a chunk at position c + i sees c + i + 1 keys), so a kernel that walks keys
no row of its tile can see shows up as a lower rate (history/2026-11-28_session44.md).

    python3 bench/probes/mla_decode_prefill_rows.py [--cases 1x1024@1024,1x1024@4096,1x256@2048,64x2@2048]

A case BxQ@S: B requests of Q query tokens each, every request S tokens long (Q of them the chunk's).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

from bench_kernels import graph_bench  # noqa: E402
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

H, L, R, PAGE = 128, 512, 64, 64


def case(B: int, nq: int, seq: int, gen: torch.Generator):
    """B requests of seq tokens, the last nq of them the queries: fresh random queries and latent pages in
    shuffled block rows."""
    per = -(-seq // PAGE)
    pages = B * per + 1
    cache = torch.randn(pages, PAGE, L + R, generator=gen).mul_(0.5).to(torch.bfloat16).cuda()
    table = (torch.randperm(pages - 1, generator=gen)[:B * per] + 1).view(B, per).cuda()
    q_lat = torch.randn(B, nq, H, L, generator=gen).cuda()
    q_pe = torch.randn(B, nq, H, R, generator=gen).cuda()
    return q_lat, q_pe, cache, table, torch.full((B,), seq, dtype=torch.int64).cuda()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x1024@1024,1x1024@4096,1x256@2048,64x2@2048")
    a = ap.parse_args()
    k = TritonKernels()
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(0))
    for spec in a.cases.split(","):
        bq, seq = spec.split("@")
        B, nq = map(int, bq.split("x"))
        seq = int(seq)
        q_lat, q_pe, cache, table, lens = case(B, nq, seq, gen)
        fn = lambda: k.mla_decode(q_lat, q_pe, cache, table, lens, L, 0.1352, max_seq_len=seq)  # noqa: E731
        fn()
        t = graph_bench(fn)
        flops = 2 * B * H * (L + R + L) * sum(seq - nq + i + 1 for i in range(nq))
        print(f"B={B} queries {nq} length {seq}: {t * 1e6:,.1f} us, {flops / t / 1e12:.0f} TFLOP/s of causal work",
              flush=True)
        del q_lat, q_pe, cache, table


if __name__ == "__main__":
    main()
