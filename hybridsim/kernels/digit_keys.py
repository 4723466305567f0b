"""The keys of the MLA oracle's expanded rows, made from token ids straight into the form the digit
kernel reads (``digit_attention_f64``): per layer, k_pe's balanced base-256 digits shared by every
head, and per head k_nope's digits and the values as int32 integers.

Why: made with torch, each long prefill chunk's keys took four passes over memory a layer: the
latents in float32 (a gather and a rope of several element-wise steps), k_nope and the values as two
int32 products summed (``torch._int_mm`` twice, then an add), and a split into digits, the int32
intermediates four bytes an element each time. On an H200 those took 22 ms a step of
``deepseek_v3_mooncake`` (synced, session 32); the int8 products themselves are about a millisecond
at the card's int8 rate. Here two launches do it: ``key_parts`` gathers each key's latent integers
from the probe's per-token tables and writes kv_c as two int8 parts (low 6 bits and the rest) and
k_pe's digits; ``expand_digits`` multiplies the parts by the int8 weights on the tensor cores and
writes k_nope's digits and the values, never an intermediate.

Exactness: kv_c's integers are at most 2**12 (so 64 J + low with J in [-64, 64], low in [0, 64): both
int8), the weights' integers (W_UK, W_UV over their power of two) in [-4, 4]; a sum of kv_lora_rank
<= 1024 products is below 2**21 and 64 times the high part's plus the low part's below 2**24: int32
holds every partial sum exactly, so the integers are the float products' (``MLAStack.expanded_nope``)
exactly. k_pe's rope is the tables' (``_rope``, as the queries' digits take it): integer products
below 2**24, exact in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .digit_attention_f64 import K_DIGITS, V_DIGITS, _next_digit, split_digits_reference, value_digits_reference
from .probe_latents import rotated_rope, rows_sum, table_rows

_DIGITS = tl.constexpr(K_DIGITS)  # (what a kernel may read of a module's globals)
# (keys a program takes, columns at most, kv_lora columns a product step at most, warps, stages)
EXPAND_TILE = (128, 128, 128, 8, 2)


@triton.jit(do_not_specialize=["n_tok", "layer"])  # (layer 1 would be a constant; a step's count varies)
def _key_parts_kernel(tok, pos, key1, key2, cc, ss, parts, kr, n_tok, layer, LR: tl.constexpr, R: tl.constexpr,
                      T1: tl.constexpr, T2: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr):
    """Keys program_id(0) * BT..: their latent integers from two table rows each; kv_c as its two int8
    parts (parts[0] low, parts[1] high), k_pe rotated and split into digits."""
    i = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    im = i < n_tok
    row1, row2 = table_rows(tok, i, im, layer.to(tl.int64), T1, T2, LR + R)
    half = n_tok.to(tl.int64) * LR
    for c0 in tl.static_range(0, LR, BL):
        d = c0 + tl.arange(0, BL)
        kv = rows_sum(key1, key2, row1, row2, 0, d, im[:, None]).to(tl.int32)
        at = parts + i[:, None] * LR + d[None, :]
        tl.store(at, (kv & 63).to(tl.int8), mask=im[:, None])
        tl.store(at + half, (kv >> 6).to(tl.int8), mask=im[:, None])
    dr = tl.arange(0, R // 2)
    r_lo, r_hi, _ = rotated_rope(key1, key2, row1, row2, pos + i, im, cc, ss, LR, R, R // 2)
    r_lo = r_lo.to(tl.int32)
    r_hi = r_hi.to(tl.int32)
    out = kr + i[:, None] * (_DIGITS * R)
    for c in tl.static_range(_DIGITS):
        d_lo, r_lo = _next_digit(r_lo)
        d_hi, r_hi = _next_digit(r_hi)
        tl.store(out + c * R + dr[None, :], d_lo.to(tl.int8), mask=im[:, None])
        tl.store(out + c * R + R // 2 + dr[None, :], d_hi.to(tl.int8), mask=im[:, None])


def key_parts(key1: torch.Tensor, key2: torch.Tensor, rope: int, tok: torch.Tensor, pos: torch.Tensor, n_pos: int,
              layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys of tokens ``tok`` at positions ``pos`` (below n_pos) from the MLA probe's per-token
    latent tables (``MLAStack.key_tables``: key1, key2 (layers, table rows, kv_lora + rope) float32, each
    entry an integer, the last ``rope`` columns k_pe's): kv_c's integers as (2, keys, kv_lora) int8 parts,
    low 6 bits and the rest (kv_c = 64 parts[1] + parts[0]), and k_pe's digits (keys, 3 * rope) int8 over
    ``MLAStack.rope_unit``, the digits splitting ``MLAStack.latents_at`` gives. A GPU, or the interpreter;
    kv_lora a multiple of 32 (``expand_widths_fit``), rope a power of two."""
    from ..layers.exact import rotation_tables
    _, T1, width = key1.shape
    R, LR = rope, width - rope
    assert expand_widths_fit(LR) and R & (R - 1) == 0
    n = tok.shape[0]
    parts = torch.empty((2, n, LR), dtype=torch.int8, device=tok.device)
    kr = torch.empty((n, K_DIGITS * R), dtype=torch.int8, device=tok.device)
    if n == 0:
        return parts, kr
    cc, ss = rotation_tables(R, n_pos, tok.device, torch.float32)
    BT = 16  # (32 keys x 128 columns of two tables spill)
    _key_parts_kernel[(triton.cdiv(n, BT),)](tok, pos, key1, key2, cc, ss, parts, kr, n, layer, LR=LR, R=R, T1=T1,
                                            T2=key2.shape[1], BT=BT, BL=_steps(LR, 128), num_warps=4)
    return parts, kr


