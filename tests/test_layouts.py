"""KV-cache group formation as vLLM 0.33 forms it (sched/groups.py; issue 39): the layouts of the
issue, the presets, explicit (recorded) layouts, and what a recording's layout this tool refuses.
tests/test_peer.py sets ``form_layout`` beside the engine's own function on random layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridsim.errors import InputError
from hybridsim.execute import groups_from_specs
from hybridsim.presets import PRESETS, build_preset
from hybridsim.sched.groups import (default_pattern, describe_layout, explicit_layout, form_layout,
                                    groups_from_layout, plan_groups)
from hybridsim.trace import header_dict
from hybridsim.vllm_recorded import load_recording

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm-recorded"


def _shape(layout):
    return [(g.kind, g.layers, g.draft_layers) for g in layout]


def test_issue_layout_mixes_target_and_drafter_attention():
    """6 Mamba + 2 attention layers and one MTP layer: two Mamba groups of 3 (strided) and ONE
    attention group of the 2 target layers and the MTP layer, the drafter's (is_eagle_group)."""
    layout = form_layout("MMMAMMMA", "mtp", 1)
    assert _shape(layout) == [("mamba", (0, 2, 4), ()), ("mamba", (1, 3, 5), ()), ("attention", (0, 1), (0,))]
    groups = groups_from_layout(layout, 16, 1024, "align", 2, lookahead=2)
    assert [g.draft for g in groups] == [False, False, True]
    assert groups[2].num_layers == 3 and groups[2].lookahead == 2 and groups[0].num_spec == 2
    # the trace header keeps both lists; the executor runs the target's layers of the mixed group
    head = header_dict({}, groups, [], "test")["groups"]
    assert head[2]["layers"] == [0, 1] and head[2]["draft_layers"] == [0] and head[2]["draft"] is True
    assert [(g.group_id, g.layers) for g in groups_from_specs(head)] == [(0, (0, 2, 4)), (1, (1, 3, 5)), (2, (0, 1))]


def test_eagle_head_is_a_bucket_of_its_own_and_order_follows_the_pattern():
    # EAGLE: another spec; buckets 2 (M), 1 (A), 2 (drafter): group size 1; attention listed first
    assert _shape(form_layout("AMM", "eagle", 2)) == [
        ("attention", (0,), ()), ("mamba", (0,), ()), ("mamba", (1,), ()),
        ("attention", (), (0,)), ("attention", (), (1,))]
    # group size: the largest bucket when under 1.5x the smallest (13 vs 12: no 24-layer padding)
    assert _shape(form_layout("M" * 12 + "A" * 12, "mtp", 1)) == [
        ("mamba", tuple(range(12)), ()), ("attention", tuple(range(12)), (0,))]
    # padding: 24 Mamba + 5 attention-like (4 + MTP): groups of 5, the last Mamba group one short
    shape = _shape(form_layout("M" * 24 + "A" * 4, "mtp", 1))
    assert [len(x[1]) for x in shape] == [5, 5, 5, 5, 4, 4] and shape[-1][2] == (0,)
    assert shape[0][1] == (0, 5, 10, 15, 20)
    # a model without Mamba and of one attention kind: every layer in one group, drafter's too
    assert _shape(form_layout("LL", "eagle", 1)) == [("mla", (0, 1), (0,))]


