"""Per-kernel GPU timings: every provider call bracketed by CUDA events.

The executor is host code and usually slower than the GPU, so events recorded around a
call would mostly measure the host's launch overhead. Each call therefore first queues
a short GPU spin (``torch.cuda._sleep``), then the start event, the call's kernels and
the end event: while the GPU spins, the host finishes launching, and the events see the
kernels back to back. A call whose host side outlasts the spin (a first call that
compiles, say) would leak host time into the measurement; it is counted apart
(``untimed``) and left out of the statistics. A spin costs the run its length, so after a
kernel's first ``TIME_FIRST`` calls only every ``TIME_EVERY``-th is timed; the others are
counted as untimed too. Events are recorded without a host sync; elapsed times are read
once, after the run.

Each call also records its traffic: bytes read, bytes written and FLOPs (``TRAFFIC``; the
benchmarks use the same accounting). The table sets them against the device's measured
read, copy and matmul rates (``ceilings.py``, probed once per process and device): each
kernel's floor is the larger of its bandwidth time and its compute time, and the table says
which one it used and how close the kernel came to it.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable, NamedTuple

import torch

from .ceilings import Ceilings, measure

SPIN_S = 1e-3  # GPU spin queued before each timed call (an MLA decode call sets up TMA descriptors: ~0.3 ms)
TIME_FIRST, TIME_EVERY = 8, 16  # time a kernel's first 8 calls, then every 16th (a spin costs the run its length)

_CEILINGS: dict[int, Ceilings] = {}


def device_ceilings(device: torch.device) -> Ceilings:
    """The device's measured read, copy and matmul rates, probed once per process (512 MiB streams)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CEILINGS:
        _CEILINGS[idx] = measure(torch.device("cuda", idx))
    return _CEILINGS[idx]


class Traffic(NamedTuple):
    """What one call must move and compute at least: bytes read, bytes written, FLOPs."""

    read: int
    written: int
    flops: int = 0


def resolve(t: "Traffic | Callable[[], Traffic]") -> Traffic:
    """A call's traffic, counting it now where it was deferred (it needed device values)."""
    return t() if callable(t) else t


def _state_copy_traffic(conv, temporal, table, items) -> Callable[[], Traffic]:
    """Each item reads and writes R - offset conv rows and one temporal page. Deferred: the
    offsets live on the device, and reading them now would sync the host."""
    rows = conv.shape[2]
    conv_row = conv[0, 0, 0].numel() * conv.element_size()
    t_page = temporal[0, 0].numel() * temporal.element_size()
    n = items.shape[0]

    def count() -> Traffic:
        moved = int(conv_row * (rows * n - int(items[:, 5].sum())) + t_page * n)
        return Traffic(moved, moved)
    return count


def _merge_traffic(o_a, lse_a, o_b, lse_b, *_, **__) -> Traffic:
    """Both partial outputs and both lse read; one float32 output and lse written."""
    return Traffic(2 * o_a.numel() * o_a.element_size() + 2 * lse_a.numel() * lse_a.element_size(),
                   o_a.numel() * 4 + lse_a.numel() * 4)


def _partial_traffic(q, k, v, scale, mask, causal=None) -> "Traffic | Callable[[], Traffic]":
    """Queries, keys and values read once (a mask read where one is given and not promised
    causal), float32 outputs and lse written; FLOPs 2 * heads * (dq + dv) per visible (query, key)
    pair: every pair without a mask, the causal triangle (counted here), or the mask's True
    elements (deferred: the mask lives on the device)."""
    n, H, dq = q.shape
    m, dv = k.shape[0], v.shape[-1]
    read = sum(x.numel() * 4 for x in (q, k, v))  # (the kernel reads float32)
    written = n * H * (dv + 1) * 4
    per_pair = 2 * H * (dq + dv)
    if causal is not None:  # row i sees keys 0 .. min(m - 1, i + causal)
        full = max(0, min(n, m - causal))  # rows that see i + causal + 1 keys
        pairs = full * (causal + 1) + full * (full - 1) // 2 + (n - full) * m
        return Traffic(read, written, per_pair * pairs)
    if mask is None:
        return Traffic(read, written, per_pair * n * m)
    return lambda: Traffic(read + mask.numel(), written, per_pair * int(mask.sum()))


def _concat_traffic(entries, slots, cache) -> Traffic:
    n, dim = entries.shape[0], cache.shape[-1]
    return Traffic(n * dim * entries.element_size(), n * dim * cache.element_size())


def _gather_traffic(cache, block_row, start, length) -> Traffic:
    moved = length * cache.shape[-1] * cache.element_size()
    return Traffic(moved, moved)


