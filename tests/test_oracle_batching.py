"""The dense attention oracle's batching (pieces of queries within a budget, rows padded
together, each piece over only the keys its last query sees) gives what the one-row
definition gives, for GQA and MLA, whatever the budget."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused oracle's kernel, under the interpreter

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


@pytest.mark.parametrize("work_bound", [False, True], ids=["gpu-rule", "cpu-rule"])
@pytest.mark.parametrize("kind,budget", [(GQA, 1 << 26), (GQA, 40_000), (GQA, 6_000), (MLA, 1 << 28), (MLA, 60_000)],
                         ids=["gqa-one-batch", "gqa-several", "gqa-few-queries-a-piece", "mla-one-batch", "mla-several"])
def test_oracle_batches_equal_the_definition(kind, budget, work_bound):
    geometry, probe_kind, dense, oracle, rtol = kind
    geo = geometry()
    probes = [probe_kind(geo, layer, seed=3) for layer in range(2)]
    rows = _rows(1)
    got = oracle(probes, torch.device("cpu"), budget, work_bound).expected(rows)
    for (toks, c, k), out in zip(rows, got):
        for layer, p in enumerate(probes):
            want = dense(p, torch.from_numpy(toks), torch.arange(c, c + k))
            assert torch.allclose(out[layer], want, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("budget", [1 << 26, 500], ids=["one-launch", "a-row-a-launch"])
def test_fused_oracle_equals_the_definition(monkeypatch, budget):
    """The GPU's oracle path (``fused``: float64 kernels that project the queries and keys from
    token ids and attend; here under the Triton interpreter): the one-row definition's values,
    with rows packed into one call or, past the budget (outputs), a call each."""
    geo = GQA[0]()
    probes = [GQAProbe(geo, layer, seed=3) for layer in range(2)]
    oracle = GQAOracle(probes, torch.device("cpu"), budget, fused=True)
    launches = []
    from hybridsim.kernels import dense_attention_f64 as kernel
    real = kernel.probe_attention
    monkeypatch.setattr(kernel, "probe_attention", lambda *a, **kw: launches.append(len(a[3])) or real(*a, **kw))
    rows = _rows(2)
    got = oracle.expected(rows)
    assert launches == ([len(ROWS)] if budget > 1 << 20 else [1] * len(ROWS))
    for (toks, c, k), out in zip(rows, got):
        assert out.shape == (2, k, geo.heads, geo.head_dim)
        for layer, p in enumerate(probes):
            want = gqa_dense(p, torch.from_numpy(toks), torch.arange(c, c + k))
            torch.testing.assert_close(out[layer], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("work_bound", [False, True], ids=["gpu-rule", "cpu-rule"])
def test_cpu_batches_do_not_pad_decodes_to_a_prefill(monkeypatch, work_bound):
    """A decode row is not padded to a prefill chunk's queries and keys, where work is the cost (a CPU)
    nor on a GPU (padding up to ``PAD_WORK`` times the real work: the two decode rows share a call, the
    prefill chunk would double it): the batches the oracle forms, by shape."""
    geo = MLA[0]()
    probes = [MLAProbe(geo, layer, seed=3) for layer in range(2)]
    oracle = MLAOracle(probes, torch.device("cpu"), work_bound=work_bound)
    shapes = []
    attend = oracle.stack.attend
    monkeypatch.setattr(oracle.stack, "attend", lambda tok, qpos: shapes.append((*tok.shape, qpos.shape[1]))
                        or attend(tok, qpos))
    g = np.random.default_rng(5)
    rows = [(g.integers(0, 60_000, size=c + k).astype(np.int64), c, k) for c, k in [(112, 112), (259, 4), (250, 3)]]
    got = oracle.expected(rows)
    assert shapes == [(1, 224, 112), (2, 263, 4)]
    for (toks, c, k), out in zip(rows, got):
        want = mla_dense(probes[1], torch.from_numpy(toks), torch.arange(c, c + k))
        assert torch.allclose(out[1], want, rtol=1e-10, atol=1e-12)


def _gqa_long():
    geo = AttentionGeometry(layers=2, heads=4, kv_heads=2, head_dim=16, dtype="float32")
    return [GQAProbe(geo, layer, seed=3) for layer in range(2)]


@pytest.mark.parametrize("memo_bytes", [1 << 30, 700_000, 40_000], ids=["kept", "memo-fills", "memo-full"])
def test_key_memo_gives_the_definition_as_requests_grow(memo_bytes):
    """A CPU oracle keeping each request's projected keys (``KeyMemo``) over steps: a request
    prefilled in chunks then decoded, one preempted and computing its prefix again (the memo
    holds more than the row needs), a key reused for other tokens (dropped, projected anew), and
    a memo too small for everything (rows projected whole): always the one-row definition."""
    probes = _gqa_long()
    oracle = GQAOracle(probes, torch.device("cpu"), work_bound=True, memo_bytes=memo_bytes)
    g = np.random.default_rng(9)
    a, b = g.integers(0, 60_000, size=700), g.integers(0, 60_000, size=500)
    steps = [  # (key, tokens committed so far, c, k) per row
        [("a", a[:300], 0, 300), ("b", b[:200], 0, 200)],
        [("a", a[:600], 300, 300), ("b", b[:203], 200, 3)],
        [("a", a[:602], 600, 2), ("b", b[:203], 0, 200)],  # b preempted: its prefix again
        [("a", a[:605], 602, 3), ("b", a[:420], 400, 20)],  # the key b now names other tokens
    ]
    memo = oracle.memo
    for rows in steps:
        got = oracle.expected([(t, c, k) for _, t, c, k in rows], [key for key, *_ in rows])
        for (_, toks, c, k), out in zip(rows, got):
            for layer, p in enumerate(probes):
                want = gqa_dense(p, torch.from_numpy(toks), torch.arange(c, c + k))
                assert torch.allclose(out[layer], want, rtol=1e-12, atol=1e-12)
        assert memo.used <= memo_bytes
    if memo_bytes > 1 << 20:
        assert set(memo.rows) == {"a", "b"} and memo.rows["b"].n == 420
    oracle.forget("a")
    oracle.forget("b")
    assert memo.used == 0 and not memo.rows


@pytest.mark.parametrize("work_bound", [False, True], ids=["gpu-rule", "cpu-rule"])
def test_a_row_in_several_pieces_projects_its_keys_once(monkeypatch, work_bound):
    """A long prefill chunk whose queries take several pieces: its K and V are projected once and
    every piece attends over them (they were projected again for each piece); the definition's values."""
    probes = _gqa_long()
    oracle = GQAOracle(probes, torch.device("cpu"), 40_000, work_bound)
    stack, calls = oracle.stack, {"keys": 0, "pieces": 0, "batched": 0}
    assert stack.key_elems == 2 * 2 * 16 + 64  # K and V (2 KV heads of 16) and the hidden state (64) a key
    keys, attend_keys, attend = stack.keys, stack.attend_keys, stack.attend

    def count(name, fn):
        def wrapped(*a):
            calls[name] += 1
            return fn(*a)
        return wrapped
    monkeypatch.setattr(stack, "keys", count("keys", keys))
    monkeypatch.setattr(stack, "attend_keys", count("pieces", attend_keys))
    monkeypatch.setattr(stack, "attend", count("batched", attend))
    g = np.random.default_rng(4)
    rows = [(g.integers(0, 60_000, size=c + k).astype(np.int64), c, k) for c, k in [(20, 100), (30, 2)]]
    got = oracle.expected(rows)
    assert calls == {"keys": 1, "pieces": 3, "batched": 1}  # 40,000 // 120 // 8 = 41 queries a piece
    for (toks, c, k), out in zip(rows, got):
        for layer, p in enumerate(probes):
            want = gqa_dense(p, torch.from_numpy(toks), torch.arange(c, c + k))
            assert torch.allclose(out[layer], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("absorbed_kernel", [True, False], ids=["absorbed-kernel", "absorbed-torch"])
@pytest.mark.parametrize("association", ["cheaper", "long-rows-expanded"])
@pytest.mark.parametrize("budget", [1 << 28, 5_000], ids=["one-group", "query-pieces"])
def test_fused_mla_oracle_equals_the_definition(monkeypatch, association, budget, absorbed_kernel):
    """The GPU's MLA oracle path (``fused``: rows expanded per head a row and a layer at a time by
    one float64 kernel over keys in memory, absorbed rows by the torch batches or the same kernel
    over the latent in packed groups; here under the Triton interpreter): the one-row
    definition's values, whatever the budget (a small one splits a row's queries into pieces) and
    whichever association a row takes."""
    geo = MLA[0]()
    probes = [MLAProbe(geo, layer, seed=3) for layer in range(2)]
    oracle = MLAOracle(probes, torch.device("cpu"), budget, fused=True, absorbed_kernel=absorbed_kernel)
    from hybridsim.kernels import latent_attention_f64 as kernel
    launches = []
    real = kernel.latent_attention
    monkeypatch.setattr(kernel, "latent_attention", lambda q, k, *a, **kw: launches.append(k.shape[2]) or
                        real(q, k, *a, **kw))
    if association == "long-rows-expanded":
        monkeypatch.setattr(oracle.stack, "expands", lambda b, q, n, bounded=True: q > 8)
    rows = _rows(4)
    got = oracle.expected(rows)
    # kv heads a launch had: per-head keys (all 4 heads, or in groups where the budget is small), or the latent (1)
    expanded = association == "long-rows-expanded"
    assert any(h > 1 for h in launches) == expanded
    if expanded:
        assert max(launches) == (geo.heads if budget > 1 << 20 else 2)  # 5,000 // (61 keys x 40) = 2 heads a group
    assert (1 in launches) == absorbed_kernel
    if budget < 1 << 20 and absorbed_kernel and not expanded:
        assert launches.count(1) > len(ROWS)  # query pieces in groups of their own
    for (toks, c, k), out in zip(rows, got):
        assert out.shape == (2, k, geo.heads, geo.v_head_dim)
        for layer, p in enumerate(probes):
            want = mla_dense(p, torch.from_numpy(toks), torch.arange(c, c + k))
            torch.testing.assert_close(out[layer], want, rtol=1e-12, atol=1e-12)
