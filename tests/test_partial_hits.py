"""Partial-block prefix hits (vLLM 0.33's ``prefix_match_unit`` below the block size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridsim.config import parse_scenario
from hybridsim.errors import InputError
from hybridsim.fidelity import run_fidelity
from hybridsim.sched import partial
from hybridsim.sched.request import Request
from hybridsim.vllm_recorded import load_recording

from .helpers import manual_workload, simulate

PARTIAL = sorted((Path(__file__).resolve().parent.parent / "data/vllm-recorded/partial").glob("*.jsonl"))

SCENARIO = """name: partial
seed: 1
model: {preset: tiny-hybrid}
cache: {block_size: 64, prefix_match_unit: 16, num_blocks: 64, mamba_cache_mode: align}
scheduler: {max_num_batched_tokens: 256, max_num_seqs: 4, max_model_len: 512}
workload: {kind: synthetic, num_requests: 2, prompt_len: {dist: fixed, value: 100},
           output_len: {dist: fixed, value: 4}}
execution: {check: off}
"""


def test_partial_recordings_present():
    assert [p.stem for p in PARTIAL] == ["partial_mtp_pressure", "partial_nemotron8b_pressure"]


@pytest.mark.parametrize("rec", PARTIAL, ids=lambda p: p.stem)
def test_partial_recordings_identical_block_for_block(rec):
    r = load_recording(rec)
    assert r.scenario.cache.prefix_match_unit == 16 and r.scenario.cache.block_size == 64
    hits = [n["num_computed_tokens"] for s in r.steps for n in s["scheduled_new_reqs"]]
    assert any(h % 64 for h in hits)  # (hits that end inside a block)
    rep = run_fidelity(str(rec))
    assert rep.identical_steps == rep.steps_recorded == rep.steps_ours > 0, [d.__dict__ for d in rep.diffs[:5]]
    assert rep.free_blocks_equal == rep.steps_recorded
    assert rep.block_ids_equal_by_group == [rep.steps_recorded] * len(r.config["kv_cache_groups"])


def _req(n: int) -> Request:
    return Request("r", 0, 0, list(range(n)), 8, hash_block_size=16, block_size=64)


def test_unit_hashes_and_block_hashes():
    """A block's hash is the unit hash at its end (it covers the whole prefix)."""
    r = _req(200)
    assert len(r.unit_hashes) == 12 and r.block_hashes == r.unit_hashes[3::4] and len(r.block_hashes) == 3
    r.append_output(list(range(56)))  # 256 tokens: a 16th unit, a 4th block
    assert len(r.unit_hashes) == 16 and r.block_hashes == r.unit_hashes[3::4]


@pytest.mark.parametrize("start,n,want", [
    (0, 218, 218),   # the final chunk exports the state at 208 in its checkpoint column: no stop
    (0, 100, 64),    # a chunk that does not finish the prefill ends on a block boundary
    (16, 202, 202),  # from a 16-token hit, the same
    (200, 18, 8),    # too close to export it: the chunk stops at the prompt's unit checkpoint (208)
    (80, 100, 48),   # a chunk starting inside a block stops at that block's end
])
def test_split_rules(start, n, want):
    assert partial.split(_req(218), start, n, 64, 16, 0, 256, 0) == want


def test_checkpoint_rules():
    assert partial.checkpoint_position(218, 16, 0) == 208
    assert partial.checkpoint_position(208, 16, 0) == 192  # (a token is left to compute)
    assert partial.checkpoint_position(218, 16, 3) == 208 and partial.checkpoint_position(210, 16, 3) == 192
    assert partial.checkpoint_valid(0, 218, 208, 16, 64)
    assert not partial.checkpoint_valid(200, 218, 208, 16, 64)  # (start + unit past the checkpoint)
    assert not partial.checkpoint_valid(8, 218, 208, 16, 64)  # (a start off the unit grid)


def test_a_hit_inside_a_block_takes_a_private_copy():
    """The second of two identical 100-token prompts hits 96 tokens: the first block whole, the
    second (the first request's, keyed at 96 by the prompt-tail rule) through a fresh copy in both
    the attention and the Mamba row; the copy's endpoints are let go when the pass ends."""
    wl = manual_workload([list(range(1, 101))] * 2, [0, 8], [4, 4])
    sim, records = simulate(SCENARIO, wl)
    assert sim.checks.get("sched.invariants").failures == 0
    first = next(s for p, _ in records for s in p.scheduled if s.req_id == "r0" and s.is_new)
    second = next(s for p, _ in records for s in p.scheduled if s.req_id == "r1" and s.is_new)
    assert first.prefix_hit_tokens == 0 and first.num_scheduled_tokens == 100
    assert second.prefix_hit_tokens == 96 and second.num_scheduled_tokens == 4
    for g, mine, theirs in zip(sim.groups, second.new_block_ids, first.new_block_ids):
        if g.is_mamba:  # the state at 96 (column 1), copied
            assert mine[0] == 0 and mine[1] not in theirs
        else:  # block 0 shared, block 1 copied
            assert mine[0] == theirs[0] and mine[1] not in theirs
    assert sim.kv.pool.num_free == 63  # (everything back at the end)


def test_a_unit_equal_to_the_block_size_changes_nothing():
    text = SCENARIO.replace("block_size: 64, prefix_match_unit: 16", "block_size: 16")
    wl = manual_workload([list(range(1, 101))] * 2 + [list(range(1, 61))], [0, 8, 9], [4, 4, 4])
    plain = [p for p, _ in simulate(text, wl)[1]]
    same = [p for p, _ in simulate(text.replace("block_size: 16", "block_size: 16, prefix_match_unit: 16"), wl)[1]]
    assert plain == same


@pytest.mark.parametrize("cache,says", [
    ("{block_size: 64, prefix_match_unit: 24, num_blocks: 64}", "does not divide block_size (64)"),
    ("{block_size: 64, prefix_match_unit: 16, num_blocks: 64, enable_prefix_caching: false}", "align"),
    ("{block_size: 64, prefix_match_unit: 0, num_blocks: 64}", "prefix_match_unit"),
])
def test_a_bad_unit_is_one_error_naming_the_key(cache, says):
    text = SCENARIO.replace("{block_size: 64, prefix_match_unit: 16, num_blocks: 64, mamba_cache_mode: align}", cache)
    with pytest.raises(InputError) as e:
        parse_scenario(text, "t.yaml")
    assert "prefix_match_unit" in str(e.value) and says in str(e.value)


def test_partial_recording_converts_to_a_consistent_trace(tmp_path):
    """(The peer driver's recordings carry no ``resumed`` key: a request seen before is resumed.)"""
    from hybridsim.convert import convert_recording
    from hybridsim.trace import read_trace

    out = tmp_path / "p.jsonl"
    assert convert_recording(PARTIAL[0], out) == 136
    tr = read_trace(out)  # raises on any accounting inconsistency
    assert tr.header["scenario"]["cache"]["prefix_match_unit"] == 16
