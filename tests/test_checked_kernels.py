"""``kernel.<name>`` checks: a provider that differs from the reference is caught, at the step it
was called in, on the pages it touched; a correct one passes with real comparisons."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridsim.checks import Checks
from hybridsim.kernels.checked import REFERENCE_MAX_QUERIES, CheckedKernels
from hybridsim.kernels.reference import (LENGTH_PAD, LENGTH_SLACK, ReferenceKernels, length_groups,
                                         takes_host_lengths)

from .helpers import mla_decode_case


class Wrong(ReferenceKernels):
    """Each kernel off in one element."""

    name = "wrong"

    def state_copy(self, conv, temporal, table, items):
        super().state_copy(conv, temporal, table, items)
        r, layer, _, dst = items[0, :4].tolist()
        temporal[layer, int(table[r, dst])].view(-1)[3] += 1

    def concat_and_cache(self, entries, slots, cache):
        super().concat_and_cache(entries, slots, cache)
        cache.view(-1, cache.shape[-1])[int(slots[0]), 0] += 1

    def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
        out, lse = super().merge_states(o_a, lse_a, o_b, lse_b, base2_bug, unguarded)
        return out * 1.01, lse

    def mla_decode(self, *a, **k):
        out, lse = super().mla_decode(*a, **k)
        return out + 0.1, lse


def _calls(k, gen, nq: int = 2):
    conv = torch.randn(2, 12, 3, 8, generator=gen)
    temporal = torch.randn(2, 12, 4, 4, generator=gen)
    table = torch.tensor([[3, 5, 7], [9, 10, 11]])
    items = torch.tensor([[0, 0, 0, 1, 2, 1], [1, 1, 0, 2, 1, 0]])  # (row, slot, src, dst, temporal src, offset)
    k.state_copy(conv, temporal, table, items)
    cache = torch.randn(6, 4, 40, generator=gen)
    k.concat_and_cache(torch.randn(3, 40, generator=gen), torch.tensor([5, 9, 20]), cache)
    o = torch.randn(5, 2, 8, generator=gen)
    k.merge_states(o, torch.randn(5, 2, generator=gen), o.flip(0), torch.randn(5, 2, generator=gen))
    q_lat, q_pe = torch.randn(2, nq, 2, 32, generator=gen), torch.randn(2, nq, 2, 8, generator=gen)
    k.mla_decode(q_lat, q_pe, cache, torch.tensor([[1, 2], [3, 4]]), torch.tensor([7, 6]), 32, 0.2, max_seq_len=7)


def test_a_correct_provider_passes_every_comparison():
    checks = Checks()
    k = CheckedKernels(ReferenceKernels(), checks)
    _calls(k, torch.Generator().manual_seed(0))
    k.flush(4)
    counts = {t.name: (t.count, t.failures) for t in checks.tallies.values()}
    assert counts == {"kernel.state_copy": (2, 0), "kernel.cache_ops": (1, 0), "kernel.merge_states": (2, 0),
                      "kernel.mla_decode": (2, 0)}


def test_every_wrong_kernel_is_caught_at_its_step():
    checks = Checks()
    k = CheckedKernels(Wrong(), checks)
    _calls(k, torch.Generator().manual_seed(1))
    k.flush(7)
    for name, fails in (("state_copy", 1), ("cache_ops", 1), ("merge_states", 1), ("mla_decode", 1)):
        t = checks.tallies[f"kernel.{name}"]
        assert t.failures == fails and t.first_failure.step == 7, (name, t)


def test_prefill_sized_decode_calls_are_left_to_the_paths_check():
    checks = Checks()
    k = CheckedKernels(Wrong(), checks)
    _calls(k, torch.Generator().manual_seed(2), nq=REFERENCE_MAX_QUERIES + 1)
    k.flush(0)
    assert "kernel.mla_decode" not in checks.tallies


def test_many_copies_are_checked_in_bounded_batches(monkeypatch):
    """A step whose copies touch more pages than one staging batch holds is checked (and launched)
    batch by batch, with the same results as one launch, and a wrong copy is still caught."""
    import hybridsim.kernels.checked as checked

    monkeypatch.setattr(checked, "STAGED_PAGES", 6)  # one request: 2 slots x 3 pages
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(2, 40, 3, 8, generator=gen)
    temporal = torch.randn(2, 40, 4, 4, generator=gen)
    table = torch.arange(1, 37).view(6, 6)
    items = torch.tensor([[r, s, 0, 1, 2, r % 3] for r in range(6) for s in range(2)])
    want_c, want_t = conv.clone(), temporal.clone()
    ReferenceKernels().state_copy(want_c, want_t, table, items)
    for provider, fails in ((ReferenceKernels(), 0), (Wrong(), 6)):  # Wrong spoils one element a launch
        checks = Checks()
        k = CheckedKernels(provider, checks)
        c, t = conv.clone(), temporal.clone()
        k.state_copy(c, t, table, items)
        k.flush(1)
        tally = checks.tallies["kernel.state_copy"]
        assert tally.count == 2 * 6 and tally.failures == fails  # 6 batches of one request's two copies
        if not fails:
            assert torch.equal(c, want_c) and torch.equal(t, want_t)


class Sleepy(ReferenceKernels):
    """The reference, its merge taking a known time: what the clock must attribute."""

    name = "sleepy"

    def __init__(self, merge_s: float):
        super().__init__()
        self.merge_s = merge_s

    def merge_states(self, *a, **k):
        time.sleep(self.merge_s)
        return super().merge_states(*a, **k)


def test_the_checks_own_work_is_a_phase_of_its_own_inside_the_callers():
    """With the executor's clock the references and comparisons are the ``kernel checks`` phase, and their
    time comes off the phase that called the kernel: the kernel's merge (20 ms) stays the layer's, the
    reference's (50 ms) is the checks'."""
    from hybridsim.device.clock import PhaseClock
    from hybridsim.kernels.checked import CHECKS_PHASE
    clock = PhaseClock(torch.device("cpu"), ("layer", CHECKS_PHASE))
    k = CheckedKernels(Sleepy(0.02), Checks())
    k.ref = Sleepy(0.05)
    k.clock = clock
    with clock.phase("layer"):
        _calls(k, torch.Generator().manual_seed(0))
    k.flush(0)
    assert 0.05 <= clock.host[CHECKS_PHASE] < 0.5
    assert 0.02 <= clock.host["layer"] < 0.05


# ------------------------------------------------------------------ MLA decode's reference in length groups

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=0, max_size=40), st.sampled_from([0, 256, 4096]))
def test_length_groups_hold_every_row_once_within_their_padding_bound(lens, slack):
    groups = length_groups(lens, slack)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert g == sorted(g) and g
        assert len(g) * max(lens[i] for i in g) <= LENGTH_PAD * sum(lens[i] for i in g) + slack
    if lens and len(set(lens)) == 1:
        assert len(groups) == 1  # rows of one length: one call, no padding


def _spread_case(gen, B: int, nq: int, lens: list[int], dev="cpu"):
    """``mla_decode_case`` at small widths over a bf16 cache, and the rows' lengths on ``dev``."""
    return (*mla_decode_case(B, nq, 3, 32, 8, 8, lens, torch.bfloat16, gen, dev), torch.tensor(lens, device=dev))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("nq", [1, 2])
