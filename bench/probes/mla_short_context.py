"""MLA decode at DeepSeek-V3 shapes, whole call (CUDA-graph replay) per split count and split
kernel, for the short contexts where fixed costs matter. python bench/probes/mla_short_context.py"""
import sys

import torch
import triton

sys.path.insert(0, ".")
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

T = TritonKernels()
H, L, R, page = 128, 512, 64, 64
for B, ctx in ((32, 1024), (32, 4096), (128, 1024)):
    blocks = ctx // page
    cache = torch.randn(B * blocks + 1, page, L + R, dtype=torch.bfloat16, device="cuda")
    table = (torch.randperm(B * blocks, device="cuda") + 1).view(B, blocks)
    lens = torch.full((B,), ctx, device="cuda")
    q_lat, q_pe = torch.randn(B, 1, H, L, device="cuda"), torch.randn(B, 1, H, R, device="cuda")
    for impl in ("gluon", "triton"):
        line = []
        for sp in (0, 1, 2, 3, 4):
            def f():
                return T.mla_decode(q_lat, q_pe, cache, table, lens, L, 0.1352338, num_splits=sp,
                                    max_seq_len=ctx, impl=impl)
            f()
            line.append(f"{sp or 'auto'}: {triton.testing.do_bench_cudagraph(f, rep=100, return_mode='median') * 1e3:.1f}")
        print(f"B={B} ctx={ctx} {impl:6s} splits -> us  " + "  ".join(line), flush=True)
    del cache
    torch.cuda.empty_cache()
