"""Kernel variants built ahead of a run's loop (``device/prebuild.py``): lists on disk, the
configuration key, the package's lists, the CLI's handling of a list, and (``prebuild_compile_cases.py``,
in a process of its own) variants described from builds and rebuilt under the same cache key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Triton decides at import whether its own ``@triton.jit`` library helpers (tl.max, tl.sum's
# combiners...) are interpreted, and never again in the process; importing it here first without
# TRITON_INTERPRET, as the suite's other kernel modules set it, would leave every interpreted
# kernel run later in this process (test_partial_exec, ...) calling compiled-only helpers
# ("Cannot call @triton.jit'd outside of the scope of a kernel"). test_builds_for_hopper drops it
# for its own process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from hybridsim.device import prebuild as pb  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_builds_for_hopper():
    """The cases that compile (``prebuild_compile_cases.py``) in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o",
                        "addopts=", "-rs", str(REPO / "tests" / "prebuild_compile_cases.py")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode == 0 and "skipped" in summary and "passed" not in summary:
        pytest.skip(f"no Triton NVIDIA tool chain here: {summary}")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert summary.startswith("5 passed"), r.stdout[-2000:]  # (every case ran: none skipped)


def test_a_layout_constexpr_is_not_described():
    class Layout:  # (a Gluon layout object: no faithful JSON form)
        pass

    class Src:
        signature = {"x": "*fp32", "L": "constexpr"}
        constants = {(1,): Layout()}
        attrs = {}

    class Meta:
        def _asdict(self):
            return {"num_warps": 4, "target": None}

    class Compiled:
        src, metadata = Src(), Meta()

    assert pb.describe("m:k", Compiled()) is None


def test_config_key_follows_the_configuration_not_the_workload():
    from hybridsim.config import load_scenario

    s = load_scenario(Path("scenarios/quickstart.yaml")).scenario.model_dump(mode="json")
    key = pb.config_key(s, "triton", "full")
    other_workload = {**s, "name": "x", "seed": 99, "workload": {"kind": "synthetic"},
                      "execution": {**s["execution"], "max_steps": 3}}
    assert pb.config_key(other_workload, "triton", "full") == key
    assert pb.config_key(s, "reference", "full") != key
    assert pb.config_key(s, "triton", "sampled") != key
    assert pb.config_key(s, "triton", "full", {"lse_base2"}) != key
    assert pb.config_key({**s, "cache": {**s["cache"], "block_size": 32}}, "triton", "full") != key


def test_a_list_is_what_the_last_recorded_run_used(tmp_path):
    path = tmp_path / "kv.json"
    assert pb.read_lists(path) == {}
    a, b, c = {"kernel": "m:a", "x": 1}, {"kernel": "m:b", "x": 2}, {"kernel": "m:c"}
    doc, new, gone = pb.with_variants({}, "k1", "one", [a, b])
    assert (new, gone) == (2, 0)
    path.write_text(pb.dumps(doc))
    doc, new, gone = pb.with_variants(pb.read_lists(path), "k1", "one", [b, c])  # (a changed: its old variant unused)
    assert (new, gone) == (1, 1) and doc["lists"]["k1"]["variants"] == [b, c]
    doc, new, gone = pb.with_variants(doc["lists"], "k2", "two", [a])
    path.write_text(pb.dumps(doc))
    assert pb.read_lists(path) == {"k1": {"label": "one", "variants": [b, c]}, "k2": {"label": "two", "variants": [a]}}
    sources = [(pb.read_lists(tmp_path / "missing.json"), "missing"), (pb.read_lists(path), str(path))]
    assert pb.lookup("k2", sources) == ([a], str(path))
    assert pb.lookup("k3", sources) == ([], "")


@pytest.mark.parametrize("text, says", [
    ("{x", "not valid JSON"),
    ("[1, 2]", "not a kernel variants file"),
    (json.dumps({"format": pb.FORMAT, "lists": {"k": {"variants": [3]}}}), "list 'k' is not a list"),
])
def test_a_file_that_is_not_a_list_is_bad_input(tmp_path, text, says):
    from hybridsim.errors import InputError

    path = tmp_path / "kv.json"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        pb.read_lists(path)
    assert says in str(e.value) and str(e.value).startswith(f"--kernel-variants: {path}: ")


def test_the_package_lists_are_well_formed_and_name_kernels_that_exist():
    """The shipped lists (recorded on the device) read back, and every kernel they name still exists
    with every parameter a description gives it: a renamed kernel or parameter shows here, not as a
    silent miss on a user's first run."""
    import importlib

    lists = pb.read_lists(pb.SHIPPED, "kernel lists")
    assert lists, "the package ships lists for its real-scale scenarios"
    for key, lst in lists.items():
        assert lst["variants"], key
        for v in lst["variants"]:
            module, _, name = v["kernel"].partition(":")
            fn = getattr(importlib.import_module(module), name)
            assert list(v["signature"]) == fn.arg_names, (key, v["kernel"])


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridsim", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "COLUMNS": "200"})


def test_cli_refuses_a_bad_list_before_any_work(tmp_path):
    bad = tmp_path / "kv.json"
    bad.write_text("not json")
    r = _cli("run", "scenarios/quickstart.yaml", "--device", "cpu", "--kernel-variants", str(bad))
    assert r.returncode == 2 and "--kernel-variants" in r.stderr and "not valid JSON" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and bad.read_text() == "not json"
    r = _cli("run", "scenarios/quickstart.yaml", "--device", "cpu", "--kernel-variants", "-")
    assert r.returncode == 2 and "not standard output" in r.stderr, r.stderr


