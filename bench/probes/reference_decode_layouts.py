"""Where the reference MLA decode's time goes (``ReferenceKernels.mla_decode``, the float32 path that
``kernel.mla_decode`` re-runs for every decode row): its two products alone in each operand layout torch can
hand cuBLAS, and whole variants of the reference (the products' layouts; fewer passes over the scores), each
timed and measured against float64, at deepseek_v3_mooncake-like decode shapes; and its other steps alone
(the keys' gather, the softmax's reductions). Needs a CUDA device.

    python3 bench/probes/reference_decode_layouts.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402

from hybridsim.kernels.reference import ReferenceKernels  # noqa: E402
from reference_decode_precision import inputs  # noqa: E402  (the same rows)

K = ReferenceKernels()
NEG_INF = float("-inf")


def ten_pass_softmax_lse(s: torch.Tensor):
    """``reference._softmax_lse`` as it was before session 35 (subtract, exp, sum, divide in place), the
    baseline its "lse" variants measure."""
    m = s.amax(-1, keepdim=True)
    finite = torch.isfinite(m)
    s.sub_(torch.where(finite, m, 0.0)).exp_()
    total = s.sum(-1, keepdim=True)
    lse = torch.where(finite, m + torch.log(total), m).squeeze(-1)
    return s.div_(torch.where(finite, total, 1.0)).masked_fill_(~finite, 0.0), lse


def variant(q_lat, q_pe, cache, table, lens, n, scale, layout: str, passes: str):
    """The reference's splits == 1 path with the products in ``layout`` ("einsum": as it is; "nn": the
    keys transposed into their own copy, so both products take plain row-major operands) and the
    softmax in ``passes`` ("lse": ``_softmax_lse`` before session 35, ``ten_pass_softmax_lse``; "fused":
    torch.softmax and torch.logsumexp, rows without a finite lse zeroed in the output) and the padding
    either zeroed ("zero") or the keys' positions clamped to the row's last key (in ``passes`` after a '+')."""
    passes, _, pad = passes.partition("+")
    dev = q_lat.device
    B, nq, H, L = q_lat.shape
    bs = cache.shape[1]
    kpos = torch.arange(n, device=dev)
    if pad == "clamp":
        at = torch.minimum(kpos[None, :], (lens - 1).clamp_min(0)[:, None])  # (B, n)
        lat = cache[table.gather(1, at // bs), at % bs]
    else:
        lat = cache[table[:, kpos // bs], kpos % bs]
    q = torch.cat([q_lat, q_pe], dim=-1).view(B, nq * H, -1)
    if layout == "nn":
        lat_t = torch.empty(B, lat.shape[2], n, device=dev)
        lat_t.copy_(lat.transpose(1, 2))
        if pad != "clamp":
            lat_t.masked_fill_((kpos[None, :] >= lens[:, None])[:, None, :], 0.0)
        s = torch.bmm(q, lat_t).mul_(scale)
        kv = lat_t[:, :L].transpose(1, 2)
    else:
        lat = lat.float()
        if pad != "clamp":
            lat.masked_fill_((kpos[None, :] >= lens[:, None])[..., None], 0.0)
        s = torch.einsum("bqd,bmd->bqm", q, lat) * scale
        kv = lat[..., :L]
    s = s.view(B, nq, H, n)
    qpos = lens[:, None] - nq + torch.arange(nq, device=dev)[None, :]
    visible = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lens[:, None, None])
    s.masked_fill_(~visible[:, :, None, :], NEG_INF)
    if passes == "fused":
        lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1)
        del s
        o = torch.bmm(p.view(B, nq * H, n), kv).view(B, nq, H, L)
        o.masked_fill_(~torch.isfinite(lse)[..., None], 0.0)
    else:
        p, lse = ten_pass_softmax_lse(s)
        o = torch.bmm(p.view(B, nq * H, n), kv).view(B, nq, H, L)
    return o, lse


def main() -> None:
    scale = 0.07
    shapes = [(32, 500, 5000), (24, 1000, 12000), (64, 200, 3000), (42, 2500, 3500)]
    for B, lo, hi in shapes:
        q_lat, q_pe, cache, table, lens, n = inputs(B, lo, hi)
        M = 2 * 128
        # the two products alone, each layout
        q = torch.randn(B, M, 576, device="cuda")
        lat = torch.randn(B, n, 576, device="cuda")
        lat_t = lat.transpose(1, 2).contiguous()
        p = torch.rand(B, M, n, device="cuda")
        kv = lat[..., :512]
        kv_t = lat_t[:, :512]
        gemm = {
            "scores q.lat^T (as now)": lambda: torch.bmm(q, lat.transpose(1, 2)),
            "scores q.lat_t (keys transposed, own copy)": lambda: torch.bmm(q, lat_t),
            "scores (lat.q^T)^T": lambda: torch.bmm(lat, q.transpose(1, 2)),
            "values p.kv (strided rows, as now)": lambda: torch.bmm(p, kv),
            "values p.kv contiguous": lambda: torch.bmm(p, kv.contiguous()),
            "values p.kv_t^T": lambda: torch.bmm(p, kv_t.transpose(1, 2)),
            "transposed copy of the keys": lambda: lat.transpose(1, 2).contiguous(),
        }
        at = torch.minimum(torch.arange(n, device="cuda")[None, :], (lens - 1)[:, None])
        pages = table.gather(1, at // 64)
        rows = (pages * 64 + at % 64).flatten()
        s = torch.randn(B, 2, 128, n, device="cuda")
        other = {
            "gather by (page, offset)": lambda: cache[pages, at % 64],
            "gather by row (index_select)": lambda: cache.view(-1, 576).index_select(0, rows),
            "the gathered keys to float32": lambda: cache[pages, at % 64].float(),
            "logsumexp": lambda: torch.logsumexp(s, -1),
            "softmax": lambda: torch.softmax(s, -1),
            "amax": lambda: s.amax(-1),
        }
        flop = 2 * B * M * n * 576
        print(f"B={B} lengths {lo}-{hi} (longest {n}): products alone")
        for name, fn in gemm.items():
            t = triton.testing.do_bench(fn, warmup=3, rep=30)
            f = flop if name.startswith("scores") else 2 * B * M * n * 512
            print(f"  {name}: {t:.3f} ms" + ("" if name.startswith("transposed") else f", {f / t / 1e9:.1f} TFLOP/s"),
                  flush=True)
        for name, fn in other.items():
            print(f"  {name}: {triton.testing.do_bench(fn, warmup=3, rep=30):.3f} ms", flush=True)
        del q, lat, lat_t, p, kv, kv_t, s
        exact = K.mla_decode(q_lat.double(), q_pe.double(), cache, table, lens, 512, scale, max_seq_len=n)

        def rel(got):
            return (float((got[0].double() - exact[0]).abs().amax() / exact[0].abs().amax()),
                    float((got[1].double() - exact[1]).abs().amax() / exact[1].abs().amax()))

        runs = {"reference as it is": lambda: K.mla_decode(q_lat, q_pe, cache, table, lens, 512, scale, max_seq_len=n)}
        for layout in ("einsum", "nn"):
            for passes in ("lse+zero", "fused+zero", "fused+clamp"):
                runs[f"{layout}, {passes}"] = (lambda la=layout, pa=passes:
                                               variant(q_lat, q_pe, cache, table, lens, n, scale, la, pa))
        print(f"B={B}: whole reference")
        for name, fn in runs.items():
            t = triton.testing.do_bench(fn, warmup=3, rep=30)
            e_o, e_l = rel(fn())
            print(f"  {name}: {t:.3f} ms; from float64: o {e_o:.1e}, lse {e_l:.1e}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
