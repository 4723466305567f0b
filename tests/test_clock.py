"""The executor's phase clock (device/clock.py) and the timings table that reports it."""

from __future__ import annotations

import time

import pytest
import torch
from rich.console import Console

from hybridsim import report
from hybridsim.config import load_scenario
from hybridsim.device.clock import PhaseClock
from hybridsim.replay import replay_trace
from hybridsim.runner import phase_share, plan_scenario

from .conftest import REPO


def test_host_time_by_phase_and_an_inner_phase_comes_off_the_outer():
    clock = PhaseClock(torch.device("cpu"), ("a", "b"))
    with clock.phase("b"):
        time.sleep(0.02)
    with clock.phase("b"):
        time.sleep(0.01)
    assert list(clock.host) == ["a", "b"] and clock.host["a"] == 0.0 and 0.03 <= clock.host["b"] < 1.0
    assert clock.device is None  # (a CPU's device time is its host time)
    before = dict(clock.host)
    with clock.phase("a"):
        time.sleep(0.01)
        with clock.phase("b"):
            time.sleep(0.05)
            with clock.phase("b"):  # (inside itself: the same phase)
                time.sleep(0.01)
        time.sleep(0.01)
    assert 0.02 <= clock.host["a"] < 0.05  # its own 20 ms, not the 60 ms inside it
    assert 0.06 <= clock.host["b"] - before["b"] < 0.09
    with pytest.raises(ValueError):  # a phase that raises still counts, and the clock is usable after it
        with clock.phase("c"):
            raise ValueError
    with clock.phase("c"):
        pass
    assert list(clock.host) == ["a", "b", "c"] and clock.host["c"] > 0.0  # (a phase not declared: listed last)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_device_time_is_the_phase_work_not_the_host_launch():
    """A phase that only queues a long matmul chain: its host time is the launch, its device time the
    work; read without waiting only once the work is done. The same chain inside another phase counts as
    the inner phase's, not the outer one's."""
    clock = PhaseClock(torch.device("cuda"), ("work", "idle"))
    x = torch.randn(4096, 4096, device="cuda")
    x = x @ x * 1e-3  # (the library's first call sets itself up on the host: not this test's subject)
    torch.cuda.synchronize()
    with clock.phase("work"):
        for _ in range(20):
            x = x @ x * 1e-3
    with clock.phase("idle"):
        with clock.phase("work"):  # (inside another phase: its time comes off that one's)
            for _ in range(20):
                x = x @ x * 1e-3
    clock.collect()  # (most likely still running: nothing waits)
    pending = clock.device["work"] == 0.0
    clock.collect(wait=True)
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 1e-3  # (collect(wait=True) left nothing running)
    assert clock.device["work"] > 5 * clock.host["work"] or not pending
    assert clock.device["work"] > 1e-4 and clock.device["idle"] < clock.device["work"] / 10


def test_timings_table_with_device_columns_fits_80_columns():
    """A CPU run given device timings as a GPU run has them: the table adds each phase's device time a step and
    its share, the whole loop's as the phases' sum, and says the oracles' share under it."""
    res = plan_scenario(load_scenario(REPO / "scenarios/quickstart.yaml"), kernels="reference", device="cpu")
    assert res.device_timings is None and res.oracle_device_share is None
    assert res.oracle_phases == ("oracle", "mla_oracle")  # (quickstart's layer kinds: Mamba and MLA)
    assert "device" not in " ".join(c.header for c in report.timings_table(res).columns)
    # (the reference provider is not checked against itself: no kernel checks phase here)
    assert res.check_phases == ("oracle", "mla_oracle", "mla_paths")
    res.device_timings = [{"phase": "mamba", "total_s": 3.0}, {"phase": "copies", "total_s": 0.5},
                          {"phase": "oracle", "total_s": 2.0}, {"phase": "mla", "total_s": 2.5},
                          {"phase": "mla_paths", "total_s": 1.0}, {"phase": "mla_oracle", "total_s": 1.0}]
    assert res.oracle_device_share == pytest.approx(0.3)
    assert res.checking_device_share == pytest.approx(0.4)
    assert phase_share([{"phase": "oracle", "total_s": 0.0}], ("oracle",)) is None
    console = Console(width=80, record=True, color_system=None)
    console.print(report.timings_table(res))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    steps = res.stats.steps
    row = next(line for line in text.splitlines() if "execute: mla_oracle" in line)
    assert f"{1e6 / steps:,.1f} µs" in row and "10.0%" in row
    whole = next(line for line in text.splitlines() if "whole loop" in line)
    assert f"{1e7 / steps:,.1f} µs" in whole and "100.0%" in whole
    assert "(oracle, mla_oracle) 30.0% of it" in " ".join(text.split())
    assert "checking in all (oracle, mla_paths, mla_oracle) 40.0%" in " ".join(text.split())
    assert res.as_dict()["oracle_device_share"] == pytest.approx(0.3)
    assert res.as_dict()["checking_device_share"] == pytest.approx(0.4)
    # the oracles' 3.0 s over the system's own 6.0 (mamba, copies, mla: what checks nothing)
    assert res.oracle_per_system_work == pytest.approx(0.5) == res.as_dict()["oracle_per_system_work"]
    assert "the system's own work the rest (the oracles 0.50× it)" in " ".join(text.split())


def test_decode_path_over_prefill_rows_is_a_checking_phase():
    """The engine runs a prefill row through the prefill path only: the decode path's calls that serve no decode
    row are there for ``mla.paths`` alone and are timed as ``mla_paths``, a checking phase, not the system's
    ``mla``; the check itself still compares every prefill row's two paths."""
    res = plan_scenario(load_scenario(REPO / "scenarios/quickstart.yaml"), kernels="reference", device="cpu")
    host = {t["phase"]: t["total_s"] for t in res.timings}
    assert host["mla_paths"] > 0 and host["mla"] > 0
    paths = res.checks.tallies["mla.paths"]
    assert paths.count > 0 and paths.failures == 0


def test_replay_reports_the_same_shares_as_a_run(tmp_path):
    """A replay names the oracles' and the checking phases as the run does, and on a GPU (its device timings
    given here as a GPU replay has them) reports their shares in ``--json`` as the run's ``--json`` does."""
    trace = tmp_path / "q.jsonl"
    res = plan_scenario(load_scenario(REPO / "scenarios/quickstart.yaml"), kernels="reference", device="cpu",
                        record=trace)
    rep = replay_trace(trace, kernels="reference", device="cpu")
    assert (rep.oracle_phases, rep.check_phases) == (res.oracle_phases, res.check_phases)
    assert "oracle_device_share" not in rep.as_dict()
    rep.device_timings = {"mamba": 3.0, "copies": 0.5, "oracle": 2.0, "mla": 2.5, "mla_paths": 1.0, "mla_oracle": 1.0}
    d = rep.as_dict()
    assert d["oracle_device_share"] == pytest.approx(0.3) and d["checking_device_share"] == pytest.approx(0.4)
    assert d["oracle_per_system_work"] == pytest.approx(0.5)

