"""The batched block copy (partial-block prefix hits' private copies): Triton against its torch
reference on fresh random pages, poisoned destinations, shuffled pairs; its check; refusals."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.checks import Checks  # noqa: E402
from hybridsim.kernels.checked import CheckedKernels  # noqa: E402
from hybridsim.kernels.reference import ReferenceKernels  # noqa: E402
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

REF = ReferenceKernels()
TRI = TritonKernels(poison=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(slots, pages, elems, n, dtype, seed):
    """Random pages (destinations poisoned with NaN) and n independent pairs drawn from a shuffle."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(slots, pages, elems, generator=gen).to(dtype)
    perm = (torch.randperm(pages - 1, generator=gen) + 1)[: 2 * n]
    pairs = perm.view(n, 2)
    data[:, pairs[:, 1]] = float("nan")
    return data.to(DEV), pairs.to(DEV)


@pytest.mark.parametrize("slots,elems,n,dtype", [(1, 1, 1, torch.float32), (3, 1000, 4, torch.float32),
                                                 (2, 4097, 3, torch.bfloat16), (4, 33, 7, torch.float16)])
def test_block_copy_bit_exact(slots, elems, n, dtype):
    data, pairs = _case(slots, 24, elems, n, dtype, slots * 1000 + elems + n)
    want = data.clone()
    REF.block_copy(want, pairs)
    got = data.clone()
    TRI.block_copy(got, pairs)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert not torch.isnan(got[:, pairs[:, 1]]).any()  # every poisoned destination element written
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[pairs[:, 1].cpu()] = False
    assert torch.equal(got[:, untouched.to(DEV)].isnan(), data[:, untouched.to(DEV)].isnan())


def test_block_copy_keeps_nan_bits_and_strided_slots():
    """A NaN page travels as its bits; a slot-strided view (an arena's slots) is reached."""
    base = torch.randn(3, 10, 64, device=DEV)
    base.view(torch.int32)[:, 2] = 0x7FC0_1234
    pages = base[:, :, 8:40]  # (slots, pages, 32) with the arena's strides
    pairs = torch.tensor([[2, 5], [7, 1]], device=DEV)
    want = base.clone()
    REF.block_copy(want[:, :, 8:40], pairs)
    TRI.block_copy(pages, pairs)
    assert torch.equal(base.view(torch.int32), want.view(torch.int32))


def test_block_copy_refuses_dependent_or_outside_pairs():
    data = torch.zeros(1, 8, 4, device=DEV)
    for bad in ([[1, 2], [2, 3]], [[1, 3], [2, 3]], [[1, 9]]):
        for k in (REF, TRI):
            with pytest.raises(ValueError):
                k.block_copy(data, torch.tensor(bad))


def test_block_copy_check_passes_and_catches_a_wrong_kernel():
    data, pairs = _case(2, 16, 40, 3, torch.float32, 7)
    good, bad = Checks(), Checks()
    k = CheckedKernels(TritonKernels(poison=True), good)
    k.block_copy(data.clone(), pairs)
    k.flush(0)
    assert good.get("kernel.block_copy").count == 1 and good.get("kernel.block_copy").failures == 0
    k = CheckedKernels(_OffByOne(), bad)
    k.block_copy(data.clone(), pairs)
    k.flush(0)
    assert bad.get("kernel.block_copy").failures == 1


class _OffByOne(TritonKernels):
    """A kernel that reads the page after its source."""

    def block_copy(self, pages, pairs):
        p = pairs.clone().cpu()
        p[:, 0] = min(set(range(1, pages.shape[1])) - set(p.flatten().tolist()))  # (a page no copy names)
        super().block_copy(pages, p)


@pytest.mark.gpu
def test_block_copy_past_2gib_on_gpu():
    """Pages past 2^31 bytes into a slot (int64 offsets), at a real page size (Nemotron-H-8B)."""
    elems = 1_056 * 2 * 8 * 128 // 2  # a bf16 attention page of one layer, as int32 elements
    pages = torch.zeros(2, 1200, elems, dtype=torch.int32, device="cuda")  # ~5.2 GB
    pages[:, 3] = torch.arange(elems, dtype=torch.int32, device="cuda")
    pages[:, 1100] = 7
    pairs = torch.tensor([[3, 1190], [1100, 4]], device="cuda")
    TRI.block_copy(pages, pairs)
    assert torch.equal(pages[:, 1190], pages[:, 3]) and bool((pages[:, 4] == 7).all())
