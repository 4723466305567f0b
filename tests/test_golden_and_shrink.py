"""CI gating on golden traces, exports, and shrinking failing traces."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from .conftest import REPO
from .cli_inproc import hsi as hs  # (in process: these tests are about what the commands say and write)

SUBSET = ["spec_decode", "vllm_spec_ngram"]


def _copy_golden(tmp_path):
    d = tmp_path / "golden"
    d.mkdir()
    for name in SUBSET:
        for suffix in (".jsonl", ".expected.json"):
            shutil.copy(REPO / "traces" / f"{name}{suffix}", d / f"{name}{suffix}")
    return d


def test_golden_folder_passes_then_catches_changes(tmp_path):
    d = _copy_golden(tmp_path)
    r = hs("replay", d, "--check")
    assert r.returncode == 0, r.stdout
    assert r.stdout.count("pass") == len(SUBSET)
    # a kernel/bookkeeping behaviour change moves the digests and fails checks
    r = hs("replay", d, "--check", "--inject-bug", "temporal_without_bias")
    assert r.returncode == 1 and "FAIL" in r.stdout
    # an altered expected file is a difference too
    exp = d / "spec_decode.expected.json"
    data = json.loads(exp.read_text())
    data["checks"]["ssm.output"]["count"] += 1
    exp.write_text(json.dumps(data))
    js = tmp_path / "g.json"
    r = hs("replay", d, "--check", "--json", js)
    rows = {t["trace"]: t for t in json.loads(js.read_text())["traces"]}
    assert r.returncode == 1 and rows["spec_decode.jsonl"]["result"] == "FAIL"
    assert any(x.startswith("checks.ssm.output.count") for x in rows["spec_decode.jsonl"]["differences"])
    assert rows["vllm_spec_ngram.jsonl"]["result"] == "pass"
    # deliberate update says what changed and makes the gate pass again
    r = hs("replay", d, "--update-expected", "--json", js)
    rows = {t["trace"]: t for t in json.loads(js.read_text())["traces"]}
    assert r.returncode == 0 and rows["spec_decode.jsonl"]["result"] == "updated"
    assert any("ssm.output.count" in x for x in rows["spec_decode.jsonl"]["differences"])
    assert rows["vllm_spec_ngram.jsonl"]["result"] == "unchanged"
    assert hs("replay", d, "--check").returncode == 0
    # an update that would record fewer checks, a bug's failures or another provider's digests is refused
    before = {p.name: p.read_text() for p in d.glob("*.expected.json")}
    for flags in (("--check-mode", "off"), ("--inject-bug", "temporal_without_bias"), ("--kernels", "triton")):
        r = hs("replay", d, "--update-expected", *flags)
        assert r.returncode == 2 and "nothing was rewritten" in r.stderr, (flags, r.stderr)
    assert {p.name: p.read_text() for p in d.glob("*.expected.json")} == before


def test_golden_check_takes_single_trace_files(tmp_path):
    """A trace named on its own is gated on its NAME.expected.json like one in a folder; a path
    that names nothing is bad input."""
    d = _copy_golden(tmp_path)
    r = hs("replay", d / "spec_decode.jsonl", "--check")
    assert r.returncode == 0 and r.stdout.count("pass") == 1, r.stdout + r.stderr
    r = hs("replay", d / "spec_decode.jsonl", "--check", "--inject-bug", "temporal_without_bias")
    assert r.returncode == 1 and "FAIL" in r.stdout
    missing = tmp_path / "nope.jsonl"
    for extra in ((), ("--check",)):
        r = hs("replay", missing, *extra)
        assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
        assert "no such trace file or folder" in r.stderr.replace("\n", "")  # (the console wraps)


def test_missing_expected_file_fails_the_gate(tmp_path):
    d = _copy_golden(tmp_path)
    (d / "spec_decode.expected.json").unlink()
    r = hs("replay", d, "--check")
    assert r.returncode == 1 and "no expected file" in r.stdout


def test_corrupt_expected_file_is_bad_input(tmp_path):
    """A cut expected file: one message naming the file, line and column, exit 2."""
    d = _copy_golden(tmp_path)
    exp = d / "spec_decode.expected.json"
    exp.write_text(exp.read_text()[:40])
    r = hs("replay", d, "--check")
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    err = r.stderr.replace("\n", "")  # the console wraps long paths
    assert f"{exp}:3: not valid JSON (Expecting " in err and " at column " in err


def test_csv_and_plot_exports(tmp_path):
    png, csv = tmp_path / "t.png", tmp_path / "csv"
    r = hs("run", "scenarios/spec_decode.yaml", "-q", "--plot", png, "--csv", csv)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    steps = pd.read_csv(csv / "steps.csv")
    checks = pd.read_csv(csv / "checks.csv")
    assert len(steps) > 10 and {"prefill_tokens", "decode_tokens", "blocks_in_use", "step_ms"} <= set(steps.columns)
    assert (steps["prefill_tokens"] + steps["decode_tokens"]).sum() > 0
    assert set(checks["check"]) >= {"ssm.output", "sched.invariants"} and checks["failures"].sum() == 0


def test_shrink_injected_bug_to_a_quarter(tmp_path):
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    r = hs("run", "scenarios/forced_preemption.yaml", "-q", "--check", "off", "--record", big,
           "--inject-bug", "stale_state_index")
    assert r.returncode == 0
    r = hs("shrink", big, "--out", small, "--check", "ssm.running_state")
    assert r.returncode == 0, r.stderr
    n_big = len(big.read_text().splitlines()) - 1
    n_small = len(small.read_text().splitlines()) - 1
    assert n_small * 4 <= n_big, (n_small, n_big)
    header = json.loads(small.read_text().splitlines()[0])
    assert header["inject_bug"] == ["stale_state_index"]
    bad = hs("replay", small, "--inject-bug", "stale_state_index", "--json", tmp_path / "r.json", "-q")
    assert bad.returncode == 1
    failing = {c["name"] for c in json.loads((tmp_path / "r.json").read_text())["checks"] if c["failures"]}
    assert "ssm.running_state" in failing
    assert hs("replay", small, "-q").returncode == 0  # the same steps are clean without the bug


def test_shrink_refuses_a_passing_trace(tmp_path):
    t = tmp_path / "t.jsonl"
    assert hs("run", "scenarios/spec_decode.yaml", "-q", "--check", "off", "--record", t).returncode == 0
    r = hs("shrink", t, "--out", tmp_path / "s.jsonl")
    assert r.returncode == 2 and "nothing to shrink" in r.stderr


def test_shrink_names_a_check_that_never_ran_or_never_fails(tmp_path):
    """In process (no subprocess): the requested check is named in the refusal, and a name no
    check has gets the list of those that ran."""
    from hybridsim.errors import InputError
    from hybridsim.shrink import shrink_trace

    trace = REPO / "traces" / "spec_padding.jsonl"  # (the smallest golden trace with Mamba checks: each call replays it)
    with pytest.raises(InputError) as ei:
        shrink_trace(trace, tmp_path / "s.jsonl", "ssm.outptu")
    assert "--check ssm.outptu: no such check ran on this trace" in ei.value.message
    assert "ssm.output" in ei.value.message
    with pytest.raises(InputError) as ei:
        shrink_trace(trace, tmp_path / "s.jsonl", "ssm.output")
    assert ei.value.message == "check ssm.output never fails on the trace; nothing to shrink"
    assert not (tmp_path / "s.jsonl").exists()