def key_parts_reference(key1: torch.Tensor, key2: torch.Tensor, rope: int, tok: torch.Tensor, pos: torch.Tensor,
                        n_pos: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_parts`` in torch: the same tables, the same integers."""
    from ..layers.exact import rope_exact
    T1, T2 = key1.shape[1], key2.shape[1]
    t = tok.long()
    lat = key1[layer, t % T1].double() + key2[layer, (t // T1) % T2].double()
    LR = lat.shape[-1] - rope
    kv = lat[:, :LR].to(torch.int32)
    parts = torch.stack([kv & 63, kv >> 6]).to(torch.int8)
    return parts, split_digits_reference(rope_exact(lat[:, LR:], pos, n_pos), 1.0, K_DIGITS)


# what _expand_digits_kernel stores: the integers (keys, heads, D) int32; their digits (keys, heads, 3 D) int8;
# their digits with the keys last (heads, 3 D, keys) int8 (the values' products take them so)
INTEGERS, DIGITS, DIGITS_KEYS_LAST = 0, 1, 2
_STORE_DIGITS, _STORE_KEYS_LAST = tl.constexpr(DIGITS), tl.constexpr(DIGITS_KEYS_LAST)  # (what a kernel may read)


@triton.jit(do_not_specialize=["h0"])
def _expand_digits_kernel(parts, w, out, h0, LR: tl.constexpr, D: tl.constexpr, STORE: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Columns program_id(0) of the group's heads (cdiv(D, BN) tiles a head) for keys program_id(1) * BM..:
    kv_c's integers times the weights' rows on the int8 tensor cores, the high parts first, then 64 times
    their sum, then the low parts (one int32 accumulator: below 2**24); stored as STORE says (one of
    INTEGERS, DIGITS, DIGITS_KEYS_LAST: k_nope's are DIGITS, the values' the others). parts (2, keys, LR),
    w (heads, D, LR) and out are tensor descriptors: the copy engine moves the tiles and fills what lies
    past the keys or a head's D columns with zeros, and clips the stores there (gathering loads' 64-bit
    addresses took every register and spilled)."""
    per_head = tl.cdiv(D, BN)
    c = tl.program_id(0)
    h = c // per_head
    c0 = (c % per_head) * BN
    r0 = tl.program_id(1) * BM
    acc = tl.zeros([BM, BN], tl.int32)
    for k0 in range(0, LR, BK):
        a = parts.load([1, r0, k0]).reshape(BM, BK)
        acc = tl.dot(a, tl.trans(w.load([h0 + h, c0, k0]).reshape(BN, BK)), acc, out_dtype=tl.int32)
    acc = acc * 64
    for k0 in range(0, LR, BK):
        a = parts.load([0, r0, k0]).reshape(BM, BK)
        acc = tl.dot(a, tl.trans(w.load([h0 + h, c0, k0]).reshape(BN, BK)), acc, out_dtype=tl.int32)
    if STORE == _STORE_DIGITS:
        for d in tl.static_range(_DIGITS):
            dig, acc = _next_digit(acc)
            out.store([r0, h, d * D + c0], dig.to(tl.int8).reshape(BM, 1, BN))
    elif STORE == _STORE_KEYS_LAST:
        for d in tl.static_range(_DIGITS):
            dig, acc = _next_digit(acc)
            out.store([h, d * D + c0, r0], tl.trans(dig.to(tl.int8)).reshape(1, BN, BM))
    else:
        out.store([r0, h, c0], acc.reshape(BM, 1, BN))


def expand_widths_fit(kv_lora_rank: int) -> bool:
    """Whether ``expand_digits`` takes this rank: its int8 products step 32 columns of it or more at a time."""
    return kv_lora_rank % 32 == 0


def _steps(width: int, most: int) -> int:
    """The largest power of two up to ``most`` (at least 32) that divides ``width``."""
    step = most
    while width % step:
        step //= 2
    return step


def expand_digits(parts: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, heads: slice = slice(None),
                  value_digits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For keys whose kv_c integers are ``parts`` (``key_parts``) and the heads ``heads`` of the weights'
    integers w_k (heads, nope, kv_lora) and w_v (heads, v, kv_lora) int8 (``MLAStack.expansion_weights``):
    k_nope's digits (keys, heads, 3 nope) int8, as ``digit_attention`` reads them, and the values (keys,
    heads, v) int32, integers of ``MLAStack.nope_key_unit`` and ``value_unit`` (``value_digits``: their
    digits (heads, 3 v, keys rounded up to 16) int8, ``value_digits_reference``'s layout; the caller has
    proved they fit, ``value_digits_fit``). Two launches (a GPU, or the interpreter)."""
    _, n, LR = parts.shape
    H, N, _ = w_k.shape
    V = w_v.shape[1]
    h0, h1, _ = heads.indices(H)
    hg = h1 - h0
    kd = torch.empty((n, hg, K_DIGITS * N), dtype=torch.int8, device=parts.device)
    if value_digits:  # (the keys past n: never written, read only as keys no query sees, their weights 0)
        v = torch.empty((hg, V_DIGITS * V, -(-n // 16) * 16), dtype=torch.int8, device=parts.device)
    else:
        v = torch.empty((n, hg, V), dtype=torch.int32, device=parts.device)
    if n == 0 or hg == 0:
        return kd, v
    assert expand_widths_fit(LR) and parts.is_contiguous() and w_k.is_contiguous() and w_v.is_contiguous()
    BM, BN, BK, warps, stages = EXPAND_TILE
    BK = _steps(LR, BK)
    src = TensorDescriptor.from_tensor(parts, block_shape=[1, BM, BK])
    for w, out, D, mode in ((w_k, kd, N, DIGITS), (w_v, v, V, DIGITS_KEYS_LAST if value_digits else INTEGERS)):
        bn = min(BN, max(32, triton.next_power_of_2(D)))
        block = [1, bn, BM] if mode == DIGITS_KEYS_LAST else [BM, 1, bn]
        _expand_digits_kernel[(hg * triton.cdiv(D, bn), triton.cdiv(n, BM))](
            src, TensorDescriptor.from_tensor(w, block_shape=[1, bn, BK]),
            TensorDescriptor.from_tensor(out, block_shape=block), h0, LR=LR, D=D, STORE=mode, BM=BM, BN=bn,
            BK=BK, num_warps=warps, num_stages=stages)
    return kd, v


def expand_digits_reference(parts: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, heads: slice = slice(None),
                            value_digits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand_digits`` in torch: the integer products in float64 (every sum below 2**53: exact)."""
    kv = parts[0].double() + 64 * parts[1].double()  # (n, kv_lora)
    n = kv.shape[0]
    k_nope = torch.einsum("nr,hdr->nhd", kv, w_k[heads].double())
    v = torch.einsum("nr,hdr->nhd", kv, w_v[heads].double())
    hg, N = k_nope.shape[1:]
    kd = split_digits_reference(k_nope.reshape(n * hg, N), 1.0, K_DIGITS).view(n, hg, K_DIGITS * N)
    return kd, value_digits_reference(v) if value_digits else v.to(torch.int32)
