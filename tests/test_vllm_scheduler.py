"""``run --scheduler vllm``: vLLM 0.33's own scheduler plans, hybridsim executes and checks.

The tests marked ``peer`` need vLLM 0.33 in this Python (skipped without it; ``bench/peer_setup.sh``
makes ``.peer-venv``, then ``.peer-venv/bin/python -m pytest -m peer tests/test_vllm_scheduler.py``).
The others hold the refusals that need no vLLM: exit 3 without it (or with another version), exit
2 for what vLLM's scheduler cannot honour."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types

import pytest

from hybridsim.config import parse_scenario
from hybridsim.errors import EnvironmentProblem, InputError

from .conftest import REPO, tiny_scenario

HAS_VLLM = importlib.util.find_spec("vllm") is not None
peer = pytest.mark.peer
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this Python (bench/peer_setup.sh)")


def hs(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "hybridsim", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


# tiny hybrid scenarios written here, each aimed at one thing vLLM's plans must survive
WRITTEN = {
    # align mode, drafts (Bernoulli acceptance) and a pool a few requests overfill: preemptions
    "drafts_pressure": dict(seed=3, blocks=40, budget=96, seqs=6, max_len=256, n=10, per_step=3, pmin=17, pmax=130,
                            omin=10, omax=40, frac=0.6, faults="[]", spec=2, acc="{kind: bernoulli, rate: 0.6}"),
    # two prefix-cache resets and a named preemption: every request resumes, some twice
    "resets": dict(seed=4, blocks=128, budget=64, seqs=4, max_len=512, n=6, per_step=2, pmin=30, pmax=90, omin=20,
                   omax=30, frac=0.5, spec=1, acc="{kind: pattern, accepted: [1, 0, 1]}",
                   faults="[{at_step: 6, kind: reset_prefix_cache}, {at_step: 10, kind: preempt, requests: [r1, r4]}, "
                          "{at_step: 16, kind: reset_prefix_cache}]"),
    # 23 usable blocks for 8 requests one after the other: block ids are handed out again and again
    "pool_wraps": dict(seed=5, blocks=24, budget=64, seqs=2, max_len=256, n=8, per_step=1, pmin=20, pmax=70, omin=4,
                       omax=12, frac=0.0, faults="[]"),
}


def written(name: str, tmp_path=None):
    text = tiny_scenario(name=name, prefix=32, execution="{kernels: reference, device: cpu}", **WRITTEN[name])
    if tmp_path is None:
        return parse_scenario(text, f"{name}.yaml")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- without vLLM


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_exit_3_saying_how_to_install(tmp_path):
    for args in (["--scheduler", "vllm"], []):
        path = written("pool_wraps", tmp_path)
        if not args:  # the scenario's own key asks for it
            path.write_text(path.read_text().replace("device: cpu}", "device: cpu, scheduler: vllm}"))
        r = hs("run", path, *args)
        assert r.returncode == 3, r.stderr
        err = " ".join(r.stderr.split())
        assert "Traceback" not in r.stderr and err.count("environment:") == 1
        assert "bench/peer_setup.sh" in err and "pip install vllm==0.33.0" in err


def test_unsupported_vllm_version_named_exit_3(monkeypatch):
    from hybridsim.engines.support import require_vllm

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.34.1"))
    with pytest.raises(EnvironmentProblem) as e:
        require_vllm()
    assert "vLLM 0.34.1 is installed" in str(e.value) and "0.33" in str(e.value)
    assert EnvironmentProblem.exit_code == 3


def test_mode_all_refused_exit_2_naming_the_key():
    r = hs("run", "scenarios/all_mode.yaml", "--scheduler", "vllm")
    assert r.returncode == 2
    assert "all_mode.yaml:6: cache.mamba_cache_mode: all: vLLM 0.33's scheduler" in " ".join(r.stderr.split())
    # the scenario's own key: a scenario error wherever it is validated
    text = (REPO / "scenarios/all_mode.yaml").read_text() + "execution: {scheduler: vllm}\n"
    with pytest.raises(InputError, match="cache.mamba_cache_mode: all: vLLM"):
        parse_scenario(text, "all.yaml")


def test_scheduler_bug_refused_and_bad_value(tmp_path):
    r = hs("run", written("pool_wraps", tmp_path), "--scheduler", "vllm", "--inject-bug", "free_shared_block")
    assert r.returncode == 2 and "--inject-bug: free_shared_block breaks hybridsim's own scheduler" in r.stderr
    r = hs("run", "scenarios/quickstart.yaml", "--scheduler", "sglang")
    assert r.returncode == 2 and "'sglang' is not one of hybridsim, vllm" in r.stderr
    with pytest.raises(InputError, match="execution.scheduler"):
        parse_scenario(written("pool_wraps", tmp_path).read_text().replace("device: cpu}", "scheduler: x}"))


def test_scheduler_key_left_out_of_dumps_at_its_default():
    """Traces and sweep cells of scenarios that do not set it are byte for byte what they were."""
    s = written("pool_wraps").scenario
    assert "scheduler" not in s.model_dump(mode="json")["execution"]
    v = s.model_copy(update={"execution": s.execution.model_copy(update={"scheduler": "vllm"})})
    assert v.model_dump(mode="json")["execution"]["scheduler"] == "vllm"


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_sweep_over_the_scheduler_needs_vllm(tmp_path):
    from hybridsim.sweep import load_sweep

    written("pool_wraps", tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: pool_wraps.yaml\ngrid: {execution.scheduler: [hybridsim, vllm]}\n")
    with pytest.raises(EnvironmentProblem, match="pip install vllm"):
        load_sweep(sweep)
    sweep.write_text("base: pool_wraps.yaml\ngrid: {execution.scheduler: [hybridsim, vlm]}\n")
    with pytest.raises(InputError, match="execution.scheduler"):
        load_sweep(sweep)


# ----------------------------------------------------------------------------- with vLLM (peer)

# the shipped tiny scenarios on which docs/fidelity.md ("Running vLLM's own scheduler") has
# vLLM 0.33's plans identical to ours (all_mode is refused: vLLM has no mode all)
AGREE = ["align_prefix_hits", "chunked_prefill", "forced_preemption", "large_pages", "memory_pressure",
         "no_prefix_cache", "priority_policy", "quickstart", "spec_decode", "spec_padding", "mixed_hybrid_mla",
         "mla_long_context", "nemotron_h_8b", "deepseek_v3"]


def _record(loaded, path, scheduler: str, check: str = "off"):
    from hybridsim.runner import plan_scenario

    res = plan_scenario(loaded, record=path, check=check, scheduler=scheduler)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return res, lines


@peer
@needs_vllm
@pytest.mark.parametrize("name", AGREE)
def test_shipped_scenario_same_trace_as_ours(name, tmp_path):
    from hybridsim.config import load_scenario

    path = REPO / "scenarios" / f"{name}.yaml"
    ours, a = _record(load_scenario(path), tmp_path / "ours.jsonl", "hybridsim")
    theirs, b = _record(load_scenario(path), tmp_path / "vllm.jsonl", "vllm")
    assert theirs.planner.startswith("vLLM 0.33") and ours.planner is None
    assert b[0]["scenario"]["execution"].pop("scheduler") == "vllm" and "(plan: vLLM 0.33" in b[0].pop("source")
    a[0].pop("source")
    assert a[0] == b[0]
    assert len(a) == len(b) > 2
    for x, y in zip(a[1:], b[1:]):
        assert x == y, f"step {x['step']}: ours {x} | vLLM {y}"
    assert ours.stats.as_dict() == theirs.stats.as_dict()


@peer
@needs_vllm
@pytest.mark.parametrize("name", ["spec_decode", "forced_preemption"])
def test_vllm_trace_replays_green(name, tmp_path):
    from hybridsim.config import load_scenario
    from hybridsim.replay import replay_trace

    _record(load_scenario(REPO / "scenarios" / f"{name}.yaml"), tmp_path / "v.jsonl", "vllm")
    r = replay_trace(tmp_path / "v.jsonl", check="full")
    assert not r.failed and r.steps > 0
    assert sum(t.count for t in r.checks.tallies.values()) > 1000


@peer
@needs_vllm
@pytest.mark.parametrize("name", list(WRITTEN))
def test_written_scenario_every_check_on(name, tmp_path):
    res, lines = _record(written(name), tmp_path / "v.jsonl", "vllm", check="full")
    assert not res.failed and not res.stats.stalled, res.checks.as_list()
    _, ours = _record(written(name), tmp_path / "ours.jsonl", "hybridsim")
    assert ours[1:] == lines[1:]  # (and they are our plans, step for step)
    assert res.stats.finished == res.stats.requests
    tallies = res.checks.tallies
    for check in ("plan.accounting", "ssm.output", "ssm.running_state", "attn.output", "attn.cached_blocks"):
        assert tallies[check].count > 0 and tallies[check].failures == 0, check
    steps = lines[1:]
    if name == "drafts_pressure":
        assert res.stats.preemptions > 0 and res.stats.drafts_accepted > 0
        assert res.stats.drafts_accepted < res.stats.drafts_scheduled
    if name == "resets":
        assert [s["step"] for s in steps if s.get("faults")] == [6, 10, 16]
        assert res.stats.forced_preemptions >= 4
        assert sum(1 for s in steps for r in s["sched"] if r.get("resumed")) >= 4
    if name == "pool_wraps":  # every usable block handed out, and some of them again to another request
        holders: dict[int, set] = {}
        for s in steps:
            for r in s["sched"]:
                for g in r.get("blocks", ()):
                    for b in g:
                        if b:
                            holders.setdefault(b, set()).add(r["id"])
        assert set(holders) == set(range(1, 24))
        assert sum(len(h) > 1 for h in holders.values()) > 10


@peer
@needs_vllm
def test_faults_that_did_nothing_noted_as_ours_notes_them(tmp_path):
    faults = ("[{at_step: 1, kind: preempt, requests: [r7]}, {at_step: 3, kind: preempt, requests: [r0, r2]}, "
              "{at_step: 900, kind: reset_prefix_cache}]")
    text = tiny_scenario(name="f", prefix=32, execution="{kernels: reference, device: cpu}",
                         **dict(WRITTEN["pool_wraps"], faults=faults))
    ours, a = _record(parse_scenario(text, "f.yaml"), tmp_path / "ours.jsonl", "hybridsim")
    theirs, b = _record(parse_scenario(text, "f.yaml"), tmp_path / "vllm.jsonl", "vllm")
    assert a[1:] == b[1:]
    notes = [n for n in ours.stats.notes if n.startswith("fault")]
    assert notes == [n for n in theirs.stats.notes if n.startswith("fault")]
    assert notes[0] == "fault at step 1: preempt did not preempt r7 (arrives at step 7): it acts on running requests only"
    assert notes[-1].startswith("fault at step 900 never acted: the run ended at step ")
    assert len(notes) == 3, notes  # (step 3: r0 or r2 was not running, whichever the pool let in)


@peer
@needs_vllm
def test_cli_says_whose_plan_ran(tmp_path):
    path = written("pool_wraps", tmp_path)
    r = hs("run", path, "--scheduler", "vllm", "--record", tmp_path / "t.jsonl", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    assert "plan" in r.stdout and "vLLM 0.33.0 scheduler (live)" in " ".join(r.stdout.split())
    assert json.loads((tmp_path / "r.json").read_text())["plan"] == "vLLM 0.33.0 scheduler (live)"
    v = hs("replay", tmp_path / "t.jsonl")
    assert v.returncode == 0, v.stdout[-2000:]


THRESHOLD_BELOW_DRAFT_ROW = """name: thr
seed: 1
model: {preset: tiny-hybrid}
cache: {block_size: 16, num_blocks: 64, enable_prefix_caching: false}
scheduler: {max_num_batched_tokens: 64, max_num_seqs: 4, max_model_len: 256, long_prefill_token_threshold: 2}
spec_decode: {num_speculative_tokens: 3, acceptance: {kind: bernoulli, rate: 0.5}}
workload:
  kind: synthetic
  num_requests: 4
  prompt_len: {dist: fixed, value: 1}
  output_len: {dist: fixed, value: 6}
