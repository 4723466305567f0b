"""Scheduler and KV-cache behaviour on small, hand-checked cases."""

from __future__ import annotations

from pathlib import Path

from hybridsim.config import parse_scenario
from hybridsim.runner import plan_scenario
from hybridsim.workload.tokens import token_block

from .conftest import tiny_scenario
from .helpers import manual_workload, simulate


def _by_step(records):
    return {p.step: {s.req_id: s for s in p.scheduled} for p, _ in records}


def test_same_scenario_same_trace_bytes(tmp_path: Path):
    text = tiny_scenario(spec=2, acc="{kind: bernoulli, rate: 0.6}", n=12)
    loaded = parse_scenario(text, "t.yaml")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    plan_scenario(loaded, record=a, check="off")
    plan_scenario(parse_scenario(text, "t.yaml"), record=b, check="off")
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "c.jsonl"
    plan_scenario(parse_scenario(tiny_scenario(spec=2, acc="{kind: bernoulli, rate: 0.6}", n=12, seed=1), "t.yaml"),
                  record=c, check="off")
    assert c.read_bytes() != a.read_bytes()


def test_align_chunks_floor_to_blocks_and_stop_at_junction():
    shared = token_block(77, 100, 32000).tolist()
    p0 = shared + token_block(1, 78, 32000).tolist()   # 178 tokens
    p1 = shared + token_block(2, 239, 32000).tolist()  # 339 tokens
    p2 = shared + token_block(3, 50, 32000).tolist()
    wl = manual_workload([p0, p1, p2], [0, 0, 5], [10, 10, 10])
    sim, recs = simulate(tiny_scenario(budget=256, max_len=4096, blocks=512), wl)
    steps = _by_step(recs)
    # step 0: r0 whole prompt; r1 gets the remaining 78 tokens of budget, floored to 64
    assert steps[0]["r0"].num_scheduled_tokens == 178 and steps[0]["r1"].num_scheduled_tokens == 64
    # step 1: r1 stops at the junction with r0's cached blocks (100 shared tokens -> 96)
    assert steps[1]["r1"].num_scheduled_tokens == 32
    # r2 later hits the state published at the junction
    first_r2 = next(s for st in steps.values() for rid, s in st.items() if rid == "r2")
    assert first_r2.is_new and first_r2.prefix_hit_tokens == 96
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_final_chunk_gets_checkpoint_column():
    wl = manual_workload([token_block(5, 178, 32000).tolist()], [0], [4])
    sim, recs = simulate(tiny_scenario(budget=256, blocks=128), wl)
    first = recs[0][0].scheduled[0]
    mamba_row = first.new_block_ids[0]
    # 178 tokens: running column 11, checkpoint at 176 tokens = column 10; everything else null
    assert len(mamba_row) == 12
    assert [i for i, b in enumerate(mamba_row) if b] == [10, 11]


def test_block_multiple_prompt_keeps_its_checkpoint_one_block_before_the_end():
    """vLLM 0.33 (bench/peer_vllm.py, its own scheduler on these prompts): a prefill
    checkpoint leaves a token to compute, so a 608-token prompt keeps the state at 592 in
    column 36, and the state at its very end is not kept; a chunk cut by the budget right
    at the checkpoint publishes its end state."""
    a = token_block(21, 608, 32000).tolist()
    other = token_block(22, 100, 32000).tolist()
    wl = manual_workload([a, a + other, a[:600] + other], [0, 10, 20], [3, 3, 3])
    sim, recs = simulate(tiny_scenario(budget=1024, max_len=4096, blocks=1024, seqs=4), wl)
    first = {s.req_id: (p.step, s) for p, _ in recs for s in p.scheduled if s.is_new}
    row = first["r0"][1].new_block_ids[0]
    assert first["r0"][1].num_scheduled_tokens == 608
    assert [i for i, b in enumerate(row) if b] == [36, 37]  # checkpoint (592), running (608)
    # the engine: 592 and 592 (the old rule here gave 608 and 0)
    assert first["r1"][1].prefix_hit_tokens == 592
    assert first["r2"][1].prefix_hit_tokens == 592
    assert sim.checks.tallies["sched.invariants"].failures == 0

    # budget 592: r0's first chunk ends at its checkpoint and publishes it (the engine: 592)
    wl = manual_workload([a, a[:600] + other], [0, 10], [3, 3])
    sim, recs = simulate(tiny_scenario(budget=592, max_len=4096, blocks=1024, seqs=4), wl)
    first = {s.req_id: s for p, _ in recs for s in p.scheduled if s.is_new}
    assert first["r0"].num_scheduled_tokens == 592 and first["r1"].prefix_hit_tokens == 592


