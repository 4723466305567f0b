"""MTP / EAGLE drafters: the scenario keys, the drafter's KV-cache group, lookahead slots and
lookahead block hashes (vLLM 0.33; compared block for block in tests/test_fidelity.py)."""

from __future__ import annotations

import pytest

from hybridsim.config import min_blocks_per_request, parse_scenario
from hybridsim.errors import InputError
from hybridsim.execute import groups_from_specs
from hybridsim.sched.request import Request
from hybridsim.simulate import Simulation, kv_groups
from hybridsim.trace import header_dict
from hybridsim.workload import build_workload

from .conftest import tiny_scenario


def _scenario(spec: int, extra: str = "", **kw):
    return parse_scenario(tiny_scenario(spec=spec, acc="{kind: bernoulli, rate: 0.7}" + extra, **kw), "s.yaml")


def _err(text: str) -> InputError:
    with pytest.raises(InputError) as ei:
        parse_scenario(text, "s.yaml")
    return ei.value


def test_bad_drafter_keys_are_one_message_each():
    e = _err(tiny_scenario(spec=2, acc="{kind: none}, method: medusa"))
    assert e.message.startswith("spec_decode.method") and "'ngram', 'mtp' or 'eagle'" in e.message
    e = _err(tiny_scenario(spec=2, acc="{kind: none}, num_draft_layers: 2"))
    assert e.message.startswith("spec_decode") and "ngram drafter has no layers" in e.message
    e = _err(tiny_scenario(spec=0, acc="{kind: none}, method: mtp"))
    assert "num_speculative_tokens must be at least 1" in e.message
    e = _err(tiny_scenario(spec=2, acc="{kind: none}, method: mtp, num_draft_layers: 0"))
    assert e.message.startswith("spec_decode.num_draft_layers")
    # multi-module MTP reads S prompt tokens past a chunk: the block must hold them (engine rule)
    e = _err(tiny_scenario(spec=20, bs=16, budget=256, acc="{kind: none}, method: mtp, num_draft_layers: 20"))
    assert "block_size (16) at least that" in e.message


def test_ngram_is_the_default_and_plans_no_drafter_group():
    s = _scenario(2).scenario
    assert s.spec_decode.method == "ngram" and s.spec_decode.draft_layers == 0
    assert not any(g.draft or g.lookahead for g in kv_groups(s))
    assert s.spec_decode.lookahead_slots == 0 and s.spec_decode.prefill_lookahead == 0


@pytest.mark.parametrize("method,layers,prefill_lookahead", [("mtp", None, 1), ("eagle", 2, 1), ("mtp", 3, 3)])
def test_drafter_group_is_last_and_flagged(method, layers, prefill_lookahead):
    extra = f", method: {method}" + (f", num_draft_layers: {layers}" if layers else "")
    s = _scenario(3, extra).scenario
    groups = kv_groups(s)
    draft = groups[-1]
    assert draft.draft and draft.kind == "attention" and len(draft.layers) == (layers or 1)
    assert not any(g.draft for g in groups[:-1])
    # every attention group (target and drafter) reserves the drafter's lookahead slots
    assert [g.lookahead for g in groups if not g.is_mamba] == [3, 3]
    assert s.spec_decode.prefill_lookahead == prefill_lookahead
    # the trace header marks the drafter's group, and only it; the executor leaves it out
    head = header_dict(s.model_dump(mode="json"), groups, [], 0)["groups"]
    assert [g.get("draft", False) for g in head] == [False] * (len(groups) - 1) + [True]
    assert [g.group_id for g in groups_from_specs(head)] == [g.group_id for g in groups[:-1]]
    # the pool minimum counts the drafter's blocks and the lookahead slots
    ngram = _scenario(3).scenario
    # (96 tokens: 6 blocks a target attention group, 7 with the 3 slots; the drafter's group 7)
    n_attn = sum(1 for g in groups[:-1] if not g.is_mamba)
    assert min_blocks_per_request(s, 96) == min_blocks_per_request(ngram, 96) + n_attn + 7


def test_lookahead_hashes_cover_the_next_tokens():
    """A block's hash exists once the tokens after it do, and changes with them."""
    toks = list(range(1, 50))
    plain = Request("a", 0, 0, toks, 4, hash_block_size=16)
    look = Request("b", 1, 0, toks, 4, hash_block_size=16, hash_lookahead=1)
    assert len(plain.block_hashes) == 3 and len(look.block_hashes) == 3  # 49 - 1 >= 48
    short = Request("c", 2, 0, toks[:48], 4, hash_block_size=16, hash_lookahead=1)
    assert len(short.block_hashes) == 2  # block 3 waits for token 49
    other = Request("d", 3, 0, toks[:16] + [999] + toks[17:], 4, hash_block_size=16, hash_lookahead=1)
    assert other.block_hashes[0] != look.block_hashes[0]  # the token after block 0 differs
    assert Request("e", 4, 0, toks[:16] + [999] + toks[17:], 4, hash_block_size=16).block_hashes[0] == \
        plain.block_hashes[0]
    short.append_output([49])
    assert short.block_hashes == look.block_hashes


def test_drafter_runs_are_deterministic_and_use_the_drafter_group():
    loaded = _scenario(2, ", method: mtp")
    s = loaded.scenario
    wl = build_workload(loaded)

    def plans():
        sim = Simulation(s, wl)
        return [(p.step, [(r.req_id, r.num_computed_tokens, r.num_scheduled_tokens, r.new_block_ids)
                          for r in p.scheduled]) for p, _ in sim]

    a = plans()
    assert a == plans()
    rows = [r[3] for _, step in a for r in step if r[3] is not None]
    assert rows and all(len(r) == len(kv_groups(s)) for r in rows)
    # the drafter's group holds as many blocks as the target's attention group
    first = next(r for _, step in a for r in step if r[3] is not None and r[3][-1])
    assert len(first[3][-1]) == len(first[3][-2])
