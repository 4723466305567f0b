"""The float64 attention kernel the GPU's MLA oracle runs (``kernels/latent_attention_f64.py``:
keys and values in memory, scores never) against its torch definition: packed rows in shuffled
order, decode rows and long chunks over context, keys shared by every head with values a view
of them (the absorbed latent) and per-head keys and values (expanded), key and value widths that
are not powers of two, float32 and float64 keys, keys between rows that no row owns (a read past
a row's keys changes its output), outputs poisoned first (a query left unwritten shows)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels.latent_attention_f64 import latent_attention, latent_attention_reference  # noqa: E402

from .helpers import compile_for_hopper  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")


def _check(heads: int, kv_heads: int, dk: int, dv: int, shared: bool, kdtype, seed: int, device: str,
           rows=((1, 0), (1, 37), (3, 70), (2, 5), (17, 0), (40, 23), (9, 100)), qdtype=torch.float64) -> None:
    """(queries, keys before them) per row; ``shared``: values are the first dv columns of the keys;
    ``qdtype`` float32: queries held in float32 (the oracle's expanded rows: exact values)."""
    g = torch.Generator().manual_seed(seed)
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    q_len, pos0 = [a for a, _ in rows], [b for _, b in rows]
    gap = 3  # keys no row owns, between rows
    k_start = [sum(a + b + gap for a, b in rows[:i]) for i in range(len(rows))]
    q_start = [sum(q_len[:i]) + i for i in range(len(rows))]  # and a query slot no row owns
    layers, nq, nk = 2, q_start[-1] + q_len[-1] + 1, k_start[-1] + sum(rows[-1]) + gap
    q = (torch.randn(layers, nq, heads, dk, generator=g, dtype=torch.float64) * 2).to(device, qdtype)
    k = torch.randn(layers, nk, kv_heads, dk, generator=g).to(device, kdtype)
    v = k[..., :dv] if shared else torch.randn(layers, nk, kv_heads, dv, generator=g).to(device, kdtype)
    want = latent_attention_reference(q, k, v, q_start, q_len, k_start, pos0, 0.31)
    out = torch.full((layers, nq, heads, dv), float("nan"), dtype=torch.float64, device=device)
    got = latent_attention(q, k, v, q_start, q_len, k_start, pos0, 0.31, out=out)
    assert got.data_ptr() == out.data_ptr()
    written = torch.isfinite(want)
    assert written.any() and torch.equal(torch.isfinite(got), written)  # every row's queries, nothing else
    torch.testing.assert_close(got[written], want[written], rtol=1e-12, atol=1e-13)


@INTERPRETER
@pytest.mark.parametrize("heads,kv_heads,dk,dv,shared,kdtype,qdtype", [
    (8, 1, 80, 64, True, torch.float32, torch.float64), (6, 1, 40, 24, True, torch.float64, torch.float64),
    (4, 4, 24, 16, False, torch.float32, torch.float64), (6, 2, 36, 20, False, torch.float64, torch.float64),
    (4, 4, 24, 16, False, torch.float32, torch.float32)],
    ids=["absorbed", "absorbed-f64-odd", "expanded", "grouped-odd", "expanded-queries-f32"])
def test_latent_attention_kernel_equals_the_definition(heads, kv_heads, dk, dv, shared, kdtype, qdtype):
    _check(heads, kv_heads, dk, dv, shared, kdtype, 11, "cpu", qdtype=qdtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("heads,kv_heads,dk,dv,shared", [(128, 1, 576, 512, True), (128, 128, 192, 128, False),
                                                         (6, 2, 36, 20, False)], ids=["deepseek-absorbed",
                                                                                      "deepseek-expanded", "odd"])
def test_latent_attention_kernel_on_the_gpu(heads, kv_heads, dk, dv, shared):
    _check(heads, kv_heads, dk, dv, shared, torch.float32, 12, "cuda",
           rows=((1, 0), (2, 1000), (2, 37), (3, 700), (64, 0), (200, 300), (9, 2000)))


def _expanded_keys_exact(device: str) -> None:
    """``MLAStack.expanded_keys`` (float32 products of split latents, TF32 on a GPU) gives the float64
    products' values bit for bit, at DeepSeek-V3's geometry (kv_lora_rank 512: sums up to 2**23 units)."""
    from hybridsim.device.matmul import matmul_tf32
    from hybridsim.layers.mla import MLAProbe, MLAStack
    from hybridsim.presets import build_preset

    geo = build_preset("deepseek-v3").mla.model_copy(update={"layers": 2})
    stack = MLAStack([MLAProbe(geo, layer, seed=5) for layer in range(2)], device)
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, 3_000_000, (300,), generator=g).to(device)
    lat = stack.latents_at(tok, torch.arange(300, device=device), 300)
    Lr = geo.kv_lora_rank
    # and latents at the bound's extremes (|kv_c| up to 2**12 units: more than TF32's 11 bits hold)
    extreme = torch.randint(-4096, 4097, (2, 300, Lr), generator=g).double().to(device) * 2.0 ** -7
    extreme[:, :5] = 4096 * 2.0 ** -7
    lat = torch.cat([lat, torch.cat([extreme, lat[..., Lr:]], dim=-1)], dim=1)
    for layer in range(2):
        with matmul_tf32():
            k, v = stack.expanded_keys(lat[layer], layer)
        assert k.dtype == v.dtype == torch.float32
        kv = lat[layer, :, :Lr]
        want_k = torch.einsum("nr,kdr->nkd", kv, stack.w_uk[layer])
        want_v = torch.einsum("nr,krv->nkv", kv, stack.w_uv[layer])
        assert torch.equal(k[..., :geo.qk_nope_head_dim].double(), want_k)
        k_pe = k[..., geo.qk_nope_head_dim:]
        assert torch.equal(k_pe.double(), lat[layer, :, None, Lr:].expand_as(k_pe))
        assert torch.equal(v.double(), want_v)


def _exact32_projections(device: str) -> None:
    """``MLAStack.queries`` and ``latents_at`` in float32 (the oracle's expanded rows; TF32 products
    on a GPU) give the float64 values bit for bit, at DeepSeek-V3's geometry, the largest token ids
    and positions included."""
    from hybridsim.layers.mla import MLAProbe, MLAStack
    from hybridsim.presets import build_preset

    geo = build_preset("deepseek-v3").mla.model_copy(update={"layers": 2})
    stack = MLAStack([MLAProbe(geo, layer, seed=7) for layer in range(2)], device)
    g = torch.Generator().manual_seed(4)
    tok = torch.cat([torch.randint(0, 3_000_000, (500,), generator=g), torch.tensor([0, 4092, 4093 * 509 - 1])])
    tok = tok.to(device)
    pos = torch.arange(tok.numel(), device=device) * 31  # positions up to ~15.6k
    n_pos = int(pos[-1]) + 1
    for layer in (None, 1):
        for a, b in zip(stack.queries(tok, pos, n_pos, layer), stack.queries(tok, pos, n_pos, layer, torch.float32)):
            assert b.dtype == torch.float32 and torch.equal(b.double(), a)
        lat64 = stack.latents_at(tok, pos, n_pos, layer)
        lat32 = stack.latents_at(tok, pos, n_pos, layer, torch.float32)
        assert lat32.dtype == torch.float32 and torch.equal(lat32.double(), lat64)


def test_expanded_keys_are_exact_in_float32():
    _expanded_keys_exact("cpu")


def test_float32_queries_and_latents_are_exact():
    _exact32_projections("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_float32_queries_and_latents_are_exact_on_the_tensor_cores():
    _exact32_projections("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_expanded_keys_are_exact_on_the_tensor_cores():
    _expanded_keys_exact("cuda")


_COMPILE_FOR_HOPPER = """
import triton
from triton import compile as build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridsim.kernels import latent_attention_f64 as lat

# DeepSeek-V3: expanded rows (a key per head: 192 wide, values 128), absorbed (the 576-wide latent, values 512)
for G, DK, DV, (rows, keys, chunk, warps, stages) in ((1, 192, 128, lat.PER_HEAD), (128, 576, 512, lat.SHARED)):
    BG = min(G, rows)
    DVC = max(16, triton.next_power_of_2(triton.cdiv(DV, 4)))
    const = dict(G=G, BG=BG, BQ=rows // BG, DK=DK, DC=chunk, NQC=triton.cdiv(DK, chunk), DV=DV, DVC=DVC,
                 NV=triton.cdiv(DV, DVC), BN=keys)
    kern = lat._latent_attention_kernel
    names = kern.arg_names
    sig = {}
    for name in names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("q", "o", "scale_ptr"):
            sig[name] = "*fp64"
        elif name in ("k", "v"):
            sig[name] = "*fp32"
        elif name == "HK":
            sig[name] = "i32"
        elif name.startswith(("sq_", "sk_", "sv_", "so_")):
            sig[name] = "i64"
        else:
            sig[name] = "*i64"
    src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    out = build(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    print(G, out.metadata.shared, "f64" in out.asm["ptx"] and "mma.sync" in out.asm["ptx"])
"""


def test_latent_attention_compiles_for_hopper_at_deepseek_shapes():
    """Without a GPU: Triton's front end and ptxas build both tile schedules for sm_90 at
    DeepSeek-V3's shapes, within Hopper's shared memory (227 KB a block), their products on the
    float64 tensor cores (a schedule the device rejects is caught anywhere). A process of its
    own: this module runs Triton's interpreter."""
    lines = compile_for_hopper(_COMPILE_FOR_HOPPER).strip().splitlines()
    for line in lines:
        group, shared, dmma = line.split()
        assert int(shared) <= 227 * 1024 and dmma == "True", line
    assert len(lines) == 2
