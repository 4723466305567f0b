"""A/B of two versions of the Gluon MLA split kernel in one process (same GPU state), whole call
replayed as a CUDA graph, alternating A and B rounds; also says whether both give identical bits.
    python bench/probes/mla_ab.py REV_OR_FILE   (A: hybridsim/kernels/mla_gluon.py at a git revision,
                                                 or a copy of it; B: the working tree's)"""
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import triton

sys.path.insert(0, ".")
import hybridsim.kernels.triton_kernels as tk  # noqa: E402
from bench.probes.mla_common import L, SCALE, deepseek_inputs, load_module  # noqa: E402

path = sys.argv[1]
if not os.path.isfile(path):
    src = subprocess.run(["git", "show", f"{path}:hybridsim/kernels/mla_gluon.py"], check=True, capture_output=True,
                         text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "mla_gluon_a.py")
    open(path, "w").write(src)
old = load_module(path, "old_mla_gluon")
new_launch = tk.launch_gluon_split
T = tk.TritonKernels()
for B, ctx in ((32, 1024), (32, 4096), (32, 16384), (128, 1024), (128, 4096), (128, 16384), (1, 1024)):
    q_lat, q_pe, cache, table, lens = deepseek_inputs(B, ctx)
    times = {"A": [], "B": []}
    outs = {}
    for _ in range(3):
        for name, launch in (("A", old.launch_gluon_split), ("B", new_launch)):
            tk.launch_gluon_split = launch

            def f():
                return T.mla_decode(q_lat, q_pe, cache, table, lens, L, SCALE, max_seq_len=ctx, impl="gluon")
            outs[name] = [x.clone() for x in f()]
            times[name].append(triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median") * 1e3)
    same = all(torch.equal(a, b) for a, b in zip(outs["A"], outs["B"]))
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"B={B:3d} ctx={ctx:5d}  A {a:8.1f} us  B {b:8.1f} us  B/A {b / a:.3f}  identical={same}  "
          f"rounds A {[round(t, 1) for t in times['A']]} B {[round(t, 1) for t in times['B']]}", flush=True)
    del cache
    torch.cuda.empty_cache()
tk.launch_gluon_split = new_launch
