"""Triton kernels against their torch references: fresh random inputs, poisoned outputs,
shuffled block tables, NaN in unused cache rows, lengths 0/1/odd, odd head counts.

On a CPU these run under the Triton interpreter at small sizes (CI). ``-m gpu`` runs
them at real sizes on the device, plus a cache larger than 2^31 bytes.
"""

from __future__ import annotations

import pytest
import torch

from .kernel_env import DEV, REF, TRI  # (first: the interpreter where there is no GPU)
from .helpers import mla_decode_case  # noqa: E402

from hybridsim.kernels.triton_kernels import fused_state_copy  # noqa: E402


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """FlashMLA-style: 1 - 2<a,b> / (|a|^2 + |b|^2); 0 for identical tensors."""
    a, b = a.double().flatten(), b.double().flatten()
    denom = (a * a).sum() + (b * b).sum()
    return float(1 - 2 * (a * b).sum() / denom) if denom > 0 else 0.0


def same_specials(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b))


# ----------------------------------------------------------------------------- state copies

def _copy_case(layers, pages, rows, dim, tshape, n, gen):
    """n requests' copies on every layer: a shuffled block table (request rows, 6 columns),
    columns chosen at random, offsets 0..rows-1; the null page is NaN and never a source."""
    conv = torch.randn(layers, pages, rows, dim, generator=gen)
    temporal = torch.randn(layers, pages, *tshape, generator=gen)
    conv[:, 0] = float("nan")
    table = (torch.randperm(pages - 1, generator=gen)[: 6 * n] + 1).view(n, 6)
    items = []
    for req in range(n):
        cols = torch.randperm(6, generator=gen)[:3].tolist()  # src, dst, temporal src: distinct pages
        for layer in range(layers):
            items.append((req, layer, cols[0], cols[1], cols[2], int(torch.randint(0, rows, (1,), generator=gen))))
    return conv.to(DEV), temporal.to(DEV), table.to(DEV), torch.tensor(items).to(DEV)


@pytest.mark.parametrize("layers,rows,dim,n", [(1, 3, 96, 1), (3, 6, 288, 5), (2, 4, 33, 7)])
def test_state_copy_bit_exact(layers, rows, dim, n):
    gen = torch.Generator().manual_seed(rows * 100 + n)
    conv, temporal, table, items = _copy_case(layers, 48, rows, dim, (4, 16, 16), n, gen)
    want_c, want_t = conv.clone(), temporal.clone()
    REF.state_copy(want_c, want_t, table, items)
    fused_state_copy(conv, temporal, table, items, block=256, conv_block=128)  # many tiles per state
    assert torch.equal(conv.nan_to_num(7.0), want_c.nan_to_num(7.0)) and same_specials(conv, want_c)
    assert torch.equal(temporal, want_t)
    assert not torch.equal(want_t, temporal.clone().normal_())  # the comparison can fail


@pytest.mark.parametrize("dim,shift", [(1500, 3), (40, 1), (96, 2)])
def test_state_copy_in_place_shift_is_memmove(dim, shift):
    """Shifts both larger and smaller than one tile: sources must be read before overwritten."""
    gen = torch.Generator().manual_seed(5)
    conv = torch.randn(2, 4, 6, dim, generator=gen).to(DEV)
    temporal = torch.randn(2, 4, 2, 2, generator=gen).to(DEV)
    table = torch.tensor([[3, 2]], device=DEV)
    items = torch.tensor([[0, 1, 1, 1, 0, shift]], device=DEV)  # layer 1, page 2 onto itself, temporal from 3
    want_c, want_t = conv.clone(), temporal.clone()
    REF.state_copy(want_c, want_t, table, items)
    TRI.state_copy(conv, temporal, table, items)
    assert torch.equal(conv, want_c) and torch.equal(temporal, want_t)
    assert torch.equal(conv[1, 2, : 6 - shift], want_c[1, 2, : 6 - shift])


