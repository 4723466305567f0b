"""The dense attention oracle's batching (pieces of queries within a budget, rows padded
together, each piece over only the keys its last query sees) gives what the one-row
definition gives, for GQA and MLA, whatever the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridsim.layers.gqa import GQAProbe
from hybridsim.layers.gqa import dense_reference as gqa_dense
from hybridsim.layers.mla import MLAProbe
from hybridsim.layers.mla import dense_reference as mla_dense
from hybridsim.model import AttentionGeometry, MLAGeometry
from hybridsim.oracle import GQAOracle, MLAOracle

# (context already committed, new queries): a long prefill chunk, decodes, a chunk over context
ROWS = [(0, 61), (40, 1), (23, 4), (30, 27), (0, 1)]


def _rows(seed: int):
    g = np.random.default_rng(seed)
    return [(g.integers(0, 60_000, size=c + k).astype(np.int64), c, k) for c, k in ROWS]


GQA = (lambda: AttentionGeometry(layers=2, heads=4, kv_heads=2, head_dim=16, dtype="float32"), GQAProbe, gqa_dense,
       GQAOracle, 1e-12)
MLA = (lambda: MLAGeometry(layers=2, heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                           v_head_dim=16), MLAProbe, mla_dense, MLAOracle, 1e-10)


@pytest.mark.parametrize("kind,budget", [(GQA, 1 << 26), (GQA, 40_000), (GQA, 6_000), (MLA, 1 << 28), (MLA, 60_000)],
                         ids=["gqa-one-batch", "gqa-several", "gqa-few-queries-a-piece", "mla-one-batch", "mla-several"])
def test_oracle_batches_equal_the_definition(kind, budget):
    geometry, probe_kind, dense, oracle, rtol = kind
    geo = geometry()
    probes = [probe_kind(geo, layer, seed=3) for layer in range(2)]
    rows = _rows(1)
    got = oracle(probes, torch.device("cpu"), budget).expected(rows)
    for (toks, c, k), out in zip(rows, got):
        for layer, p in enumerate(probes):
            want = dense(p, torch.from_numpy(toks), torch.arange(c, c + k))
            assert torch.allclose(out[layer], want, rtol=rtol, atol=1e-12)
