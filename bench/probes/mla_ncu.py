"""Two Gluon MLA decode calls for Nsight Compute (DeepSeek-V3 shapes, B=32, ctx 1k and 16k):
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis -k regex:_mla_gluon python3 bench/probes/mla_ncu.py"""
import sys

import torch

sys.path.insert(0, ".")
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

T = TritonKernels()
H, L, R, page = 128, 512, 64, 64
for B, ctx in ((32, 1024), (32, 16384)):
    blocks = ctx // page
    cache = torch.randn(B * blocks + 1, page, L + R, dtype=torch.bfloat16, device="cuda")
    table = (torch.randperm(B * blocks, device="cuda") + 1).view(B, blocks)
    lens = torch.full((B,), ctx, device="cuda")
    q_lat, q_pe = torch.randn(B, 1, H, L, device="cuda"), torch.randn(B, 1, H, R, device="cuda")
    T.mla_decode(q_lat, q_pe, cache, table, lens, L, 0.1352338, max_seq_len=ctx, impl="gluon")
    torch.cuda.synchronize()
    del cache
