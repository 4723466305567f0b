"""Deferred publishing: requests in bulk mode publish their full attention blocks late, in
the step-by-step order, before anything could tell. These workloads make the order matter:
twins (same prompt, same continuation) fill blocks holding the same prefixes, so which twin's
block a later hit gets depends on the order the blocks were published in."""

from __future__ import annotations

import random

import pytest

from .conftest import tiny_scenario
from hybridsim.config import parse_scenario
from hybridsim.sched.scheduler import Scheduler
from hybridsim.simulate import Simulation
from hybridsim.workload import Workload, WorkloadRequest
from hybridsim.workload.tokens import token_block

VOCAB = 1000


def twins_workload(trial: int) -> tuple[Workload, int, int, int]:
    """Three twins arriving early (same prompt, same continuation) and ten readers arriving
    while they decode, each prompt being that prompt plus some of the continuation around
    where the twins are (readers hit the twins' blocks and publish the same prefixes again).
    Returns the workload and a (spec tokens, token budget, pool blocks) setting."""
    rnd = random.Random(trial)
    seed = rnd.randint(0, 50)
    prompt = tuple(int(t) for t in token_block(seed + 101, 17, VOCAB))
    out = [int(t) for t in token_block(seed, 400, VOCAB)]
    reqs = [WorkloadRequest(f"t{i}", step, prompt, 120, output_seed=seed)
            for i, step in enumerate(sorted(rnd.sample(range(6), 3)))]
    for i, step in enumerate(sorted(rnd.sample(range(6, 90), 10))):
        k = max(1, step + rnd.randint(-10, 20))
        reqs.append(WorkloadRequest(f"r{i}", step, prompt + tuple(out[:k]), rnd.randint(3, 40),
                                    output_seed=seed + 1 + i))
    setting = (rnd.choice([0, 2]), rnd.choice([16, 24, 32, 48]), rnd.choice([4096, 120]))
    return Workload(reqs, VOCAB, "twins"), *setting


def run(text: str, workload: Workload, fast: bool, calls: dict | None = None):
    loaded = parse_scenario(text, "t.yaml")
    sim = Simulation(loaded.scenario, workload, bulk_decode=fast, fused_events=fast)
    steps = []
    for plan, out in sim:
        steps.append((plan.step, plan.scheduled, plan.preempted, plan.finished, dict(out.sampled)))
    if calls is not None:
        calls["side_events"] = sim.scheduler.num_side_events
    pool = sim.kv.pool
    return steps, sim.stats.as_dict(), dict(pool.cached), {k: list(v) for k, v in pool.dups.items()}


@pytest.fixture
def counted(monkeypatch):
    """Counts how the flushes published: block by block in order, or request by request."""
    calls = {"ordered": 0, "distinct": 0}
    ordered, distinct = Scheduler._publish_in_order, Scheduler._distinct_keys

    def count_ordered(self, todo):
        calls["ordered"] += 1
        return ordered(self, todo)

    def count_distinct(self, todo):
        ok = distinct(self, todo)
        calls["distinct"] += ok
        return ok
    monkeypatch.setattr(Scheduler, "_publish_in_order", count_ordered)
    monkeypatch.setattr(Scheduler, "_distinct_keys", count_distinct)
    return calls


@pytest.mark.parametrize("trial", range(40))
def test_twins_publish_in_the_step_by_step_order(counted, trial):
    """Same plans (block ids included), outcomes, stats and prefix-cache contents (the
    holders of each prefix, in order) as the step-by-step path."""
    wl, spec, budget, blocks = twins_workload(trial)
    acc = "{kind: bernoulli, rate: 0.6}" if spec else "{kind: none}"
    text = tiny_scenario(bs=4, blocks=blocks, budget=budget, seqs=12, spec=spec, acc=acc)
    fast = run(text, wl, True, counted)
    slow = run(text, wl, False)
    assert len(fast[0]) == len(slow[0])
    for a, b in zip(fast[0], slow[0]):
        assert a == b, f"step {b[0]} differs"
    assert fast[1:] == slow[1:]
    assert counted["side_events"] > 0
    assert fast[1]["prefix_hit_tokens"] > 0


def test_twins_exercise_both_ways_of_publishing(counted):
    """Across these workloads, flushes publish request by request (no shared prefix among the
    deferred blocks) and block by block in order (twins' blocks collide)."""
    for trial in range(12):
        wl, spec, budget, blocks = twins_workload(trial)
        acc = "{kind: bernoulli, rate: 0.6}" if spec else "{kind: none}"
        run(tiny_scenario(bs=4, blocks=blocks, budget=budget, seqs=12, spec=spec, acc=acc), wl, True)
    assert counted["ordered"] > 0
    assert counted["distinct"] > 0
