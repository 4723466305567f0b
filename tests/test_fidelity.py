"""Our scheduler against the real vLLM 0.33 scheduler's recordings, step by step."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from hybridsim.convert import convert_recording
from hybridsim.errors import InputError
from hybridsim.fidelity import run_fidelity
from hybridsim.trace import read_trace
from hybridsim.vllm_recorded import load_recording

from .conftest import RECORDINGS


def test_recordings_present():
    """The repository ships the three recordings (data/vllm-recorded/): nothing here is skipped."""
    assert [p.name for p in RECORDINGS] == ["mem_pressure.jsonl", "shared_prefix.jsonl", "spec_ngram.jsonl"]


@pytest.mark.parametrize("rec", RECORDINGS, ids=lambda p: p.stem)
def test_every_recorded_step_identical(rec):
    rep = run_fidelity(str(rec))
    assert rep.steps_recorded > 0
    assert rep.identical_steps_pct == 100.0, [d.__dict__ for d in rep.diffs[:5]]
    # bookkeeping matches too, not just decisions
    assert rep.free_blocks_equal == rep.steps_recorded
    assert rep.block_ids_equal == rep.steps_recorded


@pytest.mark.parametrize("rec", RECORDINGS, ids=lambda p: p.stem)
def test_recording_converts_to_a_consistent_trace(rec, tmp_path):
    out = tmp_path / f"{rec.stem}.jsonl"
    n = convert_recording(rec, out)
    tr = read_trace(out)  # raises on any accounting inconsistency
    assert len(tr.steps) == n > 0
    assert tr.header["groups"][0]["kind"] == "mamba"


def test_cut_recording_is_bad_input(tmp_path):
    """A recording cut inside a string: file, line and column, the decoder's message said once."""
    p = tmp_path / "cut.jsonl"
    p.write_text('{"type": "config", "mod')
    with pytest.raises(InputError) as ei:
        load_recording(p)
    assert ei.value.where == f"{p}:1"
    assert ei.value.message == "not valid JSON (Unterminated string starting at column 20)"


# Small awkward workloads (bench/peer_fuzz.py) with the steps vLLM 0.33's own scheduler planned
# for them (bench/peer_vllm.py --steps-dir), kept because our plans once differed on each: the
# long-prefill threshold with one request left (fuzz_1_9), a resumed prefill ending on a block
# boundary (fuzz_1_36), a chunk ending exactly at the junction (fuzz_1_0), a junction inside a
# resumed request's own outputs (fuzz_1_17, fuzz_1_20), a resumed request's checkpoint column
# (fuzz_5_13: block ids), padded one-token admissions with drafts (fuzz_6_31, fuzz_7_12); and a
# pool too small for a request's next step, where both stall alike (fuzz_8_30). Block ids are
# compared too. tests/data/peer033/README.md.
PEER033 = sorted((Path(__file__).parent / "data" / "peer033").glob("fuzz_*.json.gz"))


