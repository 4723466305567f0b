"""Is MLA decode bound by memory? The two Gluon kernels (the split kernel and the two-warp-group
"seesaw") at DeepSeek-V3 shapes (128 heads, 512 + 64 latent, bf16, page 64), timed as CUDA graphs:

* distinct pages per request (as in ``bench_kernels``);
* every request reading the same pages (the whole cache fits in L2: what the kernels do when
  memory costs nothing);
* 64 heads and twice the requests: the same programs and the same work per program, but no two
  programs read the same pages (with 128 heads the two 64-row tiles of a request read the same
  latent tiles, and only L2 can keep the second read off DRAM).

    python3 bench/probes/mla_decode_memory.py [--B 128] [--ctx 4096] [--impls seesaw,gluon]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402
from bench_kernels import graph_bench  # noqa: E402


def case(B, H, ctx, shared_pages, L=512, R=64, page=64):
    blocks = ctx // page
    n_pages = blocks if shared_pages else B * blocks
    cache = torch.randn(n_pages + 1, page, L + R, dtype=torch.bfloat16, device="cuda")
    if shared_pages:
        table = (torch.randperm(blocks, device="cuda") + 1).repeat(B, 1)
    else:
        table = (torch.randperm(B * blocks, device="cuda") + 1).view(B, blocks)
    lens = torch.full((B,), ctx, device="cuda")
    return torch.randn(B, 1, H, L, device="cuda"), torch.randn(B, 1, H, R, device="cuda"), cache, table, lens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--impls", default="seesaw,gluon", help="any of seesaw, gluon, triton")
    a = ap.parse_args()
    T = TritonKernels()
    print(torch.cuda.get_device_name(0))
    for label, B, H, shared in [("128 heads, distinct pages", a.B, 128, False),
                                ("128 heads, every request the same pages", a.B, 128, True),
                                ("64 heads, twice the requests, distinct pages", 2 * a.B, 64, False)]:
        q_lat, q_pe, cache, table, lens = case(B, H, a.ctx, shared)
        flops = 2 * B * a.ctx * H * (576 + 512)
        for impl in a.impls.split(","):

            def call():
                return T.mla_decode(q_lat, q_pe, cache, table, lens, 512, 0.1352338, max_seq_len=a.ctx, impl=impl)
            call()
            t = graph_bench(call)
            print(f"{label:48s} B={B:4d} ctx={a.ctx:6d} {impl:7s} {t * 1e6:9.1f} us  {flops / t / 1e12:6.1f} TFLOP/s",
                  flush=True)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
