"""Vectorised prefix block hashes against block-by-block hashing (the scheduler's definition)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridsim.config import parse_scenario
from hybridsim.sched import hashing
from hybridsim.sched.request import Request
from hybridsim.simulate import Simulation
from hybridsim.workload import build_workload

from .conftest import DATA, tiny_scenario

_TOKENS = st.one_of(st.integers(0, 50_000), st.integers(-(1 << 63), (1 << 63) - 1))


def _flat(prompts):
    lengths = [len(p) for p in prompts]
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    return np.array([t for p in prompts for t in p], dtype=np.int64), starts, lengths


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_TOKENS, max_size=70), min_size=1, max_size=12), st.sampled_from([1, 3, 4, 16]))
def test_vectorised_hashes_equal_block_by_block(prompts, bs):
    flat, starts, lengths = _flat(prompts)
    assert hashing.block_hashes_many(flat, starts, lengths, bs) == [hashing.chained_hashes(p, bs) for p in prompts]


def test_the_self_check_catches_a_wrong_chain():
    """The check before first use compares the numpy chain itself: a wrong inverse fails it."""
    real = hashing._CHAIN_INV
    hashing._verified = None
    hashing._CHAIN_INV = real + 2
    try:
        assert not hashing._check()
    finally:
        hashing._CHAIN_INV = real
        hashing._verified = None
    assert hashing._check()


def test_long_prompts_agree():
    rng = np.random.default_rng(5)
    lengths = [int(x) for x in rng.integers(0, 400, 300)] + [5000, 3000]
    prompts = [rng.integers(1, 32000, n).tolist() for n in lengths]
    flat, starts, lengths = _flat(prompts)
    assert hashing.block_hashes_many(flat, starts, lengths, 16) == [hashing.chained_hashes(p, 16) for p in prompts]


def test_different_prefixes_get_different_hashes():
    """Prefixes that differ in one block, runs of one repeated block of every length up to
    2,000, and every block of many random prompts: no two different prefixes share a hash."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 50, 16 * int(n)).tolist() for n in rng.integers(1, 40, 400)]
    base = rng.integers(0, 1000, 16 * 30).tolist()
    for j in range(30):  # block j changed, the rest the same
        p = list(base)
        p[16 * j + 3] += 1
        prompts.append(p)
    prompts.append(base)
    prompts.append([7] * 16 * 2000)
    prefixes = {}
    for p in prompts:
        for i, h in enumerate(hashing.chained_hashes(p, 16)):
            prefixes.setdefault(h, set()).add(tuple(p[:16 * (i + 1)]))
            assert 0 <= h < 1 << 64
    assert all(len(v) == 1 for v in prefixes.values())


def test_request_hashes_continue_the_chain():
    prompt = list(range(1, 41))
    (given,) = hashing.block_hashes_many(np.array(prompt), [0], [40], 16)
    req = Request("r", 0, 0, prompt, 10, block_hashes=given)
    req.append_output(list(range(100, 130)))
    plain = Request("r", 0, 0, prompt + list(range(100, 130)), 10)
    assert req.block_hashes == plain.block_hashes and len(plain.block_hashes) == 4


def test_workload_prompt_array_is_the_prompts_and_hashes_match():
    wl = build_workload(parse_scenario(tiny_scenario(frac=0.5, prefix=40, pmin=20, pmax=90, n=12), "t.yaml"))
    assert wl.prompt_tokens.tolist() == [t for r in wl.requests for t in r.prompt]
    sim = Simulation(parse_scenario(tiny_scenario(frac=0.5, prefix=40, pmin=20, pmax=90, n=12), "t.yaml").scenario, wl)
    assert [r.block_hashes for r in sim.requests] == \
        [hashing.chained_hashes(w.prompt, r.hash_block_size) for w, r in zip(wl.requests, sim.requests)]


def test_mooncake_prompt_array_is_the_prompts():
    text = f"""
name: t
model: {{preset: tiny-hybrid}}
cache: {{block_size: 16, num_blocks: 60000}}
scheduler: {{max_num_batched_tokens: 4096, max_num_seqs: 64, max_model_len: 2048}}
workload: {{kind: trace, format: mooncake, path: {DATA / 'mooncake/conversation_trace.jsonl'},
           limit: 60, length_scale: 0.1, arrival: {{kind: fixed, per_step: 4}}}}
execution: {{check: off}}
"""
    loaded = parse_scenario(text, "t.yaml")
    wl = build_workload(loaded)
    assert any(len(r.prompt) == 2047 for r in wl.requests)  # clipped to max_model_len - 1
    assert wl.prompt_tokens.tolist() == [t for r in wl.requests for t in r.prompt]
    sim = Simulation(loaded.scenario, wl)
    assert [r.block_hashes for r in sim.requests] == [hashing.chained_hashes(w.prompt, 16) for w in wl.requests]


def test_a_prompt_array_that_does_not_match_is_not_used():
    loaded = parse_scenario(tiny_scenario(n=4), "t.yaml")
    wl = build_workload(loaded)
    wl.prompt_tokens = wl.prompt_tokens[:-3]  # (a builder bug) -> hashed block by block instead
    sim = Simulation(loaded.scenario, wl)
    assert [r.block_hashes for r in sim.requests] == [hashing.chained_hashes(w.prompt, 16) for w in wl.requests]
