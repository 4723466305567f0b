"""Property tests: random scenarios never break a scheduler invariant, and always finish."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import tiny_scenario
from .helpers import simulate


@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from(["align", "all", "none"]))
    caching = mode != "none"
    bs = draw(st.sampled_from([16, 32]))
    spec = draw(st.integers(0, 3))
    acc = draw(st.sampled_from(["{kind: none}", "{kind: bernoulli, rate: 0.7}", "{kind: pattern, accepted: [0, 1]}"]))
    if "pattern" in acc and spec == 0:
        acc = "{kind: none}"
    pmin = draw(st.integers(1, 120))
    pmax = pmin + draw(st.integers(0, 200))
    omax = draw(st.integers(1, 60))
    longest = pmax + omax + spec
    groups_blocks = 2 * (-(-longest // bs)) + 2 * (3 + spec + (-(-longest // bs) if mode == "all" else 0))
    blocks = groups_blocks + 1 + draw(st.integers(0, 120))
    return tiny_scenario(
        seed=draw(st.integers(0, 10_000)), preset=draw(st.sampled_from(["tiny-hybrid", "tiny-hybrid-mla", "tiny-mla"])),
        bs=bs, blocks=blocks, caching="true" if caching else "false", mode=mode,
        budget=draw(st.sampled_from([32, 64, 128, 512])), seqs=draw(st.integers(1, 8)), max_len=1024,
        spec=spec, acc=acc, n=draw(st.integers(1, 12)), per_step=draw(st.integers(1, 4)),
        pmin=pmin, pmax=pmax, omin=1, omax=omax, prefix=draw(st.integers(1, 100)),
        frac=draw(st.sampled_from([0.0, 0.5, 1.0])),
    ) + draw(st.sampled_from(["", "faults:\n  - {at_step: 5, kind: reset_prefix_cache}\n",
                              "faults:\n  - {at_step: 3, kind: preempt, requests: [r0, r1]}\n"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_scenarios_keep_invariants(text):
    sim, recs = simulate(text)
    tally = sim.checks.tallies["sched.invariants"]
    assert tally.failures == 0, tally.first_failure
    assert tally.count > 0
    assert sim.stats.finished == sim.stats.requests, sim.stats.notes
    # nothing leaks: every block is back in the pool at the end
    assert sim.kv.pool.num_free == sim.kv.pool.num_blocks - 1


def _run(text: str, bulk: bool, base_dir=None):
    from hybridsim.config import parse_scenario
    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    loaded = parse_scenario(text, "t.yaml", base_dir)
    sim = Simulation(loaded.scenario, build_workload(loaded), bulk_decode=bulk, fused_events=bulk)
    steps = []
    for plan, out in sim:
        steps.append((plan.step, plan.scheduled, plan.preempted, plan.finished, plan.forced_preempted,
                      dict(out.sampled), dict(out.accepted), out.finished))
        s = sim.scheduler
        if bulk:  # the scheduler's own list of requests not in bulk mode stays exact
            assert s._awake == {r for r in s.running if not r.cruising}
    reqs = {r.req_id: (r.num_computed_tokens, tuple(r.token_ids), r.status, tuple(r.block_hashes))
            for r in sim.requests}
    return steps, reqs, sim.stats.as_dict(), sim.scheduler.num_side_events


def _assert_bulk_is_exact(text: str, base_dir=None):
    """The fast paths (bulk decode, fused decode events) against the plain step-by-step path."""
    fast = _run(text, True, base_dir)
    slow = _run(text, False, base_dir)
    assert len(fast[0]) == len(slow[0])
    for a, b in zip(fast[0], slow[0]):
        assert a == b, f"step {b[0]} differs"
    assert fast[1] == slow[1]
    assert fast[2] == slow[2]
    assert slow[3] == 0
    return fast[3]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_bulk_decode_plans_exactly_what_the_step_by_step_path_plans(text):
    """Requests advanced in bulk, with decode events taken by the fused path, give the same
    plans, outcomes, final requests and stats."""
    _assert_bulk_is_exact(text)


def test_bulk_decode_is_exact_on_every_shipped_scenario():
    from pathlib import Path

    side_events = 0
    for path in sorted(Path(__file__).resolve().parents[1].joinpath("scenarios").glob("*.yaml")):
        side_events += _assert_bulk_is_exact(path.read_text(), path.parent)
    assert side_events > 100  # bulk requests' block events (publish, release) were exercised


@st.composite
def priority_scenarios(draw):
    """``scenarios`` under the priority policy (victims can sit anywhere in the pass, even
    before the request being scheduled) and, at times, a long-prefill threshold."""
    text = draw(scenarios())
    extra = ", policy: priority"
    if draw(st.booleans()):
        extra += f", long_prefill_token_threshold: {draw(st.integers(8, 64))}"
    text = text.replace("max_model_len: 1024}", "max_model_len: 1024" + extra + "}", 1)
    return text.replace("  shared_prefix:", f"  priorities: {draw(st.integers(2, 4))}\n  shared_prefix:", 1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(priority_scenarios())
def test_bulk_decode_is_exact_under_the_priority_policy(text):
    _assert_bulk_is_exact(text)


@st.composite
def spec_scenarios(draw):
    """Speculative decoding long enough for bulk runs: small pools (side events that fall
    back, preemption), small budgets (every run woken), max_model_len stops (fewer drafts
    near the end), thresholds that cut or do not cut bulk rows, priorities and faults."""
    spec = draw(st.integers(1, 4))
    mode, caching = draw(st.sampled_from([("align", "true"), ("none", "false")]))
    bs = draw(st.sampled_from([16, 32]))
    acc = draw(st.sampled_from(["{kind: none}", "{kind: bernoulli, rate: 0.3}", "{kind: bernoulli, rate: 0.8}",
                                "{kind: bernoulli, rate: 0.97}", "{kind: pattern, accepted: [0, 1, 1, 0]}"]))
    pmin = draw(st.integers(1, 80))
    pmax = pmin + draw(st.integers(0, 120))
    omax = draw(st.integers(10, 250))
    max_len = draw(st.sampled_from([1024, max(pmax, 100) + spec + draw(st.integers(8, 200))]))
    longest = min(pmax + omax + spec, max_len)
    groups_blocks = 2 * (-(-longest // bs)) + 2 * (3 + spec)
    blocks = groups_blocks + 1 + draw(st.integers(0, 150))
    text = tiny_scenario(
        seed=draw(st.integers(0, 10_000)), preset=draw(st.sampled_from(["tiny-hybrid", "tiny-hybrid-mla", "tiny-mla"])),
        bs=bs, blocks=blocks, caching=caching, mode=mode,
        budget=draw(st.sampled_from([32, 64, 512])), seqs=draw(st.integers(1, 8)), max_len=max_len,
        spec=spec, acc=acc, n=draw(st.integers(1, 10)), per_step=draw(st.integers(1, 4)),
        pmin=pmin, pmax=pmax, omin=1, omax=omax, prefix=draw(st.integers(1, 100)),
        frac=draw(st.sampled_from([0.0, 0.5, 1.0])),
    ) + draw(st.sampled_from(["", "faults:\n  - {at_step: 40, kind: reset_prefix_cache}\n",
                              "faults:\n  - {at_step: 30, kind: preempt, requests: [r0, r1]}\n"]))
    extra = ""
    if draw(st.booleans()):
        extra += ", policy: priority"
        text = text.replace("  shared_prefix:", f"  priorities: {draw(st.integers(2, 4))}\n  shared_prefix:", 1)
    if draw(st.booleans()):
        extra += f", long_prefill_token_threshold: {draw(st.integers(2, 64))}"
    return text.replace(f"max_model_len: {max_len}}}", f"max_model_len: {max_len}{extra}}}", 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_scenarios())
def test_bulk_speculative_decoding_is_exact(text):
    """Runs of speculative decoding computed in advance (acceptance of every future round,
    rows and outcomes built when read, block events as side events) plan what the
    step-by-step path plans, with the same outcomes, final requests and stats."""
    _assert_bulk_is_exact(text)


def test_bulk_speculative_runs_happen_and_are_exact():
    """A scenario where runs start, side events fall back for lack of blocks, requests are
    preempted and max_model_len shortens the last drafts: still exact."""
    text = tiny_scenario(seed=3, bs=16, blocks=70, budget=512, seqs=6, max_len=300, spec=3,
                         acc="{kind: bernoulli, rate: 0.8}", n=10, per_step=3, pmin=20, pmax=90,
                         omin=100, omax=260, prefix=32, frac=0.5)
    fast = _run(text, True)
    assert fast[3] > 50  # side events of bulk speculative requests
    assert fast[2]["preemptions"] > 0
    _assert_bulk_is_exact(text)