def test_the_reference_in_length_groups_gives_each_row_what_one_call_does(nq, dev):
    gen = torch.Generator().manual_seed(5 + nq)
    lens = [7000, 9, 1300, 6500, 2, 640, 6990, 17, 3000, 5]  # spread: several groups at either slack
    q_lat, q_pe, cache, table, seq = _spread_case(gen, len(lens), nq, lens, dev)
    ref = ReferenceKernels()
    assert len(length_groups(lens, LENGTH_SLACK[dev])) >= 2
    want = ref.mla_decode(q_lat, q_pe, cache, table, seq, 32, 0.17, max_seq_len=max(lens))
    got = ref.mla_decode_by_length(q_lat, q_pe, cache, table, seq, lens, 32, 0.17)
    assert not torch.isnan(got[0]).any() and not torch.isnan(got[1]).any()
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


class OffOnOneRow(ReferenceKernels):
    """An MLA decode off on one row only (the call's ``row``-th)."""

    name = "off-on-one-row"

    def __init__(self, row: int):
        super().__init__()
        self.row = row

    def mla_decode(self, *a, **k):
        out, lse = super().mla_decode(*a, **k)
        out[self.row] += 0.1
        return out, lse


@pytest.mark.parametrize("row", [None, 1, 4, 9])
def test_the_checks_with_host_lengths_pass_a_correct_kernel_and_catch_any_one_wrong_row(row):
    """The checks given the lengths on the host compare every row against its group's reference: a
    correct kernel passes; one wrong in a single row, short or long, is caught."""
    gen = torch.Generator().manual_seed(11)
    lens = [700, 9, 130, 650, 2, 64, 699, 17, 300, 5]
    q_lat, q_pe, cache, table, seq = _spread_case(gen, len(lens), 2, lens)
    checks = Checks()
    k = CheckedKernels(ReferenceKernels() if row is None else OffOnOneRow(row), checks)
    assert takes_host_lengths(k) and not takes_host_lengths(ReferenceKernels())
    k.mla_decode(q_lat, q_pe, cache, table, seq, 32, 0.17, max_seq_len=max(lens), seq_lens_cpu=lens)
    k.flush(3)
    t = checks.tallies["kernel.mla_decode"]
    assert t.count == 2 and t.failures == (0 if row is None else 1), t
    if row is None:
        assert 0 < t.max_rel_err < 1e-5  # (a real comparison: the groups' sums in another order)


def test_an_mla_run_hands_the_checks_its_decode_rows_lengths_on_the_host(monkeypatch):
    """The executor passes each decode call's lengths on the host (``seq_lens_cpu``) to kernels that take
    them, the same lengths as the device's, and the run's decode rows pass their kernel checks."""
    import hybridsim.execute as execute
    from hybridsim.config import load_scenario
    from hybridsim.runner import plan_scenario
    from .conftest import REPO

    class Plugin(ReferenceKernels):  # (checked: not the reference provider itself)
        name = "plugin"

    monkeypatch.setattr(execute, "resolve_kernels", lambda requested, notes: Plugin())
    seen = []
    inner = ReferenceKernels.mla_decode_by_length

    def spy(self, q_lat, q_pe, cache, table, seq_lens, seq_lens_cpu, *a, **k):
        seen.append((list(seq_lens_cpu), seq_lens.tolist()))
        return inner(self, q_lat, q_pe, cache, table, seq_lens, seq_lens_cpu, *a, **k)

    monkeypatch.setattr(ReferenceKernels, "mla_decode_by_length", spy)
    loaded = load_scenario(REPO / "scenarios" / "mla_long_context.yaml")
    s = loaded.scenario
    loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"max_steps": 40})})
    res = plan_scenario(loaded, device="cpu")
    t = res.checks.tallies["kernel.mla_decode"]
    assert seen and all(host == dev for host, dev in seen)
    assert t.count > 0 and t.failures == 0
