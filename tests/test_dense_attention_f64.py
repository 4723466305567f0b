"""The float64 attention kernel the GPU oracle runs (``kernels/dense_attention_f64.py``) against its
torch definition: packed rows in shuffled order, decode rows and long chunks over context, GQA
groups of 1, 3 and 4 heads, head sizes that are and are not powers of two; outputs poisoned first
and the keys between rows NaN, so a read past a row's keys or a query left unwritten shows."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels.dense_attention_f64 import causal_attention_f64, causal_attention_f64_reference  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")


def _case(heads: int, kv_heads: int, d: int, seed: int, device: str = "cpu"):
    rng = random.Random(seed)
    rows = [(1, 0), (1, 37), (3, 70), (4, 5), (17, 0), (40, 23), (9, 100)]  # (queries, keys before them)
    rng.shuffle(rows)
    q_len, pos0 = [a for a, _ in rows], [b for _, b in rows]
    q_start = [sum(q_len[:i]) for i in range(len(rows))]
    gap = 3  # keys no row owns, between rows
    k_start = [sum(a + b + gap for a, b in rows[:i]) for i in range(len(rows))]
    n_keys = k_start[-1] + q_len[-1] + pos0[-1] + gap
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sum(q_len), heads, d, generator=g, dtype=torch.float64)
    k = 4 * torch.randn(2, n_keys, kv_heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, n_keys, kv_heads, d, generator=g, dtype=torch.float64)
    for ks, ql, p0 in zip(k_start, q_len, pos0):
        k[:, ks + ql + p0: ks + ql + p0 + gap] = float("nan")
        v[:, ks + ql + p0: ks + ql + p0 + gap] = float("nan")
    t = lambda x: x.to(device)  # noqa: E731
    return t(q), t(k), t(v), q_start, q_len, k_start, pos0


def _check(heads, kv_heads, d, seed, device):
    q, k, v, q_start, q_len, k_start, pos0 = _case(heads, kv_heads, d, seed, device)
    want = causal_attention_f64_reference(q, k, v, q_start, q_len, k_start, pos0, 0.25)
    assert torch.isfinite(want).all()
    out = torch.full_like(q, float("nan"))
    got = causal_attention_f64(q, k, v, q_start, q_len, k_start, pos0, 0.25, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


@INTERPRETER
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 32), (6, 2, 24), (4, 4, 16)], ids=["group4", "group3-d24", "mha"])
def test_float64_attention_kernel_equals_the_definition(heads, kv_heads, d):
    _check(heads, kv_heads, d, 11, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("heads,kv_heads,d", [(32, 8, 128), (16, 2, 256), (6, 2, 24)])
def test_float64_attention_kernel_on_the_gpu(heads, kv_heads, d):
    _check(heads, kv_heads, d, 12, "cuda")
