"""Where a small-batch MLA decode call's time goes (issue 37's B = 1 bar; history/2026-11-28_session38.md).
The Gluon split kernel at DeepSeek-V3 shapes (128 heads, 512 + 64 latent, bf16, page 64), B = 1, 2, 4, timed
as the bench's decode rows are (CUDA graphs: the pages stay in L2), with copies of the kernel leaving one
part out (results are wrong, the time is what is measured):

  current  the product's kernel (its automatic split count, and forced counts)
  noq      the queries not read (zeros cast into shared memory: the 144 KB of fp32 each program reads)
  notiles  no latent tile read or multiplied (every split empty)
  noout    no partial written (the combine launch still merges what is there)

    python3 bench/probes/mla_small_batch.py [--B 1,2,4] [--ctx 1024,4096] [--splits 0,4,8,16]
        [--combine 16,128;8,512;serial]   # the merge's shape: splits read at once, columns a program;
                                          # serial: the merge before session 38 (a split at a time)
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import hybridsim.kernels.attention_triton as at  # noqa: E402
import hybridsim.kernels.mla_gluon as mg  # noqa: E402
import hybridsim.kernels.triton_kernels as tk  # noqa: E402
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402
from bench_kernels import graph_bench, launch_floor  # noqa: E402
from probes.mla_decode_memory import case  # noqa: E402
from probes.patched import patched  # noqa: E402

PATCHES = {
    "noq": [("qa = gl.load(q_lat + gl.expand_dims(qrows, 1) * L + gl.expand_dims(c_h, 0), mask=qmask, other=0.0)",
             "qa = gl.zeros([BLOCK_M, HALF], gl.float32, layout=row_layout)"),
            ("qb = gl.load(q_lat + gl.expand_dims(qrows, 1) * L + HALF + gl.expand_dims(c_h, 0), mask=qmask, other=0.0)",
             "qb = gl.zeros([BLOCK_M, HALF], gl.float32, layout=row_layout)"),
            ("qc = gl.load(q_pe + gl.expand_dims(qrows, 1) * R + gl.expand_dims(c_r, 0), mask=qmask, other=0.0)",
             "qc = gl.zeros([BLOCK_M, R], gl.float32, layout=row_layout)")],
    "notiles": [("        n_tiles = gl.cdiv(gl.maximum(k_end - k_start, 0), BLOCK_N)\n",
                 "        n_tiles = gl.cdiv(gl.maximum(k_end - k_start, 0), BLOCK_N) * 0\n")],
    "noout": [("            _store_rows(o_part, lse_part, prow, rmask, cols, out_lo, out_hi, own_lse, L, HALF, row_layout)",
               "            pass")],
}


@triton.jit(do_not_specialize=["n_rows", "num_splits"])
def _serial_combine_kernel(o_part, lse_part, out, lse_out, n_rows, num_splits, L: tl.constexpr,
                           BLOCK_L: tl.constexpr, ROWS: tl.constexpr):
    """The merge as it was before session 38: ROWS rows a program, the splits one after another."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rm = r < n_rows
    c = tl.arange(0, BLOCK_L)
    cm = rm[:, None] & (c < L)[None, :]
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_part + s * n_rows + r, mask=rm, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([ROWS, BLOCK_L], tl.float32)
    wsum = tl.zeros([ROWS], tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(lse_part + s * n_rows + r, mask=rm, other=float("-inf")) - m_safe)
        o = tl.load(o_part + (s * n_rows + r)[:, None] * L + c[None, :], mask=cm, other=0.0)
        acc += w[:, None] * o
        wsum += w
    empty = wsum == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, wsum))
    tl.store(out + r[:, None] * L + c[None, :], acc * inv[:, None], mask=cm)
    tl.store(lse_out + r, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, wsum))), mask=rm)


def serial_combine(o_part, lse_part, out, lse_out, n_rows, num_splits, L):
    _serial_combine_kernel[(triton.cdiv(n_rows, 4),)](o_part, lse_part, out, lse_out, n_rows, num_splits, L=L,
                                                      BLOCK_L=triton.next_power_of_2(L), ROWS=4, num_warps=4)


def variant(name: str):
    """The split kernel with ``name``'s parts left out, compiled from a patched copy of its module."""
    return patched(mg, f"mla_small_batch_{name}", PATCHES[name])._mla_gluon_split_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", default="1,2,4")
    ap.add_argument("--ctx", default="1024,4096")
    ap.add_argument("--splits", default="0,4,8,16")
    ap.add_argument("--variants", default="current,noq,notiles,noout")
    ap.add_argument("--combine", default="", help="splits,columns;... of the merge launch (default: the product's)")
    a = ap.parse_args()
    shapes = [c if c == "serial" else tuple(map(int, c.split(","))) for c in a.combine.split(";") if c] or [
        (at.COMBINE_SPLITS, at.COMBINE_COLUMNS)]
    tri = TritonKernels()
    floor = launch_floor()
    print(f"{torch.cuda.get_device_name()}: launch floor {floor * 1e6:.2f} us", flush=True)
    orig = mg._mla_gluon_split_kernel
    default = at.COMBINE_SPLITS, at.COMBINE_COLUMNS
    for shape, name in [(c, v) for c in shapes for v in a.variants.split(",")]:
        tk.combine_splits = serial_combine if shape == "serial" else at.combine_splits
        if shape != "serial":
            at.COMBINE_SPLITS, at.COMBINE_COLUMNS = shape
        print(f"-- merge: {shape}", flush=True)
        try:
            mg._mla_gluon_split_kernel = orig if name == "current" else variant(name)
            for ctx in map(int, a.ctx.split(",")):
                for B in map(int, a.B.split(",")):
                    q_lat, q_pe, cache, table, lens = case(B, 128, ctx, False)
                    for splits in map(int, a.splits.split(",")):
                        def call():
                            return tri.mla_decode(q_lat, q_pe, cache, table, lens, 512, 0.1352338,
                                                  num_splits=splits, max_seq_len=ctx, impl="gluon")
                        call()
                        t = graph_bench(call)
                        print(f"{name:8s} B={B} ctx={ctx:5d} splits={splits or 'auto':>4}: {t * 1e6:6.2f} us "
                              f"({t / floor:5.1f}x the launch floor)", flush=True)
        except Exception as e:  # (a variant that does not build: say so, go on)
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            mg._mla_gluon_split_kernel = orig
    at.COMBINE_SPLITS, at.COMBINE_COLUMNS = default
    tk.combine_splits = at.combine_splits


if __name__ == "__main__":
    main()
