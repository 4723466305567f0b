"""Our plans against vLLM 0.33's own scheduler, run live beside ours (``pytest -m peer``).

Needs vLLM 0.33 in a Python of its own: ``bench/peer_setup.sh`` makes ``.peer-venv`` (or point
HYBRIDSIM_PEER_PYTHON at one). Not part of ``make test``: vLLM is not a dependency. What CI keeps
of these comparisons is in test_fidelity.py (the recordings, and fuzz workloads with the steps
vLLM planned for them, tests/data/peer033)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "probes"))

pytestmark = pytest.mark.peer


@pytest.fixture
def peer() -> str:
    """The Python with vLLM 0.33 in it (the test is skipped when there is none)."""
    py = os.environ.get("HYBRIDSIM_PEER_PYTHON") or str(REPO / ".peer-venv" / "bin" / "python")
    if not Path(py).exists():
        pytest.skip(f"no vLLM peer at {py}: run bench/peer_setup.sh (or set HYBRIDSIM_PEER_PYTHON)")
    return py


def peer_steps(peer: str, files: list[Path], out: Path) -> None:
    """vLLM's plans for each workload file, written to OUT/<stem>.steps.json."""
    r = subprocess.run([peer, str(REPO / "bench" / "peer_vllm.py"), *map(str, files), "--repeat", "0",
                        "--steps-dir", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("name", ["decode64", "spec256", "mooncake2000", "pressure", "padding"])
def test_named_workload_identical(name, peer, tmp_path, capsys):
    from bench_planner import export_peer_workload
    from peer_compare import compare, our_steps

    path = tmp_path / f"{name}.json"
    export_peer_workload(name, path)
    peer_steps(peer, [path], tmp_path)
    steps = json.loads((tmp_path / f"{name}.steps.json").read_text())
    assert compare(name, our_steps(name), steps, 5), capsys.readouterr().out


def test_memory_pressure_workload_identical(peer, tmp_path, capsys):
    from peer_compare import compare, steps_from_export
    from peer_press import make_workload

    path = tmp_path / "press.json"
    w = make_workload()
    path.write_text(json.dumps(w))
    peer_steps(peer, [path], tmp_path)
    steps = json.loads((tmp_path / "press.steps.json").read_text())
    assert compare("press", steps_from_export(w), steps, 5), capsys.readouterr().out


SEED = int(os.environ.get("HYBRIDSIM_PEER_FUZZ_SEED", "3"))


@pytest.mark.parametrize("seed,modes,drafts,at_minimum",
                         [(SEED, ("align",), False, False), (SEED + 1, ("none",), False, False),
                          (SEED + 3, ("align",), True, False), (SEED + 4, ("align", "none"), True, True),
                          (SEED + 24, ("align",), "models", True), (SEED + 30, ("align",), "partial", False),
                          (SEED + 39, ("align", "none"), "layouts", False)],
                         ids=["align", "none", "drafts", "at-minimum", "mtp-eagle", "partial-hits", "layouts"])
def test_random_workloads_identical(seed, modes, drafts, at_minimum, peer, tmp_path, capsys):
    """Every step identical, block ids included (mode none: prefix caching off; drafts: half of
    the workloads draft 1-3 tokens, padded admissions among them; mtp-eagle: those drafts from
    MTP or EAGLE drafters, with the drafter's KV-cache group; partial-hits: block 64 with
    prefix_match_unit 16 or 32, hits ending inside a block; layouts: random layer patterns and
    drafters, the groups formed by the engine's rules on both sides; at-minimum: pools at scenario
    validation's minimum or 1-2 blocks above it, where neither side may stall)."""
    from peer_fuzz import compare_dir, write

    if drafts == "models":  # MTP (one module) and EAGLE drafters, one or six Mamba groups
        write(tmp_path, 40, seed, modes, True, at_minimum, ("mtp", "eagle"), (1, 6), multi_module=False)
    elif drafts == "layouts":  # random layer patterns and drafters (0-3 MTP / EAGLE layers), units 4-16
        write(tmp_path, 12, seed, modes, False, at_minimum, units=(4, 8, 16), layouts=True)
    elif drafts == "partial":  # partial-block prefix hits: block 64, units 16 and 32, every drafter
        write(tmp_path, 30, seed, modes, True, at_minimum, ("ngram", "mtp", "eagle"), (1, 6), 64, (16, 32))
    else:
        write(tmp_path, 40, seed, modes, drafts, at_minimum)
    peer_steps(peer, sorted(tmp_path.glob("fuzz_*.json")), tmp_path)
    assert compare_dir(tmp_path, 3), capsys.readouterr().out
    if at_minimum:  # validation's promise: the longest request can always come back
        for steps in tmp_path.glob("fuzz_*.steps.json"):
            assert json.loads(steps.read_text())["stalled"] is False, steps.name


def test_group_formation_is_the_engines(peer, tmp_path):
    """sched/groups.py's ``form_layout`` beside vLLM 0.33's own grouping (bench/peer_layouts.py:
    ``get_global_kv_cache_groups`` on the same layer specs) on the issue's layouts and 150 random
    ones (1-40 Mamba, 1-8 attention layers, interleaved; 0-3 MTP or EAGLE layers): the same
    groups, in the same order, holding the same layers, flagged alike."""
    import random

    from peer_fuzz import draw_pattern

    from hybridsim.sched.groups import form_layout

    rnd = random.Random(SEED)
    cases = [{"layer_pattern": "MMMAMMMA", "spec_method": "mtp", "num_draft_layers": 1, "num_speculative_tokens": 2},
             {"layer_pattern": "AMM", "spec_method": "eagle", "num_draft_layers": 2, "num_speculative_tokens": 2}]
    for _ in range(150):
        layers = rnd.choice([0, 1, 2, 3])
        method = rnd.choice(["mtp", "eagle"]) if layers else "ngram"
        cases.append({"layer_pattern": draw_pattern(rnd), "spec_method": method, "num_draft_layers": max(layers, 1),
                      "num_speculative_tokens": rnd.choice([1, 2, 3]) if layers else 0})
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    r = subprocess.run([peer, str(REPO / "bench" / "peer_layouts.py"), str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    engine = json.loads(r.stdout)
    for case, theirs in zip(cases, engine, strict=True):
        drafts = case["num_draft_layers"] if case["spec_method"] != "ngram" else 0
        ours = form_layout(case["layer_pattern"], case["spec_method"], drafts)
        want = [(g.kind, sorted([["M" if g.kind == "mamba" else "A", i] for i in g.layers]
                                + [["D", j] for j in g.draft_layers]), bool(g.draft_layers)) for g in ours]
        got = [({"MambaSpec": "mamba"}.get(g["spec"], "attention"), sorted(g["layers"]), g["is_eagle_group"])
               for g in theirs]
        assert got == want, case
        assert {g["block_size"] for g in theirs} == {16}  # (page-size unification pads Mamba, resizes nothing)
