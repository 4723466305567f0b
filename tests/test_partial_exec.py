"""Partial-block prefix hits executed: the step's block copies travel through plans, traces and
recordings, the executor makes them with the provider's block_copy before the step's writes, and
the checks compare the hit's tokens and unit checkpoint states bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.checks import Checks  # noqa: E402
from hybridsim.errors import InputError  # noqa: E402
from hybridsim.execute import make_executor  # noqa: E402
from hybridsim.config import parse_scenario  # noqa: E402
from hybridsim.replay import replay_trace  # noqa: E402
from hybridsim.trace import header_dict, read_trace, write_trace  # noqa: E402

from .helpers import manual_workload, simulate  # noqa: E402
from .test_partial_hits import PARTIAL, SCENARIO  # noqa: E402


def _two_identical_prompts():
    """r1 hits 96 tokens of r0's 100: block 0 whole, block 1 through a private copy (both groups)."""
    wl = manual_workload([list(range(1, 101))] * 2 + [list(range(1, 101)) + [7] * 30], [0, 8, 9], [4, 4, 4])
    return wl, simulate(SCENARIO, wl)


def test_plans_carry_the_copies_in_group_order():
    _, (sim, records) = _two_identical_prompts()
    hits = {s.req_id: s for p, _ in records for s in p.scheduled if s.is_new}
    assert hits["r1"].prefix_hit_tokens == 96
    step = next(p for p, _ in records if any(s.req_id == "r1" and s.is_new for s in p.scheduled))
    rows = hits["r1"].new_block_ids
    assert len(step.block_copies) == len(sim.groups) == len(rows)  # (one per group: states and K/V)
    for (src, dst), row in zip(step.block_copies, rows):
        assert dst == row[1] and src not in row


def test_trace_round_trip_keeps_copies_and_old_traces_read_none(tmp_path):
    loaded = parse_scenario(SCENARIO, "t.yaml")
    wl, (sim, records) = _two_identical_prompts()
    header = header_dict(loaded.scenario.model_dump(mode="json"), sim.groups, wl.requests, "test")
    path = tmp_path / "t.jsonl"
    write_trace(path, header, records)
    back = read_trace(path)
    assert [p for _, p, _ in back.steps] == [p for p, _ in records]
    assert any(p.block_copies for _, p, _ in back.steps)
    lines = path.read_text().splitlines()
    old = tmp_path / "old.jsonl"  # a trace from before copies were written: read as none
    old.write_text("\n".join([lines[0]] + [json.dumps({k: v for k, v in json.loads(ln).items() if k != "copies"})
                                             for ln in lines[1:]]) + "\n")
    assert not any(p.block_copies for _, p, _ in read_trace(old).steps)
    with pytest.raises(InputError, match="no block copies"):  # executing it would read unfilled copies
        replay_trace(old)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0]] + [ln.replace('"copies":[[', '"copies":[[-') for ln in lines[1:]]) + "\n")
    with pytest.raises(InputError, match="'copies' must be a list of"):
        read_trace(bad)


def test_triton_block_copy_executes_the_hits_green():
    """The Triton provider (interpreter on a CPU) inside the executor: every copy equals the
    reference's, and the hits' K/V and Mamba states equal what their tokens give."""
    loaded = parse_scenario(SCENARIO, "t.yaml")
    _, (sim, records) = _two_identical_prompts()
    checks = Checks()
    ex = make_executor(loaded.scenario, sim.groups, checks, "full", set(), "triton", "cpu", [])
    for plan, outcome in records:
        ex.step(plan, outcome)
    ex.finish()
    bad = [(t.name, t.first_failure) for t in checks.tallies.values() if t.failures]
    assert not bad, bad
    counts = {t.name: t.count for t in checks.tallies.values()}
    for name in ("kernel.block_copy", "attn.cached_blocks", "ssm.cached_blocks", "ssm.output", "attn.output"):
        assert counts.get(name, 0) > 0, counts


@pytest.mark.parametrize("bug,check", [("block_copy_after_writes", "attn.cached_blocks"),
                                       ("block_copy_wrong_source", "attn.cached_blocks")])
def test_copy_bugs_are_caught_on_the_first_hit(bug, check):
    loaded = parse_scenario(SCENARIO, "t.yaml")
    _, (sim, records) = _two_identical_prompts()
    checks = Checks()
    ex = make_executor(loaded.scenario, sim.groups, checks, "full", {bug}, "reference", "cpu", [])
    for plan, outcome in records:
        ex.step(plan, outcome)
    ex.finish()
    t = checks.get(check)
    assert t.failures > 0 and "96-token prefix hit" in t.first_failure.message


