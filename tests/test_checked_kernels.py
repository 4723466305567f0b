"""``kernel.<name>`` checks: a provider that differs from the reference is caught, at the step it
was called in, on the pages it touched; a correct one passes with real comparisons."""

from __future__ import annotations

import time

import torch

from hybridsim.checks import Checks
from hybridsim.kernels.checked import REFERENCE_MAX_QUERIES, CheckedKernels
from hybridsim.kernels.reference import ReferenceKernels


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
