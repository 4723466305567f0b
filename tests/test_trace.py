"""Trace format: round trip, and every corruption caught with its line number."""

from __future__ import annotations

import json

import pytest

from hybridsim.config import parse_scenario
from hybridsim.errors import InputError
from hybridsim.runner import plan_scenario
from hybridsim.trace import read_trace, step_dict

from .conftest import tiny_scenario


@pytest.fixture()
def trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    text = tiny_scenario(spec=2, acc="{kind: bernoulli, rate: 0.5}", blocks=60, n=10, per_step=5, omin=20, omax=40)
    plan_scenario(parse_scenario(text, "t.yaml"), record=path, check="off")
    return path


def test_round_trip(trace_file):
    tr = read_trace(trace_file)
    lines = trace_file.read_text().splitlines()
    assert len(tr.steps) == len(lines) - 1
    for (ln, plan, out), line in zip(tr.steps, lines[1:]):
        assert step_dict(plan, out) == json.loads(line)


def _corrupt(path, lineno, fn):
    lines = path.read_text().splitlines()
    d = json.loads(lines[lineno - 1])
    fn(d)
    lines[lineno - 1] = json.dumps(d)
    path.write_text("\n".join(lines) + "\n")


def _first_cached_line(path):
    for i, line in enumerate(path.read_text().splitlines()[1:], 2):
        d = json.loads(line)
        if any(not s.get("new") for s in d["sched"]):
            return i
    raise AssertionError


def test_wrong_computed_count_rejected_with_line(trace_file):
    ln = _first_cached_line(trace_file)

    def bump(d):
        s = next(s for s in d["sched"] if not s.get("new"))
        s["c"] += 1
    _corrupt(trace_file, ln, bump)
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert ei.value.where == f"{trace_file}:{ln}" and "continues at" in ei.value.message


def test_overscheduled_request_rejected(trace_file):
    ln = _first_cached_line(trace_file)

    def grow(d):
        s = next(s for s in d["sched"] if not s.get("new"))
        s["n"] += 1000
    _corrupt(trace_file, ln, grow)
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert ei.value.where.endswith(f":{ln}")


def test_not_json_rejected(trace_file):
    lines = trace_file.read_text().splitlines()
    lines[3] = lines[3][:20]
    trace_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert ei.value.where == f"{trace_file}:4" and "not valid JSON" in ei.value.message


def test_not_json_message_reads_once(tmp_path):
    """A line cut inside a string: the decoder's message ends in "at"; the column follows it once."""
    p = tmp_path / "cut.jsonl"
    p.write_text('{"format": "hybridsim-trace", "scenar')
    with pytest.raises(InputError) as ei:
        read_trace(p)
    assert ei.value.message == "not valid JSON (Unterminated string starting at column 31)"


def test_missing_header_rejected(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"step": 0, "sched": []}\n')
    with pytest.raises(InputError) as ei:
        read_trace(p)
    assert "header" in ei.value.message and ei.value.where.endswith(":1")


def test_unknown_request_rejected(trace_file):
    _corrupt(trace_file, 2, lambda d: d["sched"][0].__setitem__("id", "ghost"))
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert "ghost" in ei.value.message


def test_interrupted_run_leaves_no_partial_trace(tmp_path, monkeypatch):
    import hybridsim.runner as runner

    good = tmp_path / "t.jsonl"
    good.write_text("keep me\n")

    class Boom(Exception):
        pass

    def exploding_progress(stats):
        if stats.steps == 3:
            raise Boom

    with pytest.raises(Boom):
        runner.plan_scenario(parse_scenario(tiny_scenario(), "t.yaml"), record=good, progress=exploding_progress)
    assert good.read_text() == "keep me\n"
    assert not (tmp_path / "t.jsonl.partial").exists()


@pytest.mark.parametrize("old", [1, 2])
def test_older_trace_versions_refused_with_why(trace_file, old):
    """Versions 1 and 2 placed align-mode prefill checkpoints elsewhere: their plans would execute
    with failing state checks, so they are refused, with why and what to do."""
    _corrupt(trace_file, 1, lambda d: d.__setitem__("version", old))
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert ei.value.where == f"{trace_file}:1"
    m = ei.value.message
    assert f"version {old} is not supported (this is 3); version {old} " in m and "re-record" in m
    assert ("resumed requests" if old == 1 else "column") in m


def test_unknown_trace_version_refused(trace_file):
    _corrupt(trace_file, 1, lambda d: d.__setitem__("version", 9))
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert ei.value.message == "trace version 9 is not supported (this is 3)"


def _padded_trace(tmp_path):
    """The spec_padding scenario's trace: admissions padded with placeholder drafts (-1)."""
    from .conftest import REPO

    path = tmp_path / "p.jsonl"
    text = (REPO / "scenarios" / "spec_padding.yaml").read_text()
    plan_scenario(parse_scenario(text, "spec_padding.yaml"), record=path, check="off")
    ln = next(i for i, line in enumerate(path.read_text().splitlines()[1:], 2)
              if any(s.get("spec", [0])[0] == -1 for s in json.loads(line)["sched"]))
    return path, ln


def test_placeholder_draft_never_accepted(tmp_path):
    path, ln = _padded_trace(tmp_path)
    read_trace(path)  # as recorded: fine

    def accept(d):
        s = next(s for s in d["sched"] if s.get("spec", [0])[0] == -1)
        d.setdefault("acc", {})[s["id"]] = 1
        d["out"][s["id"]] = d["out"][s["id"]] + [3]
    _corrupt(path, ln, accept)
    with pytest.raises(InputError) as ei:
        read_trace(path)
    assert ei.value.where == f"{path}:{ln}" and "placeholder drafts (-1) among them" in ei.value.message


@pytest.mark.parametrize("bad", ["abc", [1.5], [-2], None])
def test_draft_tokens_must_be_token_ids(trace_file, bad):
    ln = _first_cached_line(trace_file)

    def spoil(d):
        d["sched"][0]["spec"] = bad
    _corrupt(trace_file, ln, spoil)
    with pytest.raises(InputError) as ei:
        read_trace(trace_file)
    assert ei.value.where.endswith(f":{ln} (sched[0])") and "spec must be a list" in ei.value.message


def test_header_only_trace_is_nothing_to_replay(trace_file, tmp_path):
    """Its checks would all pass having compared nothing: bad input, not a green replay."""
    from hybridsim.replay import replay_trace

    cut = tmp_path / "cut.jsonl"
    cut.write_text(trace_file.read_text().splitlines()[0] + "\n")
    assert read_trace(cut).steps == []  # (consistent as far as it goes: validate says 0 steps)
    with pytest.raises(InputError) as ei:
        replay_trace(cut)
    assert "no steps after its header" in ei.value.message and ei.value.where == str(cut)
