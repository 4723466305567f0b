"""On the GPU: a scenario executed with the Triton provider, every check green, and the
per-kernel CUDA-event timings filled in with real calls, times and bytes."""

from __future__ import annotations

import pytest

from hybridsim.config import load_scenario
from hybridsim.replay import replay_trace
from hybridsim.runner import plan_scenario

from .conftest import REPO

pytestmark = pytest.mark.gpu


def _assert_timings(kt):
    assert kt is not None and kt["copy_ceiling_TBps"] > 0.1 and kt["read_ceiling_TBps"] > 0.1
    assert kt["matmul_TFLOPs"] > 1
    names = {r["kernel"] for r in kt["kernels"]}
    assert {"state_copy", "mla_decode", "merge_states", "concat_and_cache"} <= names
    for r in kt["kernels"]:
        assert r["calls"] > 0 and r["total_s"] > 0 and r["bytes"] > 0 and r["p90_us"] >= r["median_us"] > 0
        assert r["bytes"] == r["read_bytes"] + r["written_bytes"] and r["floor_s"] > 0
        assert r["bound"] in ("bandwidth", "compute", "bandwidth+compute")
        assert r["pct_floor"] == pytest.approx(100 * r["floor_s"] / r["total_s"])


def test_gpu_run_and_replay_report_kernel_timings(tmp_path):
    trace = tmp_path / "q.jsonl"
    res = plan_scenario(load_scenario(REPO / "scenarios" / "quickstart.yaml"), kernels="triton", device="cuda",
                        record=trace)
    assert not res.failed
    _assert_timings(res.kernel_timings)
    rep = replay_trace(trace, kernels="triton", device="cuda")
    assert not rep.failed
    _assert_timings(rep.kernel_timings)