def test_spec_rollback_and_draft_accounting():
    text = tiny_scenario(spec=3, acc="{kind: pattern, accepted: [1]}", n=1, pmin=40, pmax=40, omin=30, omax=30,
                         prefix=8, frac=0.0)
    sim, recs = simulate(text)
    for plan, out in recs:
        for s in plan.scheduled:
            if s.spec_token_ids:
                assert out.accepted[s.req_id] == min(1, len(s.spec_token_ids))
                # committed = accepted + bonus, unless max_tokens cut it short
                assert len(out.sampled[s.req_id]) <= out.accepted[s.req_id] + 1
    # computed tokens after each decode step = c + n - rejected drafts
    by = [(p, o) for p, o in recs if p.scheduled and p.scheduled[0].spec_token_ids]
    for (p, o), (p2, _) in zip(by, by[1:]):
        s = p.scheduled[0]
        rejected = len(s.spec_token_ids) - o.accepted[s.req_id]
        nxt = next(x for x in p2.scheduled if x.req_id == s.req_id)
        if p2.step == p.step + 1:
            assert nxt.num_computed_tokens == s.num_computed_tokens + s.num_scheduled_tokens - rejected
    assert sim.stats.finished == 1
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_memory_pressure_preempts_and_resumes():
    text = tiny_scenario(blocks=40, n=6, per_step=6, pmin=100, pmax=150, omin=60, omax=80, budget=512, max_len=512)
    sim, recs = simulate(text)
    preempted = [rid for p, _ in recs for rid in p.preempted]
    assert preempted, "the pool is too small not to preempt"
    resumed = [s for p, _ in recs for s in p.scheduled if s.resumed]
    assert {s.req_id for s in resumed} >= set(preempted)
    assert all(s.is_new and s.num_computed_tokens == s.prefix_hit_tokens for s in resumed)
    assert sim.stats.finished == 6
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_reset_prefix_cache_fault_forces_resume_without_preempted_list():
    text = tiny_scenario(n=6, per_step=6, omin=40, omax=40) + "faults:\n  - {at_step: 10, kind: reset_prefix_cache}\n"
    sim, recs = simulate(text)
    plan10 = next(p for p, _ in recs if p.step == 10)
    assert plan10.forced_preempted and not plan10.preempted
    assert plan10.faults == ("reset_prefix_cache",)
    resumed = {s.req_id for p, _ in recs for s in p.scheduled if s.resumed}
    assert set(plan10.forced_preempted) <= resumed
    assert sim.checks.tallies["sched.invariants"].failures == 0


def _two_apart(faults: str):
    """r0 (a 200-token prompt) at step 0, r1 (the same prompt and more) at step 30: idle steps between."""
    p = token_block(9, 200, 32000).tolist()
    wl = manual_workload([p, p + [5, 6, 7]], [0, 30], [3, 3])
    return simulate(tiny_scenario(mode="all", bs=16, budget=256, blocks=256, faults=faults), wl)


def test_a_fault_in_an_idle_stretch_still_acts():
    # the loop jumps over steps with nothing to schedule; a prefix cache reset there must still drop
    # what r0 cached (it used to be jumped over: r1 then hit 192 tokens)
    sim, recs = _two_apart("[{at_step: 20, kind: reset_prefix_cache}]")
    assert max(p.step for p, _ in recs if any(s.req_id == "r0" for s in p.scheduled)) < 20
    r1 = next(s for pl, _ in recs for s in pl.scheduled if s.req_id == "r1")
    assert r1.prefix_hit_tokens == 0
    assert not any("fault" in n for n in sim.stats.notes)
    _, recs = _two_apart("[{at_step: 40, kind: reset_prefix_cache}]")  # (the control: no reset before r1)
    assert next(s for pl, _ in recs for s in pl.scheduled if s.req_id == "r1").prefix_hit_tokens == 192


