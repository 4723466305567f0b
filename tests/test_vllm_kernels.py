"""The installed vLLM's own kernels under hybridsim's checks (``--kernels vllm``), run with the peer
venv (``bench/peer_setup.sh``): ``.peer-venv/bin/python -m pytest -m peer tests/test_vllm_kernels.py``.

On a CPU the engine's Triton kernels run under the Triton interpreter (slow: a few steps of tiny
scenarios); on a GPU the same tests run at the scenarios' sizes with ``-m "peer or gpu"``."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM 0.33 (bench/peer_setup.sh)")]
SCENARIOS = REPO / "scenarios"


def hs(*args):
    env = dict(os.environ, COLUMNS="250")
    return subprocess.run([sys.executable, "-m", "hybridsim", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env=env)


def test_each_engine_binding_matches_the_reference_on_adversarial_inputs():
    r = hs("kernels", "check", "vllm", "--quick", "--op", "state_copy", "--op", "merge_states", "--op",
           "mla_decode", "--op", "paged_attention")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for fn in ("postprocess_mamba_fused_kernel", "merge_attn_states", "decode_attention_fwd", "unified_attention"):
        assert fn in r.stdout, r.stdout  # each op ran the engine's function, not a fallback


def test_state_copy_binding_refuses_what_the_engine_cannot_express():
    """A temporal source other than conv source + offset (an injected bookkeeping bug) is not a copy
    the engine's kernel can make: the call runs hybridsim's op, and is counted as such."""
    import torch

    from hybridsim.kernels import get_kernels

    k = get_kernels("vllm")
    conv = torch.randn(2, 8, 3, 4)
    temporal = torch.randn(2, 8, 2, 3)
    table = torch.tensor([[1, 2, 3, 4]])
    good = torch.tensor([[0, layer, 0, 2, 1, 1] for layer in range(2)])
    bad = torch.tensor([[0, layer, 0, 2, 0, 1] for layer in range(2)])
    want_c, want_t = conv.clone(), temporal.clone()
    from hybridsim.kernels.reference import ReferenceKernels

    ReferenceKernels().state_copy(want_c, want_t, table, good)
    k.state_copy(conv, temporal, table, good)
    assert torch.equal(conv, want_c) and torch.equal(temporal, want_t)
    k.state_copy(conv, temporal, table, bad)
    assert k.call_counts()["state_copy"] == (1, 1)


@pytest.mark.parametrize("scenario, steps", [("spec_decode", 4), ("mixed_hybrid_mla", 3)])
def test_tiny_scenarios_run_clean_with_the_engines_kernels(scenario, steps):
    r = hs("run", SCENARIOS / f"{scenario}.yaml", "--kernels", "vllm", "--max-steps", steps)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "ran the engine's kernel" in r.stdout


@pytest.mark.parametrize("bug, scenario, steps, check", [
    ("no_conv_shift_on_accept", "spec_decode", 12, "ssm.running_state"),
    ("lse_base2", "mla_long_context", 2, "mla.output"),  # (caught at its first step)
])
def test_injected_bugs_are_caught_under_the_engines_kernels(bug, scenario, steps, check):
    r = hs("run", SCENARIOS / f"{scenario}.yaml", "--kernels", "vllm", "--inject-bug", bug, "--max-steps", steps)
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-3000:]
    assert check in r.stdout
