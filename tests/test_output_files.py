"""Output files never damage what they point at: links followed, pipes and devices streamed,
``-`` is standard output, a failed write is exit 3 with the earlier file intact, a folder that
cannot be made or written is exit 2 before any work (output_files.py)."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridsim.cli import app
from hybridsim.errors import EnvironmentProblem, InputError
from hybridsim.output_files import check_folder, check_writable, open_output, write_output

from .cli_inproc import hsi
from .conftest import REPO, tiny_scenario
from .test_cli import hs

QUICK = str(REPO / "scenarios" / "quickstart.yaml")
SMALL_TRACE = REPO / "traces" / "spec_padding.jsonl"
HAS_DEV_FULL = Path("/dev/full").exists() and stat.S_ISCHR(os.stat("/dev/full").st_mode)


def _read_fifo(path: Path) -> tuple[threading.Thread, list[bytes]]:
    """A reader on the named pipe (the writer's open waits for it), collecting what comes."""
    got: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: mode 0555, or (root ignores modes) /sys's
    top, which refuses new files to root too; skip where neither holds."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").touch()
    except OSError:
        return ro
    (ro / "probe").unlink()
    sysfs = Path("/sys")
    if sysfs.is_dir():
        try:
            (sysfs / "hybridsim-probe").touch()
        except OSError:
            return sysfs
    pytest.skip("root bypasses folder permissions here and /sys accepts files: no read-only folder to try")


# ----------------------------------------------------------------------------- the library


def test_symlink_target_written_and_link_kept(tmp_path):
    target = tmp_path / "real" / "t.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_output(link, "--json", "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert not list(target.parent.glob("*.partial")) and not list(tmp_path.glob("*.partial"))
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "real" / "fresh.json")
    write_output(dangling, "--json", "x")
    assert dangling.is_symlink() and (tmp_path / "real" / "fresh.json").read_text() == "x"


def test_fifo_is_streamed_not_replaced(tmp_path):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    t, got = _read_fifo(fifo)
    with open_output(fifo, "--record") as f:
        for i in range(1000):
            f.write(f"line {i}\n")
    t.join(10)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got[0].decode().splitlines()[-1] == "line 999"


@pytest.mark.skipif(not HAS_DEV_FULL, reason="no /dev/full character device here")
def test_dev_full_is_exit_3_and_stays_a_device():
    with pytest.raises(EnvironmentProblem) as e:
        write_output("/dev/full", "--record", "x" * 100_000)
    assert "/dev/full" in str(e.value) and "--record" in str(e.value)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_failed_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    """A disk that fills up at the last moment (fsync reports it): exit 3, the old file whole,
    no temporary file left."""
    path = tmp_path / "r.json"
    path.write_text("earlier\n")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(EnvironmentProblem) as e:
        write_output(path, "--json", "new\n")
    assert str(path) in str(e.value) and "unchanged" in str(e.value)
    assert path.read_text() == "earlier\n" and not list(tmp_path.glob("*.partial"))


def test_dash_is_standard_output(capsys):
    write_output("-", "--json", '{"a": 1}\n')
    assert json.loads(capsys.readouterr().out) == {"a": 1}