def test_a_recording_without_copies_is_refused_with_checks(tmp_path):
    src = PARTIAL[0]
    lines = src.read_text().splitlines()
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join(json.dumps({k: v for k, v in json.loads(ln).items() if k != "block_copies"})
                             for ln in lines) + "\n")
    with pytest.raises(InputError, match="re-record it"):
        replay_trace(old)


def test_summary_shows_what_partial_hits_buy():
    """The run plans the same workload with whole-block units and reports its hit tokens beside
    its own (planning only); a scenario whose unit is the block reports nothing extra."""
    from hybridsim.config import load_scenario
    from hybridsim.report import summary_table
    from hybridsim.runner import plan_scenario

    from .conftest import REPO

    res = plan_scenario(load_scenario(REPO / "scenarios/partial_hits.yaml"), check="off")
    assert res.whole_block_hit_tokens is not None and 0 < res.whole_block_hit_tokens < res.stats.prefix_hit_tokens
    assert res.as_dict()["summary"]["whole_block_hit_tokens"] == res.whole_block_hit_tokens
    cells = [c for col in summary_table(res).columns for c in col._cells]
    assert "prefix hits with whole-block units" in cells
    plain = plan_scenario(load_scenario(REPO / "scenarios/quickstart.yaml"), check="off")
    assert plain.whole_block_hit_tokens is None and "whole_block_hit_tokens" not in plain.as_dict()["summary"]


@pytest.mark.parametrize("skip_copies", [False, True])
def test_mla_latents_of_a_hit_inside_a_block(skip_copies, monkeypatch):
    """A Mamba + MLA model: the copy carries the latent pages too; ``mla.cached_blocks`` compares
    the hit's latents bit for bit, and fails when the copies are not made."""
    from hybridsim.engine.executor import Executor

    text = SCENARIO.replace("preset: tiny-hybrid}", "preset: tiny-hybrid-mla}")
    loaded = parse_scenario(text, "t.yaml")
    wl = manual_workload([list(range(1, 101))] * 2, [0, 8], [4, 4])
    sim, records = simulate(text, wl)
    if skip_copies:
        monkeypatch.setattr(Executor, "_block_copies", lambda self, plan: None)
    checks = Checks()
    ex = make_executor(loaded.scenario, sim.groups, checks, "full", set(), "reference", "cpu", [])
    for plan, outcome in records:
        ex.step(plan, outcome)
    ex.finish()
    t = checks.get("mla.cached_blocks")
    assert t.count > 0
    assert (t.failures > 0) == skip_copies
    if not skip_copies:
        assert not [n for n, x in checks.tallies.items() if x.failures]


def test_ownership_invariant_catches_a_hit_without_its_copy():
    """The scheduler bug ``partial_hit_not_copied`` keeps the partly hit block in the row: the
    invariants see a row write past the hit into a block two rows hold (the executor's
    ``attn.cached_blocks`` sees the same write)."""
    from hybridsim.config import load_scenario
    from hybridsim.runner import plan_scenario

    from .conftest import REPO

    res = plan_scenario(load_scenario(REPO / "scenarios/partial_hits.yaml"), bugs={"partial_hit_not_copied"})
    inv = res.checks.tallies["sched.invariants"]
    assert inv.failures > 0 and "took no private copy" in inv.first_failure.message
    assert res.checks.tallies["attn.cached_blocks"].failures > 0


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["scenario", *[p.stem for p in PARTIAL]])
def test_partial_hits_on_the_gpu_with_triton(what):
    """On the GPU: the partial-hit scenario and both vLLM recordings, Triton kernels, every check
    green, the block copies checked against the reference and timed."""
    from hybridsim.config import load_scenario
    from hybridsim.runner import plan_scenario

    from .conftest import REPO

    if what == "scenario":
        res = plan_scenario(load_scenario(REPO / "scenarios/partial_hits.yaml"), kernels="triton", device="cuda")
    else:
        res = replay_trace(next(p for p in PARTIAL if p.stem == what), kernels="triton", device="cuda")
    assert not res.failed, [(t.name, t.first_failure) for t in res.checks.tallies.values() if t.failures]
    assert res.checks.tallies["kernel.block_copy"].count > 0
    assert any(r["kernel"] == "block_copy" and r["calls"] + r["untimed"] > 0 for r in res.kernel_timings["kernels"])


@pytest.mark.parametrize("rec", PARTIAL, ids=lambda p: p.stem)
def test_our_copies_are_the_engines_pair_for_pair(rec):
    """The recordings carry vLLM's ``kv_cache_block_copies``: ours are the same on every step."""
    from hybridsim.fidelity import run_fidelity

    rep = run_fidelity(str(rec))
    assert rep.block_copies_equal == rep.steps_recorded > 0, [d.__dict__ for d in rep.block_diffs[:5]]