def test_cli_on_a_cpu_records_nothing_and_says_so(tmp_path):
    path = tmp_path / "kv.json"
    r = _cli("run", "scenarios/quickstart.yaml", "--device", "cpu", "--kernel-variants", str(path))
    assert r.returncode == 0, r.stderr
    assert "nothing recorded" in " ".join(r.stdout.split()) and not path.exists()


@pytest.mark.gpu
def test_a_gpu_run_records_its_variants_and_a_cold_cache_compiles_none_in_the_loop(tmp_path):
    """The whole path on a GPU: a run lists the variants it used; a run of the same configuration
    with Triton's cache empty builds them ahead of its loop, and its loop compiles nothing."""
    kv = tmp_path / "kv.json"
    repo = Path(__file__).resolve().parents[1]
    out = []
    for i, cache in enumerate(("first", "cold")):
        js = tmp_path / f"run{i}.json"
        r = subprocess.run([sys.executable, "-m", "hybridsim", "run", "scenarios/quickstart.yaml", "--device", "cuda",
                            "--kernels", "triton", "-q", "--json", str(js), "--kernel-variants", str(kv)],
                           capture_output=True, text=True, cwd=repo,
                           env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / cache)})
        assert r.returncode == 0, r.stderr
        out.append(json.loads(js.read_text()))
    listed = next(iter(pb.read_lists(kv).values()))["variants"]
    assert listed and all(v["kernel"].startswith("hybridsim.") for v in listed)
    first, cold = out
    assert "kernel_prebuild" not in first and first["kernel_compiles"] > 0
    assert cold["kernel_prebuild"]["built"] == cold["kernel_prebuild"]["listed"] == len(listed)
    assert cold["kernel_builds"] and cold["kernel_compiles"] == 0
    assert all(c["failures"] == 0 for c in cold["checks"])




def test_a_launcher_is_loaded_only_after_the_driver_helpers(monkeypatch):
    """A launcher module keeps the tensor-descriptor type Triton's driver module names when Python first
    loads it (None before the driver's helpers load) and is never loaded again: built first, it would
    refuse every descriptor of the run's own launches. So the helpers load before it, and without them
    no launcher is built (the loop builds it)."""
    import triton.backends.nvidia.driver as nv

    order = []

    class Utils:
        def __init__(self):
            order.append("utils")
            monkeypatch.setattr(nv, "PyCUtensorMap", object)

    class Launcher:
        def __init__(self, src, metadata):
            order.append(("launcher", nv.PyCUtensorMap is not None))

    class Compiled:
        src, metadata = "src", "metadata"

    monkeypatch.setattr(nv, "CudaUtils", Utils)
    monkeypatch.setattr(nv, "CudaLauncher", Launcher)
    monkeypatch.setattr(nv, "PyCUtensorMap", None)
    pb._build_launcher(Compiled())
    pb._build_launcher(Compiled())  # (loaded once: not again)
    assert order == ["utils", ("launcher", True), ("launcher", True)]

    class Broken:
        def __init__(self):
            raise OSError("no CUDA driver library")

    order.clear()
    monkeypatch.setattr(nv, "CudaUtils", Broken)
    monkeypatch.setattr(nv, "PyCUtensorMap", None)
    pb._build_launcher(Compiled())
    assert order == []


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_a_prebuild_reports_its_workers_and_what_they_could_not_build(kind):
    """Worker processes (the default, forked where the system forks) or threads: either way every listed
    variant is attempted and each one that cannot be built is reported (these name no module)."""
    from hybridsim.device import prebuild as pb

    run = pb.Prebuild([{"kernel": f"hybridsim.nope_{k}:kernel"} for k in "abc"], "kv.json", workers=2, kind=kind)
    report = run.wait()
    assert report.kind == kind == report.as_dict()["kind"] and pb.WORKERS == "processes"
    assert (report.listed, report.built, len(report.failed)) == (3, 0, 3)
    assert all("ModuleNotFoundError" in why for why in report.failed)
    assert f"(2 {kind};" in report.note()


@pytest.mark.parametrize("run_ignores_it", [False, True])
def test_a_worker_process_ends_quietly_at_ctrl_c(tmp_path, run_ignores_it):
    """Ctrl-C reaches the run and its build workers together: each worker ends as the system ends a
    process, with no Python traceback of its own (sixteen of them would bury the run's one message). A run
    that ignores Ctrl-C (started in the background) keeps its workers too: they alone must not end."""
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from hybridsim.device import prebuild as pb
        if {run_ignores_it}:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        pb.build = lambda entry: (time.sleep(30), (None, 30.0))[1]  # (forked: the workers run this)
        run = pb.Prebuild([{{"kernel": f"k{{i}}"}} for i in range(4)], "t", workers=2, kind="processes")
        time.sleep(1.0)
        procs = list(run.pool._processes.values())
        for p in procs:
            os.kill(p.pid, signal.SIGINT)
        for p in procs:
            p.join(3)
        print("exit codes", sorted(-1 if p.exitcode is None else p.exitcode for p in procs), flush=True)
        for p in procs:
            p.kill()
        os._exit(0)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    want = [-1, -1] if run_ignores_it else [-signal.SIGINT] * 2  # (-1: still running)
    assert f"exit codes {want}" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