def test_bad_places_are_exit_2_before_any_work(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("")
    for path, flag, words in ((afile / "x.json", "--json", "is a file, not a folder"),
                              (tmp_path / "no" / "x.json", "--json", "does not exist"),
                              (tmp_path, "--json", "is a folder")):
        with pytest.raises(InputError) as e:
            check_writable(path, flag)
        assert words in e.value.message and e.value.where == flag, e.value
    for folder, words in ((Path("/proc/zz"), "cannot make folder /proc/zz"), (afile / "d", "is a file"),
                          (afile, "exists and is not a folder"), (Path("-"), "standard output")):
        with pytest.raises(InputError) as e:
            check_folder(folder, "--csv")
        assert words in e.value.message, e.value
    check_folder(tmp_path / "new" / "deeper", "--csv")
    assert not (tmp_path / "new").exists()  # (checked, not made)


def test_read_only_folder_is_exit_2(tmp_path):
    ro = _unwritable_folder(tmp_path)
    with pytest.raises(InputError) as e:
        check_writable(ro / "x.json", "--json")
    assert f"cannot write into folder {ro}" in e.value.message


# ----------------------------------------------------------------------------- each command


def _invoke(args: list) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert isinstance(r.exception, SystemExit) or r.exception is None, r.exception
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def failing_trace(tmp_path_factory) -> Path:
    """A trace failing ssm.running_state, already shrunk once: each test's shrink (about where its
    output goes, not how far it shrinks) then starts from a few steps, not the whole run."""
    d = tmp_path_factory.mktemp("shrink")
    big, small = d / "big.jsonl", d / "small.jsonl"
    code, _, err = _invoke(["run", str(REPO / "scenarios" / "forced_preemption.yaml"), "-q", "--check", "off",
                            "--record", big, "--inject-bug", "stale_state_index"])
    assert code == 0, err
    code, _, err = _invoke(["shrink", big, "--out", small, "--check", "ssm.running_state"])
    assert code == 0, err
    return small


def _command(name: str, target, failing: Path) -> list:
    """The command ``name`` writing its main output to ``target``."""
    return {"run": ["run", QUICK, "--check", "off", "-q", "--record", target],
            "replay": ["replay", SMALL_TRACE, "-q", "--json", target],
            "shrink": ["shrink", failing, "--out", target, "--check", "ssm.running_state"]}[name]


def _looks_right(name: str, data: bytes) -> None:
    first = json.loads(data.decode().splitlines()[0] if name != "replay" else data)
    assert (first["format"] == "hybridsim-trace") if name != "replay" else ("checks" in first)


COMMANDS = ["run", "replay", "shrink"]


@pytest.mark.parametrize("name", COMMANDS)
def test_command_follows_a_symlink(name, tmp_path, failing_trace):
    target = tmp_path / "t.out"
    target.write_text("old")
    link = tmp_path / "link"
    link.symlink_to(target)
    code, _, err = _invoke(_command(name, link, failing_trace))
    assert code == 0, err
    assert link.is_symlink()
    _looks_right(name, target.read_bytes())


@pytest.mark.parametrize("name", COMMANDS)
def test_command_streams_into_a_fifo(name, tmp_path, failing_trace):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    t, got = _read_fifo(fifo)
    code, _, err = _invoke(_command(name, fifo, failing_trace))
    t.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    _looks_right(name, got[0])


@pytest.mark.skipif(not HAS_DEV_FULL, reason="no /dev/full character device here")
@pytest.mark.parametrize("name", COMMANDS)
def test_command_onto_dev_full_is_exit_3(name, failing_trace):
    code, _, err = _invoke(_command(name, "/dev/full", failing_trace))
    assert code == 3 and "/dev/full" in err and "no space left" in err, err
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.parametrize("name", COMMANDS)
def test_command_to_standard_output_keeps_tables_off_it(name, failing_trace):
    args = _command(name, "-", failing_trace)
    if name == "replay":
        args.remove("-q")  # (tables on: they must go to standard error)
    code, out, err = _invoke(args)
    assert code == 0, err
    _looks_right(name, out.encode())
    if name == "replay":
        assert "│" in err  # the tables, on standard error


@pytest.mark.parametrize("name", COMMANDS)
def test_command_refuses_unwritable_places_before_running(name, tmp_path, failing_trace):
    ro = _unwritable_folder(tmp_path)
    for target, words in ((ro / "x", "cannot write into folder"), (Path("/proc/zz/x"), "does not exist"),
                          (Path(QUICK) / "x", "is a file, not a folder")):
        code, _, err = _invoke(_command(name, target, failing_trace))
        assert code == 2 and words in " ".join(err.split()), (target, err)
        assert "Traceback" not in err


def test_run_csv_into_a_folder_that_cannot_be_made_is_exit_2():
    code, _, err = _invoke(["run", QUICK, "--check", "off", "-q", "--csv", "/proc/zz"])
    assert code == 2 and "cannot make folder /proc/zz" in " ".join(err.split()), err


def test_two_outputs_on_standard_output_are_refused(tmp_path):
    code, _, err = _invoke(["run", QUICK, "--check", "off", "-q", "--record", "-", "--json", "-"])
    assert code == 2 and "only one output" in err


def test_an_output_onto_an_input_or_another_output_is_refused_before_any_work(tmp_path, failing_trace):
    """Two outputs on one file (by name, by a link, by a hard link) or an output onto a file the command
    reads: exit 2 and every file as it was (``run s.yaml --json s.yaml`` replaced the scenario; ``--record``
    and ``--json`` on one path kept only the JSON)."""
    scen = tmp_path / "s.yaml"
    scen.write_text(Path(QUICK).read_text())
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(SMALL_TRACE.read_bytes())
    expected = tmp_path / "t.expected.json"
    expected.write_text("{}")
    small = tmp_path / "small.jsonl"
    small.write_bytes(failing_trace.read_bytes())
    (tmp_path / "link").symlink_to(tmp_path / "out")
    os.link(scen, tmp_path / "hard.yaml")
    cases = [
        (["run", scen, "-q", "--check", "off", "--json", scen], "--json", "is the scenario, which this command reads"),
        (["run", scen, "-q", "--check", "off", "--json", tmp_path / "hard.yaml"], "--json", "is the scenario"),
        (["run", scen, "-q", "--check", "off", "--record", tmp_path / "out", "--json", tmp_path / "out"], "--json",
         "is --record's file too"),
        (["run", scen, "-q", "--check", "off", "--record", tmp_path / "out", "--plot", tmp_path / "link"], "--plot",
         "is --record's file too"),
        (["replay", trace, "-q", "--json", trace], "--json", "is a trace, which this command reads"),
        (["replay", tmp_path, "-q", "--check", "--json", expected], "--json",
         "is an expected file, which this command reads"),
        (["shrink", small, "--out", small], "--out", "is the trace, which this command reads"),
    ]
    before = {p: p.read_bytes() for p in (scen, trace, expected, small)}
    for args, flag, words in cases:
        code, _, err = _invoke(args)
        assert code == 2 and f"{flag}:" in err and words in " ".join(err.split()), (args, err)
        assert {p: p.read_bytes() for p in before} == before
        assert not (tmp_path / "out").exists()
    code, _, err = _invoke(["run", scen, "-q", "--check", "off", "--record", os.devnull, "--json", os.devnull])
    assert code == 0, err  # (a device both may write: nothing is overwritten)
    # the workload's own trace file, read once the scenario is
    wl = tmp_path / "m.jsonl"
    wl.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1]}\n')
    sc = tmp_path / "w.yaml"
    sc.write_text(tiny_scenario(n=2).split("workload:")[0] + "workload: {kind: trace, format: mooncake, path: m.jsonl}\n")
    code, _, err = _invoke(["run", sc, "-q", "--check", "off", "--record", wl])
    assert code == 2 and "is the workload's trace, which this command reads" in " ".join(err.split()), err
    assert wl.read_text().startswith('{"timestamp": 0')


