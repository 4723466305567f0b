"""The MLA prefill path's streaming attention (``partial_attention.py``) against its reference
(``ReferenceKernels.attention_partial``): fresh random inputs, poisoned outputs, masks random and
causal, keys shared by the heads or per head, tiles of addresses and of the copy engine, rows that
see nothing, NaN and +inf scores.

On a CPU the kernel runs under the Triton interpreter at small sizes (CI); ``-m gpu`` runs it at
DeepSeek-V3's prefill shapes in TF32 and in full float32, and the executor's prefill path end to
end through the provider.
"""

from __future__ import annotations

import pytest
import torch

from .kernel_env import DEV, REF, TRI  # (first: the interpreter where there is no GPU)

from hybridsim.kernels import partial_attention as pa  # noqa: E402
from hybridsim.kernels.reference import ReferenceKernels  # noqa: E402
from hybridsim.kernels.timed import _partial_traffic  # noqa: E402
SMALL = (16, 16, 4, 1)  # tiles small enough that the interpreter walks several of them


def _case(n, m, H, dq, dv, shared, gen, dev=DEV):
    q = torch.randn(n, H, dq, generator=gen).to(dev)
    k = torch.randn(m, dq, generator=gen) if shared else torch.randn(m, H, dq, generator=gen)
    v = torch.randn(m, dv, generator=gen) if shared else torch.randn(m, H, dv, generator=gen)
    return q, k.to(dev), v.to(dev)


def _causal(n, m, off, dev=DEV):
    return torch.arange(m, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None] + off


