"""The MLA oracle's absorbed (decode) rows with exact scores from int8 digits
(``kernels/latent_digit_scores.py``): the kernel against its torch definition bit for bit (digits across
their whole range, padded rows whose queries see only some key blocks, the output poisoned first), the
latents' digits from token ids, ``MLAStack.attend`` with them against the float64 scores and the one-row
definition, the bounds that switch them on and off, and the oracle taking them on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import kernel_env  # noqa: F401  (the interpreter where there is no GPU: first)
from hybridsim.kernels import latent_digit_scores as lds  # noqa: E402
from hybridsim.kernels.digit_attention_f64 import DIGIT_MAX, digit_capacity, split_digits_reference  # noqa: E402
from hybridsim.kernels.probe_latents import latent_rows  # noqa: E402
from hybridsim.layers.mla import LATENT_SHIFT, ROPE_SHIFT, MLAProbe, MLAStack, dense_reference, queries_of  # noqa: E402
from hybridsim.model import MLAGeometry  # noqa: E402
from hybridsim.oracle import MLAOracle  # noqa: E402

from .helpers import compile_for_hopper  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
DEVICES = [pytest.param("cpu", marks=INTERPRETER), pytest.param("cuda", marks=GPU)]
LOW3 = -128 * (1 + 256 + 65536)  # the most negative value three digits hold
LOW2 = -128 * (1 + 256)
GEO = MLAGeometry(layers=2, heads=3, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=24)


def _ints(g: torch.Generator, lo: int, hi: int, *shape: int) -> torch.Tensor:
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_equals_its_definition_bit_for_bit(device):
    """Random integers across the digits' whole range (q_lat, q_pe, k_pe three digits, kv_c two), 2 layers x 3
    padded rows of 2 queries x 3 heads (M = 6: one partial row tile) over 150 keys (three key blocks, the
    last partial): one row sees only its first block, one all of them; a non-power-of-two scale."""
    g = torch.Generator().manual_seed(11)
    LR, R, H, Ly, b, q, n = 256, 32, 3, 2, 3, 2, 150
    assert lds.absorbed_digits_fit({"q_lat": DIGIT_MAX, "q_pe": DIGIT_MAX, "k_pe": DIGIT_MAX,
                                    "kv_c": digit_capacity(2)}, LR, R)
    Z, M = Ly * b, q * H
    q_lat, q_pe = _ints(g, LOW3, DIGIT_MAX, Z, M, LR), _ints(g, LOW3, DIGIT_MAX, Z, M, R)
    kv, k_pe = _ints(g, LOW2, digit_capacity(2), Z, n, LR), _ints(g, LOW3, DIGIT_MAX, Z, n, R)
    qd = torch.cat([lds.integer_digits(q_lat, 3), lds.integer_digits(q_pe, 3)], -1)
    kd = torch.cat([lds.integer_digits(kv, 2), lds.integer_digits(k_pe, 3)], -1)
    qpos = torch.tensor([[40, 41], [148, 149], [70, 90]])
    args = (qpos, H, 0.1147, 2.0 ** -40, 2.0 ** -44)
    want = lds.latent_digit_scores_reference(qd, kd, *args)
    exact = (torch.einsum("zmd,znd->zmn", q_lat.double(), kv.double()) * 2.0 ** -40
             + torch.einsum("zmd,znd->zmn", q_pe.double(), k_pe.double()) * 2.0 ** -44) * 0.1147
    seen = torch.isfinite(want)
    assert int(seen.sum()) == Ly * H * (41 + 42 + 149 + 150 + 71 + 91)  # (the causal mask, row by row)
    assert torch.equal(want[seen], exact[seen])  # the joined digits are the integers
    out = torch.full((Z, M, n), float("nan"), dtype=torch.float64, device=device)
    got = lds.latent_digit_scores(qd.to(device), kd.to(device), qpos.to(device), *args[1:], out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.cpu(), want)


def test_digits_of_integers_and_queries():
    """``integer_digits`` at the edges of three digits, and an absorbed query's digits joined back."""
    x = torch.tensor([[0, 1, -1, 127, -128, 128, -129, 32639, DIGIT_MAX, LOW3]])
    assert torch.equal(lds.integer_digits(x, 3), split_digits_reference(x.double(), 1.0, 3))
    q_lat, q_pe = x.double() * 2.0 ** -13, x[:, :4].double() * 2.0 ** -17
    d = lds.absorbed_query_digits(q_lat, q_pe, 2.0 ** -13, 2.0 ** -17)
    assert torch.equal(lds._joined(d[:, :30], 3) * 2.0 ** -13, q_lat)
    assert torch.equal(lds._joined(d[:, 30:], 3) * 2.0 ** -17, q_pe)


