"""Kernel providers as plugins: the registry, `hybridsim kernels`, `hybridsim kernels check`, and
`--kernels` naming a provider this environment has or lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest

from .cli_inproc import hsi
from .conftest import REPO

SCENARIOS = REPO / "scenarios"

HAS_VLLM = find_spec("vllm") is not None


def hs(*args, env_extra: dict | None = None, cwd=REPO):
    """A fresh interpreter, for the plugin tests (a provider found through another import path);
    the rest run the command in process (``hsi``)."""
    env = dict(os.environ)
    env.update(env_extra or {})
    env["COLUMNS"] = "250"
    return subprocess.run([sys.executable, "-m", "hybridsim", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env=env)


def _inproc(*args):
    """The command in process, its console as wide as ``hs`` makes it."""
    return hsi(*args, env={"COLUMNS": "250"})


def _plugin(tmp_path, name: str, body: str):
    """A package registering provider ``name`` through the entry-point group, installed only by
    being on the import path (a dist-info folder beside its module)."""
    mod = f"plug_{name}"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(body))
    info = tmp_path / f"{mod}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[hybridsim.kernels]\n{name} = {mod}:Provider\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


GOOD_MERGE = """
    from hybridsim.kernels.reference import ReferenceKernels

    class Provider(ReferenceKernels):
        name = "goodplug"

        def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
            import torch
            m = torch.maximum(lse_a, lse_b)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
            s = wa + wb
            safe = torch.where(s == 0, torch.ones_like(s), s)
            out = o_a * (wa / safe)[..., None] + o_b * (wb / safe)[..., None]
            lse = torch.where(s == 0, torch.full_like(s, float("-inf")), m + torch.log(safe))
            return out, lse
"""

BAD_MERGE = """
    from hybridsim.kernels.reference import ReferenceKernels

    class Provider(ReferenceKernels):
        name = "badplug"

        def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
            import torch  # merges with exp2 against natural-log lse: the lse_base2 bug, in a plugin
            m = torch.maximum(lse_a, lse_b)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            wa, wb = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
            s = torch.where(wa + wb == 0, torch.ones_like(m), wa + wb)
            return o_a * (wa / s)[..., None] + o_b * (wb / s)[..., None], m + torch.log(s)
"""


def test_registry_lists_built_in_providers_and_whose_code_each_op_runs():
    from hybridsim.kernels import OPS, get_kernels, op_sources, provider_names

    assert provider_names()[:3] == ("reference", "triton", "vllm")
    with pytest.raises(KeyError):
        get_kernels("nope")
    ref = op_sources(get_kernels("reference"))
    assert set(ref) == set(OPS) and set(ref.values()) == {"reference"}


def test_a_plugin_provider_is_found_listed_and_checked(tmp_path):
    env = _plugin(tmp_path, "goodplug", GOOD_MERGE)
    r = hs("kernels", env_extra=env)
    assert r.returncode == 0, r.stderr
    assert "goodplug" in r.stdout and "plug_goodplug 0.1" in r.stdout
    # its merge_states is its own; the ops it does not override stay the reference's
    rows = [line for line in r.stdout.splitlines() if "merge_states" in line]
    assert any("goodplug" in line for line in rows), r.stdout
    r = hs("kernels", "check", "goodplug", "--quick", "--op", "merge_states", "--op", "state_copy", env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merge_states" in r.stdout and "pass" in r.stdout and "fail" not in r.stdout


def test_kernels_check_fails_a_wrong_plugin_with_exit_1(tmp_path):
    env = _plugin(tmp_path, "badplug", BAD_MERGE)
    r = hs("kernels", "check", "badplug", "--quick", "--op", "merge_states", env_extra=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "fail" in r.stdout and "Traceback" not in r.stderr


def test_a_plugin_provider_runs_a_scenario_under_the_checks(tmp_path):
    """A run with a plugin's provider is checked like any other: the wrong merge is caught."""
    r = hs("run", SCENARIOS / "mla_long_context.yaml", "--kernels", "badplug", "--max-steps", "2",
           "--json", tmp_path / "run.json", env_extra=_plugin(tmp_path, "badplug", BAD_MERGE))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "kernel.merge_states" in r.stdout and "badplug merge_states off the reference" in r.stdout
    # the checks' own work (the references, the comparisons) timed as a phase apart from the layers'
    timed = {t["phase"]: t["total_s"] for t in json.loads((tmp_path / "run.json").read_text())["timings"]}
    assert timed["execute: kernel checks"] > 0 and "execute: kernel checks" in r.stdout


def test_kernels_check_triton_under_the_interpreter():
    r = _inproc("kernels", "check", "triton", "--quick", "--op", "state_copy", "--op", "merge_states", "--op",
           "reshape_and_cache")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("pass") == 3
    assert " s in all" in " ".join(r.stdout.split())


def test_kernels_check_reports_each_case_as_it_goes():
    """The progress a terminal shows (a full check on a CPU takes minutes): one call a case, counted per op."""
    import torch

    from hybridsim.kernels.provider_check import Checker
    from hybridsim.kernels.reference import ReferenceKernels

    seen = []
    c = Checker(ReferenceKernels(), torch.device("cpu"), quick=True, on_case=lambda *a: seen.append(a))
    results = {r.op: r for r in c.run(("merge_states", "mla_decode"))}
    assert [n for op, n, _ in seen if op == "merge_states"] == list(range(1, results["merge_states"].cases + 1))
    assert len(seen) == sum(r.cases for r in results.values()) > 2
    assert ("mla_decode", 1, "page 16, batch 1, 1 query") in seen


def test_unknown_provider_and_op_are_bad_input():
    r = _inproc("kernels", "check", "nope")
    assert r.returncode == 2 and "no kernel provider 'nope'" in r.stderr
    r = _inproc("kernels", "check", "triton", "--op", "warp_drive")
    assert r.returncode == 2 and "no op 'warp_drive'" in r.stderr
    r = _inproc("run", SCENARIOS / "quickstart.yaml", "--kernels", "nope", "-q")
    assert r.returncode == 2 and "--kernels" in r.stderr


def test_scenario_naming_an_unknown_provider_is_refused_with_its_key(tmp_path):
    text = (SCENARIOS / "quickstart.yaml").read_text()
    assert "kernels: auto" in text
    text = text.replace("kernels: auto", "kernels: flashplug", 1)
    p = tmp_path / "s.yaml"
    p.write_text(text)
    r = _inproc("validate", p)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "execution.kernels" in r.stderr and "flashplug" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed in this environment")
def test_vllm_provider_without_vllm_exits_3_saying_how_to_install():
    r = _inproc("run", SCENARIOS / "quickstart.yaml", "--kernels", "vllm", "-q")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "vLLM is not installed" in r.stderr and "vllm==0.33.0" in r.stderr
    r = _inproc("kernels", "check", "vllm")
    assert r.returncode == 3 and "vLLM is not installed" in r.stderr
    r = _inproc("kernels")
    assert r.returncode == 0 and "not available here" in r.stdout
