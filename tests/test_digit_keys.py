"""The MLA oracle's expanded keys made from token ids (``kernels/digit_keys.py``): kv_c's int8 parts and
k_pe's digits exactly those of ``MLAStack.latents_at``, k_nope's digits and the int32 values exactly the
float products' (``MLAStack.expanded_nope``), and the expansion against its torch definition on random
parts at their full range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import kernel_env  # noqa: F401  (the interpreter where there is no GPU: first)
from hybridsim.kernels import digit_keys as dk  # noqa: E402
from hybridsim.kernels.digit_attention_f64 import join_digits, split_digits_reference  # noqa: E402
from hybridsim.layers.mla import LATENT_SHIFT, MLAProbe, MLAStack  # noqa: E402
from hybridsim.model import MLAGeometry  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")
DEVICES = [pytest.param("cpu", marks=INTERPRETER),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a GPU")])]
GEO = MLAGeometry(layers=2, heads=3, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=24)


def _stack(device: str) -> MLAStack:
    return MLAStack([MLAProbe(GEO, layer, seed=3) for layer in range(GEO.layers)], device)


@pytest.mark.parametrize("device", DEVICES)
def test_key_parts_are_the_latents(device):
    """kv_c's parts and k_pe's digits from token ids in one kernel: exactly the integers of
    ``MLAStack.latents_at`` (and of ``key_parts_reference``), for keys past one program's tile."""
    st = _stack(device)
    g = np.random.default_rng(1)
    n = 45
    tok = torch.from_numpy(g.integers(0, 10 ** 6, size=n)).to(device)
    pos = torch.arange(3000, 3000 + n, device=device)
    Lr, R = GEO.kv_lora_rank, GEO.qk_rope_head_dim
    for layer in (0, 1):
        lat = st.latents_at(tok, pos, 4000, layer, torch.float32)[0].cpu()
        kv = torch.round(lat[:, :Lr].double() * 2.0 ** LATENT_SHIFT).to(torch.int32)
        parts, kr = dk.key_parts(*st.key_tables(), R, tok, pos, 4000, layer)
        parts, kr = parts.cpu(), kr.cpu()
        assert parts.shape == (2, n, Lr) and kr.shape == (n, 3 * R) and parts.dtype == kr.dtype == torch.int8
        assert bool((parts[0] >= 0).all()) and bool((parts[0] < 64).all())
        assert torch.equal(64 * parts[1].int() + parts[0].int(), kv)
        assert torch.equal(kr, split_digits_reference(lat[:, Lr:], st.rope_unit, 3))
        ref = dk.key_parts_reference(*st.key_tables(), R, tok, pos, 4000, layer)
        assert torch.equal(ref[0].cpu(), parts) and torch.equal(ref[1].cpu(), kr)


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_digits_are_the_float_products(device):
    """k_nope's digits and the values as int32 from int8 products (on a GPU the tensor cores): the float32
    products' values over their units, exactly, for a group of heads and for all of them, with fewer keys
    than a program's tile and with more."""
    st = _stack(device)
    g = np.random.default_rng(2)
    Lr, R, N = GEO.kv_lora_rank, GEO.qk_rope_head_dim, GEO.qk_nope_head_dim
    for n, heads in ((7, slice(1, 3)), (130, slice(None))):
        tok = torch.from_numpy(g.integers(0, 10 ** 6, size=n)).to(device)
        pos = torch.arange(n, device=device)
        lat = st.latents_at(tok, pos, n, 1, torch.float32)[0]
        parts, _ = dk.key_parts(*st.key_tables(), R, tok, pos, n, 1)
        kd, v = dk.expand_digits(parts, *st.expansion_weights(1), heads)
        k_nope, v_want = st.expanded_nope(lat, 1, heads)
        hg = k_nope.shape[1]
        assert kd.shape == (n, hg, 3 * N) and kd.dtype == torch.int8 and v.shape == (n, hg, 24) and v.dtype == torch.int32
        want_kd = split_digits_reference(k_nope.reshape(n * hg, N).cpu(), st.nope_key_unit, 3).view(n, hg, 3 * N)
        assert torch.equal(kd.cpu(), want_kd)
        assert torch.equal(v.cpu().double() * st.value_unit, v_want.cpu().double())
        del lat, parts