execution: {check: off}
"""


def test_threshold_below_a_draft_row_refused_without_align_split():
    """vLLM 0.33 asserts when the threshold cuts a padded one-token admission (fidelity.md point 12)."""
    from hybridsim.engines.support import vllm_refusals

    with pytest.raises(InputError, match=r"t.yaml:5: scheduler.long_prefill_token_threshold: 2 is below 1 \+ "):
        vllm_refusals(parse_scenario(THRESHOLD_BELOW_DRAFT_ROW, "t.yaml"))
    vllm_refusals(parse_scenario(THRESHOLD_BELOW_DRAFT_ROW.replace("threshold: 2", "threshold: 4"), "t.yaml"))


@peer
@needs_vllm
def test_a_crash_of_vllms_scheduler_is_a_failed_check():
    """Driven past the refusal, vLLM's own assertion stops the run as a failed check, not a traceback."""
    from hybridsim.checks import Checks
    from hybridsim.engines.vllm_live import ENGINE_CHECK, VllmPlanner
    from hybridsim.workload import build_workload

    loaded = parse_scenario(THRESHOLD_BELOW_DRAFT_ROW, "t.yaml")
    checks = Checks()
    planner = VllmPlanner(loaded.scenario, build_workload(loaded), "t.yaml", checks)
    plans = list(planner)
    tally = checks.tallies[ENGINE_CHECK]
    assert checks.failed and tally.failures == 1
    assert "Scheduler.schedule raised AssertionError" in tally.first_failure.message
    assert tally.first_failure.step == len(plans) and any("the run stopped there" in n for n in planner.stats.notes)