def test_sweep_outputs(tmp_path):
    """sweep --out is a folder: one that cannot be made, or lies under a file, or refuses files, is
    exit 2 before any cell runs; a link to a folder is followed; results.parquet is written through
    its link."""
    d = tmp_path / "sw"
    d.mkdir()
    (d / "base.yaml").write_text(tiny_scenario(n=2, pmax=40, omax=4))
    (d / "s.yaml").write_text("base: base.yaml\nseeds: [0]\ngrid:\n  cache.block_size: [16]\n")
    ro = _unwritable_folder(tmp_path)
    for out, words in ((Path("/proc/zz"), "cannot make folder /proc/zz"), (d / "base.yaml" / "o", "is a file"),
                       (ro / "o", "cannot make folder"), (Path("-"), "standard output")):
        r = hsi("sweep", d / "s.yaml", "--out", out, "-j", "1", "-q")
        assert r.returncode == 2 and words in " ".join(r.stderr.split()) and "Traceback" not in r.stderr, r.stderr
    real = tmp_path / "real"
    real.mkdir()
    (real / "elsewhere.parquet").write_bytes(b"old")
    (real / "results.parquet").symlink_to(real / "elsewhere.parquet")
    link = tmp_path / "out"
    link.symlink_to(real)
    r = hs("sweep", d / "s.yaml", "--out", link, "-j", "1", "-q")
    assert r.returncode == 0, r.stderr
    assert (real / "results.csv").exists() and (real / "results.parquet").is_symlink()
    assert (real / "elsewhere.parquet").read_bytes()[:4] in (b"PAR1", b"old")  # (old: no pyarrow here)


