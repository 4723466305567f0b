"""Kernel variants built ahead of a run's loop (``device/prebuild.py``): a variant described from a
build, rebuilt from the description in a worker process into Triton's disk cache under the same key
(so a launch loads it instead of compiling), lists on disk, and the configuration key. The builds
here target an H100 (sm_90) with Triton's own tool chain; no GPU is needed to compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from hybridsim.device import prebuild as pb  # noqa: E402

SIG = {"g": "*bf16", "w": "*fp64", "out": "*fp64", "width": "i32", "g_row": "i64", "w_row": "i64", "piece_len": "i32",
       "BLOCK": "constexpr", "WIDE": "constexpr"}
KERNEL = "hybridsim.kernels.row_stats_triton:_row_stats_kernel"


def _compile(block: int):
    """One real variant of one of our kernels, built as a launch would build it (for sm_90)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hybridsim.kernels import row_stats_triton as m

    src = ASTSource(m._row_stats_kernel, dict(SIG), {(7,): block, (8,): False},
                    {(0,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as e:  # pragma: no cover - a Triton without its NVIDIA tool chain
        pytest.skip(f"Triton cannot build for sm_90 here: {e}")


def _entries(cache: Path) -> set[str]:
    return set(os.listdir(cache)) if cache.exists() else set()


def test_described_variant_rebuilds_under_the_same_key(tmp_path, monkeypatch):
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    first = _compile(1024)
    d = pb.describe(KERNEL, first)
    assert d is not None and d["kernel"] == KERNEL and d["target"] == ["cuda", 90, 32]
    assert d["constants"] == [[[7], 1024], [[8], False]] and d["options"]["num_warps"] == 4
    assert "extern_libs" not in d["options"] and "hash" not in d["options"]  # (a path on this machine; a result)
    json.dumps(d)  # (what a list holds is plain JSON)
    built_by_launch = _entries(cache)
    assert built_by_launch

    # an empty cache, the variant built from its description in a worker thread, as a run builds it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    run = pb.Prebuild([d, {**d, "kernel": "hybridsim.kernels.row_stats_triton:_no_such_kernel"}], "test", workers=2)
    report = run.wait()
    assert (report.listed, report.built) == (2, 1) and report.workers == 2
    assert len(report.failed) == 1 and "_no_such_kernel" in report.failed[0] and "AttributeError" in report.failed[0]
    assert "built 1 of 2 kernel variants" in report.note() and "could not be built" in report.note()
    assert sorted(k for k, _ in report.slowest) == sorted([KERNEL, KERNEL[:-len("_row_stats_kernel")] + "_no_such_kernel"])
    assert all(t > 0 for _, t in report.slowest)
    fresh = _entries(tmp_path / "fresh")
    assert built_by_launch <= fresh  # the launch's own cache entry (same key), launchers aside

    # the launch's build now finds it: nothing new is compiled, and it is the same binary
    again = _compile(1024)
    assert _entries(tmp_path / "fresh") == fresh
    assert again.hash == first.hash and again.asm["cubin"] == first.asm["cubin"]
    # another constexpr is another variant: compiled, a new entry
    _compile(2048)
    assert len(_entries(tmp_path / "fresh")) > len(fresh)


def test_a_changed_kernel_is_reported_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    d = pb.describe(KERNEL, _compile(1024))
    stale = {**d, "signature": {k: v for k, v in d["signature"].items() if k != "piece_len"}}  # (a parameter gone)
    why, _ = pb.build(stale)
    assert why is not None and why.startswith(KERNEL)
    assert pb.build(d)[0] is None


def test_loaded_variants_lists_what_a_kernel_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    from hybridsim.kernels import row_stats_triton as m

    compiled = _compile(512)
    caches = m._row_stats_kernel.device_caches
    caches["test-device"] = ({("some", "key"): compiled},)  # (as Triton 3.x keeps a device's variants)
    try:
        listed = [v for v in pb.loaded_variants() if v["kernel"] == KERNEL]
    finally:
        del caches["test-device"]
    assert listed == [pb.describe(KERNEL, compiled)]


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
    assert pb.lookup("k2", [(tmp_path / "missing.json", "x"), (path, "y")]) == ([a], str(path))
    assert pb.lookup("k3", [(path, "y")]) == ([], "")


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


def test_an_abandoned_prebuild_drops_its_queue(tmp_path, monkeypatch):
    """A run that stops before its loop (bad input found late, a plan that does not fit) does not
    build what it will never use: what is queued is dropped, only the builds under way finish."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    d = pb.describe(KERNEL, _compile(1024))
    variants = [{**d, "constants": [[[7], 16 << i], [[8], False]]} for i in range(8)]  # 8 distinct variants
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c2"))
    run = pb.Prebuild(variants, "test", workers=2)
    run.abandon()
    run.pool.shutdown(wait=True)  # (the two under way)
    assert sum(f.cancelled() for f in run.futures) >= len(variants) - 2
    assert len(_entries(tmp_path / "c2")) <= 2


def test_in_cache_tells_a_built_variant_from_a_missing_one(tmp_path, monkeypatch):
    """A machine that ran the configuration before builds nothing ahead: the parent tells from the
    cache key, as ``triton.compile`` looks it up, which listed variants are there."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    d = pb.describe(KERNEL, _compile(1024))
    other = {**d, "constants": [[[7], 2048], [[8], False]]}
    assert pb.in_cache(d) and not pb.in_cache(other)
    assert not pb.in_cache({**d, "kernel": "hybridsim.kernels.row_stats_triton:_gone"})  # (cannot tell: build it)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert not pb.in_cache(d)
    assert pb.PrebuildReport(3, 0, cached=3, source="kv.json").note() is None  # (a warm machine: nothing to say)
    assert "; 2 were in Triton's cache;" in pb.PrebuildReport(3, 1, cached=2, workers=1, source="kv.json").note()