@pytest.mark.parametrize("case", PEER033, ids=lambda p: p.name.split(".")[0])
def test_plans_identical_to_vllm_on_fuzz_workloads(case, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from peer_compare import compare, steps_from_export

    data = json.loads(gzip.decompress(case.read_bytes()))
    w = data["workload"]
    ours = steps_from_export(w)
    assert len(data["vllm"]["steps"]) > 50
    assert compare(w["workload"], ours, data["vllm"], 3), capsys.readouterr().out


def test_plans_identical_to_vllm_on_padded_admissions(capsys):
    """bench_planner.py's ``padding`` workload (80 requests, most one token past a cached prefix,
    3 drafts): vLLM 0.33 padded 53 admissions to uniform draft rows; every step identical."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from peer_compare import compare, our_steps

    vllm = json.loads(gzip.decompress((Path(__file__).parent / "data" / "peer033" / "padding.steps.json.gz")
                                      .read_bytes()))
    ours = our_steps("padding")
    assert sum(1 for st in vllm["steps"] for c, n in st["sched"].values() if n == 4 and st["hits"]) > 40
    assert compare("padding", ours, vllm, 3), capsys.readouterr().out


def test_peer033_cases_present():
    assert len(PEER033) == 9


POOL_MINIMUM = [  # (case, usable blocks vLLM 0.33 needs, the step that needs the last of them)
    # a 255-token prompt, max_model_len 256, 3 drafts, budget 40: the final chunk (224 to 255) holds
    # the state at 224, the checkpoint at 240, the running state and three draft columns beside 16
    # attention blocks
    ("poolmin", 22, {"r0": [224, 31]}),
    # a 256-token prompt, max_model_len 257, no drafts, budget 64: 16 attention blocks, never 17 (a
    # request's blocks never cover max_model_len tokens), and three Mamba columns
    ("poolmin257", 19, {"r0": [192, 64]}),
]


@pytest.mark.parametrize("case,need,last", POOL_MINIMUM, ids=[c[0] for c in POOL_MINIMUM])
def test_pool_minimum_is_what_vllm_needs(case, need, last, monkeypatch, capsys):
    """Scenario validation's block minimum is the engine's, no more and no less: vLLM 0.33 finished
    each one-request workload with ``need`` usable blocks and never admitted it with one fewer
    (tests/data/peer033/README.md). We accept the first pool, refuse the second, and, made to
    plan the refused one anyway, stall on it step for step alike."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import hybridsim.config as config
    from peer_compare import compare, simulation_from_export, steps_from_export

    data = {}
    for usable in (need - 1, need):
        data[usable] = json.loads(gzip.decompress((Path(__file__).parent / "data" / "peer033" / f"{case}_{usable}.json.gz")
                                                  .read_bytes()))
        assert data[usable]["workload"]["num_blocks"] == usable + 1
    with pytest.raises(InputError, match=rf"needs {need} blocks .* {need - 1} usable"):
        simulation_from_export(data[need - 1]["workload"])
    fits = data[need]
    assert compare(case, steps_from_export(fits["workload"]), fits["vllm"], 3), capsys.readouterr().out
    assert fits["vllm"]["steps"][-1]["sched"] == last  # (the step that takes the last block)

    monkeypatch.setattr(config, "blocks_problem", lambda s, tokens: None)
    short = data[need - 1]
    assert len(short["vllm"]["steps"]) > 1000 and not any(st["sched"] for st in short["vllm"]["steps"][-1000:])
    assert compare(case, steps_from_export(short["workload"]), short["vllm"], 3), capsys.readouterr().out


# Recordings of vLLM 0.33's scheduler with an MTP or EAGLE drafter (bench/peer_vllm.py --record on
# the workloads bench/peer_fuzz.py named writes; data/vllm-recorded/drafters/README.md): the
# drafter's attention layers are a KV-cache group of their own, flagged is_eagle_group
DRAFTERS = sorted((Path(__file__).resolve().parent.parent / "data/vllm-recorded/drafters").glob("*.jsonl"))


def test_drafter_recordings_present():
    assert [p.stem for p in DRAFTERS] == ["eagle3", "eagle3_pressure", "mtp1", "mtp3_block64", "mtp3_pressure",
                                          "nemotron8b_mtp2"]


@pytest.mark.parametrize("rec", DRAFTERS, ids=lambda p: p.stem)
def test_drafter_recordings_identical_block_for_block(rec):
    rep = run_fidelity(str(rec))
    groups = load_recording(rec).config["kv_cache_groups"]
    assert groups[-1]["is_eagle_group"] and not any(g["is_eagle_group"] for g in groups[:-1])
    assert rep.identical_steps == rep.steps_recorded == rep.steps_ours > 0, [d.__dict__ for d in rep.diffs[:5]]
    assert rep.free_blocks_equal == rep.steps_recorded
    assert rep.block_ids_equal_by_group == [rep.steps_recorded] * len(groups)
    assert rep.block_diffs == []


def test_drafter_recordings_become_drafter_scenarios():
    """The drafter group of a recording is the scenario's drafter: an MTP layer has the target
    attention's spec, an EAGLE head another; our groups end with it, flagged ``draft``."""
    from hybridsim.simulate import kv_groups

    for rec in DRAFTERS:
        r = load_recording(rec)
        sd = r.scenario.spec_decode
        assert sd.method == ("eagle" if rec.stem.startswith("eagle") else "mtp")
        assert sd.draft_layers == 1 and sd.num_speculative_tokens == r.config["num_spec_tokens"]
        groups = kv_groups(r.scenario)
        assert len(groups) == len(r.config["kv_cache_groups"])
        assert [g.draft for g in groups] == [False] * (len(groups) - 1) + [True]
        assert [g.kind == "mamba" for g in groups] == [g["spec"] == "MambaSpec" for g in r.config["kv_cache_groups"]]


def _tampered(src: Path, dst: Path, step: int, edit) -> Path:
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    for d in lines:
        if d.get("type") == "step" and d["step"] == step:
            edit(d)
    dst.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return dst


def test_report_lists_block_level_differences(tmp_path):
    """A recording whose block ids (one group) and free count differ at one step: the decisions
    stay identical, and the report names the step, the group and both sides' values."""
    src = DRAFTERS[0]
    step = next(d for d in (json.loads(x) for x in src.read_text().splitlines())
                if d.get("type") == "step" and d["scheduled_new_reqs"])
    rid = step["scheduled_new_reqs"][0]["id"]
    want = step["scheduled_new_reqs"][0]["block_ids"][1]

    def edit(d):
        d["scheduled_new_reqs"][0]["block_ids"][1] = [b + 1000 for b in want]
        d["num_free_blocks"] += 1

    rep = run_fidelity(str(_tampered(src, tmp_path / "t.jsonl", step["step"], edit)))
    assert rep.identical_steps == rep.steps_recorded
    assert rep.free_blocks_equal == rep.steps_recorded - 1
    assert rep.block_ids_equal_by_group[1] == rep.steps_recorded - 1
    assert rep.block_ids_equal_by_group[0] == rep.steps_recorded
    kinds = {(d.step, d.what): d for d in rep.block_diffs}
    d = kinds[(step["step"], "block ids, group 1")]
    assert d.recorded == f"{rid}:[{' '.join(str(b + 1000) for b in want)}]"
    assert d.ours == f"{rid}:[{' '.join(map(str, want))}]"
    free = kinds[(step["step"], "free blocks")]
    assert int(free.recorded) == int(free.ours) + 1
    js = rep.as_dict()["first_block_diffs"]
    assert {x["what"] for x in js} == {"block ids, group 1", "free blocks"}
