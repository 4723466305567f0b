"""Hostile files are bad input like any other (safe_load.py): alias bombs, self-referring
aliases, python and unknown tags, deep nesting, numbers past Python's integer-string limit and
oversized lines — in scenarios, sweep files, traces, vLLM recordings, workload files and expected
files — are each one InputError (exit 2) naming the file, and the line where there is one."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridsim import safe_load, vllm_recorded
from hybridsim.cli import app
from hybridsim.config import load_scenario
from hybridsim.errors import InputError
from hybridsim.golden import _read_expected
from hybridsim.sweep import load_sweep
from hybridsim.trace import read_trace
from hybridsim.vllm_recorded import load_recording

from .conftest import REPO, tiny_scenario


def _bomb() -> str:
    """Nine levels of nine aliases: 9**9 strings once expanded."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


YAML_CASES = {  # name: (document, line of the message, words in it)
    "alias bomb": (_bomb(), None, "aliases expand past"),
    "self alias": ("name: x\nloop: &a [1, *a]\n", 2, "contains it"),
    "python tag": ("name: x\nrun: !!python/object/apply:os.system ['true']\n", 2, "!!python/object/apply"),
    "unknown tag": ("name: !secret x\n", 1, "tag !secret is not allowed"),
    "deep flow": ("name: x\nmodel: " + "[" * 5000 + "]" * 5000 + "\n", 2, "nested more than"),
    "deep block": ("name: x\nmodel:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 200)) + " " * 200 + "v: 1\n",
                   None, "nested more than"),
    "deep via aliases": ("a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: &b " + "[" * 40 + "*a" + "]" * 40 + "\n",
                         None, "nest more than"),
}


def _check(e: pytest.ExceptionInfo, path: Path, line, words: str) -> None:
    assert words in e.value.message, e.value
    assert e.value.where == (f"{path}:{line}" if line else e.value.where) and str(path) in e.value.where, e.value


@pytest.mark.parametrize("case", list(YAML_CASES))
def test_hostile_scenario(case, tmp_path):
    text, line, words = YAML_CASES[case]
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_scenario(path)
    _check(e, path, line, words)


@pytest.mark.parametrize("case", list(YAML_CASES))
def test_hostile_sweep_file_and_its_base(case, tmp_path):
    text, line, words = YAML_CASES[case]
    (tmp_path / "base.yaml").write_text(tiny_scenario(n=2))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(text)
    with pytest.raises(InputError) as e:
        load_sweep(sweep)
    _check(e, sweep, line, words)
    (tmp_path / "base.yaml").write_text(text)
    sweep.write_text("base: base.yaml\nseeds: [0]\ngrid:\n  cache.block_size: [16]\n")
    with pytest.raises(InputError) as e:
        load_sweep(sweep)
    _check(e, tmp_path / "base.yaml", line, words)


def test_oversized_yaml_file_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_load, "MAX_YAML_BYTES", 1000)
    path = tmp_path / "s.yaml"
    path.write_text("name: " + "x" * 2000 + "\n")
    with pytest.raises(InputError) as e:
        load_scenario(path)
    assert "larger than a scenario or sweep file can be" in e.value.message and e.value.where == str(path)


def test_plain_yaml_features_still_load(tmp_path):
    """Aliases, merge keys and plain tags stay allowed: only the hostile is refused."""
    text = tiny_scenario(n=2).replace("name:", "defaults: &d {block_size: 16}\nname:", 1)
    assert safe_load.load_yaml("a: &x {k: 1}\nb:\n  <<: *x\n  j: !!int '2'\n", "t") == \
        {"a": {"k": 1}, "b": {"k": 1, "j": 2}}
    assert safe_load.load_yaml(text, "t")["defaults"] == {"block_size": 16}


# ----------------------------------------------------------------------------- JSON lines


def _header() -> str:
    return (REPO / "traces" / "quickstart.jsonl").read_text().splitlines()[0]


def _recording_lines() -> list[str]:
    return (REPO / "data" / "vllm-recorded" / "shared_prefix.jsonl").read_text().splitlines()


