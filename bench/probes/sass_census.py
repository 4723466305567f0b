"""Without a GPU: build the MLA oracle's digit attention kernel for sm_90 at DeepSeek-V3's expanded shapes
and count its key loop's SASS by opcode: registers, local memory (spills), shared memory, instructions a
warp a key block and a (query, key) pair a head: the instruction work of a tile, before a device call
times it. They do not rank tiles by speed: ncu on an H200 (history/2026-11-28_session34.md) found the
kernel waiting on latency (a third of its issue slots used, 0.4 eligible warps a scheduler), not on issue.
Before session 34 the count took the widest backward branch, an out-of-line wait loop's, and so took in
the prologue and epilogue too (about twice the key loop).

    python bench/probes/sass_census.py [--tile 16,64,4,2] [--maxnreg 168]

It builds with the Triton installed. To count what the device runs, build with its version (3.6:
``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``): Triton 3.9 emits other code (the
float64 products as DMMA.8x8x4, not 16x8x16: 1,482 instructions a warp an iteration against 1,316).

Needs Triton's NVIDIA tool chain (ptxas, cuobjdump: the pip wheel carries them); no CUDA device.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton import compile as build  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybridsim.kernels import digit_attention_f64 as da  # noqa: E402

ADDRESS = re.compile(r"\s+/\*([0-9a-f]{4,6})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def cubin(tile: tuple[int, int, int, int], maxnreg: int | None) -> tuple[bytes, int]:
    """The kernel's cubin at DeepSeek-V3's widths (nope 128, rope 64, values 128 int32) and its shared memory."""
    BQ, BN, warps, stages = tile
    const = dict(DN=128, DR=64, DV=128, DVC=32, NV=4, BQ=BQ, BN=BN)
    desc = dict(qd=f"tensordesc<i8[{BQ}, 1, 128]>", qdr=f"tensordesc<i8[{BQ}, 1, 64]>",
                kd=f"tensordesc<i8[{BN}, 1, 128]>", kr=f"tensordesc<i8[{BN}, 1, 64]>",
                v=f"tensordesc<i32[{BN}, 1, 32]>")
    kern = da._digit_attention_kernel
    sig = {n: "constexpr" if n in const else desc[n] if n in desc else "*fp64" if n in ("o", "consts")
           else "i64" if n.startswith("so_") else "*i64" for n in kern.arg_names}
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    out = build(ASTSource(fn=kern, signature=sig, constexprs={(kern.arg_names.index(k),): v for k, v in const.items()}),
                target=GPUTarget("cuda", 90, 64), options=options)
    return out.asm["cubin"], out.metadata.shared


def census(binary: bytes) -> tuple[str, list[str]]:
    """(cuobjdump's resource line, the opcodes of the longest loop: the widest backward branch's span)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    instr = [(int(m.group(1), 16), m.group(3), line) for line in sass.splitlines() if (m := ADDRESS.match(line))]
    # the key loop's back edge: the widest predicated backward branch (the unpredicated ones go back from
    # out-of-line wait loops past the kernel's end, and would take the prologue and epilogue in)
    span = (0, -1)
    for addr, op, line in instr:
        if not op.startswith("BRA") or not re.search(r"@!?P\d", line):
            continue
        target = re.search(r"0x([0-9a-f]+)", line.split(op, 1)[1])
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > span[1] - span[0]:
            span = (int(target.group(1), 16), addr)
    resources = re.search(r"REG:\d+ STACK:\d+", usage)
    return resources.group(0) if resources else "?", [op for a, op, _ in instr if span[0] <= a <= span[1]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile", default=",".join(map(str, da.TILE)), help="queries, keys a block, warps, stages")
    ap.add_argument("--maxnreg", type=int, default=None, help="a register cap a thread (spills show as STACK)")
    a = ap.parse_args()
    tile = tuple(int(x) for x in a.tile.split(","))
    binary, shared = cubin(tile, a.maxnreg)
    resources, body = census(binary)
    BQ, BN, warps, _ = tile
    print(f"tile {a.tile}: {resources}, shared {shared:,} B; key loop {len(body):,} instructions a warp, "
          f"{len(body) * warps / (BQ * BN):.2f} a (query, key) pair a head")
    ops = collections.Counter(op.split(".")[0] for op in body)
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(30)))


if __name__ == "__main__":
    main()
