"""The reference MLA decode's products on the bfloat16 matrix units (``reference.split_bmm``): a float32
operand as three bfloat16 pieces whose sum is the operand (CPU), and on a GPU the reference decode with a
bfloat16 cache as close to float64 as its float32 form, on fresh random inputs and shuffled block tables
(``kernel.mla_decode`` re-runs every decode row through it)."""

from __future__ import annotations

import pytest
import torch

from hybridsim.kernels.reference import ReferenceKernels, bf16_pieces, split_bmm


def test_three_pieces_sum_to_the_float32_value():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(100_000, generator=g) * torch.exp(torch.randn(100_000, generator=g) * 20)
    x[:4] = torch.tensor([1.0 + 2.0 ** -23, -(2.0 ** -100), 3.0e38, 0.0])
    pieces = list(bf16_pieces(x))
    assert len(pieces) == 3 and all(p.dtype == torch.bfloat16 for p in pieces)
    total = sum(p.double() for p in pieces)
    # within one rounding of the last piece: 2**-24 of the value, or half of bfloat16's smallest step
    # (2**-133) where a remainder falls below the normal range; exact where 24 bits hold the value
    assert bool(((total - x.double()).abs() <= x.double().abs() * 2.0 ** -24 + 2.0 ** -134).all())
    assert torch.equal(total[:4], x[:4].double())
    assert float(pieces[1].float().abs().max()) > 0 and float(pieces[2].float().abs().max()) > 0


@pytest.mark.parametrize("shape", [(3, 256, 576, 700), (2, 40, 64, 33)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_split_bmm_has_float32_accuracy(shape):
    B, M, K, N = shape
    g = torch.Generator().manual_seed(M)
    a = torch.randn(B, M, K, generator=g).cuda()
    b = torch.randn(B, K, N, generator=g).to(torch.bfloat16).cuda()
    want = torch.bmm(a.double(), b.double())
    got = torch.empty(B, M, N, device="cuda").fill_(float("nan"))
    got.copy_(split_bmm(a, b))
    f32 = torch.bmm(a, b.float())  # float32 on the CUDA cores (TF32 off: torch's default)
    err = float((got.double() - want).abs().max() / want.abs().max())
    err32 = float((f32.double() - want).abs().max() / want.abs().max())
    assert got.dtype == torch.float32 and err <= max(2 * err32, 1e-6), (err, err32)


@pytest.mark.parametrize("nq", [1, 2])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_reference_decode_with_a_bf16_cache_is_as_close_to_float64_as_float32(nq):
    K = ReferenceKernels()
    g = torch.Generator().manual_seed(nq)
    B, H, L, R, page = 5, 16, 512, 64, 64
    lens = torch.tensor([1, 63, 64, 700, 1500])
    per_row = -(-int(lens.max()) // page)
    blocks = B * per_row + 3
    cache = (torch.randn(blocks, page, L + R, generator=g) * 0.5).to(torch.bfloat16).cuda()
    table = torch.randperm(blocks, generator=g)[:B * per_row].view(B, per_row).cuda()
    used = torch.zeros(blocks, dtype=torch.bool)
    for b in range(B):  # blocks no row reads hold NaN: a read past a row's end would show
        used[table[b, :-(-int(lens[b]) // page)].cpu()] = True
    cache[~used.cuda()] = float("nan")
    q_lat = torch.randn(B, nq, H, L, generator=g).cuda()
    q_pe = torch.randn(B, nq, H, R, generator=g).cuda()
    seq = lens.cuda()
    o, lse = K.mla_decode(q_lat, q_pe, cache, table, seq, L, 0.07)  # the split products
    o32, lse32 = K.mla_decode(q_lat, q_pe, cache.float(), table, seq, L, 0.07)  # float32 products
    o64, lse64 = K.mla_decode(q_lat.double(), q_pe.double(), cache.double(), table, seq, L, 0.07)
    assert o.dtype == torch.float32 and bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all())

    def rel(x, want):
        return float((x.double() - want).abs().max() / want.abs().max())

    assert rel(o, o64) <= max(2 * rel(o32, o64), 1e-6), (rel(o, o64), rel(o32, o64))
    assert rel(lse, lse64) <= max(2 * rel(lse32, lse64), 1e-6), (rel(lse, lse64), rel(lse32, lse64))