def test_state_copy_refuses_dependent_copies():
    """One launch runs every copy at once, so a copy may not read what another writes."""
    conv, temporal = torch.randn(1, 5, 3, 4), torch.randn(1, 5, 2)
    table = torch.tensor([[1, 2, 3]])
    chain = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 1, 2, 1, 0]])  # 1->2 then 2->3
    with pytest.raises(ValueError, match="reads or writes"):
        REF.state_copy(conv, temporal, table, chain)


# ----------------------------------------------------------------------------- cache ops

@pytest.mark.parametrize("page,dim", [(16, 80), (32, 576), (64, 17)])
def test_concat_and_gather_bit_exact(page, dim):
    gen = torch.Generator().manual_seed(page + dim)
    blocks = 12
    cache = torch.full((blocks, page, dim), float("nan")).to(DEV)
    row = (torch.randperm(blocks - 1, generator=gen) + 1)[:5]
    n = 3 * page + 5
    slots = torch.tensor([int(row[p // page]) * page + p % page for p in range(n)])
    entries = torch.randn(n, dim, generator=gen).to(DEV)
    want = cache.clone()
    REF.concat_and_cache(entries, slots, want)
    TRI.concat_and_cache(entries, slots, cache)
    assert torch.equal(cache.nan_to_num(3.0), want.nan_to_num(3.0))
    for start, length in ((0, n), (page, 1), (2 * page, 5), (0, 0)):
        got = TRI.gather_cache(cache, row, start, length)
        assert torch.equal(got, REF.gather_cache(want, row, start, length))
    with pytest.raises(ValueError):
        TRI.gather_cache(cache, row, 1, 2)


# ----------------------------------------------------------------------------- merge

def test_merge_states_with_guards():
    gen = torch.Generator().manual_seed(3)
    o_a, o_b = torch.randn(7, 5, 24, generator=gen).to(DEV), torch.randn(7, 5, 24, generator=gen).to(DEV)
    l_a, l_b = torch.randn(7, 5, generator=gen).to(DEV), torch.randn(7, 5, generator=gen).to(DEV)
    l_a[0] = float("-inf")  # one side empty
    l_a[1] = l_b[1] = float("-inf")  # both empty
    o_a[0] = 0.0
    got = TRI.merge_states(o_a, l_a, o_b, l_b)
    want = REF.merge_states(o_a, l_a, o_b, l_b)
    assert same_specials(got[1], want[1]) and not torch.isnan(got[0]).any()
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert torch.allclose(got[1].nan_to_num(0, 0, 0), want[1].nan_to_num(0, 0, 0), atol=1e-6)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1])) and torch.isneginf(got[1][1]).all()


# ----------------------------------------------------------------------------- MLA decode

def _mla_case(B, nq, H, L, R, page, lens, dtype, gen):
    return mla_decode_case(B, nq, H, L, R, page, lens, dtype, gen, DEV)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tensor-descriptors"])
@pytest.mark.parametrize("nq,H,page,lens", [(1, 8, 16, [37, 1, 64]), (3, 5, 32, [33, 7, 96]),
                                            (4, 16, 64, [130, 4]), (20, 4, 16, [20, 70, 45])])
def test_mla_decode_matches_reference(nq, H, page, lens, tma):
    """Both load paths: masked pointer loads, and whole page slices through tensor
    descriptors (TMA on the GPU) with the partial last tile through pointer loads; and a prefill
    chunk's 20 queries (two row tiles, each stopping at its last row's last visible key: a split
    past a chunk that starts its sequence is empty for its first tokens' rows)."""
    gen = torch.Generator().manual_seed(nq * 7 + H)
    L, R = 64, 16
    lens = [max(n, nq) for n in lens]
    q_lat, q_pe, cache, table = _mla_case(len(lens), nq, H, L, R, page, lens, torch.float32, gen)
    o, lse = TRI.mla_decode(q_lat, q_pe, cache, table, torch.tensor(lens), L, 0.125, num_splits=2,
                                    block_n=16, tma=tma)
    for b, n in enumerate(lens):
        ro, rl = REF.mla_decode_one(q_lat[b].cpu(), q_pe[b].cpu(), cache.cpu(), table[b].cpu(), n, L, 0.125)
        assert not torch.isnan(o[b]).any()
        rel = (o[b].cpu() - ro).abs().max() / ro.abs().max()
        assert rel < 1e-5 and cos_diff(o[b].cpu(), ro) < 1e-9
        assert torch.allclose(lse[b].cpu(), rl, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("L", [24, 128, 512, 640])
def test_combine_splits_equals_its_definition(splits, L):
    """The split merge against its definition in float64: weights exp(lse_s - max lse), -inf splits weighing
    nothing, a row empty in every split giving 0 and -inf; split counts under, at and past the splits a
    program reads at once (several groups: the running maximum across them), widths that are no power of
    two, one of them two column blocks a row; outputs poisoned first."""
    from hybridsim.kernels.attention_triton import COMBINE_SPLITS, combine_splits

    gen = torch.Generator().manual_seed(splits * 7 + L)
    n = 6
    o_part = torch.randn(splits, n, L, generator=gen)
    lse = torch.randn(splits, n, generator=gen) * 8
    lse[:, 1] = float("-inf")  # row 1: empty in every split
    lse[::2, 2] = float("-inf")  # row 2: every other split empty
    if splits > COMBINE_SPLITS:
        lse[:COMBINE_SPLITS, 3] = float("-inf")  # row 3: the first group of splits empty
        lse[-1, 4] = 60.0  # row 4: the largest in the last group (the running maximum rises late)
    o_part[lse == float("-inf")] = 0.0  # (an empty split's partial, as the split kernels write it)
    out = torch.full((n, L), float("nan")).to(DEV)
    lse_out = torch.full((n,), float("nan")).to(DEV)
    combine_splits(o_part.to(DEV), lse.to(DEV), out, lse_out, n, splits, L)
    m = lse.double().amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros(()).double(), m)
    w = torch.exp(lse.double() - m_safe)
    wsum = w.sum(0)
    want = (w[..., None] * o_part.double()).sum(0) / torch.where(wsum == 0, 1.0, wsum)[:, None]
    want_lse = torch.where(wsum == 0, float("-inf"), m_safe + torch.log(torch.where(wsum == 0, 1.0, wsum)))
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1].cpu(), torch.zeros(L)) and torch.isneginf(lse_out[1].cpu())
    torch.testing.assert_close(lse_out.cpu().double(), want_lse, rtol=1e-6, atol=1e-5)


