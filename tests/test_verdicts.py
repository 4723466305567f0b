"""Check results read one step late (the GPU's overlap of host and device) tally exactly what
reading them at once does."""

from __future__ import annotations

import pytest
import torch

import hybridsim.engine.executor as executor_mod
from hybridsim.config import load_scenario
from hybridsim.device.verdicts import Verdicts
from hybridsim.runner import plan_scenario

from .conftest import REPO


def test_lagged_verdicts_resolve_in_order_and_drain():
    seen = []
    v = Verdicts(1)
    for step in range(3):
        v.add(torch.tensor([step, 10 + step]), lambda h, s=step: seen.append((s, h.tolist())))
        v.add(torch.tensor([100 + step]), lambda h, s=step: seen.append((s, h.tolist())))
        v.end_step()
        assert [s for s, _ in seen] == [s for s in range(step) for _ in range(2)]  # one step behind
    v.drain()
    assert seen == [(s, [s, 10 + s]) if k == 0 else (s, [100 + s]) for s in range(3) for k in range(2)]


def test_no_lag_tallies_at_once():
    seen = []
    v = Verdicts(0)
    v.add(torch.tensor([7]), lambda h: seen.append(h.item()))
    assert seen == [7]


def _tallies(res) -> dict:
    return {t.name: (t.count, t.failures, t.max_abs_err, t.max_rel_err,
                     t.first_failure.as_dict() if t.first_failure else None, [f.as_dict() for f in t.examples])
            for t in res.checks.tallies.values()}


def test_a_run_with_lagged_verdicts_tallies_the_same(monkeypatch):
    """The GPU path's lag forced on a CPU run with an injected attention bug: every count, error
    and failure (with its step) as without the lag, the last step's included."""
    path = load_scenario(REPO / "scenarios" / "chunked_prefill.yaml")
    at_once = plan_scenario(path, bugs={"slot_off_by_one"})
    monkeypatch.setattr(executor_mod, "Verdicts", lambda lag: Verdicts(1))
    lagged = plan_scenario(load_scenario(REPO / "scenarios" / "chunked_prefill.yaml"), bugs={"slot_off_by_one"})
    a, b = _tallies(at_once), _tallies(lagged)
    assert a["attn.output"][1] > 0 and a["ssm.output"][0] > 0
    assert a == b


@pytest.mark.gpu
def test_on_the_gpu_the_lag_changes_no_tally(monkeypatch):
    """On a GPU the lag is the default: the same run read at once (lag forced to 0) tallies the same."""
    def run():
        return plan_scenario(load_scenario(REPO / "scenarios" / "chunked_prefill.yaml"), bugs={"slot_off_by_one"},
                             kernels="triton", device="cuda")
    lagged = run()
    monkeypatch.setattr(executor_mod, "Verdicts", lambda lag: Verdicts(0))
    at_once = run()
    a, b = _tallies(at_once), _tallies(lagged)
    assert a["attn.output"][1] > 0 and a["kernel.paged_attention"][0] > 0
    assert a == b
