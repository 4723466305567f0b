"""Repro probe: paged attention cases in sequence as bench_kernels runs them (graph replay,
then the torch reference timed), with CUDA_LAUNCH_BLOCKING to name the failing launch."""
import sys
import torch
import triton
sys.path.insert(0, ".")
from hybridsim.kernels.attention_triton import plan_paged_attention, run_paged_attention
from hybridsim.kernels.reference import ReferenceKernels

H, KVH, D = 32, 8, 128
new = lambda s, d: torch.empty(s, dtype=d, device="cuda")
for case in sys.argv[1:]:
    B, ctx, page, graph, ref_t = (int(x) for x in case.split(","))
    blocks = -(-ctx // page)
    kc = torch.randn(B * blocks + 1, page, KVH, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    table = (torch.randperm(B * blocks, device="cuda") + 1).view(B, blocks).to(torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(B + 1)
    lens = torch.full((B,), ctx)
    plan = plan_paged_attention(qsl, lens, H, KVH, page, True, torch.device("cuda"), 0)
    call = lambda: run_paged_attention(plan, q, kc, vc, table, 0.088, new)
    call()
    torch.cuda.synchronize()
    print(case, "eager ok", flush=True)
    if graph:
        t = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
        torch.cuda.synchronize()
        print(case, "graph ok", t, flush=True)
    if ref_t:
        ref = ReferenceKernels()
        t = triton.testing.do_bench(lambda: ref.paged_attention(q, kc, vc, table, qsl, lens, 0.088), rep=20)
        torch.cuda.synchronize()
        print(case, "ref ok", t, flush=True)
    del kc, vc
    torch.cuda.empty_cache()