def test_plan_accounting_fails_a_plan_that_does_not_add_up():
    """``plan.accounting``'s trace check, on our own plans of a written scenario: they pass; one row
    moved a token ahead fails at its step (the check needs no vLLM to be held to account)."""
    from types import SimpleNamespace

    from hybridsim.checks import Checks
    from hybridsim.engines.vllm_live import PLAN_CHECK, PlanChecker
    from hybridsim.sched.plan import StepPlan
    from hybridsim.simulate import Simulation
    from hybridsim.workload import build_workload

    loaded = written("pool_wraps")
    sim = Simulation(loaded.scenario, build_workload(loaded))
    records = [(plan.step, plan, outcome) for plan, outcome in sim]
    owner = SimpleNamespace(scenario=loaded.scenario, groups=sim.groups, workload=sim.workload, source="w.yaml")
    for tamper in (False, True):
        checks = Checks()
        checker = PlanChecker(owner, checks.get(PLAN_CHECK))
        checker.records = list(records)
        if tamper:  # step 5: its first continuing row claims one computed token more than it has
            step, plan, outcome = records[5]
            i = next(i for i, r in enumerate(plan.scheduled) if not r.is_new)
            rows = list(plan.scheduled)
            rows[i] = rows[i]._replace(num_computed_tokens=rows[i].num_computed_tokens + 1)
            checker.records[5] = (step, StepPlan(step, tuple(rows), plan.preempted, plan.finished), outcome)
        checker.finish()
        tally = checks.tallies[PLAN_CHECK]
        assert tally.failures == (1 if tamper else 0)
        if tamper:
            assert tally.first_failure.step == records[5][0] and "continues at" in tally.first_failure.message
