"""The command line as a user meets it: exit codes, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .cli_inproc import hsi
from .conftest import DATA, RECORDINGS, REPO, SCENARIOS


def hs(*args, cwd=REPO):
    """``python -m hybridsim ARGS`` in a fresh interpreter: for what only a real process shows (the
    entry point, pipes, signals, workers); the rest of the command line runs in process (``hsi``)."""
    return subprocess.run([sys.executable, "-m", "hybridsim", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


def test_quickstart_runs_records_and_validates(tmp_path):
    trace = tmp_path / "q.jsonl"
    js = tmp_path / "q.json"
    r = hs("run", "scenarios/quickstart.yaml", "--check", "off", "--record", trace, "--json", js)
    assert r.returncode == 0, r.stderr
    assert "run summary" in r.stdout and "preemptions" in r.stdout
    assert "planning wall time" in r.stdout and "execute" not in r.stdout  # --check off: planning alone
    d = json.loads(js.read_text())
    assert d["summary"]["steps"] > 0 and d["summary"]["finished"] == d["summary"]["requests"]
    v = hs("validate", trace)
    assert v.returncode == 0 and "token accounting consistent" in v.stdout
    assert _squeezed("the schedule keeps the engine's rules") in _squeezed(v.stdout)
    # a block handed to a second request while the first holds it: consistent tokens, a broken schedule
    lines = trace.read_text().splitlines()
    for i, line in enumerate(lines[1:], 1):
        rows = [r for r in json.loads(line)["sched"] if r.get("blocks") and r["blocks"][0]]
        if len(rows) >= 2:
            step = json.loads(line)
            a, b = [r for r in step["sched"] if r.get("blocks") and r["blocks"][0]][:2]
            b["blocks"][0][0] = a["blocks"][0][0]
            lines[i] = json.dumps(step, separators=(",", ":"))
            break
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    v = hs("validate", trace, broken)
    said = _squeezed(v.stdout)  # (Rich wraps long paths anywhere)
    assert v.returncode == 1, v.stdout + v.stderr
    assert _squeezed(f"broken {broken}:") in said, said
    assert _squeezed(f"{broken}:{i + 1}: block {a['blocks'][0][0]} given to") in said, said


def test_every_scenario_validates_on_the_cli():
    r = hsi("validate", *[p.relative_to(REPO) for p in SCENARIOS])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok ") == len(SCENARIOS)


def test_bad_scenario_exit_2_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "scenarios/quickstart.yaml").read_text().replace("num_blocks: 96", "num_blocks: -1"))
    r = hsi("run", bad)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"{bad}:4" in r.stderr.replace("\n", "") and "cache.num_blocks" in r.stderr


def test_missing_file_and_bad_flag_exit_2(tmp_path):
    r = hsi("run", tmp_path / "nope.yaml")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = hsi("run", "scenarios/quickstart.yaml", "--check", "sometimes")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_record_into_missing_folder_fails_before_running(tmp_path):
    r = hsi("run", "scenarios/quickstart.yaml", "--record", tmp_path / "no" / "t.jsonl")
    assert r.returncode == 2 and "does not exist" in " ".join(r.stderr.split())  # (the console wraps the path)


def _squeezed(text: str) -> str:
    """Without whitespace: Rich wraps long messages anywhere, paths included."""
    return "".join(text.split())


def test_binary_file_is_bad_input_not_a_traceback(tmp_path):
    """A binary file where a trace, a recording or an expected file belongs: one message, exit 2."""
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    for args in (("replay", binary), ("validate", binary), ("fidelity", binary)):
        r = hsi(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert _squeezed(f"{binary}: not a UTF-8 text file") in _squeezed(r.stderr), (args, r.stderr)
    gold = tmp_path / "gold"
    gold.mkdir()
    assert hsi("run", "scenarios/quickstart.yaml", "-q", "--check", "off", "--record", gold / "q.jsonl").returncode == 0
    (gold / "q.expected.json").write_bytes(bytes(range(128, 256)))
    r = hsi("replay", gold, "--check", "--check-mode", "off")
    assert r.returncode == 2 and _squeezed("q.expected.json: not a UTF-8 text file") in _squeezed(r.stderr), r.stderr


def test_corrupt_trace_exit_2_with_line(tmp_path):
    t = tmp_path / "t.jsonl"
    assert hsi("run", "scenarios/spec_decode.yaml", "-q", "--record", t).returncode == 0
    lines = t.read_text().splitlines()
    lines[5] = lines[5].replace('"c":', '"c":1') if '"c":0' not in lines[5] else lines[5].replace('"c":0', '"c":7')
    t.write_text("\n".join(lines) + "\n")
    r = hsi("validate", t)
    assert r.returncode == 2 and f"{t}:6" in r.stderr.replace("\n", "")


def test_a_fault_naming_no_request_exit_2_with_its_line(tmp_path):
    text = (REPO / "scenarios" / "quickstart.yaml").read_text()
    assert "requests: [r11]" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("requests: [r11]", "requests: [r11, r99]"))
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if "r99" in t)
    for args in (("validate", bad), ("run", bad, "-q", "--check", "off")):
        r = hsi(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert _squeezed(f"{bad}:{line}: faults.1.requests: 'r99' is not a request of this workload (r0 .. r23)") \
            in _squeezed(r.stderr), r.stderr
        assert "Traceback" not in r.stderr


def test_presets_lists_real_models():
    r = hsi("presets")
    assert r.returncode == 0
    for name in ("nemotron-h-8b", "deepseek-v3", "qwen3-next-80b", "jamba-1.5-mini", "tiny-hybrid-mla"):
        assert name in r.stdout


def test_fidelity_json(tmp_path):
    js = tmp_path / "f.json"
    r = hsi("fidelity", DATA / "vllm-recorded/mem_pressure.jsonl", "--json", js)
    assert r.returncode == 0, r.stderr
    assert json.loads(js.read_text())["identical_steps_pct"] == 100.0


def test_convert_then_validate(tmp_path):
    out = tmp_path / "c.jsonl"
    r = hsi("convert", DATA / "vllm-recorded/spec_ngram.jsonl", "--out", out)
    assert r.returncode == 0, r.stderr
    assert hsi("validate", out).returncode == 0
    r = hsi("convert", out, "--out", tmp_path / "again.jsonl")  # (a trace given where a recording belongs)
    assert r.returncode == 2 and "a hybridsim step trace, not a vLLM recording" in " ".join(r.stderr.split())
    r = hsi("validate", DATA / "vllm-recorded/spec_ngram.jsonl")  # (converted in memory, as replay does)
    said = " ".join(r.stdout.split())
    assert r.returncode == 0 and "vLLM recording" in said and "converted in memory" in said, r.stdout + r.stderr


def test_version():
    from importlib.metadata import version

    r = hsi("--version")
    assert r.returncode == 0 and r.stdout == f"hybridsim {version('hybridsim')}\n", r.stdout + r.stderr


def test_replay_runs_a_vllm_recording_directly(tmp_path):
    """A recording is converted in memory (a note says so) and replays exactly as its converted trace."""
    rec = DATA / "vllm-recorded/spec_ngram.jsonl"
    js, js_trace = tmp_path / "rec.json", tmp_path / "trace.json"
    r = hsi("replay", rec, "--json", js)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "converted in memory" in r.stdout and "hybridsim convert" in r.stdout
    assert hsi("replay", REPO / "traces/vllm_spec_ngram.jsonl", "--json", js_trace, "-q").returncode == 0
    got, want = json.loads(js.read_text()), json.loads(js_trace.read_text())
    # (sched.recorded also compares the recording's free-block counts, which a converted trace lacks)
    sched = [{c["name"]: c for c in d["checks"]}.pop("sched.recorded") for d in (got, want)]
    assert sched[0]["count"] == sched[1]["count"] + 65 and not sched[0]["failures"] and not sched[1]["failures"]
    got["checks"], want["checks"] = ([c for c in d["checks"] if c["name"] != "sched.recorded"] for d in (got, want))
    assert got["checks"] == want["checks"] and got["checks"]
    assert got["summary"]["steps"] == want["summary"]["steps"] == 65
    # --check: a recording has no expected file, which is what the gate says of any trace without one
    r = hsi("replay", rec, "--check")
    assert r.returncode == 1 and "no expected file" in r.stdout and "Traceback" not in r.stderr


def _bad_recordings(tmp_path) -> dict:
    import copy

    lines = [json.loads(line) for line in (DATA / "vllm-recorded/spec_ngram.jsonl").read_text().splitlines()]
    cases = {}

    def case(name, where, edit=None, text=None):
        d = copy.deepcopy(lines)
        if edit:
            edit(d)
        p = tmp_path / f"{name}.jsonl"
        p.write_text(text if text is not None else "\n".join(json.dumps(x) for x in d) + "\n")
        cases[p] = where

    case("no_groups", ":1", lambda d: d[0].pop("kv_cache_groups"))
    case("bad_shapes", ":1", lambda d: d[0]["kv_cache_groups"][0].update(shapes=[[3], [8, 32, 16]]))
    case("unknown_spec", ":1", lambda d: d[0]["kv_cache_groups"][1].update(spec="SlidingWindowSpec"))
    case("tiny_pool", ":1", lambda d: d[0].update(num_blocks=1))
    case("requests", ":2", lambda d: d[1].update(requests=5))
    case("no_token_counts", ":5", lambda d: d[4].pop("num_scheduled_tokens"))
    case("block_ids", ":3", lambda d: d[2]["scheduled_new_reqs"][0].update(block_ids="x"))
    case("accounting", ":6", lambda d: d[5]["scheduled_cached_reqs"][0].update(num_computed_tokens=189))
    case("no_steps", "", lambda d: d.__delitem__(slice(2, None)))
    case("cut", ":2", text=(DATA / "vllm-recorded/spec_ngram.jsonl").read_text()[:5000])
    return cases


def test_malformed_recording_is_one_message_exit_2(tmp_path):
    """replay, convert and fidelity on a broken recording: one error naming the file (and line), exit 2."""
    from typer.testing import CliRunner

    from hybridsim.cli import app

    runner = CliRunner()
    for path, where in _bad_recordings(tmp_path).items():
        for args in (["replay", path], ["convert", path, "--out", tmp_path / "out.jsonl"], ["fidelity", path]):
            if args[0] == "fidelity" and path.stem == "accounting":
                continue  # (fidelity compares decisions and reports differences; it does not check accounting)
            r = runner.invoke(app, [str(a) for a in args])
            assert r.exit_code == 2, (path.stem, args[0], r.output)
            assert isinstance(r.exception, SystemExit), (path.stem, args[0], r.exception)
            text = "".join(r.output.split())  # (the console wraps long messages)
            assert text.startswith(f"error:{path}{where}"), (path.stem, args[0], r.output)
            assert text.count("error:") == 1
        assert not (tmp_path / "out.jsonl").exists()  # convert wrote nothing


def test_run_executes_and_names_the_failing_check():
    r = hsi("run", "scenarios/spec_decode.yaml", "--inject-bug", "temporal_without_bias")
    assert r.returncode == 1
    assert "ssm.running_state" in r.stdout and "Traceback" not in r.stderr
    ok = hsi("run", "scenarios/spec_decode.yaml", "-q")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_list_bugs_and_unknown_bug():
    r = hsi("run", "--list-bugs")
    assert r.returncode == 0 and "stale_state_index" in r.stdout and "lse_base2" in r.stdout
    r = hsi("run", "scenarios/spec_decode.yaml", "--inject-bug", "gremlins")
    assert r.returncode == 2 and "gremlins" in r.stderr


def test_bug_in_a_layer_kind_the_model_lacks_is_refused(tmp_path):
    """--inject-bug of a GQA-attention bug on a Mamba + MLA model could change nothing: a run or a
    single trace's replay is refused (exit 2, naming the model's layers, nothing written); a folder
    of traces replays with a note on the traces it cannot touch."""
    out = tmp_path / "r.json"
    r = hsi("run", "scenarios/quickstart.yaml", "--inject-bug", "slot_off_by_one", "--json", out)
    assert r.returncode == 2 and "slot_off_by_one breaks GQA attention layers" in r.stderr
    assert "Mamba, MLA" in r.stderr and "Traceback" not in r.stderr and not out.exists()
    r = hsi("replay", "traces/mla_long_context.jsonl", "--inject-bug", "temporal_without_bias", "-q")
    assert r.returncode == 2 and "temporal_without_bias breaks Mamba layers" in r.stderr
    d = tmp_path / "two"
    d.mkdir()
    for name in ("mla_long_context", "spec_decode"):
        (d / f"{name}.jsonl").write_bytes((REPO / "traces" / f"{name}.jsonl").read_bytes())
    r = hsi("replay", d, "--inject-bug", "temporal_without_bias")
    assert r.returncode == 1, r.stdout + r.stderr  # spec_decode's Mamba states break
    assert "it changes nothing in this trace" in r.stdout


def test_cuda_without_gpu_is_environment_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = hsi("run", "scenarios/spec_decode.yaml", "--device", "cuda")
    assert r.returncode == 3 and "no CUDA GPU" in r.stderr


def test_replay_of_recorded_vllm_traces_is_green(tmp_path):
    assert len(RECORDINGS) == 3
    traces = []
    for rec in RECORDINGS:
        out = tmp_path / f"{rec.stem}.jsonl"
        assert hsi("convert", rec, "--out", out).returncode == 0
        traces.append(out)
    js = tmp_path / "r.json"
    r = hsi("replay", *traces, "--json", js)
    assert r.returncode == 0, r.stdout[-2000:]
    data = json.loads(js.read_text())["traces"]
    for t in data:
        counts = {c["name"]: (c["count"], c["failures"]) for c in t["checks"]}
        assert counts["ssm.running_state"][0] > 0 and counts["ssm.output"][0] > 0
        assert all(f == 0 for _, f in counts.values())
    bug = hsi("replay", traces[-1], "--inject-bug", "temporal_without_bias", "-q")
    assert bug.returncode == 1


def test_replay_rejects_inconsistent_trace_before_running(tmp_path):
    t = tmp_path / "t.jsonl"
    assert hsi("run", "scenarios/chunked_prefill.yaml", "-q", "--check", "off", "--record", t).returncode == 0
    lines = t.read_text().splitlines()
    for i, line in enumerate(lines[1:], 2):
        d = json.loads(line)
        cached = [s for s in d["sched"] if not s.get("new")]
        if cached:
            cached[0]["n"] += 10_000  # past the end of its tokens: wrong on this very line
            lines[i - 1] = json.dumps(d)
            break
    t.write_text("\n".join(lines) + "\n")
    r = hsi("replay", t)
    assert r.returncode == 2 and f"{t}:{i}" in r.stderr.replace("\n", "")


def test_run_then_replay_same_checks(tmp_path):
    t = tmp_path / "t.jsonl"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert hsi("run", "scenarios/forced_preemption.yaml", "-q", "--record", t, "--json", a).returncode == 0
    assert hsi("replay", t, "-q", "--json", b).returncode == 0
    ra = {c["name"]: c["count"] for c in json.loads(a.read_text())["checks"] if c["name"] != "sched.invariants"}
    rb = {c["name"]: c["count"] for c in json.loads(b.read_text())["checks"] if c["name"] != "sched.recorded"}
    assert ra == rb  # replaying the recorded steps makes exactly the same comparisons (and verifies them first)


def test_kernel_timings_table_renders_every_kernel_row():
    """The GPU-only table, rendered from the summary a TimedKernels run produces."""
    from rich.console import Console

    from hybridsim.report import kernel_timings_table

    kt = {"device": "Test GPU", "copy_ceiling_TBps": 3.0, "read_ceiling_TBps": 3.3, "write_side_TBps": 2.75,
          "matmul_TFLOPs": 700.0, "kernels": [
        {"kernel": "state_copy", "calls": 8, "untimed": 1, "total_s": 6.1e-4, "median_us": 76.3, "p90_us": 78.5,
         "bytes": 1_700_000_000, "GBps": 2760.0, "bound": "bandwidth", "pct_floor": 92.4},
        {"kernel": "paged_attention", "calls": 8, "untimed": 0, "total_s": 6.1e-4, "median_us": 76.3,
         "p90_us": 78.5, "bytes": 1_700_000_000, "GBps": 2760.0, "bound": "bandwidth+compute", "pct_floor": 104.5},
        {"kernel": "mla_decode", "calls": 0, "untimed": 3, "total_s": 0.0, "median_us": 0.0, "p90_us": 0.0,
         "bytes": 0, "GBps": 0.0, "bound": "", "pct_floor": 0.0}]}
    console = Console(width=200, record=True)
    console.print(kernel_timings_table(kt))
    text = console.export_text()
    assert "Test GPU" in text and "read 3.30, copy 3.00, write side 2.75 TB/s" in text and "bf16 700 TFLOP/s" in text
    assert "state_copy" in text and "92.4%" in text and "76.3 / 78.5" in text and "1.6 GiB" in text
    assert "104.5%!" in text and "92.4%!" not in text and "both" in text  # never clamped, flagged
    assert "mla_decode" in text and "0 (3)" in text and "not timed" in text


def test_checked_run_labels_its_wall_time_as_the_whole_loop():
    """With checks the loop also executes and checks every step: the summary says so and gives
    the planning part separately (it used to call the whole loop "planning wall time")."""
    from rich.console import Console

    from hybridsim.config import parse_scenario
    from hybridsim.report import summary_table
    from hybridsim.runner import plan_scenario

    res = plan_scenario(parse_scenario((REPO / "scenarios/quickstart.yaml").read_text(), "q.yaml"), check="full")
    console = Console(width=200, record=True)
    console.print(summary_table(res))
    text = console.export_text()
    assert "wall time (plan + execute + check)" in text and "of which planning (schedule + update)" in text
    assert "planning wall time" not in text


def test_validate_tells_what_can_be_planned_but_not_executed(tmp_path):
    """All mode with drafts plans but does not execute: validate says so up front, and a
    checked run refuses it with the same words and exit 2."""
    text = (REPO / "scenarios/all_mode.yaml").read_text()
    text += "spec_decode: {num_speculative_tokens: 2, acceptance: {kind: bernoulli, rate: 0.6}}\n"
    f = tmp_path / "allspec.yaml"
    f.write_text(text)
    v = hsi("validate", f)
    assert v.returncode == 0 and "mamba_cache_mode all with speculative decoding is not" in " ".join(v.stdout.split())
    assert "not supported" not in hsi("validate", "scenarios/all_mode.yaml").stdout
    r = hsi("run", f, "--check", "full")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "mamba_cache_mode all with speculative decoding is not" in " ".join((r.stdout + r.stderr).split())
    assert hsi("run", f, "--check", "off").returncode == 0


def test_a_reader_that_goes_away_ends_the_command_with_141_not_1():
    """`hybridsim ... | head`: the closed pipe ends the command the way a shell reports SIGPIPE, not
    with 1 (which says a check failed) and not with a traceback."""
    p = subprocess.Popen([sys.executable, "-m", "hybridsim", "run", "--list-bugs"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # (before the command writes: its first write meets a closed pipe)
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and "Exception" not in err, err
