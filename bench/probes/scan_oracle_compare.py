"""What the Mamba oracle's comparisons inside the probe scans cost (history/2026-11-28_session38.md): each
variant is a copy of a scan kernel's source with its output or state comparison changed, patched in for
``bench_scan``'s oracle-mode cases (a GPU):

    python3 bench/probes/scan_oracle_compare.py                  # every variant
    python3 bench/probes/scan_oracle_compare.py --chunked current,store --token ""

Chunked kernel (``probe_scan_chunked``, prefill 4 x 1,024 in oracle mode):
  current  the product's kernel
  none     no output comparison: the outputs are then dead code, so their products go too (a bound on
           nothing but that)
  any      the system's outputs loaded and OR-ed as y_ref ^ y into one tile (no count, worst or first)
  early    the system's outputs loaded at the top of the chunk, before its products
  next     the next chunk's loaded at the top of this one, carried across the loop
  store    the oracle's outputs stored (as the system's kernel does) instead of loaded and compared
  red      the oracle's outputs subtracted from the system's in place by atomics
Token-by-token kernel (``probe_scan_triton``, the oracle's decode rows):
  current  the product's kernel
  prefetch the first compared state's page tile loaded at the start, beside the oracle's own state

The patches anchor on the kernels' source text and stop with an AssertionError when it has changed.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))

import hybridsim.kernels.probe_scan_chunked as pc  # noqa: E402
import hybridsim.kernels.probe_scan_triton as pt  # noqa: E402
from patched import load_source, module_source, patched  # noqa: E402


def _between(src: str, a: str, b: str) -> str:
    return src[src.index(a):src.index(b)]


def chunked_variants() -> dict:
    src = module_source(pc)
    compare = _between(src, "        if COMPARE:\n            inr = jm", "        h = (A_end * h")
    fold = _between(src, "    if COMPARE:\n        cnt = tl.sum", "def token_parts")
    load = """            inr = jm & (j >= yf) & (j < yf + yc)
            yo_ref = ((ys + j - yf).to(tl.int64)[:, None] * L64 + lay) * HP + xc[None, :]
            yr = tl.load(y_ref + yo_ref, mask=inr[:, None], other=0)
            bad"""
    top = "        j = t0 + ar\n        jm = j < t1\n        lo, hi = _token_parts(parts, start, j, jm)\n"
    loop = "    t0 = 0\n    while t0 < n:\n"
    assert load in src and top in src and loop in src, "probe_scan_chunked changed: update the patches"
    ref_at = "(ys + {j} - yf).to(tl.int64)[:, None] * L64 + lay) * HP + xc[None, :]"
    head = ("        if COMPARE:\n            inr = jm & (j >= yf) & (j < yf + yc)\n"
            "            yo_ref = (" + ref_at.format(j="j") + "\n")
    out = {
        "none": src.replace(compare, "").replace(fold, "\n\n"),
        "any": src.replace(compare, head + "            yr = tl.load(y_ref + yo_ref, mask=inr[:, None], other=0)\n"
                           "            ybad = ybad | tl.where(inr[:, None], yr ^ y, 0)\n").replace(fold, """    if COMPARE:
        cnt = tl.max(tl.max(ybad, axis=1), axis=0) != 0
        _fold(stats + ((n_cmp + b) * L64 + lay) * 3, cnt, cnt.to(tl.int64), cnt.to(tl.int64), cnt.to(tl.int64))


"""),
        "early": src.replace(load, "            bad").replace(top, top + """        if COMPARE:
            inr = jm & (j >= yf) & (j < yf + yc)
            yr = tl.load(y_ref + (""" + ref_at.format(j="j") + """, mask=inr[:, None], other=0)
"""),
        "next": src.replace(load, "            inr = jm & (j >= yf) & (j < yf + yc)\n            bad").replace(
            loop, """    t0 = 0
    yr_n = tl.zeros([BT, P], dtype=tl.int32)
    if COMPARE:
        yr_n = tl.load(y_ref + (""" + ref_at.format(j="ar") + """,
                       mask=((ar < n) & (ar >= yf) & (ar < yf + yc))[:, None], other=0)
    while t0 < n:
""").replace(top, top + """        yr = yr_n
        if COMPARE:
            jn = t1 + ar
            yr_n = tl.load(y_ref + (""" + ref_at.format(j="jn") + """,
                           mask=((jn < n) & (jn >= yf) & (jn < yf + yc))[:, None], other=0)
"""),
        "store": src.replace(compare, head + "            tl.store(y_ref + yo_ref, y, mask=inr[:, None])\n").replace(
            fold, "\n\n"),
        "red": src.replace(compare, head + "            tl.atomic_add(y_ref + yo_ref, -y, mask=inr[:, None], "
                           "sem='relaxed')\n").replace(fold, "\n\n"),
    }
    return {name: load_source(f"scan_oracle_compare_{name}", s)._chunked_scan_kernel for name, s in out.items()}


def token_variants() -> dict:
    start = "                                                      WRITE_Y, COMPARE)\n    for j in range(0, n):"
    state = """                if tp >= 0:
                    _cmp_state(cmp_temporal + cslot * ct_ss + tp * ct_sp, h, tile, tm, st, KM1 * DIM)
"""
    prefetch = patched(pt, "scan_oracle_compare_prefetch", [
        (start, """                                                      WRITE_Y, COMPARE)
    ci0 = ci
    pre = tl.zeros([BP, BN], dtype=tl.float32)
    if COMPARE:
        cs0 = tl.load(cmp_slot + lay).to(tl.int64)
        tp0 = tl.load(cmp_tpage + ci * L64 + lay, mask=ct >= 0, other=-1).to(tl.int64)
        pre = tl.load(cmp_temporal + cs0 * ct_ss + tl.maximum(tp0, 0) * ct_sp + tile, mask=tm & (tp0 >= 0), other=0.0)
    for j in range(0, n):"""),
        (state, """                if tp >= 0:
                    if ci == ci0:
                        _cmp_state_values(pre, h, tile, tm, st, KM1 * DIM)
                    else:
                        _cmp_state(cmp_temporal + cslot * ct_ss + tp * ct_sp, h, tile, tm, st, KM1 * DIM)
""")])
    return {"prefetch": prefetch._probe_scan_kernel}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunked", default="current,none,any,early,next,store,red")
    ap.add_argument("--token", default="current,prefetch")
    a = ap.parse_args()
    chunked = [v for v in a.chunked.split(",") if v]
    token = [v for v in a.token.split(",") if v]
    cv, tv = chunked_variants(), token_variants()
    bench = runpy.run_path(os.path.join(ROOT, "bench", "bench_scan.py"))
    for names, only, mod, attr, table in (
            (chunked, "prefill 4 x 1024, chunks of 32, 8 warps, 128|prefill 4 x 1024, oracle mode, chunks of 32",
             pc, "_chunked_scan_kernel", cv),
            (token, "oracle rows, token by token", pt, "_probe_scan_kernel", tv)):
        orig = getattr(mod, attr)
        for name in names:
            setattr(mod, attr, orig if name == "current" else table[name])
            print(f"== {attr}: {name}", flush=True)
            sys.argv = ["bench_scan.py", "--only", only]
            try:
                bench["main"]()
            finally:
                setattr(mod, attr, orig)


if __name__ == "__main__":
    main()