def test_faults_that_did_nothing_are_noted():
    sim, recs = _two_apart("[{at_step: 10, kind: preempt, requests: [r1]}, "
                           "{at_step: 31, kind: preempt, requests: [r0, r1]}, {at_step: 900, kind: reset_prefix_cache}]")
    notes = [n for n in sim.stats.notes if "fault" in n]
    assert notes == ["fault at step 10: preempt did not preempt r1 (arrives at step 30): it acts on running requests "
                     "only",
                     "fault at step 31: preempt did not preempt r0 (finished): it acts on running requests only",
                     f"fault at step 900 never acted: the run ended at step {sim.stats.last_step}"]
    plan31 = next(p for p, _ in recs if p.step == 31)
    assert plan31.preempted == ("r1",) and sim.stats.forced_preemptions == 1


def test_none_mode_rows_are_one_plus_spec_blocks_and_never_hit():
    text = tiny_scenario(caching="false", mode="none", spec=2, acc="{kind: bernoulli, rate: 0.5}", frac=1.0)
    sim, recs = simulate(text)
    for p, _ in recs:
        for s in p.scheduled:
            if s.is_new:
                assert s.prefix_hit_tokens == 0
                assert len([b for b in s.new_block_ids[0] if b]) == 3
    assert sim.stats.prefix_hit_tokens == 0


def test_all_mode_hits_at_any_boundary():
    p = token_block(9, 200, 32000).tolist()
    wl = manual_workload([p, p + [5, 6, 7]], [0, 30], [3, 3])
    sim, recs = simulate(tiny_scenario(mode="all", bs=16, budget=256, blocks=256), wl)
    r1 = next(s for pl, _ in recs for s in pl.scheduled if s.req_id == "r1")
    # the whole 200-token prompt is cached at every boundary: the hit is the last full block <= 202
    assert r1.prefix_hit_tokens == 192


def test_priority_policy_admits_lower_value_first():
    text = tiny_scenario(n=9, per_step=9, seqs=3).replace("shared_prefix", "priorities: 3\n  shared_prefix")
    text = text.replace("max_num_seqs: 3", "max_num_seqs: 3, policy: priority")
    sim, recs = simulate(text)
    first = [s.req_id for s in recs[0][0].scheduled]
    prios = {r.req_id: r.priority for r in sim.requests}
    admitted = sorted(prios[r] for r in first)
    assert admitted == sorted(prios.values())[: len(first)]


def test_priority_victim_scheduled_earlier_in_the_pass_is_unscheduled():
    """Priority policy: the victim (lowest priority, r0) comes before r1 in the running order,
    so it already has its row when r1 cannot get a block. As upstream, its row is dropped and
    its tokens go back to the budget: no request is both scheduled and preempted in a step."""
    from hybridsim.workload.base import Workload, WorkloadRequest

    reqs = [WorkloadRequest("r0", 0, tuple(token_block(1, 40, 32000).tolist()), 200, 2, 1000),
            WorkloadRequest("r1", 1, tuple(token_block(2, 40, 32000).tolist()), 200, 0, 1001)]
    text = tiny_scenario(blocks=22, seqs=4).replace("max_num_seqs: 4", "max_num_seqs: 4, policy: priority")
    sim, recs = simulate(text, Workload(reqs, 32000, "manual"))
    steps = [p for p, _ in recs if "r0" in p.preempted]
    assert steps, "the case must preempt r0 while r1 decodes"
    for p in steps:
        assert "r0" not in {s.req_id for s in p.scheduled} and "r1" in {s.req_id for s in p.scheduled}
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_acceptance_of_future_rounds_equals_round_by_round():
    """What a bulk speculative run is computed from: every acceptance model's answer for many
    rounds of many requests at once equals asking round by round."""
    import random

    from hybridsim.outputs import BernoulliModel, PatternModel, RejectAll
    from hybridsim.sched.request import Request

    rng = random.Random(3)
    for num_drafts in (1, 3, 4, 5, 9):
        for model in (BernoulliModel(0.3, 7), BernoulliModel(0.9, 8), PatternModel([0, 2, 3, 1]), RejectAll()):
            reqs = [Request(f"r{i}", rng.randrange(10**6), 0, [1], 10) for i in range(6)]
            firsts = [rng.randrange(200) for _ in reqs]
            counts = [rng.randrange(0, 25) for _ in reqs]
            want = []
            for r, f, c in zip(reqs, firsts, counts):
                for rd in range(f, f + c):
                    r.draft_round = rd
                    want.append(model.accepted(r, num_drafts))
            assert model.accepted_runs(reqs, firsts, counts, num_drafts).tolist() == want
            assert sum(want) > 0 or isinstance(model, RejectAll)