def test_mla_decode_split_count_does_not_matter():
    gen = torch.Generator().manual_seed(9)
    q_lat, q_pe, cache, table = _mla_case(2, 2, 4, 64, 16, 16, [90, 45], torch.float32, gen)
    lens = torch.tensor([90, 45])
    a = TRI.mla_decode(q_lat, q_pe, cache, table, lens, 64, 0.2, num_splits=1)
    b = TRI.mla_decode(q_lat, q_pe, cache, table, lens, 64, 0.2, num_splits=3)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)


def test_mla_decode_empty_rows_give_zero_and_neg_inf():
    """A request with no key (length 0) and splits past a short request's end: out 0, lse -inf,
    never NaN, and the other rows unaffected. (The interpreter's bf16 dot is wrong on this
    CPU build, so the bf16 path is tested on the GPU only.)"""
    gen = torch.Generator().manual_seed(4)
    lens = [100, 0, 2, 65]
    q_lat, q_pe, cache, table = _mla_case(4, 2, 6, 48, 24, 16, [max(1, n) for n in lens], torch.float32, gen)
    o, lse = TRI.mla_decode(q_lat, q_pe, cache, table, torch.tensor(lens), 48, 0.3, num_splits=3)
    assert torch.equal(o[1].cpu(), torch.zeros_like(o[1].cpu())) and torch.isneginf(lse[1]).all()
    for b in (0, 2, 3):
        ro, rl = REF.mla_decode_one(q_lat[b].cpu(), q_pe[b].cpu(), cache.cpu(), table[b].cpu(), lens[b], 48, 0.3)
        assert not torch.isnan(o[b]).any() and cos_diff(o[b].cpu(), ro) < 1e-9
        assert torch.allclose(o[b].cpu(), ro, atol=1e-5) and torch.allclose(lse[b].cpu(), rl, atol=1e-5)