# ----------------------------------------------------------------------------- JUnit for CI


def test_junit_report_of_the_gate(tmp_path):
    """replay --check --junit: one test case per trace, a failing trace's failure message its
    earliest failing check with that check's first divergence (as --json reports it), a bad trace
    an error; written through a symlink like every output; XML that xml.etree reads."""
    import shutil
    import xml.etree.ElementTree as ET

    gate = tmp_path / "gate"
    gate.mkdir()
    for suffix in (".jsonl", ".expected.json"):
        shutil.copy(REPO / "traces" / f"spec_padding{suffix}", gate / f"spec_padding{suffix}")
    (gate / "bad.jsonl").write_text('{"format": "hybridsim-trace", "version": 3}\n')
    report = tmp_path / "reports" / "junit.xml"
    report.parent.mkdir()
    link = tmp_path / "junit-link.xml"
    link.symlink_to(report)
    js = tmp_path / "gate.json"
    code, _, err = _invoke(["replay", gate, "--check", "--junit", link, "--json", js, "--inject-bug",
                            "rejected_state_kept"])
    assert code == 2 and f"{gate / 'bad.jsonl'}:1" in "".join(err.split()), err  # (bad input outranks a failure)
    assert link.is_symlink()
    root = ET.parse(report).getroot()
    assert root.tag == "testsuites" and (root.get("tests"), root.get("failures"), root.get("errors")) == ("2", "1", "1")
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"bad.jsonl", "spec_padding.jsonl"}
    error = cases["bad.jsonl"].find("error")
    assert error is not None and error.get("type") == "bad input" and "header is missing" in error.get("message")
    row = next(r for r in json.loads(js.read_text())["traces"] if r["trace"] == "spec_padding.jsonl")
    assert row["result"] == "FAIL" and row["first_failures"]
    first_check, first_where = next(iter(row["first_failures"].items()))
    failure = cases["spec_padding.jsonl"].find("failure")
    assert failure.get("message") == f"{first_check}: {first_where}" and "step " in first_where
    steps = [int(w.split(",")[0].split(":")[0].split()[1]) for w in row["first_failures"].values()]
    assert steps == sorted(steps)  # earliest divergence first
    for name in row["first_failures"]:
        assert name in failure.text

    passing = tmp_path / "pass"
    passing.mkdir()
    for suffix in (".jsonl", ".expected.json"):
        shutil.copy(REPO / "traces" / f"spec_padding{suffix}", passing / f"spec_padding{suffix}")
    code, _, err = _invoke(["replay", passing, "--check", "--junit", report, "-q"])
    assert code == 0, err
    root = ET.parse(report).getroot()
    (case,) = root.iter("testcase")
    assert root.get("failures") == "0" and list(case) == [] and float(case.get("time")) > 0


def test_junit_needs_the_gate(tmp_path):
    code, _, err = _invoke(["replay", SMALL_TRACE, "--junit", tmp_path / "j.xml"])
    assert code == 2 and "--junit" in err and "--check" in err and not (tmp_path / "j.xml").exists()


def test_dev_stdout_piped_carries_the_data_alone():
    """`run ... --json /dev/stdout | jq`: standard output (a pipe) gets the JSON alone, the tables go
    to standard error; the same with --record."""
    r = hs("run", QUICK, "--check", "off", "--json", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["steps"] > 0 and "run summary" in r.stderr
    r = hs("run", QUICK, "--check", "off", "--record", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert json.loads(lines[0])["format"] == "hybridsim-trace" and all(json.loads(x)["step"] >= 0 for x in lines[1:])
