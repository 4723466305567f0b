"""Probe for the paged-attention "illegal memory access" of bench_kernels.py's gqa section
(bench/RESULTS.md; driven by paged_fault.sh). The cause it showed: ``triton.testing.
do_bench_cudagraph`` runs the call eagerly (warm-up, estimate) on a fresh stream of its own
before it synchronizes; that stream does not wait for the default stream, where the case has just
queued its setup (the caches' randn, the block table, the plan's index upload). The kernel then
reads block/row ids from memory the allocator recycled (stale bytes of earlier tensors) and runs
off its buffers. bench_kernels.graph_bench now drains the device first.

Modes (each in a process of its own: a fault poisons the CUDA context):

  witness                a table written by a kernel on the default stream behind ~100 ms of
                         queued work, read at once by a kernel on a side stream (as
                         do_bench_cudagraph's calls read it): how many entries did the side
                         stream see stale? Variants: the side stream first allocates nothing,
                         allocates from its cached blocks, allocates fresh memory, or waits for
                         the default stream (the fix).
  seq [--sync] [--no-write] [--warm-streams] B ctx page
                         the bench's pattern at a small size, made deterministic: the small
                         allocator pool filled with float bits (as the reference's leftovers
                         leave it), 100 ms of queued work on the default stream, then the table
                         written and the plan uploaded there, one eager call, then
                         do_bench_cudagraph. --sync drains the default stream first (the fix);
                         --no-write skips writing the table (the stale table as such);
                         --warm-streams gives every pool stream a cached block of the output's
                         size first (so the side stream's first allocation is no cudaMalloc).
  bench PATH [--tap] [--stop N] -- ARGS
                         run bench_kernels.py at PATH with ARGS; every do_bench_cudagraph call is
                         logged with whether the default stream still had work queued, and every
                         PinnedRing upload with its stream (default or not, capturing or not).
                         --tap: first replay do_bench_cudagraph's six eager calls on a fresh
                         stream with each kernel replaced by a copy of the ids it would read,
                         synchronize, and count entries that differ from their final values;
                         then the real benchmark (safe: the device was drained).
"""

from __future__ import annotations

import collections
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
FLOAT_BITS = 0x3F800000  # 1.0f read as an int32: a block id of about 1e9
SLEEP_CYCLES = int(2e8)  # ~100 ms of queued default-stream work at H100 clocks