def _causal_pairs(q_lens: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """(query, key) pairs under a bottom-right causal mask: query j of q sees s - q + 1 + j keys."""
    q, s = q_lens.to(torch.int64), seq_lens.to(torch.int64)
    return int((q * (s - q) + q * (q + 1) // 2).sum())


def _mla_traffic(q_lat, q_pe, cache, block_table, seq_lens, *_, **__) -> Callable[[], Traffic]:
    """Latent rows read once per request, queries read; outputs (float32) and lse written.
    FLOPs as FlashMLA counts them: 2 * H * (L + R + L) per (query, key) pair. Deferred: the
    lengths may live on the device."""
    B, nq, H, L = q_lat.shape
    R = q_pe.shape[-1]
    row = cache.shape[-1] * cache.element_size()
    fixed_read = q_lat.numel() * q_lat.element_size() + q_pe.numel() * q_pe.element_size()
    written = q_lat.numel() * 4 + B * nq * H * 4

    def count() -> Traffic:
        total = int(seq_lens.sum())
        pairs = _causal_pairs(torch.full((B,), nq), seq_lens.cpu())
        return Traffic(total * row + fixed_read, written, 2 * H * (L + R + L) * pairs)
    return count


def _reshape_traffic(key, value, slots, k_cache, v_cache) -> Traffic:
    return Traffic(key.numel() * key.element_size() + value.numel() * value.element_size(),
                   (key.numel() + value.numel()) * k_cache.element_size())


def _paged_traffic(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *_, **__) -> Traffic:
    """K and V rows of each row's whole sequence read once, queries read, float32 outputs written
    (lengths are host tensors); FLOPs 4 * heads * D per causal (query, key) pair (QK and PV)."""
    row = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    flops = 4 * q.shape[1] * q.shape[2] * _causal_pairs(query_start_loc[1:] - query_start_loc[:-1], seq_lens)
    return Traffic(int(seq_lens.sum()) * 2 * row + q.numel() * q.element_size(), q.numel() * 4, flops)


def _block_copy_traffic(pages, pairs) -> Traffic:
    """Each (source, copy) pair reads one whole page of every slot and writes it again."""
    moved = pairs.shape[0] * pages.shape[0] * pages.shape[2] * pages.element_size()
    return Traffic(moved, moved)


TRAFFIC: dict[str, Callable[..., "Traffic | Callable[[], Traffic]"]] = {
    "state_copy": _state_copy_traffic,
    "block_copy": _block_copy_traffic,
    "concat_and_cache": _concat_traffic,
    "gather_cache": _gather_traffic,
    "merge_states": _merge_traffic,
    "attention_partial": _partial_traffic,
    "mla_decode": _mla_traffic,
    "reshape_and_cache": _reshape_traffic,
    "paged_attention": _paged_traffic,
}


def floor_row(ceilings: Ceilings, traffic: list[Traffic], measured_s: float) -> dict:
    """Bytes, FLOPs, the summed per-call floors and the % of them reached by ``measured_s``.
    ``bound`` says which limit set the floors: bandwidth, compute, or both (some calls each)."""
    floors = [ceilings.floor(t.read, t.written, t.flops) for t in traffic]
    total = sum(f.seconds for f in floors)
    bounds = sorted({f.bound for f in floors})
    return {"read_bytes": sum(t.read for t in traffic), "written_bytes": sum(t.written for t in traffic),
            "flops": sum(t.flops for t in traffic), "floor_s": total,
            "bound": "+".join(bounds) if bounds else "",
            "pct_floor": 100 * total / measured_s if measured_s > 0 else 0.0}


class TimedKernels:
    """Wraps a provider; every kernel call gets a start and end CUDA event and its traffic."""

    def __init__(self, inner, device: torch.device):
        self.inner = inner
        self.name = inner.name
        self.device = device
        self.calls: dict[str, list] = {k: [] for k in TRAFFIC}
        self.untimed: dict[str, int] = {k: 0 for k in TRAFFIC}
        clock_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_980_000
        self.spin_cycles = int(SPIN_S * clock_khz * 1e3)

    def __getattr__(self, attr):
        if attr not in TRAFFIC:
            return getattr(self.inner, attr)
        fn = getattr(self.inner, attr)
        prepare = getattr(self.inner, "prepare_" + attr, None)  # a provider's host-side work for the call
        calls = self.calls[attr]
        count = TRAFFIC[attr]
        untimed = self.untimed

        seen = [0]

        def timed(*args, **kwargs):
            seen[0] += 1
            if seen[0] > TIME_FIRST and seen[0] % TIME_EVERY:  # sampled out: no spin, no events
                untimed[attr] += 1
                return fn(*args, **kwargs)
            if prepare is not None:  # (outside the events: what the engine keeps on the device already)
                prepare(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(self.spin_cycles)
            t0 = perf_counter()
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            if perf_counter() - t0 < 0.8 * SPIN_S:  # launched well within the spin: events see only the GPU
                calls.append((start, end, count(*args, **kwargs)))
            else:
                untimed[attr] += 1
            return out
        setattr(self, attr, timed)  # built once: later calls find it without __getattr__
        return timed

    def summary(self) -> dict:
        """Per kernel: calls, total/median/p90 time, bytes read and written, FLOPs, GB/s, the
        floor (bandwidth or compute) and the % of it reached."""
        torch.cuda.synchronize(self.device)
        ceilings = device_ceilings(self.device)
        rows = []
        for name, calls in self.calls.items():
            if not calls:
                if self.untimed[name]:
                    rows.append({"kernel": name, "calls": 0, "untimed": self.untimed[name], "total_s": 0.0,
                                 "median_us": 0.0, "p90_us": 0.0, "bytes": 0, "GBps": 0.0,
                                 **floor_row(ceilings, [], 0.0)})
                continue
            times = sorted(s.elapsed_time(e) * 1e-3 for s, e, _ in calls)
            total = sum(times)
            traffic = [resolve(t) for _, _, t in calls]
            nbytes = sum(t.read + t.written for t in traffic)
            rows.append({"kernel": name, "calls": len(calls), "untimed": self.untimed[name], "total_s": total,
                         "median_us": 1e6 * times[len(times) // 2],
                         "p90_us": 1e6 * times[min(len(times) - 1, int(0.9 * len(times)))],
                         "bytes": nbytes, "GBps": nbytes / total / 1e9 if total else 0.0,
                         **floor_row(ceilings, traffic, total)})
        from . import op_sources

        c = ceilings.as_dict()
        return {"device": torch.cuda.get_device_name(self.device), "copy_ceiling_TBps": c["copy_TBps"],
                "read_ceiling_TBps": c["read_TBps"], "write_side_TBps": c["write_TBps"],
                "matmul_TFLOPs": c["matmul_TFLOPs"], "kernels": rows, "runs": op_sources(self.inner)}