# ----------------------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("nq,page,splits", [(1, 64, 0), (2, 16, 0), (4, 32, 3), (1, 64, 5)])
def test_gpu_mla_decode_deepseek_shapes_bf16(nq, page, splits):
    """DeepSeek-V3 shapes (128 heads, 512 + 64, bf16) against the fp32 reference, including
    spec-decode queries (bottom-right causal mask), every page size and forced split counts."""
    gen = torch.Generator().manual_seed(nq * 10 + page)
    lens = [4096, 1000, 1 + nq, 333]
    q_lat, q_pe, cache, table = _mla_case(4, nq, 128, 512, 64, page, lens, torch.bfloat16, gen)
    o, lse = TRI.mla_decode(q_lat, q_pe, cache, table, torch.tensor(lens), 512, 0.1352338,
                                    num_splits=splits)
    for b, (ro, rl) in enumerate(_mla_references(q_lat, q_pe, cache, table, lens)):
        rel = float((o[b].cpu() - ro).abs().max() / ro.abs().max())
        assert rel < 2e-2 and cos_diff(o[b].cpu(), ro) < 1e-4, rel
        assert float((lse[b].cpu() - rl).abs().max()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["gluon", "seesaw", "triton"])
@pytest.mark.parametrize("nq,H,lens,splits", [(1, 128, [4096, 1000, 2, 333, 0], 0), (2, 128, [700, 65, 3], 3),
                                              (4, 128, [130, 64, 4097], 0), (1, 40, [1000, 1, 77], 2),
                                              (1, 128, [4096, 100, 0], 8),
                                              (48, 40, [48, 300, 1111], 0), (24, 128, [24, 900, 150], 2)])
def test_gpu_mla_decode_both_split_kernels(impl, nq, H, lens, splits):
    """The Gluon (Hopper: the split kernel and the two-warp-group one) and Triton split kernels, each forced, at page 64: partial last tiles over
    NaN rows, a request with no key (0 and -inf), splits past short requests, spec-decode queries,
    40 heads (a 64-row tile reaching into the next request's queries and past the last one),
    8 splits (the Gluon kernel merges 2 in its last program, more in the combine kernel), and a prefill
    chunk's many queries (``mla.paths``: the Gluon kernel stops at each row tile's last visible key, so a
    chunk that starts its sequence leaves later splits empty for its first tokens' rows)."""
    from hybridsim.kernels.mla_gluon import gluon_applies

    gen = torch.Generator().manual_seed(nq * 31 + H + len(lens))
    q_lat, q_pe, cache, table = _mla_case(len(lens), nq, H, 512, 64, 64, [max(1, n) for n in lens],
                                          torch.bfloat16, gen)
    if impl != "triton" and not gluon_applies(cache, 512, 64, 64):
        pytest.skip("the Gluon kernels need a Hopper GPU")
    o, lse = TRI.mla_decode(q_lat, q_pe, cache, table, torch.tensor(lens), 512, 0.1352338, num_splits=splits,
                            impl=impl)
    _assert_mla_page64_rows(o, lse, _mla_references(q_lat, q_pe, cache, table, lens), lens)


def _mla_references(q_lat, q_pe, cache, table, lens, scale: float = 0.1352338) -> list:
    """Each request's reference (o, lse) on the CPU in float32 (None for an empty request), the cache copied
    over once: a copy per request took most of a GPU test's time (a 72-request case's cache is 335 MB)."""
    cache32 = cache.cpu().float()
    return [None if n == 0 else REF.mla_decode_one(q_lat[b].cpu(), q_pe[b].cpu(), cache32, table[b].cpu(), n,
                                                   cache.shape[-1] - q_pe.shape[-1], scale)
            for b, n in enumerate(lens)]


