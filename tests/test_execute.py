"""Execution and oracle: clean runs pass with real comparisons; every injected bug is caught."""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import pytest

from hybridsim.config import load_scenario, parse_scenario
from hybridsim.bugs import BUGS
from hybridsim.runner import plan_scenario

from .conftest import REPO, SCENARIOS, tiny_scenario

# scenarios with real model geometries (nemotron_h_8b, deepseek_v3) are GPU work: bench/gpu_session.sh
EXECUTED = [p for p in SCENARIOS if load_scenario(p).scenario.execution.check != "off"
            and (load_scenario(p).scenario.model.preset or "tiny-").startswith("tiny-")]

# the checks each model kind must exercise (count > 0)
MAMBA_CHECKS = {"ssm.output", "ssm.running_state", "mamba.chunk_meta"}
MLA_CHECKS = {"mla.output", "mla.paths"}
ATTN_CHECKS = {"attn.output", "attn.cached_blocks"}


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_clean_scenario_passes_every_check(path):
    loaded = load_scenario(path)
    res = plan_scenario(loaded)
    bad = [(t.name, t.first_failure) for t in res.checks.tallies.values() if t.failures]
    assert not bad, bad
    counts = {t.name: t.count for t in res.checks.tallies.values()}
    geo = loaded.scenario.geometry()
    want = ({"sched.invariants"} | (MAMBA_CHECKS if geo.mamba else set()) | (MLA_CHECKS if geo.mla else set())
            | (ATTN_CHECKS if geo.attention else set()))
    assert all(counts.get(name, 0) > 0 for name in want), counts
    assert res.stats.finished == res.stats.requests


BUG_SCENARIOS = {
    "stale_state_index": "forced_preemption",
    "no_conv_shift_on_accept": "spec_decode",
    "temporal_without_bias": "spec_decode",
    "align_precopy_skipped": "chunked_prefill",
    "chunk_crosses_boundary": "no_prefix_cache",
    "rejected_state_kept": "spec_decode",
    "ctx_chunk_unaligned": "mla_long_context",
    "lse_base2": "mla_long_context",
    "lse_unmasked": "mla_long_context",
    "int32_block_offset": "large_pages",
    "attn_hit_not_cut": "align_prefix_hits",
    "free_shared_block": "memory_pressure",
    "slot_off_by_one": "chunked_prefill",
    "rejected_kv_visible": "spec_decode",
    "paged_attn_past_end": "chunked_prefill",
    "block_copy_after_writes": "partial_hits",
    "block_copy_wrong_source": "partial_hits",
    "unit_checkpoint_at_block": "partial_hits",
    "partial_hit_not_copied": "partial_hits",
}


# where a bug's run may stop (execution.max_steps): each check catches its bug within the first
# steps (the step of its first failure, from a whole run, in brackets), so the rest of the scenario,
# up to 277 steps, would prove nothing more; a bug caught later than this fails its test. Bugs not
# listed run their scenario to the end (slot_off_by_one: its run also shows Mamba checks green).
STOP_AT = {
    "stale_state_index": 32,  # (12)
    "no_conv_shift_on_accept": 12,  # (4)
    "temporal_without_bias": 12,  # (4)
    "align_precopy_skipped": 12,  # (1)
    "chunk_crosses_boundary": 12,  # (2)
    "rejected_state_kept": 12,  # (2)
    "ctx_chunk_unaligned": 8,  # (1)
    "lse_base2": 8,  # (1)
    "lse_unmasked": 8,  # (0)
    "int32_block_offset": 12,  # (4)
    "attn_hit_not_cut": 12,  # (1)
    "free_shared_block": 48,  # (22)
    "rejected_kv_visible": 12,  # (3)
    "paged_attn_past_end": 12,  # (0)
    "block_copy_after_writes": 24,  # (8)
    "block_copy_wrong_source": 24,  # (8)
    "unit_checkpoint_at_block": 24,  # (0)
    "partial_hit_not_copied": 24,  # (8)
}