def witness() -> None:
    """A table written by a kernel on the default stream behind ~100 ms of queued work, read by a
    kernel on a side stream right after (into a buffer allocated beforehand). Variants: what the
    side stream does first: nothing; allocate from its cached blocks; allocate fresh memory (a
    cudaMalloc, after empty_cache); wait for the default stream (the fix)."""
    n = 1 << 15
    real = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
    snap = torch.empty(n, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    # load every kernel used below once: a kernel's first launch loads its module (CUDA lazy
    # loading), which waits for the device and would close the window being measured
    torch.cuda._sleep(1)
    torch.add(real, 0, out=snap)
    torch.full((n,), FLOAT_BITS, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    for variant in ("none", "cached_alloc", "cudaMalloc", "wait"):
        with torch.cuda.stream(side):
            x = torch.empty(1 << 19, dtype=torch.float32, device="cuda")  # 2 MB: cached for the side stream
            del x
        table = torch.full((n,), FLOAT_BITS, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        if variant == "cudaMalloc":
            torch.cuda.empty_cache()
        torch.cuda._sleep(SLEEP_CYCLES)
        torch.add(real, 0, out=table)  # a kernel write, as randperm / randn would
        pending = not torch.cuda.current_stream().query()
        with torch.cuda.stream(side):
            if variant == "wait":
                side.wait_stream(torch.cuda.default_stream())
            if variant in ("cached_alloc", "cudaMalloc"):
                o = torch.empty(1 << 19, dtype=torch.float32, device="cuda")  # as run_paged_attention's out
            torch.add(table, 0, out=snap)  # a kernel read
        torch.cuda.synchronize()
        stale = int((snap != real).sum())
        print(f"WITNESS side_stream_first={variant} default_pending={int(pending)} "
              f"side_stream_read_stale={stale}/{n} max_seen={int(snap.max())}", flush=True)


def _poison_small_pool(mb: int = 4) -> None:
    """Fill the caching allocator's small pool (blocks <= 1 MB) with float bits, then free it."""
    ts = [torch.empty(128, dtype=torch.int32, device="cuda") for _ in range(mb * 2048)]  # 512 B each
    for t in ts:
        t.fill_(FLOAT_BITS)
    torch.cuda.synchronize()
    del ts


def seq(B: int, ctx: int, page: int, sync: bool, write: bool, warm_streams: bool) -> None:
    from hybridsim.kernels.attention_triton import plan_paged_attention, run_paged_attention
    from hybridsim.kernels.reference import ReferenceKernels

    H, KVH, D = 32, 8, 128
    new = lambda s, d: torch.empty(s, dtype=d, device="cuda")  # noqa: E731
    blocks = -(-ctx // page)
    kc = torch.randn(B * blocks + 1, page, KVH, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    src = (torch.randperm(B * blocks, device="cuda") + 1).view(B, blocks).to(torch.int32)
    qsl, lens = torch.arange(B + 1), torch.full((B,), ctx)
    dev = torch.device("cuda")
    # warm-up: compile, the pinned ring, the stream pool; all of it before the poisoned pass
    plan = plan_paged_attention(qsl, lens, H, KVH, page, True, dev, 0)
    triton.testing.do_bench_cudagraph(lambda: run_paged_attention(plan, q, kc, vc, src, 0.088, new), rep=5)
    ref = ReferenceKernels().paged_attention(q, kc, vc, src, qsl, lens, 0.088)
    torch.add(src, 0, out=torch.empty_like(src))  # load the kernels used in the window (lazy loading waits)
    torch.cuda._sleep(1)
    torch.empty(1, dtype=torch.int32, device="cuda").fill_(FLOAT_BITS)
    if warm_streams:  # every pool stream caches blocks of the call's output sizes: no cudaMalloc later
        for _ in range(64):
            with torch.cuda.stream(torch.cuda.Stream()):
                run_paged_attention(plan, q, kc, vc, src, 0.088, new)
    torch.cuda.synchronize()
    del plan
    _poison_small_pool()
    torch.cuda._sleep(SLEEP_CYCLES)  # the setup a big case queues (2 GiB of randn at B=128, ctx=4096)
    table = torch.empty(B, blocks, dtype=torch.int32, device="cuda")
    if write:
        torch.add(src, 0, out=table)  # a kernel write, as the bench's randperm chain
    plan = plan_paged_attention(qsl, lens, H, KVH, page, True, dev, 0)
    call = lambda: run_paged_attention(plan, q, kc, vc, table, 0.088, new)  # noqa: E731
    call()  # as the bench does, on the default stream
    pending = not torch.cuda.current_stream().query()
    print(f"SEQ B={B} ctx={ctx} page={page} sync={int(sync)} write={int(write)} warm_streams={int(warm_streams)} "
          f"default_pending={int(pending)} "
          f"splits={plan.num_splits}", flush=True)
    if sync:
        torch.cuda.synchronize()
    t = triton.testing.do_bench_cudagraph(call, rep=20, return_mode="median")
    err = float((call() - ref).abs().max()) if write else float("nan")
    torch.cuda.synchronize()
    print(f"SEQ_OK sync={int(sync)} write={int(write)} graph_us={t * 1e3:.1f} max_abs_err_vs_ref={err:.2e}", flush=True)


def bench(path: str, tap: bool, stop: int, args: list[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_under_probe", path)
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)  # puts its repository root first on sys.path
    from hybridsim.engine import transfer

    ring_puts: collections.Counter = collections.Counter()
    put = transfer.PinnedRing.put

    def logged_put(self, a, dtype):
        s = torch.cuda.current_stream(self.device)
        ring_puts[(s == torch.cuda.default_stream(self.device), torch.cuda.is_current_stream_capturing())] += 1
        return put(self, a, dtype)

    transfer.PinnedRing.put = logged_put
    real = triton.testing.do_bench_cudagraph
    n = [0]
    # snapshot buffers for the tap, allocated once now: an allocation inside the window could itself
    # order the streams (a cudaMalloc)
    EAGER = 6  # do_bench_cudagraph's eager calls before its first synchronize: warm-up + 5 for the estimate
    snap_t = torch.empty(EAGER, 1 << 17, dtype=torch.int32, device="cuda")
    snap_p = torch.empty(EAGER, 4, 1 << 11, dtype=torch.int32, device="cuda")

    def report_ring():
        for (default, capturing), c in sorted(ring_puts.items()):
            print(f"RING uploads default_stream={int(default)} capturing={int(capturing)}: {c}", flush=True)

    def tapped(cv):
        """do_bench_cudagraph's eager prologue replayed on a fresh stream, each call's kernel replaced
        by a copy of what it reads as ids (block table, the plan's tile rows, tile offsets, row
        starts, lengths), after the same output allocations; then compared with the final values."""
        plan, table, q = cv["plan"], cv["table"], cv["q"]
        named = [plan.tile_row, plan.tile_q0, plan.qsl, plan.lens]
        T, H, D = q.shape
        with torch.cuda.stream(torch.cuda.Stream()):
            for i in range(EAGER):
                o = [torch.empty((T, H, D), dtype=torch.float32, device="cuda")]  # run_paged_attention's outputs
                if plan.num_splits > 1:
                    o += [torch.empty((plan.num_splits, T, H, D), dtype=torch.float32, device="cuda"),
                          torch.empty((plan.num_splits, T, H), dtype=torch.float32, device="cuda")]
                torch.add(table.reshape(-1), 0, out=snap_t[i, :table.numel()])
                for j, v in enumerate(named):
                    torch.add(v, 0, out=snap_p[i, j, :v.numel()])
                del o
        torch.cuda.synchronize()
        parts = []
        for i in range(EAGER):
            bad_t = snap_t[i, :table.numel()] != table.reshape(-1)
            bad_p = sum(int((snap_p[i, j, :v.numel()] != v).sum()) for j, v in enumerate(named))
            part = f"call{i + 1}:table_stale={int(bad_t.sum())}/{table.numel()}"
            if bad_t.any():
                part += f"(max_id_seen={int(snap_t[i, :table.numel()].max())},pages={cv['k_cache'].shape[0]})"
            part += f",plan_stale={bad_p}/{sum(v.numel() for v in named)}"
            if bad_p:
                part += f"(max_seen={int(max(int(snap_p[i, j, :v.numel()].max()) for j, v in enumerate(named)))})"
            parts.append(part)
        return " ".join(parts)

    def wrapped(fn, *a, **k):
        n[0] += 1
        pending = not torch.cuda.current_stream().query()
        cv = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        line = f"GRAPH #{n[0]} default_pending={int(pending)}"
        if "plan" in cv and "table" in cv:
            table, kc = cv["table"], cv["k_cache"]
            line += f" B={table.shape[0]} page={kc.shape[1]} ctx={table.shape[1] * kc.shape[1]} splits={cv['plan'].num_splits}"
            if tap:
                line += " " + tapped(cv)
        print(line, flush=True)
        t = real(fn, *a, **k)
        if stop and n[0] >= stop:
            torch.cuda.synchronize()
            report_ring()
            print(f"STOP after {n[0]} graph benchmarks, clean", flush=True)
            os._exit(0)
        return t

    triton.testing.do_bench_cudagraph = wrapped
    sys.argv = [path] + args
    try:
        bk.main()
    finally:
        report_ring()


def main() -> None:
    argv = sys.argv[1:]
    mode = argv.pop(0)
    sys.path.insert(0, str(ROOT))
    print(f"{mode} {' '.join(argv)} | {torch.cuda.get_device_name(0)} torch {torch.__version__} "
          f"triton {triton.__version__} CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '')}", flush=True)
    t0 = time.time()
    if mode == "witness":
        witness()
    elif mode == "seq":
        nums = [int(x) for x in argv if not x.startswith("--")]
        seq(*nums, sync="--sync" in argv, write="--no-write" not in argv, warm_streams="--warm-streams" in argv)
    elif mode == "bench":
        path = argv.pop(0)
        rest = argv[argv.index("--") + 1:] if "--" in argv else []
        head = argv[:argv.index("--")] if "--" in argv else argv
        stop = int(head[head.index("--stop") + 1]) if "--stop" in head else 0
        bench(path, "--tap" in head, stop, rest)
    print(f"done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
