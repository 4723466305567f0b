"""The parts of ``device/prebuild.py`` that build kernels for sm_90 with Triton's compiler (no GPU
needed): a variant described from a build and rebuilt from the description in a worker process
under the same cache key, a stale description reported, a process's variants listed, an
abandoned prebuild, the cache lookup. Run by ``test_prebuild.test_builds_for_hopper`` in a process
without the Triton interpreter: once interpreted kernels have run in a process (the suite runs
many), Triton's language is patched for the interpreter and nothing compiles there. This file's
name keeps pytest from collecting it in the suite's own processes."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from hybridsim.device import prebuild as pb  # noqa: E402

MODULE = "hybridsim.kernels._prebuild_test_kernels"


def _scale_kernel(x, y, n, BLOCK: tl.constexpr, TWICE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n)
    tl.store(y + i, v * 2.0 if TWICE else v, mask=i < n)


_scale_kernel.__module__ = MODULE
_scale_kernel = JITFunction(_scale_kernel)
sys.modules[MODULE] = types.ModuleType(MODULE)  # (where a build finds it by name, as it finds ours)
sys.modules[MODULE]._scale_kernel = _scale_kernel
KERNEL = f"{MODULE}:_scale_kernel"
SIG = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr", "TWICE": "constexpr"}


def _compile(block: int):
    """One real variant of a kernel, built as a launch would build it (for sm_90)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(_scale_kernel, dict(SIG), {(3,): block, (4,): True},
                    {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as e:  # pragma: no cover - a Triton without its NVIDIA tool chain
        if "ptxas" in str(e):
            pytest.skip(f"Triton cannot build for sm_90 here: {e}")
        raise


def _entries(cache: Path) -> set[str]:
    return set(os.listdir(cache)) if cache.exists() else set()


def _kernel_entries(cache: Path) -> set[str]:
    """The cache's entries holding a build of the test kernel (not a launcher's: where the CUDA driver
    is there, a built variant's launcher is an entry of its own)."""
    return {e for e in _entries(cache) if (cache / e / "_scale_kernel.json").exists()}


def test_described_variant_rebuilds_under_the_same_key(tmp_path, monkeypatch):
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    first = _compile(1024)
    d = pb.describe(KERNEL, first)
    assert d is not None and d["kernel"] == KERNEL and d["target"] == ["cuda", 90, 32]
    assert d["constants"] == [[[3], 1024], [[4], True]] and d["options"]["num_warps"] == 4
    assert "extern_libs" not in d["options"] and "hash" not in d["options"]  # (a path on this machine; a result)
    json.dumps(d)  # (what a list holds is plain JSON)
    built_by_launch = _entries(cache)
    assert built_by_launch

    # an empty cache, the variant built from its description in a worker process, as a run builds it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    run = pb.Prebuild([d, {**d, "kernel": f"{MODULE}:_no_such_kernel"}], "test", workers=2)
    report = run.wait()
    assert (report.listed, report.built) == (2, 1) and report.workers == 2
    assert len(report.failed) == 1 and "_no_such_kernel" in report.failed[0] and "AttributeError" in report.failed[0]
    assert "built 1 of 2 kernel variants" in report.note() and "could not be built" in report.note()
    assert sorted(k for k, _ in report.slowest) == sorted([KERNEL, f"{MODULE}:_no_such_kernel"])
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
    stale = {**d, "signature": {k: v for k, v in d["signature"].items() if k != "n"}}  # (a parameter gone)
    why, _ = pb.build(stale)
    assert why is not None and why.startswith(KERNEL)
    assert pb.build(d)[0] is None


def test_loaded_variants_lists_what_a_kernel_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    compiled = _compile(512)
    caches = _scale_kernel.device_caches
    caches["test-device"] = ({("some", "key"): compiled},)  # (as Triton 3.x keeps a device's variants)
    try:
        listed = [v for v in pb.loaded_variants() if v["kernel"] == KERNEL]
    finally:
        del caches["test-device"]
    assert listed == [pb.describe(KERNEL, compiled)]


def test_an_abandoned_prebuild_drops_its_queue(tmp_path, monkeypatch):
    """A run that stops before its loop (bad input found late, a plan that does not fit) does not
    build what it will never use: what is queued is dropped, only the builds under way finish."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    d = pb.describe(KERNEL, _compile(1024))
    variants = [{**d, "constants": [[[3], 16 << i], [[4], True]]} for i in range(8)]  # 8 distinct variants
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c2"))
    run = pb.Prebuild(variants, "test", workers=2)
    run.abandon()
    run.pool.shutdown(wait=True)  # (the two under way)
    assert sum(f.cancelled() for f in run.futures) >= len(variants) - 2
    assert len(_kernel_entries(tmp_path / "c2")) <= 2


def test_in_cache_tells_a_built_variant_from_a_missing_one(tmp_path, monkeypatch):
    """A machine that ran the configuration before builds nothing ahead: the parent tells from the
    cache key, as ``triton.compile`` looks it up, which listed variants are there."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    d = pb.describe(KERNEL, _compile(1024))
    other = {**d, "constants": [[[3], 2048], [[4], True]]}
    assert pb.in_cache(d) and not pb.in_cache(other)
    assert not pb.in_cache({**d, "kernel": f"{MODULE}:_gone"})  # (cannot tell: build it)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert not pb.in_cache(d)
    assert pb.PrebuildReport(3, 0, cached=3, source="kv.json").note() is None  # (a warm machine: nothing to say)
    assert "; 2 were in Triton's cache;" in pb.PrebuildReport(3, 1, cached=2, workers=1, source="kv.json").note()
    assert "; 1 was in Triton's cache;" in pb.PrebuildReport(3, 2, cached=1, workers=1, source="kv.json").note()
