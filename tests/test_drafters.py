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


# the engine's groups for tiny-hybrid (2 Mamba layers, 1 attention layer) and a drafter (vLLM 0.33's
# get_kv_cache_groups, sched/groups.py): (kind, target layers, drafter layers) per group, and the
# pool minimum for 96 tokens with 3 drafts (align Mamba: 3 + 3 blocks; attention 6, 7 with 3 slots)
ENGINE_LAYOUTS = {
    # an MTP layer shares the target attention's spec: buckets of 2 and 2, one group each
    ("mtp", None): ([("mamba", (0, 1), ()), ("attention", (0,), (0,))], 6 + 7),
    # an EAGLE head has a spec of its own: buckets of 2, 1 and 2, groups of one layer
    ("eagle", 2): ([("mamba", (0,), ()), ("mamba", (1,), ()), ("attention", (0,), ()),
                    ("attention", (), (0,)), ("attention", (), (1,))], 6 + 6 + 7 + 7 + 7),
    # 3 MTP layers: the attention bucket holds 4, split strided into 2 groups of 2
    ("mtp", 3): ([("mamba", (0, 1), ()), ("attention", (0,), (1,)), ("attention", (), (0, 2))], 6 + 7 + 7),
}


@pytest.mark.parametrize("method,layers,prefill_lookahead", [("mtp", None, 1), ("eagle", 2, 1), ("mtp", 3, 3)])
def test_drafter_groups_are_the_engines(method, layers, prefill_lookahead):
    extra = f", method: {method}" + (f", num_draft_layers: {layers}" if layers else "")
    s = _scenario(3, extra).scenario
    groups = kv_groups(s)
    want, pool = ENGINE_LAYOUTS[(method, layers)]
    assert [(g.kind, g.layers, g.draft_layers) for g in groups] == want
    # a group holding any drafter layer is flagged, as the engine flags is_eagle_group
    assert [g.draft for g in groups] == [bool(d) for _, _, d in want]
    # every attention group (target and drafter) reserves the drafter's lookahead slots
    assert {g.lookahead for g in groups if not g.is_mamba} == {3}
    assert s.spec_decode.prefill_lookahead == prefill_lookahead
    # the trace header marks the drafter's groups; the executor runs the target layers only
    head = header_dict(s.model_dump(mode="json"), groups, [], 0)["groups"]
    assert [g.get("draft", False) for g in head] == [g.draft for g in groups]
    run = groups_from_specs(head)
    assert [(g.group_id, g.layers) for g in run] == [(g.group_id, g.layers) for g in groups if g.layers]
    # the pool minimum counts the drafter's blocks and the lookahead slots
    assert min_blocks_per_request(s, 96) == pool
    assert min_blocks_per_request(_scenario(3).scenario, 96) == 6 + 6 + 6  # (ngram: no slots)


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
    groups = kv_groups(s)
    assert rows and all(len(r) == len(groups) == 2 for r in rows)
    # the MTP layer shares the target attention's group (the engine's layout): its row holds the
    # prompt's blocks plus the lookahead slots
    assert groups[-1].draft and groups[-1].layers == (0,) and groups[-1].draft_layers == (0,)
    first = next(r for _, step in a for r in step if r[3] is not None and r[3][-1] and r[1] == 0)
    assert len(first[3][-1]) >= -(-min(first[2] + 2, 1024) // 16)