def planned_with_bug(scenario: str, bug: str, max_steps: Optional[int] = None):
    """One planned run per (scenario, bug, stop), shared by the tests that look at it (each test only
    reads the result)."""
    return _planned_with_bug(scenario, bug, max_steps)  # (one cache key however it is called)


@lru_cache(maxsize=None)
def _planned_with_bug(scenario: str, bug: str, max_steps: Optional[int]):
    loaded = load_scenario(REPO / "scenarios" / f"{scenario}.yaml")
    if max_steps is not None:
        s = loaded.scenario
        loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"max_steps": max_steps})})
    return plan_scenario(loaded, bugs={bug})


def test_every_bug_has_a_scenario():
    assert set(BUG_SCENARIOS) == set(BUGS)
    assert set(STOP_AT) <= set(BUGS)


@pytest.mark.parametrize("bug", sorted(BUG_SCENARIOS))
def test_injected_bug_is_caught_by_its_check(bug):
    res = planned_with_bug(BUG_SCENARIOS[bug], bug, STOP_AT.get(bug))
    assert res.stats.steps > 0
    expected = BUGS[bug][1]
    tally = res.checks.tallies.get(expected)
    assert tally is not None and tally.failures > 0, {t.name: t.failures for t in res.checks.tallies.values()}
    assert tally.first_failure.step >= 0


def test_bug_is_specific_no_false_alarm_elsewhere():
    """A Mamba bookkeeping bug leaves the MLA checks of a mixed model green, and vice versa."""
    path = REPO / "scenarios" / "mixed_hybrid_mla.yaml"
    res = plan_scenario(load_scenario(path), bugs={"lse_base2"})
    assert res.checks.tallies["mla.output"].failures > 0
    assert res.checks.tallies["ssm.output"].failures == 0


@pytest.mark.parametrize("preset,must_run", [
    ("tiny-hybrid-mla", ("kernel.state_copy", "kernel.mla_decode", "kernel.merge_states", "kernel.cache_ops",
                         "ssm.running_state", "mla.output")),
    ("tiny-hybrid", ("kernel.reshape_and_cache", "kernel.paged_attention", "attn.output", "attn.cached_blocks")),
])
def test_triton_provider_executes_a_hybrid_scenario_green(preset, must_run):
    """The Triton kernels inside the executor (interpreter on a CPU), with prefix hits, chunked
    prefill and speculative rows: every kernel is called, every call equals the reference on the
    same inputs, and the oracle checks pass. (Short prompts: the interpreter takes seconds a step;
    every request shares a 32-token prefix, so the later arrivals hit it.)"""
    src = tiny_scenario(preset=preset, spec=2, acc="{kind: bernoulli, rate: 0.6}", n=4, per_step=2,
                        pmin=16, pmax=48, omin=4, omax=6, budget=48, prefix=32, frac=1.0)
    res = plan_scenario(parse_scenario(src, "tiny-triton"), kernels="triton")
    bad = [(t.name, t.first_failure) for t in res.checks.tallies.values() if t.failures]
    assert not bad, bad
    assert res.stats.prefix_hit_tokens > 0
    counts = {t.name: t.count for t in res.checks.tallies.values()}
    for name in must_run:
        assert counts.get(name, 0) > 0, counts


def test_attention_bug_leaves_mamba_checks_green():
    """A slot-mapping bug breaks attention outputs and nothing the Mamba layers compute."""
    res = planned_with_bug("chunked_prefill", "slot_off_by_one")  # (the whole run, shared with its bug's test)
    assert res.checks.tallies["attn.output"].failures > 0
    assert res.checks.tallies["ssm.output"].failures == 0
    assert res.checks.tallies["ssm.output"].count > 0


def test_replay_reports_each_step_as_it_goes():
    """The progress a terminal shows: one call a step executed, in order, with the trace's step count."""
    from hybridsim.replay import replay_trace

    seen = []
    res = replay_trace(REPO / "traces" / "spec_padding.jsonl", check="off", progress=lambda *a: seen.append(a))
    assert seen == [(i, res.steps) for i in range(1, res.steps + 1)] and res.steps > 10