def _agree(got, want, tol):
    """Outputs within ``tol`` of the largest output; lse within ``tol`` where finite, the same
    -inf / +inf / NaN elsewhere."""
    o, lse = got
    wo, wl = want
    assert not torch.isnan(o).any(), "an output element was not written (poisoned NaN survived)"
    scale = wo.abs().max().clamp_min(1e-30)
    assert float((o - wo).abs().max() / scale) <= tol
    fin = torch.isfinite(wl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.equal(torch.isnan(lse), torch.isnan(wl))
    assert torch.equal(lse[torch.isinf(wl)], wl[torch.isinf(wl)])
    if fin.any():
        assert float((lse[fin] - wl[fin]).abs().max()) <= tol * max(1.0, float(wl[fin].abs().max()))


@pytest.mark.parametrize("n,m,H,dq,dv,shared", [
    (5, 17, 3, 24, 20, False),   # odd sizes: every dimension masked, a remainder of the query dim
    (33, 40, 2, 192, 128, False),  # DeepSeek-V3's head dims (128 + 64 queries and keys, 128 values)
    (21, 35, 2, 64, 48, True),   # keys and values shared by the heads (absorbed form)
    (1, 1, 1, 16, 16, False),
])
@pytest.mark.parametrize("masking", ["none", "random", "causal"])
def test_matches_reference(n, m, H, dq, dv, shared, masking):
    gen = torch.Generator().manual_seed(n * 131 + m * 7 + H + dq)
    q, k, v = _case(n, m, H, dq, dv, shared, gen)
    off = max(m - n, 0)
    mask = causal = None
    if masking == "random":
        mask = (torch.rand(n, m, generator=gen) < 0.7).to(DEV)
        mask[0] = False  # a row that sees nothing: 0 and -inf
    elif masking == "causal":
        mask, causal = _causal(n, m, off), off
    want = REF.attention_partial(q, k, v, 0.13, mask)
    for descriptors in (True, False):
        got = pa.partial_attention(q, k, v, 0.13, mask, torch.full((n, H, dv), float("nan"), device=DEV),
                                   torch.full((n, H), float("nan"), device=DEV), config=SMALL,
                                   precision="ieee", descriptors=descriptors, causal=causal)
        _agree(got, want, 1e-5)


def test_causal_promise_is_what_the_kernel_computes():
    """With ``causal`` the mask tensor is not read: a different mask of the same shape gives the
    causal result, and a mask of another shape is refused."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _case(20, 36, 2, 32, 32, False, gen)
    want = REF.attention_partial(q, k, v, 0.2, _causal(20, 36, 16))
    got = pa.partial_attention(q, k, v, 0.2, torch.ones(20, 36, dtype=torch.bool, device=DEV), config=SMALL,
                               precision="ieee", causal=16)
    _agree(got, want, 1e-5)
    with pytest.raises(ValueError, match="mask of shape"):
        pa.partial_attention(q, k, v, 0.2, torch.ones(20, 35, dtype=torch.bool, device=DEV), causal=16)


def test_rows_with_nan_or_inf_scores():
    """A visible NaN score makes the row 0 and NaN, a visible +inf one 0 and +inf (the reference's
    softmax); a NaN score under the mask changes nothing; a row that sees nothing is 0 and -inf."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = _case(6, 40, 1, 16, 16, False, gen)
    k[3, 0, 0] = float("nan")
    k[30, 0, :] = 0.0
    q[4, 0, :] = 0.0
    k[30, 0, 0] = float("inf")
    q[4, 0, 0] = 1.0  # row 4 meets +inf at key 30
    mask = torch.ones(6, 40, dtype=torch.bool, device=DEV)
    mask[1, 3] = False  # row 1 does not see the NaN key
    mask[4, 3] = False
    mask[5] = False  # row 5 sees nothing
    want = REF.attention_partial(q, k, v, 0.5, mask)
    assert torch.isnan(want[1][0]).all() and torch.isinf(want[1][4]).all() and want[1][5, 0] == float("-inf")
    got = TRI.attention_partial(q, k, v, 0.5, mask)
    _agree(got, want, 1e-5)


def test_provider_takes_every_query_in_one_call():
    """The streaming kernel keeps no score matrix: the executor's prefill path gives it all
    queries at once; the reference bounds its scores."""
    assert TRI.partial_query_rows(8192, 128) >= 1 << 30
    assert REF.partial_query_rows(8192, 128) == (1 << 26) // (8192 * 128)


def test_causal_promise_only_to_providers_that_take_it():
    """A plugin's ``attention_partial`` written before the ``causal`` parameter gets the mask alone
    (through the timing and checking wrappers too); the built-in providers take the promise."""
    from hybridsim.kernels.reference import takes_causal

    class OldPlugin(ReferenceKernels):
        def attention_partial(self, q, k, v, scale, mask):
            return super().attention_partial(q, k, v, scale, mask)

    class Wrapper:
        def __init__(self, inner):
            self.inner = inner

    assert takes_causal(REF) and takes_causal(TRI) and takes_causal(Wrapper(Wrapper(TRI)))
    assert not takes_causal(OldPlugin()) and not takes_causal(Wrapper(OldPlugin()))


def test_traffic_counts_visible_pairs():
    q, k, v = torch.zeros(6, 2, 24), torch.zeros(10, 2, 24), torch.zeros(10, 2, 8)
    per_pair = 2 * 2 * (24 + 8)
    for off in (0, 3, 4, 12):
        mask = _causal(6, 10, off, "cpu")
        assert _partial_traffic(q, k, v, 1.0, mask, causal=off).flops == per_pair * int(mask.sum())
        assert _partial_traffic(q, k, v, 1.0, mask)().flops == per_pair * int(mask.sum())
    assert _partial_traffic(q, k, v, 1.0, None).flops == per_pair * 60


# ----------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("n,m,causal", [(1024, 1024, 0), (700, 3000, None), (1, 8192, None), (256, 1280, 1024)])
@pytest.mark.parametrize("precision,tol", [("tf32", 1e-2), ("ieee", 1e-5)])
def test_gpu_deepseek_prefill_shapes(n, m, causal, precision, tol):
    """128 heads, queries and keys 128 + 64, values 128 (DeepSeek-V3's up-projected prefill), the
    default tiles, against float64. TF32 rounds q, k, v and the probabilities to 11 significant
    bits (2^-11 each); an output row averages thousands of random values, so its error measured
    against the largest output is larger: 4.3-4.7e-3 over 3,000-8,192 keys on an H200 (the 16-bit
    cache's tolerance, which this path serves, is 2e-2). Full float32 products within 1e-5."""
    gen = torch.Generator().manual_seed(n + m)
    q, k, v = _case(n, m, 128, 192, 128, False, gen)
    mask = _causal(n, m, causal) if causal is not None else None
    want = REF.attention_partial(q.double(), k.double(), v.double(), 192 ** -0.5, mask)
    got = pa.partial_attention(q, k, v, 192 ** -0.5, mask, torch.full((n, 128, 128), float("nan"), device=DEV),
                               torch.full((n, 128), float("nan"), device=DEV), precision=precision, causal=causal)
    _agree((got[0].double(), got[1].double()), want, tol)


@pytest.mark.gpu
def test_gpu_descriptor_and_gather_paths_agree():
    gen = torch.Generator().manual_seed(11)
    q, k, v = _case(300, 900, 16, 192, 128, False, gen)
    a = pa.partial_attention(q, k, v, 0.1, None, precision="ieee")
    b = pa.partial_attention(q, k, v, 0.1, None, precision="ieee", descriptors=False)
    assert float((a[0] - b[0]).abs().max()) <= 1e-5 and float((a[1] - b[1]).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("descriptors", [True, False])
def test_gpu_random_mask(descriptors):
    """A mask read from memory (tiles no row sees skipped), compiled: rows that see nothing, a key
    tile nobody sees, the rest random."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = _case(200, 700, 8, 192, 128, False, gen)
    mask = (torch.rand(200, 700, generator=gen) < 0.5).to(DEV)
    mask[:, 256:384] = False
    mask[7] = False
    want = REF.attention_partial(q.double(), k.double(), v.double(), 0.1, mask)
    got = pa.partial_attention(q, k, v, 0.1, mask, torch.full((200, 8, 128), float("nan"), device=DEV),
                               torch.full((200, 8), float("nan"), device=DEV), precision="ieee",
                               descriptors=descriptors)
    _agree((got[0].double(), got[1].double()), want, 1e-5)
