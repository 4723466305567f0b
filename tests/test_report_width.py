"""Every table fits an 80-column terminal and never breaks a name (check, trace, preset, kernel,
bug, phase, summary row) across lines or cuts it with an ellipsis."""

from __future__ import annotations

import pytest
from rich.console import Console

from hybridsim import report
from hybridsim.cli import bugs_table
from hybridsim.config import load_scenario
from hybridsim.bugs import BUGS
from hybridsim.fidelity import FidelityReport, StepDiff, run_fidelity
from hybridsim.golden import GoldenRow
from hybridsim.presets import PRESETS, build_preset
from hybridsim.replay import replay_trace
from hybridsim.runner import plan_scenario

from .conftest import DATA, REPO

WIDTH = 80


def render(table) -> list[str]:
    console = Console(width=WIDTH, record=True, color_system=None)
    console.print(table)
    lines = console.export_text().splitlines()
    assert all(len(line.rstrip()) <= WIDTH for line in lines), "\n".join(lines)
    return lines


def assert_whole(lines: list[str], names, *, first_column: bool = True) -> None:
    """Each name stands whole in a table row: in the first column (``│ name ``), or anywhere in a row."""
    rows = [line for line in lines if line.startswith("│")]
    for name in names:
        cell = f"│ {name} " if first_column else f" {name} "
        assert any(cell in row for row in rows), f"{name!r} is not whole in any row:\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def failing_run():
    """A run whose checks fail (so the first-failure column holds long text)."""
    return plan_scenario(load_scenario(REPO / "scenarios/spec_decode.yaml"), bugs={"temporal_without_bias"})


def test_run_tables_fit_80_columns(failing_run):
    res = failing_run
    assert res.failed
    lines = render(report.summary_table(res))
    labels = ["steps", "requests (finished)", "scheduled tokens (prefill / decode)", "prefix hit tokens (rate)",
              "wall time (plan + execute + check)", "of which planning (schedule + update)"]
    assert_whole(lines, labels)
    lines = render(report.checks_table(res))
    assert_whole(lines, res.checks.tallies)
    assert "…" not in "\n".join(lines)
    lines = render(report.timings_table(res))
    assert_whole(lines, ["schedule", "update", "whole loop"] + [f"execute: {d['phase']}" for d in res.timings])


def test_replay_table_of_a_recording_fits_80_columns():
    res = replay_trace(DATA / "vllm-recorded/spec_ngram.jsonl")
    lines = render(report.replay_table(res))
    assert_whole(lines, res.checks.tallies)


def test_golden_table_keeps_trace_names_whole():
    names = sorted(p.name for p in (REPO / "traces").glob("*.jsonl"))
    assert "mixed_hybrid_mla.jsonl" in names and "vllm_shared_prefix.jsonl" in names
    rows = [GoldenRow(n, 41, 6_643, "FAIL", ["digests.mla0.latent: 1a2b3c4d5e6f… -> 9f8e7d6c5b4a…",
                                              "checks.ssm.running_state.count: 570 -> 571",
                                              "ssm.output: 3 failures"]) for n in names]
    rows[0] = GoldenRow(names[0], 58, 7_930, "no expected file",
                        [f"run with --update-expected to create {names[0][:-6]}.expected.json"])
    rows[1] = GoldenRow(names[1], 49, 5_227, "pass")
    lines = render(report.golden_table(rows, False))
    assert_whole(lines, names)
    assert any("no expected file" in line for line in lines)
    text = "\n".join(lines)
    assert "checks.ssm.running_state.count: 570 -> 571" in text  # the differences, under the table
    lines = render(report.golden_table([GoldenRow(n, 41, 6_643, "updated", ["created"]) for n in names], True))
    assert_whole(lines, names)


def test_kernel_timings_table_keeps_kernel_names_whole():
    kernels = ["state_copy", "concat_and_cache", "gather_cache", "merge_states", "mla_decode"]
    kt = {"device": "NVIDIA H100 80GB HBM3", "copy_ceiling_TBps": 2.99, "read_ceiling_TBps": 3.21,
          "write_side_TBps": 2.80, "matmul_TFLOPs": 708.0, "kernels": [
        {"kernel": k, "calls": 12_345, "untimed": 12, "total_s": 1.23456, "median_us": 1_234.5, "p90_us": 98_765.4,
         "bytes": 987_654_321_000, "GBps": 2_760.5, "bound": ("bandwidth", "compute", "bandwidth+compute")[i % 3],
         "pct_floor": 104.4} for i, k in enumerate(kernels)]}
    lines = render(report.kernel_timings_table(kt))
    assert_whole(lines, kernels)
    assert "…" not in "\n".join(lines)


def test_presets_table_keeps_preset_names_whole():
    lines = render(report.presets_table([(build_preset(n), PRESETS[n]["source"]) for n in PRESETS], 3))
    assert_whole(lines, PRESETS)
    assert "…" not in "\n".join(lines)


def test_bugs_table_keeps_bug_and_check_names_whole():
    lines = render(bugs_table())
    assert_whole(lines, BUGS)
    assert_whole(lines, {check for _, check in BUGS.values()}, first_column=False)
    assert "…" not in "\n".join(lines)


def test_fidelity_table_fits_80_columns():
    rep = run_fidelity(str(DATA / "vllm-recorded/mem_pressure.jsonl"))
    render(report.fidelity_table(rep))
    diffs = [StepDiff(12, "scheduled tokens", "r0:16, r1:240, r2:1, r3:1, r4:1", "r0:16, r1:224, r2:1, r3:1"),
             StepDiff(13, "prefix hits", "r5:96", "r5:80"), StepDiff(14, "preempted", "r7", "-"),
             StepDiff(200, "step missing", "absent", "present")]
    lines = render(report.fidelity_table(FidelityReport("data/vllm-recorded/mem_pressure.jsonl", 199, 200, 195,
                                                        190, diffs, 190)))
    assert_whole(lines, ["scheduled tokens", "prefix hits", "preempted", "step missing"], first_column=False)
