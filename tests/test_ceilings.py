"""The honest floors: the read-bandwidth probe against its torch reference, the floor model
(read side, derived write side, compute), and each kernel's traffic accounting.

On a CPU the probe runs under the Triton interpreter at tiny sizes; ``-m gpu`` runs it at real
size and measures the card's rates.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels.ceilings import Ceilings, measure, read_stream, read_stream_reference  # noqa: E402
from hybridsim.kernels.timed import TRAFFIC, Traffic, floor_row, resolve  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")


@INTERPRETER
@pytest.mark.parametrize("n", [256, 300, 17])  # whole tiles (EVEN), a ragged last tile, less than one tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_stream_sums_equal_torch(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    tile, block = 64, 16
    out = torch.full((-(-n // tile),), float("nan"))  # poisoned: every program must write its sum
    got = read_stream(x, tile, block, out=out)
    want = read_stream_reference(x, tile)
    assert got.shape == want.shape and not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_read_stream_refuses_a_tile_it_cannot_split():
    with pytest.raises(ValueError, match="multiple of block"):
        read_stream(torch.zeros(64), 48, 32)


def test_derived_write_side_puts_the_copy_at_exactly_its_floor():
    c = Ceilings(read_Bps=5e12, copy_Bps=4e12, matmul_flops=7e14)
    assert c.write_Bps == pytest.approx(1 / (2 / 4e12 - 1 / 5e12))
    n = 2 ** 32
    copy_floor = c.floor(n, n)
    assert copy_floor.bound == "bandwidth" and copy_floor.pct(2 * n / 4e12) == pytest.approx(100.0)
    assert c.floor(n, 0).pct(n / 5e12) == pytest.approx(100.0)  # a read-only stream at the read rate
    assert c.floor(n, 0).seconds < c.floor(0, n).seconds  # writes cost more than reads here
    slow = c.floor(n, n).pct(4 * n / 4e12)
    assert slow == pytest.approx(50.0)


def test_compute_floor_wins_where_flops_dominate_and_above_100_is_not_clamped():
    c = Ceilings(read_Bps=4.8e12, copy_Bps=4.26e12, matmul_flops=7.08e14)
    f = c.floor(1e6, 1e6, flops=1e12)
    assert f.bound == "compute" and f.seconds == pytest.approx(1e12 / 7.08e14)
    assert f.pct(f.seconds / 1.07) == pytest.approx(107.0)


def test_write_side_unbounded_when_the_copy_beats_two_reads():
    c = Ceilings(read_Bps=2e12, copy_Bps=5e12, matmul_flops=1e15)
    assert math.isinf(c.write_Bps) and c.as_dict()["write_TBps"] is None
    assert c.floor(1000, 10 ** 9).seconds == pytest.approx(1000 / 2e12)
    assert "unbounded" in c.line()


def test_floor_row_sums_per_call_floors_and_names_both_bounds():
    c = Ceilings(read_Bps=4e12, copy_Bps=4e12, matmul_flops=1e15)
    calls = [Traffic(4 * 10 ** 9, 0, 0), Traffic(0, 0, 10 ** 13)]  # 1 ms of reads, 10 ms of compute
    row = floor_row(c, calls, 0.01)
    assert row["floor_s"] == pytest.approx(0.011) and row["bound"] == "bandwidth+compute"
    assert row["pct_floor"] == pytest.approx(110.0)  # faster than the floor: reported as such
    assert row["read_bytes"] == 4 * 10 ** 9 and row["flops"] == 10 ** 13
    assert floor_row(c, [], 0.0) == {"read_bytes": 0, "written_bytes": 0, "flops": 0, "floor_s": 0,
                                     "bound": "", "pct_floor": 0.0}


def _causal_pairs_by_mask(q_lens, seq_lens):
    """Count (query, key) pairs from an explicit bottom-right causal mask."""
    total = 0
    for q, s in zip(q_lens, seq_lens):
        pos = torch.arange(s - q, s)[:, None]
        total += int((torch.arange(s)[None, :] <= pos).sum())
    return total


def test_paged_attention_traffic_counts_kv_once_and_causal_flops():
    H, KVH, D, page = 6, 2, 16, 8
    q_lens, seq_lens = [1, 5, 12, 3], [9, 5, 40, 3]
    k = torch.zeros(20, page, KVH, D, dtype=torch.bfloat16)
    q = torch.zeros(sum(q_lens), H, D, dtype=torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    t = resolve(TRAFFIC["paged_attention"](q, k, k, None, qsl, torch.tensor(seq_lens), 0.1))
    assert t.read == sum(seq_lens) * 2 * KVH * D * 2 + q.numel() * 2
    assert t.written == q.numel() * 4
    assert t.flops == 4 * H * D * _causal_pairs_by_mask(q_lens, seq_lens)


def test_mla_traffic_matches_flashmla_accounting():
    B, nq, H, L, R = 3, 2, 4, 32, 8
    q_lat, q_pe = torch.zeros(B, nq, H, L), torch.zeros(B, nq, H, R)
    cache = torch.zeros(10, 16, L + R, dtype=torch.bfloat16)
    lens = torch.tensor([7, 30, 2])
    t = resolve(TRAFFIC["mla_decode"](q_lat, q_pe, cache, None, lens, L, 0.1))
    assert t.read == int(lens.sum()) * (L + R) * 2 + q_lat.numel() * 4 + q_pe.numel() * 4
    assert t.written == q_lat.numel() * 4 + B * nq * H * 4
    assert t.flops == 2 * H * (L + R + L) * _causal_pairs_by_mask([nq] * B, lens.tolist())


def test_copy_kernels_read_what_they_write():
    conv = torch.zeros(2, 5, 4, 10, dtype=torch.bfloat16)
    temporal = torch.zeros(2, 5, 3, 3)
    items = torch.tensor([[0, 0, 0, 1, 2, 1], [1, 1, 0, 1, 2, 3]])
    t = resolve(TRAFFIC["state_copy"](conv, temporal, None, items))
    assert t.read == t.written == (4 - 1 + 4 - 3) * 10 * 2 + 2 * 9 * 4
    cache = torch.zeros(4, 8, 24, dtype=torch.bfloat16)
    assert TRAFFIC["gather_cache"](cache, None, 0, 13) == Traffic(13 * 24 * 2, 13 * 24 * 2)
    assert TRAFFIC["concat_and_cache"](torch.zeros(5, 24), None, cache) == Traffic(5 * 24 * 4, 5 * 24 * 2)
    key = torch.zeros(6, 2, 8)
    assert TRAFFIC["reshape_and_cache"](key, key, None, cache, cache) == Traffic(2 * 96 * 4, 2 * 96 * 2)
    o, lse = torch.zeros(3, 2, 8), torch.zeros(3, 2)
    assert TRAFFIC["merge_states"](o, lse, o, lse) == Traffic(2 * 48 * 4 + 2 * 6 * 4, 48 * 4 + 6 * 4)


@pytest.mark.gpu
def test_read_stream_at_real_size_and_the_measured_rates():
    """1 GiB streamed: the sums equal torch's; then the card's rates, each plausible against the others."""
    x = torch.randn(2 ** 28, device="cuda")
    out = torch.full((2 ** 28 // 65536,), float("nan"), device="cuda")
    got = read_stream(x, 65536, 4096, 8, out=out)
    torch.testing.assert_close(got, read_stream_reference(x, 65536), rtol=1e-4, atol=1e-3)
    del x
    c = measure(torch.device("cuda"))
    # a read-only stream is no slower than the reads of a copy, so the write side is bounded
    assert c.copy_Bps / 2 < c.read_Bps and not math.isinf(c.write_Bps)
    assert c.read_Bps > 5e11 and c.matmul_flops > 5e13
