"""The Mamba probe scan on the GPU at Nemotron-H-8B geometry (24 layers, 128 heads x 64 x 128).

The scan is integer arithmetic: per state element and token, h = (a*h + x'*B) mod Q and the
y sum term h*C. Its ceiling is measured here too: a kernel that runs exactly that update on
a register tile with no memory traffic (same tile shape, same modulus) gives the device's
element-update rate for this arithmetic. The scan's floor is the larger of its updates at that
rate and its traffic (pages and inputs read, pages and outputs written) over the measured read
rate and write side (``hybridsim/kernels/ceilings.py``); each case says which bound it is and the
% of it, flagged when above 100% (the floor is then wrong). Long rows run in chunks on int8 tensor
cores (``probe_scan_chunked``): their floor is their int8 products at the measured int8 rate (an
8192-cube ``torch._int_mm``) or their traffic, a lower bound only (their element-wise work on the
CUDA cores, conv inputs and reductions mod Q, has no measured rate of its own).

    python3 bench/bench_scan.py [--out results.json] [--only 'oracle rows|prefill']
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridsim.kernels.ceilings import measure  # noqa: E402
from hybridsim.kernels.probe_scan import ScanBuilder  # noqa: E402
from hybridsim.kernels.probe_scan_triton import CHUNK_MIN_TOKENS, CHUNK_TOKENS, scan_triton  # noqa: E402
from hybridsim.layers.exact import Q  # noqa: E402
from hybridsim.layers.mamba import MambaProbe, stack_tables  # noqa: E402
from hybridsim.oracle import STATE_DTYPE  # noqa: E402
from hybridsim.presets import build_preset  # noqa: E402

OWN_DTYPE = {"product": STATE_DTYPE}  # the oracle's own states in oracle mode (--own-states float32: as before session 41)


@triton.jit
def _update_ceiling(out, steps, a_in, BP: tl.constexpr, BN: tl.constexpr, QQ: tl.constexpr):
    """The scan's inner update on a (BP, BN) register tile, ``steps`` times, nothing else."""
    p = tl.arange(0, BP)
    n = tl.arange(0, BN)
    h = (p[:, None] * 7 + n[None, :] * 13 + tl.program_id(0)) % QQ
    x = (p * 5 + 1) % QQ
    b = (n * 3 + 2) % QQ
    c = (n * 11 + 3) % QQ
    a = tl.load(a_in)
    acc = tl.zeros([BP], dtype=tl.int32)
    for _ in range(steps):
        h = (a * h + x[:, None] * b[None, :]) % QQ
        acc = (acc + tl.sum(h * c[None, :], axis=1)) % QQ
    tl.store(out + tl.program_id(0) * BP + p, acc)


def ceiling_rate(programs: int = 132 * 16, steps: int = 512) -> float:
    """State element-updates per second of the bare arithmetic (BP 32 x BN 128 tiles, 4 warps)."""
    out = torch.empty(programs * 32, dtype=torch.int32, device="cuda")
    a = torch.tensor([1234], dtype=torch.int32, device="cuda")
    t = triton.testing.do_bench(lambda: _update_ceiling[(programs,)](out, steps, a, BP=32, BN=128, QQ=Q,
                                                                      num_warps=4), return_mode="median") * 1e-3
    return programs * steps * 32 * 128 / t