JSON_CASES = {  # name: (a hostile line, words)
    "deep arrays": ('{"step": 1, "sched": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "deep objects": ('{"step": 1, "x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}", "nested too deeply"),
    "huge number": ('{"step": ' + "7" * 5000 + ', "sched": []}', "a number too long"),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_hostile_trace_line(case, tmp_path):
    line, words = JSON_CASES[case]
    path = tmp_path / "t.jsonl"
    path.write_text(_header() + "\n" + line + "\n")
    with pytest.raises(InputError) as e:
        read_trace(path)
    assert words in e.value.message and e.value.where == f"{path}:2", e.value
    path.write_text(line.replace('"step"', '"format": "hybridsim-trace", "step"', 1) + "\n")  # as the header
    with pytest.raises(InputError) as e:
        read_trace(path)
    assert words in e.value.message and e.value.where == f"{path}:1", e.value


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_hostile_recording_line(case, tmp_path):
    line, words = JSON_CASES[case]
    lines = _recording_lines()
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([*lines[:3], line, *lines[3:]]) + "\n")
    with pytest.raises(InputError) as e:
        load_recording(path)
    assert words in e.value.message and e.value.where == f"{path}:4", e.value
    path.write_text("\n".join([line, *lines]) + "\n")  # where the config line should be
    with pytest.raises(InputError) as e:
        load_recording(path)
    assert words in e.value.message and e.value.where == f"{path}:1", e.value


def test_oversized_lines_are_refused_before_being_held(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_load, "MAX_LINE_CHARS", 4096)
    monkeypatch.setattr(vllm_recorded, "MAX_LINE_CHARS", 4096)
    long = '{"step": 1, "sched": [], "pad": "' + "x" * 10_000 + '"}'
    trace = tmp_path / "t.jsonl"
    trace.write_text(_header()[:4000] + "\n" + long + "\n") if len(_header()) > 4096 else \
        trace.write_text(_header() + "\n" + long + "\n")
    with pytest.raises(InputError) as e:
        read_trace(trace)
    assert "line longer than 4,096 characters" in e.value.message and e.value.where.startswith(f"{trace}:")
    rec = tmp_path / "r.jsonl"
    rec.write_text(long + "\n")
    assert not vllm_recorded.is_vllm_recording(rec)
    with pytest.raises(InputError) as e:
        load_recording(rec)
    assert "line longer than" in e.value.message and e.value.where == f"{rec}:1"


def test_hostile_workload_and_expected_files(tmp_path):
    mooncake = tmp_path / "m.jsonl"
    for line, words in JSON_CASES.values():
        mooncake.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1]}\n' + line + "\n")
        sc = tmp_path / "s.yaml"
        sc.write_text(tiny_scenario(n=2).split("workload:")[0]
                      + f"workload: {{kind: trace, format: mooncake, path: {mooncake}}}\n")
        from hybridsim.workload import build_workload
        with pytest.raises(InputError) as e:
            build_workload(load_scenario(sc))
        assert e.value.where == f"{mooncake}:2", e.value
        expected = tmp_path / "x.expected.json"
        expected.write_text(line)
        with pytest.raises(InputError) as e:
            _read_expected(expected)
        assert words in e.value.message and str(expected) in e.value.where, e.value


def test_a_workload_path_that_is_no_file_is_named_with_its_line(tmp_path):
    """A trace path to nothing, or to a folder: one message at the scenario's line (a folder used to
    end in a traceback), the relative path shown resolved."""
    from hybridsim.workload import build_workload

    (tmp_path / "dir").mkdir()
    for path, words in (("dir", "workload.path: dir is a folder, not a trace file"),
                        ("../nowhere.jsonl", "workload.path: trace file not found: ../nowhere.jsonl (relative to the "
                                             f"scenario's folder: {tmp_path.parent.resolve() / 'nowhere.jsonl'})")):
        sc = tmp_path / "s.yaml"
        sc.write_text(tiny_scenario(n=2).split("workload:")[0]
                      + f"workload:\n  kind: trace\n  format: mooncake\n  path: {path}\n")
        line = sc.read_text().splitlines().index(f"  path: {path}") + 1
        with pytest.raises(InputError) as e:
            build_workload(load_scenario(sc))
        assert e.value.message == words and e.value.where == f"{sc}:{line}", e.value
        r = CliRunner().invoke(app, ["run", str(sc), "-q"])
        assert r.exit_code == 2 and "Traceback" not in r.output and r.stderr.count("error:") == 1, r.output


@pytest.mark.parametrize("args", [["validate"], ["replay"], ["convert"], ["fidelity"]])
def test_cli_says_one_line_and_exits_2(args, tmp_path):
    """Through the command line: one message, exit 2, no traceback (a scenario for validate, a
    recording with a line 100,000 arrays deep for the rest)."""
    if args == ["validate"]:
        path = tmp_path / "s.yaml"
        path.write_text(_bomb())
    else:
        path = tmp_path / "r.jsonl"
        path.write_text("\n".join([*_recording_lines()[:2], JSON_CASES["deep arrays"][0]]) + "\n")
    extra = ["--out", str(tmp_path / "o.jsonl")] if args == ["convert"] else []
    r = CliRunner().invoke(app, [*args, str(path), *extra])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_shrink_names_a_trace_whose_header_scenario_is_invalid(tmp_path):
    """A header scenario with a key the schema lacks (here a deep list) is one message, line 1."""
    lines = (REPO / "traces" / "spec_padding.jsonl").read_text().splitlines()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([lines[0].replace('"scenario":{', '"scenario":{"zz":' + "[" * 900 + "]" * 900 + ",", 1),
                               *lines[1:]]) + "\n")
    r = CliRunner().invoke(app, ["shrink", str(path), "--out", str(tmp_path / "s.jsonl")])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"{path}:1" in "".join(r.stderr.split()) and "header's scenario is invalid" in " ".join(r.stderr.split())
