"""MLA decode at DeepSeek-V3 shapes, whole call (CUDA-graph replay) per split count and split
kernel, for the short contexts where fixed costs matter. python bench/probes/mla_short_context.py"""
import sys

import torch
import triton

sys.path.insert(0, ".")
from bench.probes.mla_common import L, SCALE, deepseek_inputs  # noqa: E402
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

T = TritonKernels()
for B, ctx in ((32, 1024), (32, 4096), (128, 1024)):
    q_lat, q_pe, cache, table, lens = deepseek_inputs(B, ctx)
    for impl in ("gluon", "triton"):
        line = []
        for sp in (0, 1, 2, 3, 4):
            def f():
                return T.mla_decode(q_lat, q_pe, cache, table, lens, L, SCALE, num_splits=sp,
                                    max_seq_len=ctx, impl=impl)
            f()
            line.append(f"{sp or 'auto'}: {triton.testing.do_bench_cudagraph(f, rep=100, return_mode='median') * 1e3:.1f}")
        print(f"B={B} ctx={ctx} {impl:6s} splits -> us  " + "  ".join(line), flush=True)
    del cache
    torch.cuda.empty_cache()
