"""Two Gluon MLA decode calls for Nsight Compute (DeepSeek-V3 shapes, B=32, ctx 1k and 16k):
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis -k regex:_mla_gluon python3 bench/probes/mla_ncu.py"""
import sys

import torch

sys.path.insert(0, ".")
from bench.probes.mla_common import L, SCALE, deepseek_inputs  # noqa: E402
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

T = TritonKernels()
for B, ctx in ((32, 1024), (32, 16384)):
    q_lat, q_pe, cache, table, lens = deepseek_inputs(B, ctx)
    T.mla_decode(q_lat, q_pe, cache, table, lens, L, SCALE, max_seq_len=ctx, impl="gluon")
    torch.cuda.synchronize()
    del cache
