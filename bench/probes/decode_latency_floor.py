"""How fast can a one-request decode call be at all? Issue 37 asks MLA decode at B = 1 to come
within 2x of the launch floor (an empty one-program kernel replayed as a CUDA graph). These kernels
do nothing but the dependent steps any paged decode call has, timed the same way (CUDA graph
replays, so the latent pages stay in L2: a lower bound):

* empty: the launch floor itself;
* chain: one program reads its block-table entry, then a 64 x 64 slice of that page, then writes
  a row (two dependent reads and a write);
* split + merge: P programs each do the chain on their own page and write a partial row; the last
  to finish (an atomic counter) reads every partial and writes the result: the least a one-launch
  split decode must wait for;
* split + combine: the same in two launches, a second kernel merging the partials.

    python3 bench/probes/decode_latency_floor.py [--splits 1,8,16,64]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_kernels import graph_bench  # noqa: E402

ROW = 576  # latent entry: 512 + 64 bf16
PAGE = 64


@triton.jit
def _empty_kernel(x):
    pass


@triton.jit
def _chain(table, cache, idx, ROW: tl.constexpr, PAGE: tl.constexpr):
    """Block-table entry, then a 64 x 64 slice of its page; returns the slice's row sums."""
    page = tl.load(table + idx).to(tl.int64)
    r = tl.arange(0, PAGE)
    c = tl.arange(0, 64)
    x = tl.load(cache + page * (PAGE * ROW) + r[:, None] * ROW + c[None, :])
    return tl.sum(x.to(tl.float32), 1)


@triton.jit
def _chain_kernel(table, cache, out, ROW: tl.constexpr, PAGE: tl.constexpr):
    tl.store(out + tl.arange(0, PAGE), _chain(table, cache, 0, ROW, PAGE))


@triton.jit
def _split_merge_kernel(table, cache, partial, counter, out, P, ROW: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, PAGE)
    tl.store(partial + pid * PAGE + r, _chain(table, cache, pid, ROW, PAGE))
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == P - 1:  # the last program merges every partial and resets the counter
        p = tl.arange(0, BLOCK_P)
        parts = tl.load(partial + p[:, None] * PAGE + r[None, :], mask=(p < P)[:, None], other=0.0,
                        cache_modifier=".cg")
        tl.store(out + r, tl.sum(parts, 0))
        tl.store(counter, 0)


@triton.jit
def _split_kernel(table, cache, partial, ROW: tl.constexpr, PAGE: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(partial + pid * PAGE + tl.arange(0, PAGE), _chain(table, cache, pid, ROW, PAGE))


@triton.jit
def _combine_kernel(partial, out, P, PAGE: tl.constexpr, BLOCK_P: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    r = tl.arange(0, PAGE)
    parts = tl.load(partial + p[:, None] * PAGE + r[None, :], mask=(p < P)[:, None], other=0.0)
    tl.store(out + r, tl.sum(parts, 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--splits", default="1,8,16,64")
    a = ap.parse_args()
    dev = "cuda"
    n_pages = 4096
    cache = torch.randn(n_pages, PAGE, ROW, dtype=torch.bfloat16, device=dev)
    table = torch.randperm(n_pages, device=dev)
    out = torch.empty(PAGE, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    print(torch.cuda.get_device_name(0))
    x = torch.zeros(16, device=dev)
    floor = graph_bench(lambda: _empty_kernel[(1,)](x))
    print(f"{'empty kernel (the launch floor)':44s} {floor * 1e6:7.2f} us   1.0x")
    t = graph_bench(lambda: _chain_kernel[(1,)](table, cache, out, ROW=ROW, PAGE=PAGE))
    print(f"{'chain: table entry, page slice, a row out':44s} {t * 1e6:7.2f} us  {t / floor:4.1f}x")
    want = cache[table[:1].long(), :, :64].float().sum(-1).sum(0)
    assert torch.allclose(out, want, rtol=1e-3, atol=1e-2)
    for P in (int(s) for s in a.splits.split(",")):
        partial = torch.empty(P, PAGE, device=dev)
        bp = triton.next_power_of_2(P)
        t = graph_bench(lambda: _split_merge_kernel[(P,)](table, cache, partial, counter, out, P, ROW=ROW, PAGE=PAGE,
                                                          BLOCK_P=bp))
        want = cache[table[:P].long(), :, :64].float().sum(-1).sum(0)
        assert torch.allclose(out, want, rtol=1e-3, atol=1e-1) and int(counter) == 0
        print(f"{f'{P} splits, the last program merging':44s} {t * 1e6:7.2f} us  {t / floor:4.1f}x")

        def two():
            _split_kernel[(P,)](table, cache, partial, ROW=ROW, PAGE=PAGE)
            _combine_kernel[(1,)](partial, out, P, PAGE=PAGE, BLOCK_P=bp)
        t = graph_bench(two)
        print(f"{f'{P} splits, then a combine launch':44s} {t * 1e6:7.2f} us  {t / floor:4.1f}x")


if __name__ == "__main__":
    main()