def case(tab, rows: int, tokens: int, compare: bool, every: bool | None = None, differ: bool = False, **kw):
    """rows x tokens through all layers; each row starts from a cached state and writes the state
    after every token (``every``; by default decode rows, as the system's speculative rows) or after
    its last (prefill rows, and the oracle's rows); pages as the engine's slots.

    In oracle mode (``compare``) the system's rows run first, then the oracle's rows are timed: they
    write their end states to pages of their own, so every repetition starts from the same states
    and everything agrees, as in a checked run without failures (checked after the timing). With
    ``differ`` they write back over their starting pages, as before session 29: from the second
    repetition on every output and state differs (the cost of a run where everything fails)."""
    every = tokens <= 4 if every is None else every
    L, K, dim = tab.layers, tab.K, tab.dim
    groups = 6
    slots = L // groups
    pages = 2 * rows * groups + 1
    conv = torch.randint(0, Q, (slots, pages, K - 1 + 3, dim), device="cuda", dtype=torch.float32)
    temporal = torch.randint(0, Q, (slots, pages, tab.H, tab.P, tab.N), device="cuda", dtype=torch.float32)
    slot = torch.tensor([layer // groups for layer in range(L)], device="cuda")
    toks = [torch.randint(0, 10 ** 6, (tokens,)).tolist() for _ in range(rows)]

    def builder(oracle: bool) -> ScanBuilder:
        b = ScanBuilder(L)
        for r in range(rows):
            pg = [1 + r * groups + layer % groups for layer in range(L)]
            out = [p + rows * groups for p in pg] if oracle and not differ else pg
            i = b.add_row(toks[r], pg, y_from=0, y_count=tokens)
            for t in (range(tokens) if every else [tokens - 1]):
                b.write(i, t, out, out)
            if oracle:
                b.compare(i, tokens - 1, pg, pg, 0, r)
        return b
    window = torch.randint(0, Q, (rows, L, K - 1, dim), device="cuda", dtype=torch.float32)
    y = torch.empty(rows * tokens, L, tab.H * tab.P, dtype=torch.int32, device="cuda")
    starts = torch.arange(rows, device="cuda") * tokens
    opts, kw = kw, dict(y_out=y)
    b = builder(False)
    if compare:  # as the oracle runs: the system's outputs and states are there
        state = (conv.clone(), temporal.to(OWN_DTYPE["product"], copy=True))  # the oracle's own copy of the starting states
        ref, _ = b.build(window, conv, temporal, slot, "cuda", y_start=starts, y_out=y)
        scan_triton(tab, ref, **opts)  # the system under test writes its states and outputs
        kw = dict(cmp=(conv, temporal, slot), y_ref=y)
        conv, temporal = state
        b = builder(True)
    ln, _ = b.build(window, conv, temporal, slot, "cuda", y_start=starts, **kw)
    scan_triton(tab, ln, **opts)  # compile
    t = triton.testing.do_bench(lambda: scan_triton(tab, ln, **opts), warmup=20, rep=200, return_mode="median") * 1e-3
    if compare:
        bad = int(ln.stats[..., 0].sum())
        assert (bad > 0) == differ, f"oracle mode: {bad} mismatching elements (expected {'some' if differ else 'none'})"
    elem = rows * tokens * L * tab.H * tab.P * tab.N
    page = tab.H * tab.P * tab.N * 4
    own = tab.H * tab.P * tab.N * temporal.element_size()  # (the pages the launch starts from and writes)
    writes = rows * (tokens if every else 1)
    read = rows * L * (own + (page if compare else 0))
    written = writes * L * own + rows * tokens * L * tab.H * tab.P * 4
    return t, elem, read, written


def int8_rate(n: int = 8192) -> float:
    """int8 tensor-core multiply-accumulates per second (an n x n x n product, int32 sums): the
    chunked scan's matrix products run on them."""
    a = torch.randint(-64, 64, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-64, 64, (n, n), dtype=torch.int8, device="cuda").t().contiguous().t()
    t = triton.testing.do_bench(lambda: torch._int_mm(a, b), return_mode="median") * 1e-3
    return n ** 3 / t


def chunked_macs(tab, rows: int, tokens: int, bt: int) -> int:
    """int8 multiply-accumulates of the chunked kernel (``probe_scan_chunked``): per chunk and
    (row, layer, head), C h0^T, C B^T, (C B^T) W and W^T B, each as four digit products."""
    P, N = tab.P, tab.N
    chunks = rows * -(-tokens // bt)
    return chunks * tab.layers * tab.H * 4 * (bt * N * P + bt * bt * N + bt * bt * P + P * bt * N)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default="", help="|-separated parts of case names: only those cases")
    ap.add_argument("--own-states", choices=["product", "float32"], default="product",
                    help="the oracle's own states in oracle mode: as the product keeps them (int16), or float32")
    a = ap.parse_args()
    if a.own_states == "float32":
        OWN_DTYPE["product"] = torch.float32
    geo = build_preset("nemotron-h-8b").mamba
    tab = stack_tables([MambaProbe(geo, layer, 1) for layer in range(geo.layers)], "cuda")
    ceil, rates, mma = ceiling_rate(), measure(torch.device("cuda"), nbytes=2 ** 31), int8_rate()
    dev = torch.cuda.get_device_name()
    print(f"{dev}, {date.today()}: update ceiling {ceil / 1e12:.2f} T element-updates/s; int8 products "
          f"{mma / 1e12:.0f} T MAC/s; {rates.line()}")
    rows = []
    cases = [("decode 128 rows x 4 tokens", 128, 4, False, {}), ("decode, oracle mode", 128, 4, True, {})]
    # the oracle's short rows write one state (at their end): token by token or one chunk each
    for n in (1, 4):
        cases += [(f"decode 128 x {n}, oracle rows, token by token", 128, n, True, dict(every=False, chunked=False)),
                  (f"decode 128 x {n}, oracle rows, chunked", 128, n, True, dict(every=False, chunk_min=1)),
                  (f"decode 128 x {n}, oracle rows, token by token, every element differs", 128, n, True,
                   dict(every=False, chunked=False, differ=True))]
    cases += [("decode 128 x 4, chunked (a chunk a token)", 128, 4, False, dict(chunk_min=1))]
    for bp, warps in ((16, 4), (32, 8), (64, 8)):  # token by token: tile sweep (default 32 x 4 warps above)
        kw = dict(block_p=bp, num_warps=warps)
        cases += [(f"decode 128 x 4, {bp}-row tiles, {warps} warps", 128, 4, False, kw),
                  (f"decode 128 x 1, oracle rows, {bp}-row tiles, {warps} warps", 128, 1, True,
                   dict(every=False, **kw)),
                  (f"decode 128 x 4, oracle rows, {bp}-row tiles, {warps} warps", 128, 4, True,
                   dict(every=False, **kw))]
    for bt, warps, regs in ((32, 8, 128), (32, 8, None), (64, 4, None)):  # chunked (tensor cores): tile sweep
        kw = dict(chunk_tokens=bt, chunk_warps=warps, chunk_maxnreg=regs)
        tile = f"chunks of {bt}, {warps} warps, " + (f"{regs} registers" if regs else "registers unbounded")
        cases += [(f"prefill 4 x 1024, {tile}", 4, 1024, False, kw),
                  (f"prefill 4 x 1024, oracle mode, {tile}", 4, 1024, True, kw)]
    cases += [("prefill 4 x 1024, oracle mode, chunks of 32, every element differs", 4, 1024, True, dict(differ=True))]
    cases += [("prefill 4 x 1024, token by token", 4, 1024, False, dict(chunked=False)),
              ("prefill 4 x 1024, oracle mode, token by token", 4, 1024, True, dict(chunked=False))]
    if a.only:
        cases = [c for c in cases if any(part in c[0] for part in a.only.split("|"))]
    for name, r, n, cmp, kw in cases:
        t, elem, read, written = case(tab, r, n, cmp, **kw)
        bw_floor = rates.floor(read, written).seconds
        if n >= kw.get("chunk_min", CHUNK_MIN_TOKENS) and kw.get("chunked", True):  # the chunked kernel: products on tensor cores
            # (its element-wise work on the CUDA cores has no measured floor of its own: the floor
            # here is a lower bound, not the kernel's whole cost)
            work_floor, work = chunked_macs(tab, r, n, kw.get("chunk_tokens", CHUNK_TOKENS)) / mma, "int8 MACs"
        else:  # token by token: every state element updated on the CUDA cores, token after token
            work_floor, work = elem / ceil, "updates"
        floor, bound = (work_floor, work) if work_floor > bw_floor else (bw_floor, "bandwidth")
        pct = 100 * floor / t
        rows.append({"case": name, "ms": t * 1e3, "int8_MAC_s": mma, "Tupd_s": elem / t / 1e12, "pct_update_ceiling": 100 * elem / t / ceil,
                     "read_bytes": read, "written_bytes": written, "GBps": (read + written) / t / 1e9,
                     "floor_ms": floor * 1e3, "bound": bound, "pct_floor": pct, "above_floor": pct > 100})
        print(f"  {name:30s} {t * 1e3:8.2f} ms  {elem / t / 1e12:6.2f} T upd/s  {(read + written) / t / 1e9:7.1f} GB/s"
              f"  floor {floor * 1e3:7.2f} ms ({bound}): {pct:5.1f}%" + ("  ABOVE FLOOR (floor wrong)" if pct > 100 else ""))
    if a.out:
        a.out.write_text(json.dumps({"device": dev, "date": str(date.today()), "update_ceiling": ceil,
                                     **rates.as_dict(), "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