@pytest.mark.parametrize("device", DEVICES)
def test_expansion_equals_its_definition_at_full_range(device):
    """Random parts and weights at the edges of their ranges (low parts in [0, 63], high in [-64, 64], weights
    in [-4, 4]), a rank of 256 (two product steps of 128): the kernel's digits and values are the torch
    definition's, exactly, the values as int32 and as digits with the keys last (their padding past the keys
    is never read as a value: left out)."""
    gen = torch.Generator().manual_seed(11)
    n, H, N, V, Lr = 150, 3, 32, 40, 256
    parts = torch.stack([torch.randint(0, 64, (n, Lr), generator=gen), torch.randint(-64, 65, (n, Lr), generator=gen)])
    parts[:, 0] = torch.tensor([63, 64])[:, None]  # the largest kv_c, 64 * 64 + 63, in every column of key 0
    parts[:, 1] = torch.tensor([0, -64])[:, None]
    parts = parts.to(torch.int8).to(device)
    w_k = torch.randint(-4, 5, (H, N, Lr), generator=gen).to(torch.int8)
    w_k[0, 0] = 4  # key 0's k_nope in head 0, column 0: 4 * 4159 * 256, near three digits' top
    w_k[0, 1] = -4
    w_v = torch.randint(-4, 5, (H, V, Lr), generator=gen).to(torch.int8)
    w_k, w_v = w_k.to(device), w_v.to(device)
    w_v[1, 2] = 4  # key 0's value in head 1, column 2: 4 * 4159 * 256, near three digits' top
    for heads, value_digits in ((slice(None), False), (slice(2, 3), False), (slice(None), True), (slice(1, 3), True)):
        kd, v = dk.expand_digits(parts, w_k, w_v, heads, value_digits=value_digits)
        want_kd, want_v = dk.expand_digits_reference(parts.cpu(), w_k.cpu(), w_v.cpu(), heads, value_digits)
        assert torch.equal(kd.cpu(), want_kd) and v.shape == want_v.shape and torch.equal(v[..., :n].cpu(), want_v[..., :n])
        if value_digits and heads == slice(None):
            assert v.shape == (H, 3 * V, 160) and join_digits(v[1, :, 0].cpu(), 1.0, 3)[2] == 4 * 4159 * Lr
        if heads == slice(None):  # the edges went through: key 0's first two k_nope columns in head 0
            top = join_digits(kd[0, 0].cpu(), 1.0, 3)[:2]
            assert top.tolist() == [4 * 4159 * Lr, -4 * 4159 * Lr]


@pytest.mark.parametrize("device", DEVICES)
def test_keys_at_a_rank_that_is_no_power_of_two(device):
    """kv_lora 96 (a multiple of 32, three product steps of 32): both kernels give their torch definitions."""
    geo = MLAGeometry(layers=1, heads=2, kv_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    st = MLAStack([MLAProbe(geo, 0, seed=3)], device)
    tok = torch.from_numpy(np.random.default_rng(1).integers(0, 10 ** 6, size=20)).to(device)
    pos = torch.arange(20, device=device)
    parts, kr = dk.key_parts(*st.key_tables(), 32, tok, pos, 20, 0)
    ref = dk.key_parts_reference(*st.key_tables(), 32, tok, pos, 20, 0)
    assert torch.equal(parts.cpu(), ref[0].cpu()) and torch.equal(kr.cpu(), ref[1].cpu())
    kd, v = dk.expand_digits(parts, *st.expansion_weights(0))
    want_kd, want_v = dk.expand_digits_reference(parts.cpu(), *(w.cpu() for w in st.expansion_weights(0)))
    assert torch.equal(kd.cpu(), want_kd) and torch.equal(v.cpu(), want_v)
