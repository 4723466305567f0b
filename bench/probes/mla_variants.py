"""Timing probes of the Gluon MLA split kernel at B=32 (where fixed costs matter): variants made by
editing the module's source in memory (never used for results, only to see what a stage costs).
    python bench/probes/mla_variants.py"""
import statistics
import sys

import torch
import triton

sys.path.insert(0, ".")
import hybridsim.kernels.triton_kernels as tk  # noqa: E402
from bench.probes.mla_common import L, SCALE, deepseek_inputs, load_module  # noqa: E402

SRC = open("hybridsim/kernels/mla_gluon.py").read()
TILE1 = """        for s in gl.static_range(1, NUM_STAGES):
            _load_tile(kv_desc, kr_desc, table, ready.index(s), kv_lo.index(s), kv_hi.index(s), k_r.index(s),
                       k_start + s * BLOCK_N, s < n_tiles, PAGE, HALF, L)
"""
QSTORE = """        q_r.store(qc.to(dt))
"""
QC = """        qc = gl.load(q_pe + gl.expand_dims(qrows, 1) * R + gl.expand_dims(c_r, 0), mask=qmask, other=0.0)
"""
EDITS = {  # name: (source edits, module attributes)
    "as is": ([], {}),
    "whole merge (second merges all)": ([], {"MERGE_HALVES": False}),
    "first to start writes whole, second merges": ([], {"MERGE_HALVES": "first-whole"}),
    "no merge (both write partials)": ([("int(num_splits == 2)", "0")], {}),
    "tile 1 issued before the queries land": ([(QSTORE + TILE1, QSTORE), (QC, QC + TILE1)], {}),
}


def variant(name, edits, attrs):
    src = SRC
    for a, b in edits:
        assert a in src, (name, a)
        src = src.replace(a, b)
    path = f"/tmp/mla_variant_{abs(hash(name))}.py"
    open(path, "w").write(src)
    mod = load_module(path, f"mla_variant_{abs(hash(name))}")
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


mods = {name: variant(name, *e) for name, e in EDITS.items()}
T = tk.TritonKernels()
for B, ctx in ((32, 1024), (32, 4096)):
    *q32, cache, table, lens = deepseek_inputs(B, ctx)
    q16 = tuple(x.bfloat16() for x in q32)
    cases = [(n, m, q32) for n, m in mods.items()] + [("as is, queries in bf16", mods["as is"], q16)]
    times = {n: [] for n, _, _ in cases}
    for _ in range(3):
        for name, mod, (ql, qp) in cases:
            tk.launch_gluon_split = mod.launch_gluon_split

            def f():
                return T.mla_decode(ql, qp, cache, table, lens, L, SCALE, max_seq_len=ctx, impl="gluon")
            f()
            times[name].append(triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median") * 1e3)
    for name in times:
        print(f"B={B} ctx={ctx}  {name:40s} {statistics.median(times[name]):7.1f} us  "
              f"{[round(t, 1) for t in times[name]]}", flush=True)
    del cache
    torch.cuda.empty_cache()