@pytest.mark.parametrize("device", DEVICES)
def test_latent_rows_digits_are_the_latents_split(device):
    st = MLAStack([MLAProbe(GEO, layer, seed=5) for layer in range(GEO.layers)], device)
    R, LR = GEO.qk_rope_head_dim, GEO.kv_lora_rank
    tok = torch.from_numpy(np.random.default_rng(2).integers(0, 10 ** 7, size=(3, 37))).to(device)
    lat, dig = latent_rows(st.key1, st.key2, R, tok, torch.arange(37, device=device), 37, LATENT_SHIFT, ROPE_SHIFT,
                           digits=True)
    assert torch.equal(lat, latent_rows(st.key1, st.key2, R, tok, torch.arange(37, device=device), 37, LATENT_SHIFT,
                                        ROPE_SHIFT))
    flat = lat.reshape(-1, LR + R).cpu()
    want = torch.cat([split_digits_reference(flat[:, :LR], st.query_unit, 2),
                      split_digits_reference(flat[:, LR:], st.rope_unit, 3)], -1)
    assert dig.shape == (GEO.layers, 3, 37, 2 * LR + 3 * R) and torch.equal(dig.reshape(-1, 2 * LR + 3 * R).cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_attend_with_digit_scores_is_the_definition(device):
    """Absorbed attention over padded rows with the latents' digits: the float64 scores' values to 1e-13,
    and each row's one-row definition (``dense_reference``) to 1e-12."""
    probes = [MLAProbe(GEO, layer, seed=5) for layer in range(GEO.layers)]
    st = MLAStack(probes, device)
    assert lds.absorbed_digits_fit(st.integer_bounds, GEO.kv_lora_rank, GEO.qk_rope_head_dim)
    g = np.random.default_rng(3)
    n = 90
    tok = torch.from_numpy(g.integers(0, 10 ** 7, size=(3, n))).to(device)
    qpos = torch.tensor([[60, 61], [20, 21], [88, 89]], device=device)
    lat, dig = latent_rows(st.key1, st.key2, GEO.qk_rope_head_dim, tok, torch.arange(n, device=device), n,
                           LATENT_SHIFT, ROPE_SHIFT, digits=True)
    got = st.attend(tok, qpos, expand=False, lat=lat, key_digits=dig)
    f64 = st.attend(tok, qpos, expand=False, lat=lat)
    torch.testing.assert_close(got, f64, rtol=1e-13, atol=1e-13)
    for row in range(3):
        for layer, p in enumerate(probes):
            want = dense_reference(p, tok[row].cpu(), qpos[row].cpu())
            torch.testing.assert_close(got[layer, row].cpu(), want, rtol=1e-12, atol=1e-12)


def test_absorbed_bounds_hold_and_follow_the_tables():
    """``integer_bounds``' q_lat and kv_c bound every token's (DeepSeek-V3's geometry fits with room), and a
    table whose absorbed queries could pass three digits, or a width the products do not take, turns the
    digits off (the oracle's float64 scores run)."""
    st = MLAStack([MLAProbe(GEO, layer, seed=3) for layer in range(2)], torch.device("cpu"))
    b = st.integer_bounds
    tok = torch.from_numpy(np.random.default_rng(5).integers(0, 10 ** 6, size=300))
    pos = torch.arange(300)
    for layer in range(2):
        q_nope, _ = st.queries(tok, pos, 300, layer)
        q_lat = torch.einsum("lqkd,kdr->lqkr", q_nope, st.w_uk[layer]) / st.nope_key_unit
        lat = st.latents_at(tok, pos, 300, layer)[0]
        assert q_lat.abs().max() <= b["q_lat"] and (lat[:, :GEO.kv_lora_rank] / st.query_unit).abs().max() <= b["kv_c"]
    ds_geo = MLAGeometry(layers=2, heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    ds = MLAStack([MLAProbe(ds_geo, layer, seed=22) for layer in range(2)], torch.device("cpu")).integer_bounds
    assert lds.absorbed_digits_fit(ds, 512, 64) and ds["q_lat"] < 0.2 * DIGIT_MAX
    cpu = torch.device("cpu")
    assert MLAOracle([MLAProbe(GEO, 0, seed=3)], cpu, fused=True).absorbed_digits
    assert not MLAOracle([MLAProbe(GEO, 0, seed=3)], cpu, fused=True, digit_scores=False).absorbed_digits
    wide = [MLAProbe(GEO, layer, seed=3) for layer in range(2)]
    wide[1].w.w_uk = wide[1].w.w_uk * 2.0 ** 9  # q_lat's bound past three digits in layer 1
    assert not MLAOracle(wide, cpu, fused=True).absorbed_digits
    odd = MLAGeometry(layers=1, heads=2, kv_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=16)
    assert not MLAOracle([MLAProbe(odd, 0, seed=3)], cpu, fused=True).absorbed_digits  # 96: no whole column step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_oracle_decode_rows_take_digit_scores_on_the_gpu(monkeypatch):
    """On a GPU the oracle's absorbed rows (padded batches) take the digit scores unless told not to; both give
    the definition's values."""
    probes = [MLAProbe(GEO, layer, seed=3) for layer in range(GEO.layers)]
    g = np.random.default_rng(4)
    rows = [(g.integers(0, 60_000, size=c + k).astype(np.int64), c, k) for c, k in [(300, 2), (40, 1), (1000, 3)]]
    calls = []
    real = lds.latent_digit_scores
    monkeypatch.setattr(lds, "latent_digit_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for digit_scores in (None, False):
        calls.clear()
        oracle = MLAOracle(probes, torch.device("cuda"), fused=True, digit_scores=digit_scores)
        got = oracle.expected(rows)
        assert oracle.absorbed_digits == (digit_scores is None) and bool(calls) == (digit_scores is None)
        for (toks, c, k), out in zip(rows, got):
            for layer, p in enumerate(probes):
                want = dense_reference(p, torch.from_numpy(toks), torch.arange(c, c + k))
                torch.testing.assert_close(out[layer].cpu(), want, rtol=1e-12, atol=1e-12)


_COMPILE_FOR_HOPPER = """
import os, re, subprocess, tempfile
import triton
from triton import compile as build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridsim.kernels import latent_digit_scores as lds

k = lds._latent_digit_scores_kernel
BM, BN, BK, warps = lds.TILE
const = dict(LR=512, R=64, BM=BM, BN=BN, BK=BK)  # DeepSeek-V3's latent
ptrs = dict(qd="*i8", kd="*i8", qpos="*i64", s="*fp64", consts="*fp64")
sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in k.arg_names}
out = build(ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()},
                      attrs={(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}),
            target=GPUTarget("cuda", 90, 64), options={"num_warps": warps})
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(out.asm["cubin"])
    f.flush()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
print(out.asm["ptx"].count("wgmma.mma_async"), *re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups())
"""


def test_kernel_compiles_for_hopper_at_deepseek_shapes():
    """Without a GPU: the kernel builds for sm_90 at DeepSeek-V3's widths, its int8 products on the warp-group
    tensor cores, nothing spilled. A process of its own: this module runs Triton's interpreter."""
    wgmma, regs, stack = map(int, compile_for_hopper(_COMPILE_FOR_HOPPER).split())
    assert wgmma > 0 and 0 < regs <= 255 and stack == 0