def test_batched_drafts_equal_one_request_at_a_time():
    """The drafter's vectorised round (all requests sampled in a step) proposes exactly what
    proposing for each request on its own does, draft by draft, round after round."""
    import random

    from hybridsim.outputs import BernoulliModel, ModelDrafts, SeededContinuation
    from hybridsim.sched.request import Request

    rng = random.Random(7)
    cont = SeededContinuation(32000)

    def fleet():
        reqs = []
        for i in range(40):
            r = Request(f"r{i}", i, 0, [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 50))], 200)
            r.token_ids.extend(cont.stream(r, rng.randrange(0, 30)))
            r.out_stream = cont.stream(r, 260) if i % 3 else None
            reqs.append(r)
        return reqs

    for num_spec, max_len in ((3, 90), (4, 60), (6, 4096)):
        state = rng.getstate()
        one, many = fleet(), None
        rng.setstate(state)
        many = fleet()
        a = ModelDrafts(num_spec, cont, BernoulliModel(0.6, 11), 32000, max_len)
        b = ModelDrafts(num_spec, cont, BernoulliModel(0.6, 11), 32000, max_len)
        for _ in range(5):
            assert b.propose_many(many) == [a.propose(r) for r in one]
            assert [r.draft_round for r in many] == [r.draft_round for r in one]
            for r, s in zip(one + many, (1, 2) * 40):
                r.token_ids.extend(cont.stream(r, len(r.token_ids) - r.num_prompt_tokens + s)[-s:])


