"""The MLA probe's latent cache entries [kv_c | k_pe] of many tokens, every layer, in one launch.

Why: the oracle's absorbed rows (decodes) attend over every committed token's latent entry, made
again each step from the token ids (``MLAStack.latents_at``). In torch that is two row gathers, an
add, and a rope of several element-wise steps over the whole batch: 7.4 ms a step of
``deepseek_v3_mooncake`` on an H200 (synced, session 33), where writing the entries takes well under
one. Here each entry is written once: its two table rows summed, kv_c scaled, k_pe rotated with the
integer cos/sin tables and scaled, the same arithmetic (integer sums and products below 2**24, powers
of two: exact in float32 and float64), so the same values bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dense_attention_f64 import _rope


@triton.jit
def table_rows(tok, i, im, layer, T1: tl.constexpr, T2: tl.constexpr, W: tl.constexpr):
    """Where tokens i's two rows start in per-layer tables of width W (``MLAStack``'s key1 and key2:
    rows tok % T1 and (tok // T1) % T2 of layer ``layer``, an int64)."""
    t = tl.load(tok + i, mask=im, other=0).to(tl.int64)
    return (layer * T1 + t % T1) * W, (layer * T2 + (t // T1) % T2) * W


@triton.jit
def rows_sum(key1, key2, row1, row2, c: tl.constexpr, d, m):
    """The two table rows' columns c + d summed (integers: exact)."""
    return (tl.load(key1 + row1[:, None] + c + d[None, :], mask=m, other=0.0)
            + tl.load(key2 + row2[:, None] + c + d[None, :], mask=m, other=0.0))


@triton.jit
def rotated_rope(key1, key2, row1, row2, pos_at, im, cc, ss, LR: tl.constexpr, R: tl.constexpr, RH: tl.constexpr):
    """k_pe of the rows (their last R columns) rotated at the positions ``pos_at`` points to with the integer
    tables: its two halves (BT, RH), columns past R // 2 zero, and the mask of the real ones."""
    dr = tl.arange(0, RH)
    m = im[:, None] & (dr < R // 2)[None, :]
    lo = rows_sum(key1, key2, row1, row2, LR, dr, m)
    hi = rows_sum(key1, key2, row1, row2, LR + R // 2, dr, m)
    r_lo, r_hi = _rope(lo, hi, tl.load(pos_at, mask=im, other=0), im, cc, ss, R, RH)
    return r_lo, r_hi, m


@triton.jit(do_not_specialize=["n_tok", "P"])
def _latent_rows_kernel(tok, pos, key1, key2, cc, ss, out, n_tok, P, LR: tl.constexpr, R: tl.constexpr,
                        T1: tl.constexpr, T2: tl.constexpr, KV_SCALE: tl.constexpr, ROPE_SCALE: tl.constexpr,
                        BT: tl.constexpr, BL: tl.constexpr, RH: tl.constexpr):
    """Tokens program_id(0) * BT.. of layer program_id(1): token i at position pos[i % P]."""
    i = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    im = i < n_tok
    row1, row2 = table_rows(tok, i, im, layer, T1, T2, LR + R)
    o = out + (layer * n_tok + i)[:, None] * (LR + R)
    for c0 in tl.static_range(0, LR, BL):
        d = c0 + tl.arange(0, BL)
        m = im[:, None] & (d < LR)[None, :]
        tl.store(o + d[None, :], (rows_sum(key1, key2, row1, row2, 0, d, m) * KV_SCALE).to(out.dtype.element_ty), mask=m)
    r_lo, r_hi, m = rotated_rope(key1, key2, row1, row2, pos + i % P, im, cc, ss, LR, R, RH)
    dr = tl.arange(0, RH)
    tl.store(o + LR + dr[None, :], (r_lo * ROPE_SCALE).to(out.dtype.element_ty), mask=m)
    tl.store(o + LR + R // 2 + dr[None, :], (r_hi * ROPE_SCALE).to(out.dtype.element_ty), mask=m)


def latent_rows(key1: torch.Tensor, key2: torch.Tensor, rope: int, tok: torch.Tensor, pos: torch.Tensor, n_pos: int,
                kv_shift: int, rope_shift: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Every layer's entries of tokens ``tok`` (any shape) at positions ``pos`` (1-D, P of them: token i of
    the flattened tok at pos[i % P], so (b, n) tokens take pos = arange(n)), each below n_pos: (layers,
    *tok.shape, kv_lora + rope) in ``dtype`` (float64 or float32), from the per-token latent tables key1,
    key2 (layers, table rows, kv_lora + rope) (``MLAStack``'s: integers, their last ``rope`` columns
    k_pe's): kv_c times 2**-kv_shift, k_pe rotated (integer tables, times 1024) times 2**-rope_shift, the
    values ``MLAStack.latents_at`` gives. A GPU, or the interpreter."""
    from ..layers.exact import rotation_tables
    L, T1, width = key1.shape
    assert key1.dtype == key2.dtype and dtype in (torch.float32, torch.float64) and pos.dim() == 1
    n = tok.numel()
    out = torch.empty((L, *tok.shape, width), dtype=dtype, device=tok.device)
    if n == 0:
        return out
    assert n % pos.numel() == 0, "latent_rows: positions must repeat along the tokens' last axes"
    cc, ss = rotation_tables(rope, n_pos, tok.device, key1.dtype)
    BT = 16
    _latent_rows_kernel[(triton.cdiv(n, BT), L)](
        tok.reshape(-1), pos, key1, key2, cc, ss, out, n, pos.numel(), LR=width - rope, R=rope, T1=T1,
        T2=key2.shape[1], KV_SCALE=2.0 ** -kv_shift, ROPE_SCALE=2.0 ** -rope_shift, BT=BT,
        BL=min(triton.next_power_of_2(width - rope), 128), RH=triton.next_power_of_2(rope // 2), num_warps=4)
    return out
