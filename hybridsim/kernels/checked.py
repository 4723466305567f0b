"""``kernel.<name>`` checks: run every provider call through the reference too and compare.

The reference runs on clones of the same inputs, so the comparison is between two
implementations of one kernel on identical data: state copies must be bit-exact,
attention pieces within the dtype tolerance, and ±inf/NaN positions identical.
"""

from __future__ import annotations

import torch

from ..checks import Checks, Failure
from .reference import ReferenceKernels


def _same_specials(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and
                torch.equal(torch.isposinf(a), torch.isposinf(b)) and torch.equal(torch.isneginf(a), torch.isneginf(b)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fa, fb = torch.nan_to_num(a.double(), 0.0, 0.0, 0.0), torch.nan_to_num(b.double(), 0.0, 0.0, 0.0)
    ref = fb.abs().max().item() if fb.numel() else 0.0
    return (fa - fb).abs().max().item() / max(ref, 1e-30) if fa.numel() else 0.0


LOW_PRECISION_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


class CheckedKernels:
    def __init__(self, inner, checks: Checks, tol: float = 1e-5):
        self.inner = inner
        self.ref = ReferenceKernels()
        self.checks = checks
        self.tol = tol
        self.name = inner.name
        self.step = -1

    def _exact(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        t = self.checks.get(f"kernel.{name}")
        if torch.equal(torch.nan_to_num(got, 1.0), torch.nan_to_num(want, 1.0)) and _same_specials(got, want):
            t.passed()
        else:
            t.failed(Failure(self.step, None, f"{self.name} {name} differs from the reference"))

    def _close(self, name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        t = self.checks.get(f"kernel.{name}")
        rel = _rel(got, want)
        t.max_rel_err = max(t.max_rel_err, rel)
        if rel <= tol and _same_specials(got, want):
            t.passed()
        else:
            t.failed(Failure(self.step, None, f"{self.name} {name} off the reference by rel {rel:.2e}",
                             max_rel_err=rel))

    def state_copy(self, conv, temporal, table, items):
        ref_c, ref_t = conv.clone(), temporal.clone()
        self.ref.state_copy(ref_c, ref_t, table, items)
        self.inner.state_copy(conv, temporal, table, items)
        self._exact("state_copy", conv, ref_c)
        self._exact("state_copy", temporal, ref_t)

    def concat_and_cache(self, entries, slots, cache):
        ref = cache.clone()
        self.ref.concat_and_cache(entries, slots, ref)
        self.inner.concat_and_cache(entries, slots, cache)
        self._exact("cache_ops", cache, ref)

    def gather_cache(self, cache, block_row, start, length):
        got = self.inner.gather_cache(cache, block_row, start, length)
        self._exact("cache_ops", got, self.ref.gather_cache(cache, block_row, start, length))
        return got

    def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
        got = self.inner.merge_states(o_a, lse_a, o_b, lse_b, base2_bug=base2_bug, unguarded=unguarded)
        want = self.ref.merge_states(o_a, lse_a, o_b, lse_b, base2_bug=base2_bug, unguarded=unguarded)
        self._close("merge_states", got[0], want[0], 1e-6)
        self._close("merge_states", got[1], want[1], 1e-6)
        return got

    def attention_partial(self, *a, **k):
        return self.inner.attention_partial(*a, **k)

    def mla_decode(self, q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits=0,
                   max_seq_len=None):
        got = self.inner.mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits,
                                    max_seq_len=max_seq_len)
        want = self.ref.mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits)
        # the reference computes in fp32; a bf16/fp16 cache feeds the kernel's matrix units in
        # that precision, so the bar is the dtype's (SPEC §7: rel. err <= 2e-2 for bf16)
        tol = max(self.tol, LOW_PRECISION_TOL.get(cache.dtype, 0.0))
        self._close("mla_decode", got[0], want[0], tol)
        self._close("mla_decode", got[1], want[1], tol)
        return got
