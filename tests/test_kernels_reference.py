"""The reference kernels' own semantics: copies, merges with their guards, paged gathers, decode."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridsim.engine.metadata import chunk_metadata, chunk_metadata_varlen
from hybridsim.kernels.reference import ReferenceKernels

K = ReferenceKernels()


def test_conv_copy_is_memmove_safe_in_place():
    conv = torch.randn(1, 4, 6, 5)
    temporal = torch.randn(1, 4, 3)
    before, t_before = conv.clone(), temporal.clone()
    K.state_copy(conv, temporal, torch.tensor([[2, 3]]), torch.tensor([[0, 0, 0, 0, 1, 2]]))
    assert torch.equal(conv[0, 2, :4], before[0, 2, 2:6])  # left shift inside one block
    assert torch.equal(conv[0, 2, 4:], before[0, 2, 4:])  # tail rows untouched
    assert torch.equal(conv[0, [0, 1, 3]], before[0, [0, 1, 3]])
    assert torch.equal(temporal[0, 2], t_before[0, 3]) and torch.equal(temporal[0, 3], t_before[0, 3])


def _partial(q, k, v, scale):
    return K.attention_partial(q, k, v, scale, None)


def test_merge_equals_attention_over_the_union():
    torch.manual_seed(1)
    q = torch.randn(3, 2, 8)
    k = torch.randn(10, 2, 8)
    v = torch.randn(10, 2, 4)
    full_o, full_l = _partial(q, k, v, 0.3)
    o1, l1 = _partial(q, k[:6], v[:6], 0.3)
    o2, l2 = _partial(q, k[6:], v[6:], 0.3)
    o, lse = K.merge_states(o1, l1, o2, l2)
    assert torch.allclose(o, full_o, atol=1e-6, rtol=1e-6) and torch.allclose(lse, full_l, atol=1e-6)


def test_merge_guards_empty_partials():
    o = torch.randn(2, 3, 4)
    lse = torch.randn(2, 3)
    empty_o = torch.full_like(o, float("nan"))
    empty_l = torch.full_like(lse, float("-inf"))
    mo, ml = K.merge_states(empty_o.nan_to_num(0.0), empty_l, o, lse)
    assert torch.allclose(mo, o) and torch.allclose(ml, lse)
    bo, bl = K.merge_states(torch.zeros_like(o), empty_l, torch.zeros_like(o), empty_l)
    assert torch.equal(bo, torch.zeros_like(o)) and torch.isneginf(bl).all()


def test_gather_rejects_unaligned_start_and_follows_block_table():
    cache = torch.randn(6, 4, 3)
    row = torch.tensor([5, 2, 4])
    got = K.gather_cache(cache, row, 4, 6)
    assert torch.equal(got[:4], cache[2]) and torch.equal(got[4:], cache[4, :2])
    with pytest.raises(ValueError):
        K.gather_cache(cache, row, 3, 2)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_mla_decode_independent_of_splits(splits):
    torch.manual_seed(2)
    L, R, H, bs = 16, 4, 3, 4
    cache = torch.randn(8, bs, L + R)
    row = torch.tensor([7, 1, 3, 6, 2])
    q_lat, q_pe = torch.randn(3, H, L), torch.randn(3, H, R)
    ref_o, ref_l = K.mla_decode_one(q_lat, q_pe, cache, row, 18, L, 0.2, num_splits=1)
    o, l = K.mla_decode_one(q_lat, q_pe, cache, row, 18, L, 0.2, num_splits=splits)
    assert torch.allclose(o, ref_o, atol=1e-6) and torch.allclose(l, ref_l, atol=1e-6)
    # dense check with the bottom-right causal mask
    lat = K.gather_cache(cache, row, 0, 18)
    for qi in range(3):
        visible = 18 - 3 + qi + 1
        s = (q_lat[qi] @ lat[:visible, :L].T + q_pe[qi] @ lat[:visible, L:].T) * 0.2
        p = torch.softmax(s, dim=-1)
        assert torch.allclose(o[qi], p @ lat[:visible, :L], atol=1e-5)
        assert torch.allclose(l[qi], torch.logsumexp(s, dim=-1), atol=1e-5)


ON_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs a GPU")])]


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("splits,strided", [(1, False), (2, False), (1, True)])
def test_mla_decode_batch_padding_and_specials(splits, strided, device):
    """A batch of rows of different lengths equals each row alone and reads nothing past a row's end
    (pages no row owns, and the padding's null page, hold NaN); the specials: a query that sees no key,
    and a request of no keys, give o = 0 and lse = -inf; a NaN among a row's visible keys gives lse =
    NaN and p = 0, so o is 0 times the row's values: NaN in the NaN's column, 0 elsewhere (in one split).
    ``strided``: a cache that is a view with gaps between entries (gathered by page and offset, not by row)."""
    torch.manual_seed(3)
    L, R, H, bs, nq = 16, 4, 3, 4, 2
    cache = torch.randn(12, bs, L + R + 3)[..., :L + R] if strided else torch.randn(12, bs, L + R)
    lens = [9, 2, 14, 1, 6, 0]
    rows = [[1, 4, 9], [0], [2, 5, 7, 10], [11], [3, 6], []]
    table = torch.full((6, 4), 8)  # page 8: the null page, NaN
    for b, r in enumerate(rows):
        table[b, :len(r)] = torch.tensor(r, dtype=torch.int64)
    cache[8] = float("nan")
    cache[6, 2:] = float("nan")  # past row 4's end (6 tokens: page 6 holds its positions 4, 5)
    cache[5, 1, 3] = float("nan")  # row 2's position 5 (visible to both its queries), column 3 of kv_c
    q_lat, q_pe = torch.randn(6, nq, H, L), torch.randn(6, nq, H, R)
    cache, table, q_lat, q_pe = (x.to(device) for x in (cache, table, q_lat, q_pe))
    o, lse = K.mla_decode(q_lat, q_pe, cache, table, torch.tensor(lens, device=device), L, 0.2, num_splits=splits)
    for b in (0, 1, 4):
        ob, lb = K.mla_decode_one(q_lat[b], q_pe[b], cache, table[b], lens[b], L, 0.2, num_splits=1)
        assert torch.allclose(o[b], ob, atol=1e-6) and torch.allclose(lse[b], lb, atol=1e-6)
        assert bool(torch.isfinite(o[b]).all()) and bool(torch.isfinite(lse[b]).all())
    for b, q in ((3, 0), (5, 0), (5, 1)):  # nothing visible
        assert torch.equal(o[b, q], torch.zeros_like(o[b, q])) and bool(torch.isneginf(lse[b, q]).all())
    assert bool(torch.isfinite(o[3, 1]).all()) and bool(torch.isfinite(lse[3, 1]).all())
    assert bool(lse[2].isnan().all())
    assert bool(o[2, ..., 3].isnan().all())
    if splits == 1:  # (split partials merge a NaN lse into the whole row)
        column = torch.zeros(L, dtype=torch.bool, device=device)
        column[3] = True
        assert torch.equal(o[2].isnan(), column.expand_as(o[2]))
        assert torch.equal(o[2].nan_to_num(0.0), torch.zeros_like(o[2]))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 90)), min_size=1, max_size=6),
       st.sampled_from([4, 16, 32]))
def test_chunk_metadata_constructions_agree(rows, chunk):
    computed = [c for c, _ in rows]
    qsl = [0]
    for _, n in rows:
        qsl.append(qsl[-1] + n)
    a = chunk_metadata(computed, qsl, chunk)
    b = chunk_metadata_varlen(computed, qsl, chunk)
    assert a == b
    cu, seq_idx, _ = a
    for j in range(len(seq_idx)):  # no chunk crosses a chunk_size boundary of its sequence
        r = seq_idx[j]
        start = computed[r] + cu[j] - qsl[r]
        end = start + cu[j + 1] - cu[j]
        assert start // chunk == (end - 1) // chunk
