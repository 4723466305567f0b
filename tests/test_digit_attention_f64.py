"""The MLA oracle's expanded rows with exact scores from int8 digits (``kernels/digit_attention_f64.py``):
the digit split and its inverse at the edges of their range, the kernel against its torch definition
(packed rows in shuffled order, keys between rows that no row owns, outputs poisoned first) and against
the float64 kernel on the same values, the oracle taking the digits where the tables' bounds allow and
the float64 scores where they do not, both giving the one-row definition's values."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from . import kernel_env  # noqa: F401  (the interpreter where there is no GPU: first)
from hybridsim.kernels import digit_attention_f64 as da  # noqa: E402
from hybridsim.kernels.latent_attention_f64 import latent_attention  # noqa: E402
from hybridsim.layers.mla import MLAProbe, dense_reference  # noqa: E402
from hybridsim.model import MLAGeometry  # noqa: E402
from hybridsim.oracle import WEIGHTS_SHARE, MLAOracle  # noqa: E402

from .helpers import compile_for_hopper  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")
# a test on both: the interpreter on a CPU, compiled under ``-m gpu``
DEVICES = [pytest.param("cpu", marks=INTERPRETER),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a GPU")])]
LOW3 = -128 * (1 + 256 + 65536)  # the most negative value three digits hold


def test_digits_split_and_join_exactly_at_the_edges():
    vals = torch.tensor([[0, 1, -1, 127, -128, 128, -129, 255, 32639, -32896, da.DIGIT_MAX, LOW3, 4096, -4096,
                          65535, -65536]], dtype=torch.float64) * 2.0 ** -7
    d = da.split_digits_reference(vals, 2.0 ** -7, 3)
    assert d.dtype == torch.int8 and d.shape == (1, 48)
    assert torch.equal(da.join_digits(d, 2.0 ** -7, 3), vals)
    two = vals[:, :10]  # within two digits: [-32896, 32639]
    assert torch.equal(da.join_digits(da.split_digits_reference(two, 2.0 ** -7, 2), 2.0 ** -7, 2), two)
    with pytest.raises(ValueError, match="more than 2 digits"):
        da.split_digits_reference(torch.tensor([[32640.0]]), 1.0, 2)
    with pytest.raises(ValueError, match="more than 3 digits"):
        da.split_digits_reference(torch.tensor([[da.DIGIT_MAX + 1.0]]), 1.0, 3)
    with pytest.raises(ValueError, match="not integers"):
        da.split_digits_reference(torch.tensor([[0.5]]), 1.0, 3)


def _packed(seed: int, H: int, DN: int, DR: int, DV: int, rows, device: str, align: int = 1):
    """Random exact queries and keys at their full digit range, as digits; rows packed in shuffled order
    with a key slot no row owns between rows (and up to ``align``) and a query slot no row owns after each."""
    g = torch.Generator().manual_seed(seed)
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    q_len, pos0 = [a for a, _ in rows], [b for _, b in rows]
    k_start = [0]
    for a, b in rows[:-1]:
        k_start.append(-(-(k_start[-1] + a + b + 3) // align) * align)
    q_start = [sum(q_len[:i]) + i for i in range(len(rows))]
    nq, nk = q_start[-1] + q_len[-1] + 1, k_start[-1] + sum(rows[-1]) + 3

    def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, shape, generator=g).double()
    # units chosen so the scores spread over a few units: q_nope up to 2**12, the others at full range
    u_n, u_r = 2.0 ** -38, 2.0 ** -47
    qn, qr = ints(-4096, 4096, nq, H, DN), ints(LOW3, da.DIGIT_MAX, nq, H, DR)
    kn, kr = ints(LOW3, da.DIGIT_MAX, nk, H, DN) * u_n, ints(LOW3, da.DIGIT_MAX, nk, DR) * u_r
    v = torch.randn(nk, H, DV, generator=g)
    qd = torch.cat([da.split_digits_reference(qn.reshape(-1, DN), 1.0, 2).view(nq, H, -1),
                    da.split_digits_reference(qr.reshape(-1, DR), 1.0, 3).view(nq, H, -1)], dim=-1)
    kd = da.split_digits_reference(kn.reshape(-1, DN), u_n, 3).view(nk, H, -1)
    krd = da.split_digits_reference(kr, u_r, 3)
    dense = (torch.cat([qn, qr], -1), torch.cat([kn, kr[:, None].expand(-1, H, -1)], -1))
    on = lambda *t: [x.to(device) for x in t]  # noqa: E731
    return on(qd, kd, krd, v.float()), (q_start, q_len, k_start, pos0), (u_n, u_r), on(*dense)


def _check_kernel(device: str, H: int, DN: int, DR: int, DV: int, rows, values: str = "float32") -> None:
    """``values``: float32; int32, integers of a unit (the oracle's), a view into a wider tensor; or digits,
    those integers' digits (the weights then integers of 2**-30: float64's outputs within the bound)."""
    (qd, kd, kr, v), meta, units, (q, k) = _packed(7, H, DN, DR, DV, rows, device, 16 if values == "digits" else 1)
    unit_v = 1.0
    if values != "float32":
        unit_v = 2.0 ** -20
        top = da.digit_capacity(da.V_DIGITS)
        wide = torch.randint(-top, top + 1, (v.shape[0], H, DV + 8), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(3)).to(device)
        v = wide[..., 8:]
    given = da.value_digits_reference(v) if values == "digits" else v
    want = da.digit_attention_reference(qd, kd, kr, given, *meta, 0.31, *units, unit_value=unit_v)
    out = torch.full(want.shape, float("nan"), dtype=torch.float64, device=device)
    got = da.digit_attention(qd, kd, kr, given, *meta, 0.31, *units, out=out, unit_value=unit_v)
    assert got.data_ptr() == out.data_ptr()
    written = torch.isfinite(want)
    assert written.any() and torch.equal(torch.isfinite(got), written)  # every row's queries, nothing else
    spread = float(v.max() - v.min()) * unit_v
    # (integer weights: the device's exp and torch's may differ in a last bit, and where a weight lies that
    # close to half a unit it rounds the other way: an output moves by at most 2**-30 of the spread a flip;
    # a wrong rounding rule or block would move it by about n times that)
    flips = 4 * 2.0 ** -30 * spread if values == "digits" else 0.0
    torch.testing.assert_close(got[written], want[written], rtol=1e-12, atol=1e-13 + flips)
    # the float64 kernel on the same values (its scores summed in float64): the same outputs, or with the
    # weights integers within n 2**-31 of the values' spread (n: a row's keys, at most)
    f64 = latent_attention(q[None], k[None], (v.double() * unit_v)[None], *meta, 0.31)[0]
    bound = max(p0 + ql for ql, p0 in zip(meta[1], meta[3])) * 2.0 ** -31 * spread
    torch.testing.assert_close(got[written], f64[written], rtol=1e-12, atol=bound if values == "digits" else 1e-13)
    if values == "digits":  # (and the weights' rounding shows: not float64's outputs to float64 rounding)
        assert float((got[written] - f64[written]).abs().max()) > 1e-12 * float(f64[written].abs().max())


@INTERPRETER
@pytest.mark.parametrize("values", ["float32", "int32", "digits"])
def test_digit_attention_kernel_equals_the_definition(values):
    _check_kernel("cpu", 3, 64, 32, 24 if values != "digits" else 32, ((1, 0), (17, 5), (3, 40), (20, 0), (2, 33),
                                                                        (5, 70)), values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_digit_attention_kernel_on_the_gpu():
    rows = ((1, 0), (2, 1000), (2, 37), (3, 700), (64, 0), (200, 300), (9, 2000))
    for values in ("float32", "int32", "digits"):
        _check_kernel("cuda", 5, 128, 64, 128, rows, values)


GEO = MLAGeometry(layers=2, heads=2, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=24)
GEO32 = MLAGeometry(layers=2, heads=2, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)


def _oracle_rows(monkeypatch, digit_scores, budget: int = 1 << 28, probes=None, device: str = "cpu",
                 digit_values=None, weights_within: float = 0.0):
    probes = probes or [MLAProbe(GEO, layer, seed=3) for layer in range(2)]
    device = torch.device(device)
    oracle = MLAOracle(probes, device, budget, fused=True, digit_scores=digit_scores, digit_values=digit_values,
                       weights_within=weights_within)
    monkeypatch.setattr(oracle.stack, "expands", lambda b, q, n, bounded=True: q > 8)
    launches = []
    real = da.digit_attention
    monkeypatch.setattr(da, "digit_attention", lambda qd, kd, kr, v, *a, **kw: launches.append((kd.shape[1], v.dtype))
                        or real(qd, kd, kr, v, *a, **kw))
    g = np.random.default_rng(4)
    rows = [(g.integers(0, 60_000, size=c + k).astype(np.int64), c, k) for c, k in [(0, 40), (30, 27), (20, 2)]]
    return oracle, rows, oracle.expected(rows), launches, probes


BF16_WITHIN = 2e-2 * WEIGHTS_SHARE  # what the executor allows the weights' rounding in a bf16 run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("digit_scores,budget,geo,digit_values,within", [
    (None, 1 << 28, GEO, None, BF16_WITHIN), (None, 3_000, GEO, None, BF16_WITHIN), (False, 1 << 28, GEO, None, 0.0),
    (None, 1 << 28, GEO32, None, BF16_WITHIN), (None, 3_000, GEO32, None, BF16_WITHIN),
    (None, 1 << 28, GEO32, False, BF16_WITHIN), (None, 1 << 28, GEO32, None, 1e-5 * WEIGHTS_SHARE)],
    ids=["digits", "digits-head-groups", "float64-scores", "digit-values", "digit-values-head-groups",
         "digit-scores-float64-values", "fp32-tolerance-float64-values"])
def test_oracle_expanded_rows_take_digit_scores(monkeypatch, digit_scores, budget, geo, digit_values, within, device):
    """Expanded rows take the digits where the tables' bounds allow (unless told not to), a layer at a
    time and, with a small budget, a group of heads a launch, and their values' digits where those fit
    too (a width the products take: 32, not 24) and the rounding's bound is within what the check allows
    (a bf16 run's, not an fp32 run's); every path gives the definition's values, to float64 rounding, or
    with the weights integers of 2**-30 within n 2**-31 of the values' spread (n: the row's keys)."""
    probes = [MLAProbe(geo, layer, seed=3) for layer in range(2)]
    oracle, rows, got, launches, probes = _oracle_rows(monkeypatch, digit_scores, budget, probes, device,
                                                       digit_values, within)
    assert oracle.digit_scores == (digit_scores is not False)
    assert oracle.digit_values == (geo is GEO32 and digit_values is not False)
    rounded = oracle.value_digits_for(70)  # (the expanded rows' keys: 40 and 57)
    assert rounded == (oracle.digit_values and within == BF16_WITHIN)
    if digit_scores is False:
        assert launches == []
    else:
        heads = geo.heads if budget > 1 << 20 else 1  # 3,000 // (70 keys x 88) = 0: a head a launch
        values = torch.int8 if rounded else torch.int32  # (the values as digits, or as integers)
        assert launches == [(heads, values)] * (2 * geo.layers * geo.heads // heads)  # two expanded rows
    spread = 2 * oracle.stack.integer_bounds["v"] * oracle.stack.value_unit
    for (toks, c, k), out in zip(rows, got):
        for layer, p in enumerate(probes):
            want = dense_reference(p, torch.from_numpy(toks), torch.arange(c, c + k))
            atol = (c + k) * 2.0 ** -31 * spread if rounded and k > 8 else 1e-12  # (k > 8: the expanded rows)
            torch.testing.assert_close(out[layer].cpu(), want, rtol=1e-12, atol=atol)


def test_integer_bounds_hold_every_token():
    """``MLAStack.integer_bounds`` bound what the tables give: every entry of a key table and every query of
    a sample of tokens, as integers of their units, lies within them (and the DeepSeek-V3 geometry's digits,
    its values' too, fit with room)."""
    from hybridsim.layers.mla import MLAStack
    probes = [MLAProbe(GEO, layer, seed=3) for layer in range(2)]
    st = MLAStack(probes, torch.device("cpu"))
    b = st.integer_bounds
    tok = torch.from_numpy(np.random.default_rng(5).integers(0, 10 ** 6, size=300))
    pos = torch.arange(300)
    for layer in range(2):
        q_nope, q_pe = st.queries(tok, pos, 300, layer)
        lat = st.latents_at(tok, pos, 300, layer)[0]
        k_nope, v = st.expanded_nope(lat.float(), layer)
        assert (q_nope / st.query_unit).abs().max() <= b["q_nope"] and (q_pe / st.rope_unit).abs().max() <= b["q_pe"]
        assert (lat[:, GEO.kv_lora_rank:] / st.rope_unit).abs().max() <= b["k_pe"]
        assert (k_nope.double() / st.nope_key_unit).abs().max() <= b["k_nope"]
        assert (v.double() / st.value_unit).abs().max() <= b["v"]
    geo = MLAGeometry(layers=2, heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    ds = MLAStack([MLAProbe(geo, layer, seed=22) for layer in range(2)], torch.device("cpu")).integer_bounds
    assert da.digits_fit(ds, 128, 64, 128, 512) and ds["k_nope"] < 0.8 * da.DIGIT_MAX
    assert da.value_digits_fit(ds, 128) and ds["v"] < 0.8 * da.digit_capacity(da.V_DIGITS)
    assert not da.value_digits_fit(ds, 24) and not da.value_digits_fit({"v": da.DIGIT_MAX + 1.0}, 128)


def test_digit_bounds_follow_the_tables(monkeypatch):
    """A table whose values could overflow three digits turns the digits off (the float64 scores run), and so
    do widths the kernel does not take."""
    probes = [MLAProbe(GEO, layer, seed=3) for layer in range(2)]
    probes[1].w.w_qr = probes[1].w.w_qr * 4096  # q_pe's bound past DIGIT_MAX in layer 1
    oracle, rows, got, launches, _ = _oracle_rows(monkeypatch, None, probes=probes)
    assert oracle.stack.integer_bounds["q_pe"] > da.DIGIT_MAX and not oracle.digit_scores and launches == []
    for narrow in (MLAGeometry(layers=1, heads=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                               v_head_dim=16),  # products narrower than the int8 tensor cores take
                   MLAGeometry(layers=1, heads=2, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                               v_head_dim=22)):  # values' rows the copy engine cannot tile
        assert not MLAOracle([MLAProbe(narrow, 0, seed=3)], torch.device("cpu"), fused=True).digit_scores


_COMPILE_FOR_HOPPER = """
import re
from triton import compile as build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridsim.kernels import digit_attention_f64 as da

BQ, BN, warps, stages = da.TILE
int8 = r"mma[.]sync[.]aligned[.]m16n8k32[.]row[.]col[.](satfinite[.])?s32[.]s8[.]s8"
f64 = r"mma[.]sync[.]aligned[.]m8n8k4[.]row[.]col[.]f64"
kern = da._digit_attention_kernel
for digits in (False, True):  # DeepSeek-V3's expanded rows: values as int32, and as digits
    const = dict(DN=128, DR=64, DV=128, DVC=128 if digits else 32, NV=1 if digits else 4, BQ=BQ, BN=BN,
                 VD=da.V_DIGITS if digits else 0)
    desc = dict(qd=f"tensordesc<i8[{BQ}, 1, 128]>", qdr=f"tensordesc<i8[{BQ}, 1, 64]>",
                kd=f"tensordesc<i8[{BN}, 1, 128]>", kr=f"tensordesc<i8[{BN}, 1, 64]>",
                v=f"tensordesc<i8[1, 128, {BN}]>" if digits else f"tensordesc<i32[{BN}, 1, 32]>")
    sig = {}
    for name in kern.arg_names:
        sig[name] = ("constexpr" if name in const else desc[name] if name in desc else "*fp64" if name in ("o", "consts")
                     else "i64" if name.startswith("so_") else "*i64")
    src = ASTSource(fn=kern, signature=sig, constexprs={(kern.arg_names.index(k),): v for k, v in const.items()})
    out = build(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages})
    ptx = out.asm["ptx"]
    print(out.metadata.shared, len(re.findall(int8, ptx)), len(re.findall(f64, ptx)),
          len(re.findall(r"cp[.]async[.]bulk[.]tensor", ptx)))
# the queries' digits from token ids: their runtime integers as arguments (layer 1 included)
qk = da._query_digits_kernel
const = dict(HID=64, T1=4093, T2=509, N=128, R=64, BT=32)
sig = {n: "constexpr" if n in const else "*i64" if n in ("tok", "pos") else "*i8" if n == "qd" else "i32"
       if n in ("first", "n_tok", "layer", "H") else "*fp32" for n in qk.arg_names}
build(ASTSource(fn=qk, signature=sig, constexprs={(qk.arg_names.index(k),): v for k, v in const.items()}),
      target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
from hybridsim.kernels import digit_keys as dk
# the keys' parts and digits from token ids, and their expansion on the int8 tensor cores
kp = dk._key_parts_kernel
const = dict(LR=512, R=64, T1=4093, T2=509, BT=16, BL=128)  # (as key_parts launches it)
sig = {n: "constexpr" if n in const else "*i64" if n in ("tok", "pos") else "*i8" if n in ("parts", "kr") else "i32"
       if n in ("n_tok", "layer") else "*fp32" for n in kp.arg_names}
build(ASTSource(fn=kp, signature=sig, constexprs={(kp.arg_names.index(k),): v for k, v in const.items()}),
      target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
ek = dk._expand_digits_kernel
BM, BN, BK, warps, stages = dk.EXPAND_TILE
for store in (dk.DIGITS, dk.INTEGERS, dk.DIGITS_KEYS_LAST):
    const = dict(LR=512, D=128, STORE=store, BM=BM, BN=BN, BK=BK)
    desc = dict(parts=f"tensordesc<i8[1, {BM}, {BK}]>", w=f"tensordesc<i8[1, {BN}, {BK}]>",
                out={dk.DIGITS: f"tensordesc<i8[{BM}, 1, {BN}]>", dk.INTEGERS: f"tensordesc<i32[{BM}, 1, {BN}]>",
                     dk.DIGITS_KEYS_LAST: f"tensordesc<i8[1, {BN}, {BM}]>"}[store])
    sig = {n: "constexpr" if n in const else desc.get(n, "i32") for n in ek.arg_names}
    built = build(ASTSource(fn=ek, signature=sig, constexprs={(ek.arg_names.index(k),): v for k, v in const.items()}),
                  target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages})
    assert re.search(r"wgmma[.]mma_async[^\\n]*[.]s32[.]s8[.]s8", built.asm["ptx"]), "no int8 wgmma"
"""


def test_digit_attention_compiles_for_hopper_at_deepseek_shapes():
    """Without a GPU: Triton's front end and ptxas build the kernel for sm_90 at DeepSeek-V3's expanded
    shapes within Hopper's shared memory, its scores on the int8 tensor cores and its values on the
    float64 ones (or, given their digits, on the int8 ones), its tiles moved by the copy engine (TMA); and
    the queries' and keys' digits, the keys' expansion on the int8 warpgroup products (each way it stores).
    A process of its own: this module runs Triton's interpreter."""
    found = list(map(int, compile_for_hopper(_COMPILE_FOR_HOPPER).split()))
    shared, int8, f64, tma = found[:4]
    assert shared <= 227 * 1024 and int8 > 0 and f64 > 0 and tma > 0
    shared, int8_d, f64, tma = found[4:]  # values as digits: their products on the int8 ones too, none in float64
    assert shared <= 227 * 1024 and int8_d > int8 and f64 == 0 and tma > 0


@pytest.mark.parametrize("device", DEVICES)
def test_query_digits_are_the_split_queries(device):
    """The queries' digits from their token ids in one kernel: exactly the split of ``MLAStack.queries``."""
    from hybridsim.layers.mla import MLAStack
    geo = MLAGeometry(layers=2, heads=3, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=24)
    st = MLAStack([MLAProbe(geo, layer, seed=3) for layer in range(2)], device)
    g = np.random.default_rng(1)
    tok = torch.from_numpy(g.integers(0, 10 ** 6, size=45)).to(device)
    pos = torch.arange(3000, 3045, device=device)
    for layer in (0, 1):
        q_nope, q_pe = st.queries(tok, pos, 4000, layer, torch.float32)
        split = lambda x, unit, count: da.split_digits_reference(x[0].reshape(-1, 32).cpu(), unit, count)  # noqa: E731
        want = torch.cat([split(q_nope, st.query_unit, 2).view(45, 3, -1), split(q_pe, st.rope_unit, 3).view(45, 3, -1)],
                         dim=-1)
        assert torch.equal(da.query_digits(*st.query_tables(), tok, pos, 4000, layer).cpu(), want)
        # the last 30 of them, by an offset into the same tensors
        assert torch.equal(da.query_digits(*st.query_tables(), tok, pos, 4000, layer, first=15).cpu(), want[15:])