# the presets' groups without a drafter are the ones hybridsim always planned (block counts of
# every shipped recording and golden trace rest on them)
PRESET_GROUPS = {
    "tiny-hybrid": "2× mamba[1], 1× attention[1]",
    "tiny-mla": "1× mla[2]",
    "tiny-hybrid-mla": "2× mamba[1], 1× mla[1]",
    "nemotron-h-8b": "6× mamba[4], 1× attention[4]",
    "jamba-1.5-mini": "7× mamba[4], 1× attention[4]",
    "granite-4.0-h-small": "9× mamba[4], 1× attention[4]",
    "qwen3-next-80b": "3× mamba[12], 1× attention[12]",
    "deepseek-v3": "1× mla[61]",
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_form_the_engines_groups(name):
    geo = build_preset(name)
    assert describe_layout(form_layout(default_pattern(geo))) == PRESET_GROUPS[name]
    groups = plan_groups(geo, 16, 4096, "align", 0)
    assert sum(len(g.layers) for g in groups if g.is_mamba) == (geo.mamba.layers if geo.mamba else 0)
    assert not any(g.draft for g in groups)


def test_nemotron_with_mtp_joins_the_attention_group():
    geo = build_preset("nemotron-h-8b")
    line = describe_layout(form_layout(default_pattern(geo), "mtp", 1))
    assert line == "4× mamba[5], 1× mamba[4], 1× attention[4+1 draft]"


@settings(max_examples=60, deadline=None)
@given(st.text("MA", min_size=2, max_size=48).filter(lambda p: "M" in p and "A" in p),
       st.sampled_from(["ngram", "mtp", "eagle"]), st.integers(0, 3))
def test_explicit_layout_of_a_formed_one_is_the_same(pattern, method, drafts):
    """A recording lists only how many layers each group holds: rebuilt from those counts, the
    layout has the same groups, every layer in one of them; without a drafter, the engine's very
    layer indices (strided)."""
    layout = form_layout(pattern, method, drafts)
    assert all(g.layers or g.draft_layers for g in layout)
    again = explicit_layout([(g.kind, len(g.layers), len(g.draft_layers)) for g in layout])
    assert [(g.kind, len(g.layers), len(g.draft_layers)) for g in again] == \
        [(g.kind, len(g.layers), len(g.draft_layers)) for g in layout]
    if method == "ngram" or not drafts:
        assert again == layout
    for lay in (layout, again):  # every layer in exactly one group
        for kind, n in (("mamba", pattern.count("M")), ("attention", pattern.count("A"))):
            assert sorted(i for g in lay if g.kind == kind for i in g.layers) == list(range(n))
        assert sorted(i for g in lay for i in g.draft_layers) == list(range(drafts if method != "ngram" else 0))


def _edited(tmp_path, src: Path, edit) -> Path:
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    edit(lines[0])
    dst = tmp_path / src.name
    dst.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return dst


def test_recorded_layout_is_kept_and_refused_where_not_modelled(tmp_path):
    # nemotron8b_mtp2's drafter sits alone although MTP: not what the rules form, kept as recorded
    rec = load_recording(DATA / "drafters" / "nemotron8b_mtp2.jsonl")
    assert [(g.kind, g.layers, g.draft_layers) for g in rec.scenario.model.kv_cache_groups] == \
        [("mamba", 1, 0)] * 6 + [("attention", 1, 0), ("attention", 0, 1)]
    src = DATA / "drafters" / "mtp1.jsonl"
    assert load_recording(src).scenario.model.kv_cache_groups is None  # (the rules form it)

    def resized(cfg):
        cfg["kv_cache_groups"][1]["block_size"] = 32

    with pytest.raises(InputError, match=r"kv_cache_groups\[1\]: block size 32 differs from scheduler_block_size"):
        load_recording(_edited(tmp_path, src, resized))

    def mamba_drafter(cfg):
        cfg["kv_cache_groups"][0].update(is_eagle_group=True, num_draft_layers=1)

    with pytest.raises(InputError, match=r"kv_cache_groups\[0\]: a drafter with Mamba layers is not modelled"):
        load_recording(_edited(tmp_path, src, mamba_drafter))

    def unflagged(cfg):
        cfg["kv_cache_groups"][1]["num_draft_layers"] = 1

    with pytest.raises(InputError, match=r"holds 1 drafter layers but is not flagged is_eagle_group"):
        load_recording(_edited(tmp_path, src, unflagged))


def test_presets_command_prints_each_presets_groups():
    from typer.testing import CliRunner

    from hybridsim.cli import app

    r = CliRunner().invoke(app, ["presets", "--draft-layers", "2"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    text = r.output
    i = text.index("KV-cache groups")
    block = text[i:text.index("sources", i)]
    for name in PRESETS:
        geo = build_preset(name)
        head = block.index(name)
        assert f"no drafter: {PRESET_GROUPS[name]}" in block[head:]
        mtp = describe_layout(form_layout(default_pattern(geo), "mtp", 2))
        assert f"MTP (2 layers): {mtp}" in block[head:]
    assert "4× mamba[6], 1× attention[4+2 draft]" in block  # nemotron-h-8b + 2 MTP layers: buckets 24 and 6


# Recordings of vLLM 0.33's scheduler on layouts the engine forms from a layer pattern and a
# drafter (bench/peer_fuzz.py named --layouts; data/vllm-recorded/layouts/README.md)
LAYOUTS = sorted((DATA / "layouts").glob("*.jsonl"))


def test_layout_recordings_present():
    assert [p.stem for p in LAYOUTS] == ["eagle2_attention_first", "mixed_mtp_partial", "mixed_mtp_pressure",
                                         "mtp3_qwen_like"]


@pytest.mark.parametrize("rec", LAYOUTS, ids=lambda p: p.stem)
def test_layout_recordings_identical_and_formed_by_our_rules(rec):
    from hybridsim.fidelity import run_fidelity
    from hybridsim.simulate import kv_groups

    w = json.loads(rec.with_name(rec.stem + ".workload.json").read_text())
    r = load_recording(rec)
    cfg_groups = r.config["kv_cache_groups"]
    # the engine's groups (layer names, flags) are the ones our rules form from the same pattern
    ours = form_layout(w["layer_pattern"], w["spec_method"], w["num_draft_layers"])
    pattern = w["layer_pattern"]
    for g, mine in zip(cfg_groups, ours, strict=True):
        names = g["layer_names"]
        target = sorted(pattern[:int(n.split(".")[2])].count(pattern[int(n.split(".")[2])])
                        for n in names if n.startswith("model."))
        drafts = sorted(int(n.split(".")[2]) for n in names if n.startswith("draft."))
        assert (target, drafts, g["is_eagle_group"]) == (sorted(mine.layers), sorted(mine.draft_layers),
                                                          bool(mine.draft_layers))
    groups = kv_groups(r.scenario)
    assert [(g.kind, len(g.layers), len(g.draft_layers)) for g in groups] == \
        [(m.kind, len(m.layers), len(m.draft_layers)) for m in ours]
    rep = run_fidelity(str(rec))
    assert rep.identical_steps == rep.steps_recorded == rep.steps_ours > 0, [d.__dict__ for d in rep.diffs[:5]]
    assert rep.free_blocks_equal == rep.steps_recorded
    assert rep.block_ids_equal_by_group == [rep.steps_recorded] * len(groups)


def test_mixed_group_recording_replays_green_with_every_check():
    """The issue's layout (the MTP layer in the target attention's group) executes as recorded:
    the mixed group's target layers run on its blocks, every check compares and passes."""
    from hybridsim.replay import replay_trace

    res = replay_trace(DATA / "layouts" / "mixed_mtp_pressure.jsonl", check="full")
    tallies = res.checks.tallies
    assert tallies["attn.output"].count > 0 and tallies["ssm.running_state"].count > 0
    assert all(t.failures == 0 for t in tallies.values()), {k: t.failures for k, t in tallies.items()}
