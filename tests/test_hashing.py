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

from .conftest import need_shared, tiny_scenario

_TOKENS = st.one_of(st.integers(0, 50_000), st.integers(-(1 << 63), (1 << 63) - 1))


def _flat(prompts):
    lengths = [len(p) for p in prompts]
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    return np.array([t for p in prompts for t in p], dtype=np.int64), starts, lengths


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_TOKENS, max_size=70), min_size=1, max_size=12), st.sampled_from([1, 3, 4, 16]),
       st.sampled_from([1, 5, 10 ** 9]))
def test_vectorised_hashes_equal_block_by_block(prompts, bs, vector_min):
    """Every part in numpy (vector_min 1), the chain's tail in Python (5), or all of the chain in Python."""
    flat, starts, lengths = _flat(prompts)
    saved = hashing._VECTOR_MIN
    hashing._VECTOR_MIN = vector_min
    try:
        got = hashing.block_hashes_many(flat, starts, lengths, bs)
    finally:
        hashing._VECTOR_MIN = saved
    assert got == [hashing.chained_hashes(p, bs) for p in prompts]


def test_the_self_check_exercises_the_vectorised_chain():
    """The check before first use must compare the numpy chain, not only the Python tail."""
    hashing._verified = None
    chained = []  # prompts per vectorised chain step (a tuple of two: the parent and the block)
    real = hashing._finish

    def counting(acc, n):
        if n == 2:
            chained.append(len(acc))
        return real(acc, n)
    hashing._finish = counting
    try:
        assert hashing._check()
    finally:
        hashing._finish = real
    assert chained and min(chained) >= hashing._VECTOR_MIN


def test_long_prompts_finish_block_by_block_and_still_agree():
    """Past the point where few prompts are left the chain goes on in Python: same values."""
    rng = np.random.default_rng(5)
    lengths = [int(x) for x in rng.integers(0, 400, 300)] + [5000, 3000]
    prompts = [rng.integers(1, 32000, n).tolist() for n in lengths]
    flat, starts, lengths = _flat(prompts)
    assert hashing.block_hashes_many(flat, starts, lengths, 16) == [hashing.chained_hashes(p, 16) for p in prompts]


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
    shared = need_shared()
    text = f"""
name: t
model: {{preset: tiny-hybrid}}
cache: {{block_size: 16, num_blocks: 60000}}
scheduler: {{max_num_batched_tokens: 4096, max_num_seqs: 64, max_model_len: 2048}}
workload: {{kind: trace, format: mooncake, path: {shared / 'traces-real/mooncake/conversation_trace.jsonl'},
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
