"""The shrinker's reach: a failing trace shrinks to at most a quarter of its steps and requests."""

from __future__ import annotations

import json

from hybridsim.replay import replay_trace, verify_recorded
from hybridsim.shrink import shrink_trace

from .conftest import REPO


def test_golden_trace_with_an_injected_bug_shrinks_to_a_quarter(tmp_path):
    """A golden trace replayed with a known-wrong variant fails; its shrunk trace keeps the same
    failing check with at most a quarter of the steps and of the requests, is itself a schedule
    the engine could make, and passes without the bug."""
    big = REPO / "traces" / "spec_decode.jsonl"
    small = tmp_path / "small.jsonl"
    seen = []
    r = shrink_trace(big, small, None, {"temporal_without_bias"}, progress=lambda *a: seen.append(a))
    assert r.steps_after * 4 <= r.steps_before and r.requests_after * 4 <= r.requests_before, r
    assert r.steps_before == 35 and r.requests_before == 10
    assert seen and seen[-1][1] == r.tests  # progress heard of every candidate
    lines = small.read_text().splitlines()
    assert len(lines) - 1 == r.steps_after and len(json.loads(lines[0])["requests"]) == r.requests_after
    assert verify_recorded(small).ok  # (sched.recorded: a schedule the engine could make)
    bad = replay_trace(small, bugs={"temporal_without_bias"})
    assert bad.checks.tallies[r.check].failures  # the same check still fails
    assert not replay_trace(small).failed  # and only because of the bug


def test_a_schedule_that_breaks_the_rules_shrinks_on_sched_recorded(tmp_path):
    """A trace recorded with a scheduler bug fails sched.recorded (nothing executes); the shrinker
    re-plans its candidates with the same bug and keeps that check, to a quarter or less."""
    from hybridsim.config import load_scenario
    from hybridsim.runner import plan_scenario

    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    plan_scenario(load_scenario(REPO / "scenarios" / "align_prefix_hits.yaml"), record=big, check="off",
                  bugs={"attn_hit_not_cut"})
    r = shrink_trace(big, small)
    assert r.check == "sched.recorded"
    assert r.steps_after * 4 <= r.steps_before and r.requests_after * 4 <= r.requests_before, r
    v = verify_recorded(small)
    assert not v.ok and "not free" in v.checks.tallies["sched.recorded"].first_failure.message
