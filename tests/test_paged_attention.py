"""GQA paged attention and slot-mapped cache writes: Triton against the torch reference, the
reference against dense attention, and the GQA probe against its definition.

Fresh random inputs, NaN-poisoned outputs and null pages, shuffled block tables, pages
living inside larger shared pages (strided views), lengths 1/odd/block-aligned, rows of
prefill, decode and verification mixed in one call. On a CPU under the Triton interpreter at
small sizes; ``-m gpu`` at Nemotron-H-8B shapes in bf16.
"""

from __future__ import annotations

import pytest
import torch

from .kernel_env import DEV, REF, TRI  # (first: the interpreter where there is no GPU)

from hybridsim.engine.cache import NAN_BITS, PageArena  # noqa: E402
from hybridsim.layers.gqa import GQAProbe, GQAStack, dense_reference  # noqa: E402
from hybridsim.model import AttentionGeometry  # noqa: E402


def _case(qlens, seqs, H, KVH, D, page, dtype, gen, shared_page=False):
    """Caches with random K/V in every written slot and NaN elsewhere (the null page and
    every slot past a row's length), a shuffled block table with a null column past the end."""
    cols = [-(-s // page) for s in seqs]
    nblocks = sum(cols) + 3
    if shared_page:  # K and V inside a larger page, as the executor's arena lays them out
        arena = PageArena(1, nblocks, 2 * page * KVH * D * torch.finfo(dtype).bits // 8 + 4096, DEV)
        kc = arena.slot_view(0, 0, (page, KVH, D), dtype)
        vc = arena.slot_view(0, page * KVH * D * torch.finfo(dtype).bits // 8, (page, KVH, D), dtype)
    else:
        kc = torch.full((nblocks, page, KVH, D), float("nan"), dtype=dtype, device=DEV)
        vc = torch.full_like(kc, float("nan"))
    perm = (torch.randperm(nblocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seqs), max(cols) + 1, dtype=torch.int64)
    for r, s in enumerate(seqs):
        for c in range(cols[r]):
            b = perm.pop()
            table[r, c] = b
            n = min(page, s - c * page)
            kc[b, :n] = torch.randn(n, KVH, D, generator=gen).to(DEV, dtype)
            vc[b, :n] = torch.randn(n, KVH, D, generator=gen).to(DEV, dtype)
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(qlens), 0).tolist())
    q = torch.randn(int(qsl[-1]), H, D, generator=gen).to(DEV)
    return q, kc, vc, table.to(DEV), qsl, torch.tensor(seqs)


def _dense(q, kc, vc, table, qsl, seqs, scale):
    """Row by row, head by head: softmax(q k^T) v over the row's keys up to each query's position."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    page = kc.shape[1]
    G = q.shape[1] // kc.shape[2]
    for r in range(len(seqs)):
        n, s = int(qsl[r + 1] - qsl[r]), int(seqs[r])
        pos = torch.arange(s)
        blocks = table[r].cpu()[pos // page]
        k = kc.cpu()[blocks, pos % page].double().repeat_interleave(G, dim=1)
        v = vc.cpu()[blocks, pos % page].double().repeat_interleave(G, dim=1)
        for t in range(n):
            qq = q[int(qsl[r]) + t].cpu().double()
            p = s - n + t
            w = torch.softmax(torch.einsum("hd,mhd->hm", qq, k[: p + 1]) * scale, dim=-1)
            out[int(qsl[r]) + t] = torch.einsum("hm,mhd->hd", w, v[: p + 1])
    return out


CASES = [  # (query lengths, sequence lengths): decode, verification, prefill over context, fresh prefill
    ([1, 4, 20, 3, 1], [17, 40, 20, 33, 16]),
    ([7], [7]),
    ([1, 1, 1], [1, 64, 65]),
]


@pytest.mark.parametrize("qlens,seqs", CASES)
@pytest.mark.parametrize("H,KVH,page", [(4, 2, 16), (6, 2, 8), (4, 4, 5)])
def test_reference_equals_dense_attention(qlens, seqs, H, KVH, page):
    gen = torch.Generator().manual_seed(len(qlens) * 10 + H + page)
    q, kc, vc, table, qsl, sl = _case(qlens, seqs, H, KVH, 16, page, torch.float32, gen)
    got = REF.paged_attention(q, kc, vc, table, qsl, sl, 0.3)
    want = _dense(q, kc, vc, table, qsl, sl, 0.3)
    assert torch.allclose(got.cpu().double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qlens,seqs", CASES)
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("shared_page", [False, True], ids=["own-pages", "arena-pages"])
def test_triton_paged_attention_matches_reference(qlens, seqs, splits, shared_page):
    gen = torch.Generator().manual_seed(sum(seqs) + splits)
    q, kc, vc, table, qsl, sl = _case(qlens, seqs, 4, 2, 16, 16, torch.float32, gen, shared_page)
    want = REF.paged_attention(q, kc, vc, table, qsl, sl, 0.25)
    got = TRI.paged_attention(q, kc, vc, table, qsl, sl, 0.25, num_splits=splits)
    assert not torch.isnan(got).any()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_past_end_bug_reads_the_null_column_in_both():
    """The injectable bug's semantics are the reference's too: NaN where the row reads the null page."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, table, qsl, sl = _case([1, 3], [16, 21], 4, 2, 16, 16, torch.float32, gen)
    want = REF.paged_attention(q, kc, vc, table, qsl, sl, 0.25, past_end_bug=True)
    got = TRI.paged_attention(q, kc, vc, table, qsl, sl, 0.25, past_end_bug=True)
    assert torch.isnan(want).all() and torch.isnan(got).all()


@pytest.mark.parametrize("page,KVH,D", [(16, 2, 16), (5, 3, 8)])
@pytest.mark.parametrize("shared_page", [False, True], ids=["own-pages", "arena-pages"])
def test_reshape_and_cache_bit_exact(page, KVH, D, shared_page):
    gen = torch.Generator().manual_seed(page * KVH)
    _, kc, vc, _, _, _ = _case([1], [1], KVH, KVH, D, page, torch.float32, gen, shared_page)
    n = 9
    slots = torch.randperm(kc.shape[0] * page, generator=gen)[:n]
    key, val = torch.randn(n, KVH, D, generator=gen), torch.randn(n, KVH, D, generator=gen)
    want_k, want_v = kc.clone(), vc.clone()
    REF.reshape_and_cache(key, val, slots, want_k, want_v)
    TRI.reshape_and_cache(key.to(DEV), val.to(DEV), slots.to(DEV), kc, vc)
    assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert torch.equal(kc.isnan(), want_k.isnan())


def test_arena_fill_is_nan_in_every_dtype():
    arena = PageArena(2, 3, 256, "cpu")
    assert int(arena.data.view(torch.int32)[0, 0, 0]) == NAN_BITS
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.isnan(arena.slot_view(1, 64, (4, 2), dt)).all()


# ----------------------------------------------------------------------------- the GQA probe

def test_gqa_probe_is_exact_and_equals_its_definition():
    geo = AttentionGeometry(layers=2, heads=6, kv_heads=2, head_dim=16, dtype="float32")
    probes = [GQAProbe(geo, layer, seed=4) for layer in range(2)]
    tok = torch.tensor([5, 4096 * 3 + 7, 11, 2, 2, 900, 4095, 17])
    pos = torch.arange(len(tok))
    k64, v64, q64 = GQAStack(probes, "cpu").project(tok, pos)
    k32, v32, q32 = GQAStack(probes, "cpu", torch.float32).project(tok, pos)
    for a, b in ((k64, k32), (v64, v32), (q64, q32)):
        assert torch.equal(a, b.double())  # exact in float32
    want = torch.stack([dense_reference(p, tok, pos) for p in probes])
    got = GQAStack(probes, "cpu").attend(tok[None], pos[None])[:, 0]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # every key depends on its position (RoPE) and its token
    assert not torch.equal(k64[:, 3], k64[:, 4]) and not torch.equal(v64[:, 2], v64[:, 3])
    assert torch.equal(v64[:, 3], v64[:, 4])  # V carries no position: same token, same V


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64, 1056])
@pytest.mark.parametrize("qlens,seqs", [([1] * 32, [4096 + 37 * i for i in range(32)]),
                                        ([4] * 8 + [1] * 8 + [300], [2000 + i for i in range(16)] + [5000])])
def test_gpu_paged_attention_nemotron_shapes_bf16(page, qlens, seqs):
    gen = torch.Generator().manual_seed(page)
    q, kc, vc, table, qsl, sl = _case(qlens, seqs, 32, 8, 128, page, torch.bfloat16, gen)
    want = REF.paged_attention(q, kc, vc, table, qsl, sl, 128 ** -0.5)
    for splits in (0, 1, 5):
        got = TRI.paged_attention(q, kc, vc, table, qsl, sl, 128 ** -0.5, num_splits=splits)
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 2e-2 and not torch.isnan(got).any(), (splits, rel)
