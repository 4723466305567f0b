"""The float64 attention kernel the GPU oracle runs (``kernels/dense_attention_f64.py``: keys
projected from token ids inside it) against its torch definition: packed rows in shuffled order,
decode rows and long chunks over context, GQA groups of 1, 3 and 4 heads, head sizes whose half
is and is not a power of two, tokens between rows that no row owns (a read past a row's keys
changes its output), outputs poisoned first (a query left unwritten shows)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels.dense_attention_f64 import probe_attention, probe_attention_reference  # noqa: E402
from hybridsim.layers.gqa import GQAProbe, GQAStack  # noqa: E402
from hybridsim.model import AttentionGeometry  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")


def _check(heads: int, kv_heads: int, d: int, seed: int, device: str) -> None:
    geo = AttentionGeometry(layers=2, heads=heads, kv_heads=kv_heads, head_dim=d, dtype="bfloat16")
    stack = GQAStack([GQAProbe(geo, layer, seed) for layer in range(2)], device)
    rng = random.Random(seed)
    rows = [(1, 0), (1, 37), (3, 70), (4, 5), (17, 0), (40, 23), (9, 100)]  # (queries, keys before them)
    rng.shuffle(rows)
    q_len, pos0 = [a for a, _ in rows], [b for _, b in rows]
    gap = 3  # tokens no row owns, between rows
    k_start = [sum(a + b + gap for a, b in rows[:i]) for i in range(len(rows))]
    tokens = torch.tensor([rng.randrange(0, 3_000_000) for _ in range(k_start[-1] + sum(rows[-1]) + gap)],
                          device=device)
    q_start = [sum(q_len[:i]) for i in range(len(rows))]
    qtok = torch.cat([tokens[ks + p0: ks + p0 + ql] for ks, p0, ql in zip(k_start, pos0, q_len)])
    qpos = torch.cat([torch.arange(p0, p0 + ql, device=device) for p0, ql in zip(pos0, q_len)])
    q = stack.queries(qtok, qpos, max(qpos.tolist()) + 1).contiguous()
    want = probe_attention_reference(stack, q, tokens, q_start, q_len, k_start, pos0)
    assert torch.isfinite(want).all()
    out = torch.full_like(q, float("nan"))
    got = probe_attention(stack.cast(torch.float32), q, tokens, q_start, q_len, k_start, pos0, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


@INTERPRETER
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 32), (6, 2, 24), (4, 4, 16)], ids=["group4", "group3-d24", "mha"])
def test_float64_attention_kernel_equals_the_definition(heads, kv_heads, d):
    _check(heads, kv_heads, d, 11, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("heads,kv_heads,d", [(32, 8, 128), (16, 2, 256), (6, 2, 24)])
def test_float64_attention_kernel_on_the_gpu(heads, kv_heads, d):
    _check(heads, kv_heads, d, 12, "cuda")
