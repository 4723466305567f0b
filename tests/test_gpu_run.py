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
    # each executor phase's device time (CUDA events), every phase the host timed, the oracles' share of it
    dev = {d["phase"]: d["total_s"] for d in res.device_timings}
    assert list(dev) == [d["phase"] for d in res.timings if d["phase"] not in ("device wait", "verdicts")]
    assert all(v > 0 for k, v in dev.items() if k != "copies") and sum(dev.values()) < res.wall_s
    assert 0 < res.oracle_device_share < 1 and res.as_dict()["oracle_device_share"] == res.oracle_device_share
    # every check's share: the oracles', the MLA prefill rows' decode path (mla_paths) and the kernel checks'
    assert {"mla_paths", "kernel checks"} <= set(res.check_phases)
    assert res.oracle_device_share < res.checking_device_share < 1
    own = sum(v for k, v in dev.items() if k not in res.check_phases)  # the system's own work
    assert res.oracle_per_system_work == pytest.approx(sum(dev[p] for p in res.oracle_phases if p in dev) / own)
    rep = replay_trace(trace, kernels="triton", device="cuda")
    assert not rep.failed
    _assert_timings(rep.kernel_timings)
    assert set(rep.device_timings) == set(dev) and rep.as_dict()["device_timings"]


def test_a_second_identical_run_builds_no_kernel():
    """``kernel_builds`` counts the variants Triton built inside a run's loop: the same scenario run
    again in the same process needs none (an integer that changes class between steps would build
    one mid-run: ``tests/test_kernels_triton.py::STEP_INTS``), and the count sees the kernels the
    runs hold (it is not empty because it looked nowhere)."""
    from hybridsim.device.builds import built_variants
    path = REPO / "scenarios" / "quickstart.yaml"
    first = plan_scenario(load_scenario(path), kernels="triton", device="cuda")
    second = plan_scenario(load_scenario(path), kernels="triton", device="cuda")
    assert not first.failed and not second.failed
    assert first.kernel_builds is not None and second.kernel_builds == {}
    held = built_variants()
    assert any(k.startswith("probe_scan_triton.") for k in held) and sum(held.values()) >= sum(first.kernel_builds.values())