def _assert_mla_page64_rows(o, lse, refs, lens):
    """Each request against its reference (``_mla_references``): an empty one gives 0 and -inf, the others
    no NaN, 2e-2 relative and a cosine difference under 1e-4, and lse to 2e-2 relative (bf16 queries and
    cache: logits of magnitude ~6 carry ~2e-2 rounding) with the same infinities."""
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(o[b].cpu(), torch.zeros_like(o[b].cpu())) and torch.isneginf(lse[b].cpu()).all()
            continue
        ro, rl = refs[b]
        assert not torch.isnan(o[b]).any()
        rel = float((o[b].cpu() - ro).abs().max() / ro.abs().max())
        assert rel < 2e-2 and cos_diff(o[b].cpu(), ro) < 1e-4, (b, rel)
        assert same_specials(lse[b].cpu(), rl)
        assert bool(((lse[b].cpu() - rl).abs() <= 2e-2 * rl.abs().clamp(min=1)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("halves", [True, "first-whole", False], ids=["halves", "first-whole", "whole"])
@pytest.mark.parametrize("H,lens", [(128, [1000, 64, 3, 0, 700]), (40, [513, 1, 1024]),
                                    (128, [300] * 70 + [4000, 1])])
def test_gpu_mla_gluon_two_split_merge(monkeypatch, halves, H, lens):
    """The Gluon kernel's in-kernel merge of two splits, every way (each split merging half the
    columns; the first to start writing its whole partial and the second merging all; the second
    to finish merging all), twice in a row (its counters must return to zero): requests whose
    second split is empty, 40 heads (rows past the last head masked), and a grid of several
    waves (where the kernel merges whole even with halves allowed)."""
    from hybridsim.kernels import mla_gluon

    gen = torch.Generator().manual_seed(H + len(lens))
    q_lat, q_pe, cache, table = _mla_case(len(lens), 1, H, 512, 64, 64, [max(1, n) for n in lens],
                                          torch.bfloat16, gen)
    if not mla_gluon.gluon_applies(cache, 512, 64, 64):
        pytest.skip("the Gluon kernel needs a Hopper GPU")
    monkeypatch.setattr(mla_gluon, "MERGE_HALVES", halves)
    refs = _mla_references(q_lat, q_pe, cache, table, lens)
    for _ in range(2):
        o, lse = TRI.mla_decode(q_lat, q_pe, cache, table, torch.tensor(lens), 512, 0.1352338, num_splits=2,
                                impl="gluon")
        assert int(mla_gluon._counters(cache.device, 1).abs().sum()) == 0
        _assert_mla_page64_rows(o, lse, refs, lens)


@pytest.mark.gpu
def test_gpu_state_copy_past_2gib():
    """A temporal cache larger than 2^31 bytes: block id x stride must not wrap in 32 bits."""
    pages = 600
    temporal = torch.zeros(2, pages, 128, 64, 64, device="cuda")  # 2 MiB pages: 2.5 GB in all
    assert temporal.numel() * 4 > 2 ** 31
    conv = torch.randn(2, pages, 4, 256, device="cuda")
    temporal[1, pages - 2].normal_()
    table = torch.tensor([[pages - 2, pages - 1]], device="cuda")
    fused_state_copy(conv, temporal, table, torch.tensor([[0, 1, 0, 1, 0, 1]], device="cuda"))
    assert torch.equal(temporal[1, pages - 1], temporal[1, pages - 2])
    assert torch.equal(conv[1, pages - 1, :3], conv[1, pages - 2, 1:])


# Integer arguments that change from step to step, per kernel. Triton specialises an integer by class
# (1, a multiple of 16, other) and compiles a variant for each class it meets: a specialised count
# compiled the kernel again in the middle of a real-scale run (the oracle's comparison count: 3.7 s of
# nemotron_h_8b_mooncake's 18.5 s loop on an H200; paged attention's and MLA decode's split counts too;
# deepseek_v3_mooncake's first run built the latent gather in 4 variants and the write in 2).
STEP_INTS = {
    ("probe_scan_triton", "_probe_scan_kernel"): {"L", "n_cmp"},
    ("probe_scan_chunked", "_chunked_scan_kernel"): {"L", "n_cmp"},
    ("attention_triton", "_paged_attention_kernel"): {"table_stride", "keys_per_split", "num_tokens"},
    ("attention_triton", "combine_splits_kernel"): {"n_rows", "num_splits"},
    ("attention_triton", "_reshape_and_cache_kernel"): {"n"},
    ("mla_gluon", "_mla_gluon_split_kernel"): {"n_qrows", "max_blocks", "keys_per_split", "num_splits"},
    ("mla_seesaw", "_mla_seesaw_kernel"): {"n_qrows", "max_blocks", "keys_per_split"},
    ("dense_attention_f64", "_project_keys_kernel"): {"pair0"},
    ("dense_attention_f64", "_workspace_attention_kernel"): {"pair0"},
    ("triton_kernels", "_scatter_rows_kernel"): {"n"},
    ("triton_kernels", "_gather_rows_kernel"): {"start", "length"},
    ("triton_kernels", "_merge_kernel"): {"n_rows"},
    ("partial_attention", "_partial_attention_kernel"): {"n", "m", "causal_off"},
}


@pytest.mark.parametrize("module,name", sorted(STEP_INTS))
def test_kernels_do_not_specialise_what_changes_every_step(module, name):
    import importlib
    mod = importlib.import_module(f"hybridsim.kernels.{module}")
    if module in ("mla_gluon", "mla_seesaw") and not mod.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    kern = getattr(mod, name)
    if hasattr(kern, "params"):  # compiled (and Gluon, under the interpreter too)
        kept = {p.name for p in kern.params if p.do_not_specialize}
        names = {p.name for p in kern.params}
    else:  # Triton's interpreter: the decorator's arguments
        kept = set(kern.kwargs.get("do_not_specialize") or ())
        names = set(kern.arg_names)
    assert STEP_INTS[module, name] <= names  # (a renamed argument must not pass unnoticed)
    assert STEP_INTS[module, name] <= kept, sorted(STEP_INTS[module, name] - kept)


@pytest.mark.parametrize("which", ["split", "seesaw"])
def test_gluon_launchers_pass_every_kernel_argument(monkeypatch, which):
    """The Gluon launchers run only on Hopper. Here their host side runs on the CPU with the kernel
    replaced by a recorder: every argument must bind to one of the kernel's parameters and every
    parameter must get one (a name the launcher lost fails here, not first on a GPU)."""
    from hybridsim.kernels import mla_gluon, mla_seesaw

    if not mla_gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    mod, name = (mla_gluon, "_mla_gluon_split_kernel") if which == "split" else (mla_seesaw, "_mla_seesaw_kernel")
    params = getattr(mod, name).arg_names
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(grid=grid, args=args, kwargs=kwargs)

    monkeypatch.setattr(mod, name, Recorder())
    monkeypatch.setattr(mla_gluon, "_sm_count", lambda device: 132)
    B, H, L, R, page = 2, 128, 512, 64, 64
    cache = torch.zeros(5, page, L + R, dtype=torch.bfloat16)
    table = torch.tensor([[1, 2], [3, 4]])
    lens = torch.tensor([100, 70])
    q_lat, q_pe = torch.zeros(B, H, L), torch.zeros(B, H, R)
    o_part, lse_part = torch.zeros(2, B, H, L), torch.zeros(2, B, H)
    if which == "split":
        mla_gluon.launch_gluon_split(q_lat, q_pe, cache, table, lens, o_part, lse_part, o_part[0], lse_part[0], H, H,
                                     1, 64, 0.1, 2)
    else:
        mla_seesaw.launch_seesaw(q_lat, q_pe, cache, table, lens, o_part, lse_part, H, H, 1, 64, 0.1, 2)
    assert seen["grid"] == (2, 2, B)
    named = [k for k in seen["kwargs"] if k not in ("num_warps", "num_stages", "maxnreg")]
    assert list(params[:len(seen["args"])]) + named == list(params)
