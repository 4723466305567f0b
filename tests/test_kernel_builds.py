"""Kernel variants built inside a run's loop (``device/builds.py``): counted from the kernels'
in-memory caches, and said under the run's timings, since the whole loop's time includes them."""

from __future__ import annotations

import types

from rich.console import Console

from hybridsim import report
from hybridsim.config import load_scenario
from hybridsim.device.builds import built_variants, grown
from hybridsim.runner import plan_scenario

from .conftest import REPO


def _kernel(name: str, module: str = "hybridsim.kernels._fake"):
    """A real ``JITFunction`` (whatever TRITON_INTERPRET says: the decorator would follow it),
    defined in ``module``."""
    from triton.runtime.jit import JITFunction

    def body(x):
        pass
    body.__name__ = body.__qualname__ = name
    body.__module__ = module
    return JITFunction(body)


def test_built_variants_count_each_kernels_specialisations(monkeypatch):
    mod = types.ModuleType("hybridsim.kernels._fake")
    mod.k_one, mod.k_two, mod.k_none = _kernel("k_one"), _kernel("k_two"), _kernel("k_none")
    mod.k_one.device_caches = {0: ({"spec a": object()}, None, None, None, None)}
    mod.k_two.device_caches = {0: ({"spec a": object(), "spec b": object()}, None, None, None, None)}
    mod.k_none.device_caches = {}
    monkeypatch.setitem(__import__("sys").modules, "hybridsim.kernels._fake", mod)
    before = built_variants()
    assert before["_fake.k_one"] == 1 and before["_fake.k_two"] == 2
    assert "_fake.k_none" not in before  # (nothing built: not listed)
    mod.k_two.device_caches[0][0]["spec c"] = object()  # a launch met a new class of an integer
    mod.k_none.device_caches = {0: ({"spec a": object()}, None, None, None, None)}
    assert grown(before, built_variants()) == {"_fake.k_none": 1, "_fake.k_two": 1}
    assert grown(before, before) == {}
    # a kernel imported into another module is one kernel: counted once, under the module that defines it
    other = types.ModuleType("hybridsim.kernels._fake_user")
    other.k_two = mod.k_two
    monkeypatch.setitem(__import__("sys").modules, "hybridsim.kernels._fake_user", other)
    held = built_variants()
    assert held["_fake.k_two"] == 3 and not any(k.startswith("_fake_user.") for k in held)


def test_a_run_reports_what_its_loop_built():
    """A CPU run with the reference kernels builds nothing: the JSON says so (an empty count, not a
    missing one); a run whose loop built kernels says so under its timings."""
    res = plan_scenario(load_scenario(REPO / "scenarios/quickstart.yaml"), kernels="reference", device="cpu")
    assert res.kernel_builds == {}
    assert res.as_dict()["kernel_builds"] == {}
    assert report.timings_table(res).caption is None
    res.kernel_builds = {"probe_scan_triton._probe_scan_kernel": 2, "attention_triton._paged_attention_kernel": 1}
    console = Console(width=80, record=True, color_system=None)
    console.print(report.timings_table(res))
    text = " ".join(console.export_text().split())
    assert "includes building 3 kernel variants" in text
    assert "probe_scan_triton._probe_scan_kernel (2)" in text and "attention_triton._paged_attention_kernel" in text
    for compiles, says in ((0, "every one loaded from Triton's cache, none compiled"),
                           (5, "5 new entries compiled into Triton's cache")):
        res.kernel_compiles = compiles
        console = Console(width=200, record=True, color_system=None)
        console.print(report.timings_table(res))
        assert says in " ".join(console.export_text().split())
