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


@pytest.mark.gpu
def test_reading_a_step_late_does_not_wait_for_the_next_steps_work():
    """Step 1's results are read at the end of step 2 without waiting for step 2's work: the device
    is still busy with it when the tally runs (a plain ``.cpu()`` there would have drained it)."""
    seen = []
    v = Verdicts(1)
    v.add(torch.arange(4, device="cuda") * 3, lambda h: seen.append(h.tolist()))
    v.end_step()
    torch.cuda._sleep(2_000_000_000)  # step 2's work: about a second of device time
    busy = []
    v.add(torch.ones(1, device="cuda"), lambda h: busy.append(torch.cuda.current_stream().query()))
    v.end_step()
    assert seen == [[0, 3, 6, 9]]
    assert not torch.cuda.current_stream().query()  # step 2 still running after step 1 was tallied
    v.drain()
    assert busy == [True]  # step 2's own results waited for step 2


@pytest.mark.gpu
def test_a_result_made_on_another_stream_is_read_after_that_stream_wrote_it():
    seen = []
    v = Verdicts(1)
    side = torch.cuda.Stream()
    out = torch.zeros(3, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the side stream writes late; the main stream has nothing queued
        out.fill_(7.0)
        v.add(out, lambda h: seen.append(h.tolist()))
    v.end_step()
    v.drain()
    assert seen == [[7.0, 7.0, 7.0]]


def test_the_tallies_time_is_kept_apart_from_the_wait_for_the_device():
    import time
    v = Verdicts(1)
    v.add(torch.tensor([1]), lambda h: time.sleep(0.02))
    v.end_step()
    v.drain()
    assert v.tally_s >= 0.02 and v.wait_s >= 0.0
