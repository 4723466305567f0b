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


def harsh_twins(trial: int) -> tuple[Workload, str]:
    """Twins and readers under pressure: small pools (preemption of requests with deferred
    blocks), the priority policy (victims anywhere in the pass), faults (a prefix-cache reset,
    named preemptions), a short max_model_len, 1 or 3 drafts, readers sharing the twins'
    continuation or not."""
    rnd = random.Random(1000 + trial)
    seed = rnd.randint(0, 50)
    prompt = tuple(int(t) for t in token_block(seed + 101, rnd.choice([9, 17, 30]), VOCAB))
    out = [int(t) for t in token_block(seed, 400, VOCAB)]
    reqs = [WorkloadRequest(f"t{i}", step, prompt, rnd.choice([60, 120, 200]), priority=rnd.randint(0, 2),
                            output_seed=seed)
            for i, step in enumerate(sorted(rnd.choices(range(8), k=rnd.randint(2, 5))))]
    for i, step in enumerate(sorted(rnd.sample(range(4, 120), rnd.randint(4, 14)))):
        k = max(1, step + rnd.randint(-15, 25))
        reqs.append(WorkloadRequest(f"r{i}", step, prompt + tuple(out[:k]), rnd.randint(3, 60),
                                    priority=rnd.randint(0, 2), output_seed=rnd.choice([seed, seed + 1 + i])))
    spec = rnd.choice([0, 0, 1, 3])
    max_len = rnd.choice([1024, 200])
    text = tiny_scenario(bs=4, blocks=rnd.choice([4096, 160, 100, 80]), budget=rnd.choice([16, 24, 32, 48, 128]),
                         seqs=rnd.choice([4, 8, 12]), spec=spec, max_len=max_len, pmax=100,
                         acc="{kind: bernoulli, rate: 0.6}" if spec else "{kind: none}")
    if rnd.random() < 0.4:
        text = text.replace(f"max_model_len: {max_len}}}", f"max_model_len: {max_len}, policy: priority}}")
    if rnd.random() < 0.3:
        at = rnd.randint(5, 60)
        text += rnd.choice([f"faults:\n  - {{at_step: {at}, kind: reset_prefix_cache}}\n",
                            f"faults:\n  - {{at_step: {at}, kind: preempt, requests: [t0, t1]}}\n"])
    return Workload(reqs, VOCAB, "twins"), text


@pytest.mark.parametrize("trial", range(40))
def test_twins_under_pressure_publish_in_the_step_by_step_order(trial):
    wl, text = harsh_twins(trial)
    fast = run(text, wl, True)
    slow = run(text, wl, False)
    assert len(fast[0]) == len(slow[0])
    for a, b in zip(fast[0], slow[0]):
        assert a == b, f"step {b[0]} differs"
    assert fast[1:] == slow[1:]


def test_harsh_twins_preempt_and_use_the_priority_policy():
    """The pressure is real: across these workloads requests are preempted, under both
    policies, and faults fire."""
    preempted = {"fcfs": 0, "priority": 0}
    faults = 0
    for trial in range(40):
        wl, text = harsh_twins(trial)
        stats = run(text, wl, True)[1]
        preempted["priority" if "policy: priority" in text else "fcfs"] += stats["preemptions"] > 0
        faults += "faults:" in text
    assert preempted["fcfs"] > 0 and preempted["priority"] > 0 and faults > 0