def test_prefill_chunk_that_fills_a_block_publishes_it_in_that_step():
    """A chunk that starts mid-block and ends on the boundary publishes the block it filled
    at once (a request admitted later in the same pass can hit it), with or without the
    scheduler's fast paths."""
    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    text = tiny_scenario(preset="tiny-mla", budget=20, n=1, per_step=1, pmin=32, pmax=32, omin=5, omax=5, frac=0.0)
    loaded = parse_scenario(text, "t.yaml")
    for fast in (True, False):
        sim = Simulation(loaded.scenario, build_workload(loaded), bulk_decode=fast, fused_events=fast)
        pool, attn = sim.kv.pool, sim.kv.managers[0]
        for plan, _ in sim:
            if plan.step == 1:
                assert [(r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.scheduled] == [(20, 12)]
                row = attn.rows[sim.requests[0].index]
                assert [pool.block_key[b] is not None for b in row] == [True, True]
                break
        else:
            raise AssertionError("the run ended before step 1")


def test_run_pauses_the_garbage_collector_and_restores_it():
    """``Simulation.run`` plans with the cyclic collector paused and leaves it as it found it."""
    import gc

    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    loaded = parse_scenario(tiny_scenario(n=3), "t.yaml")
    seen = []

    class Probe(Simulation):
        def __iter__(self):
            for item in super().__iter__():
                seen.append(gc.isenabled())
                yield item
    was = gc.isenabled()
    try:
        for start in (True, False):
            (gc.enable if start else gc.disable)()
            seen.clear()
            Probe(loaded.scenario, build_workload(loaded)).run()
            assert seen and not any(seen)
            assert gc.isenabled() is start
    finally:
        (gc.enable if was else gc.disable)()


def test_prefix_caching_off_publishes_nothing():
    """With prefix caching off no block ever holds a hash, decode blocks included (so a freed
    block goes back to the front of the free queue, as every unhashed block does), on the fast
    paths and on the step-by-step path alike."""
    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    text = tiny_scenario(caching="false", mode="none", n=10, omin=20, omax=60, blocks=200)
    loaded = parse_scenario(text, "t.yaml")
    for fast in (True, False):
        sim = Simulation(loaded.scenario, build_workload(loaded), bulk_decode=fast, fused_events=fast)
        pool = sim.kv.pool
        decode_rows = 0
        for plan, _ in sim:
            assert not pool.cached and not pool.dups
            assert pool.block_key.count(None) == pool.num_blocks
            decode_rows += sum(1 for r in plan.scheduled if r.num_computed_tokens >= 16)
        assert decode_rows > 50 and sim.stats.finished == sim.stats.requests


def test_planning_makes_no_reference_cycles():
    """What makes pausing the collector in ``Simulation.run`` free: a run leaves no cyclic
    garbage behind (with bulk decode, drafts, preemptions and prefix hits)."""
    import gc

    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    loaded = parse_scenario((Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml").read_text(),
                            "quickstart.yaml")
    wl = build_workload(loaded)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        sim = Simulation(loaded.scenario, wl)
        stats = sim.run()
        assert gc.collect() == 0
    finally:
        (gc.enable if was else gc.disable)()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.drafts_accepted > 0


def test_a_dropped_simulation_is_freed_without_the_cyclic_collector():
    """No reference cycle holds a simulation (the bulk-decode token source, the pool's
    free-queue view): dropping it frees everything at once. The run pauses the collector
    and hands what it made to the oldest generation, so a cycle would keep whole traces'
    token lists alive until a rare full collection."""
    import gc
    import weakref

    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    loaded = parse_scenario(tiny_scenario(spec=2, acc="{kind: bernoulli, rate: 0.7}", n=12), "t.yaml")
    sim = Simulation(loaded.scenario, build_workload(loaded))
    sim.run()
    assert len(list(sim.kv.pool.free_queue)) == sim.kv.pool.num_free
    alive = [weakref.ref(o) for o in (sim, sim.scheduler, sim.kv, sim.kv.managers[0])]
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        del sim
        assert [r() is None for r in alive] == [True] * len(alive)
        gc.set_debug(gc.DEBUG_SAVEALL)  # and nothing of ours is left for the collector
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("hybridsim")]
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_on:
            gc.enable()


def test_resumed_prefill_checkpoint_follows_its_prefill_end():
    """A resumed request replays its outputs as prefill up to one token before its last; whether
    a chunk stops short of the last token (and where a final chunk keeps its checkpoint) follows
    that prefill's end (vLLM 0.33, bench/probes/peer_press.py, bench/peer_fuzz.py)."""
    from hybridsim.simulate import Simulation

    prompt = token_block(41, 416, 32000).tolist()
    loaded = parse_scenario(tiny_scenario(budget=1024, max_len=4096, blocks=1024, seqs=4), "t.yaml")
    sim = Simulation(loaded.scenario, manual_workload([prompt], [0], [6]))  # (not run)
    req = sim.requests[0]
    req.append_output([7])  # 417 tokens: prefill end 416
    req.junction = 0
    n, checkpoint, publish = sim.scheduler._align_split(req, 0, 417, None)
    # the chunk also computes the last token, so its checkpoint is the last boundary before
    # 417: 416, in column 25 (vLLM 0.33's block ids, bench/peer_fuzz.py fuzz_5_13; not 400)
    assert (n, checkpoint, publish) == (417, 25, False)
    # a chunk cut at the prefill's end keeps the prefill's checkpoint, 400 (column 24; the
    # prompt's replay point, so published by the manager); its end state, at 416, is not kept
    assert sim.scheduler._align_split(req, 0, 416, None) == (416, 24, False)
    req.append_output([8])  # 418 tokens: prefill end 417, checkpoint 416 (column 25)
    assert sim.scheduler._align_split(req, 0, 418, None) == (418, 25, False)


def test_resumed_prefill_ending_on_a_block_boundary_stops_there():
    """vLLM 0.33 (bench/peer_fuzz.py, fuzz_1_36): a final chunk that has no checkpoint column to
    write never runs past the sequence's last block boundary before its last token, so a
    resumed prefill ending on a boundary stops there, one token short of the sequence."""
    from hybridsim.simulate import Simulation

    prompt = token_block(43, 416, 32000).tolist()
    loaded = parse_scenario(tiny_scenario(budget=1024, max_len=4096, blocks=1024, seqs=4), "t.yaml")
    sim = Simulation(loaded.scenario, manual_workload([prompt], [0], [40]))  # (not run)
    req = sim.requests[0]
    req.append_output(list(range(1, 18)))  # 433 tokens: prefill end 432, its checkpoint 416
    req.junction = 0
    # from 416 the checkpoint is behind: the chunk stops at 432 (the old rule ran to 433)
    assert sim.scheduler._align_split(req, 416, 17, None) == (16, None, False)
    # from 400 it passes the prefill's checkpoint (416), so it runs on to the end and keeps
    # the state at the last boundary before its last token, 432 (column 26)
    assert sim.scheduler._align_split(req, 400, 33, None) == (33, 26, False)


def test_long_prefill_threshold_is_off_with_one_request():
    """vLLM 0.33: the threshold keeps a long prefill from starving others; with one request
    running or waiting there is no one to starve, so the whole budget is used."""
    text = tiny_scenario(n=1, pmin=200, pmax=200, budget=256, max_len=1024).replace(
        "max_model_len: 1024}", "max_model_len: 1024, long_prefill_token_threshold: 32}")
    _, recs = simulate(text)
    assert recs[0][0].scheduled[0].num_scheduled_tokens == 200
    _, recs = simulate(text.replace("num_requests: 1", "num_requests: 2"))
    assert [s.num_scheduled_tokens for s in recs[0][0].scheduled] == [32, 32]


def test_chunk_ending_exactly_at_the_junction_publishes_its_state():
    """vLLM 0.33 (fuzz_1_0): the state at the junction with a cached prefix is kept whether the
    chunk was cut there or the budget ends it there; a later request sharing that prefix hits it."""
    a = token_block(51, 200, 32000).tolist()
    x, y = token_block(52, 140, 32000).tolist(), token_block(53, 4, 32000).tolist()
    wl = manual_workload([a, a[:60] + x, a[:60] + y], [0, 12, 30], [3, 3, 3])
    sim, recs = simulate(tiny_scenario(budget=48, max_len=1024, blocks=256, seqs=4), wl)
    first = {s.req_id: s for p, _ in recs for s in p.scheduled if s.is_new}
    assert first["r1"].prefix_hit_tokens == 0 and first["r1"].num_scheduled_tokens == 48  # ends at the junction
    assert first["r2"].prefix_hit_tokens == 48  # (0 when only a cut chunk published)
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_with_drafts_a_finishing_request_caches_its_computed_blocks():
    """vLLM 0.33 with drafts caches the blocks full of computed tokens after each update, so a
    request's last full block is cached before it is freed (spec256's block ids); a stop inside
    a step's new tokens leaves the computed count covering the kept ones but the last."""
    for max_tokens, cached in ((13, True), (12, False)):
        text = tiny_scenario(spec=3, acc="{kind: pattern, accepted: [3]}", n=1, pmin=20, pmax=20,
                             omin=max_tokens, omax=max_tokens, prefix=8, frac=0.0)
        sim, recs = simulate(text)
        req = sim.requests[0]
        # 20 prompt tokens, then 4 a step: the last step computes 28..31 and commits 4 tokens
        # (13: 33 tokens, 32 computed, block 1 full) or keeps 3 of them (12: 32 tokens, 31 computed)
        assert len(req.token_ids) == 20 + max_tokens
        assert req.num_computed_tokens == (32 if cached else 31)
        assert (req.block_hashes[1] in sim.kv.pool.cached) is cached
        assert sim.checks.tallies["sched.invariants"].failures == 0


def _first_rows(recs):
    return {s.req_id: (p.step, s) for p, _ in recs for s in p.scheduled if s.is_new}


def test_one_token_admission_is_padded_to_a_uniform_draft_row():
    """vLLM 0.33 (fuzz_6_31, fuzz_7_12): with drafts on, a request admitted with one token to
    compute is padded to 1 + num_speculative_tokens tokens with placeholder drafts, which are
    computed and never accepted (even by a model that accepts every real draft), unless the
    step ran no request and the admission has no prefix hit, or a running request continues
    its prefill in the step."""
    from hybridsim.sched.plan import PLACEHOLDER_DRAFT

    S = 3
    a = token_block(61, 32, 32000).tolist()
    long = token_block(62, 200, 32000).tolist()
    prompts = [a + [5], [7], a + [6], long, a + [8]]
    wl = manual_workload(prompts, [0, 0, 4, 8, 9], [30, 30, 6, 6, 6])
    text = tiny_scenario(spec=S, acc="{kind: pattern, accepted: [3]}", budget=128, blocks=256).replace(
        "max_model_len: 1024}", "max_model_len: 1024, long_prefill_token_threshold: 16}")
    sim, recs = simulate(text, wl)
    first = _first_rows(recs)
    # r1 (one-token prompt) came in the first step, which ran no request: not padded
    assert first["r1"][1].num_scheduled_tokens == 1 and first["r1"][1].spec_token_ids == ()
    # r2 hits r0's 32 cached tokens while r0 and r1 decode: padded
    step, row = first["r2"]
    assert (row.num_computed_tokens, row.num_scheduled_tokens) == (32, 1 + S)
    assert row.spec_token_ids == (PLACEHOLDER_DRAFT,) * S
    out = next(o for p, o in recs if p.step == step)
    assert out.accepted["r2"] == 0 and len(out.sampled["r2"]) == 1
    nxt = next(s for p, _ in recs if p.step == step + 1 for s in p.scheduled if s.req_id == "r2")
    assert nxt.num_computed_tokens == 33  # the padding rolled back like rejected drafts
    # r4 is admitted while r3 continues its prefill (16 tokens a step): not padded
    step4, row4 = first["r4"]
    assert any(s.req_id == "r3" and not s.is_new and s.num_computed_tokens + s.num_scheduled_tokens < 200
               for p, _ in recs if p.step == step4 for s in p.scheduled)
    assert row4.num_scheduled_tokens == 1 and row4.spec_token_ids == ()
    assert sim.stats.padded_rows == 1
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_padded_admission_waits_for_budget_and_needs_room_for_the_sampled_token():
    """vLLM 0.33: a padded row that does not fit the budget is not scheduled unpadded (the
    admission waits); one that would leave no room for the sampled token is not padded."""
    S = 3
    text = tiny_scenario(spec=S, acc="{kind: pattern, accepted: [3]}", caching="false", mode="none",
                         budget=6, max_len=64, n=1, pmin=1, pmax=8, omin=1, omax=8, prefix=1, frac=0.0)
    wl = manual_workload([[7], [9]], [0, 1], [8, 4])
    sim, recs = simulate(text, wl)
    first = _first_rows(recs)
    last_r0 = max(p.step for p, _ in recs for s in p.scheduled if s.req_id == "r0")
    # r0 decodes 4 tokens a step, leaving 2 of 6: r1 waits for r0 to finish, then comes in a
    # step that runs nothing, unpadded
    assert first["r1"][0] > last_r0 and first["r1"][1].num_scheduled_tokens == 1
    assert sim.checks.tallies["sched.invariants"].failures == 0

    text = tiny_scenario(spec=S, acc="{kind: pattern, accepted: [3]}", caching="false", mode="none",
                         budget=16, max_len=4, n=1, pmin=1, pmax=1, omin=1, omax=1, prefix=1, frac=0.0)
    sim, recs = simulate(text, manual_workload([[7], [9]], [0, 1], [2, 2]))
    first = _first_rows(recs)
    # 0 computed + 4 padded + 1 sampled > max_model_len 4: r1 comes in unpadded beside r0
    assert first["r1"][0] == 1 and first["r1"][1].num_scheduled_tokens == 1
    assert sim.checks.tallies["sched.invariants"].failures == 0


def test_stall_rule_marks_a_run_only_after_its_idle_stretch_with_no_arrival_left():
    """Every planner's loop keeps this rule (ours and the live vLLM driver): a scheduled step
    resets the count; the run is stalled after STALL_STEPS + 1 idle steps, never while arrivals remain."""
    from hybridsim.simulate import STALL_STEPS, RunStats, StallWatch

    stats, watch = RunStats(), StallWatch()
    assert not any(watch.stalled(0, True, stats, s) for s in range(3 * STALL_STEPS))  # arrivals still to come
    assert not watch.stalled(2, False, stats, 0)  # progress resets the stretch
    assert not any(watch.stalled(0, False, stats, s) for s in range(STALL_STEPS))
    assert not stats.stalled
    assert watch.stalled(0, False, stats, 1234)
    assert stats.stalled and stats.notes[-1] == f"stalled: nothing schedulable for {STALL_STEPS} steps (at step 1234)"
