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

Each call also records the bytes it moves (read + written, the same accounting as the
copy ceiling), so the table can say how close a kernel came to the device's measured
copy bandwidth. The ceiling is probed once per process and device and cached.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable

import torch

SPIN_S = 1e-3  # GPU spin queued before each timed call (an MLA decode call sets up TMA descriptors: ~0.3 ms)
TIME_FIRST, TIME_EVERY = 8, 16  # time a kernel's first 8 calls, then every 16th (a spin costs the run its length)

_CEILING: dict[int, float] = {}


def copy_ceiling(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + written), 512 MiB copies."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CEILING:
        x = torch.empty(2 ** 27, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        reps = 10
        for _ in range(reps):
            y.copy_(x)
        end.record()
        end.synchronize()
        _CEILING[idx] = reps * 2 * x.numel() * 4 / (start.elapsed_time(end) * 1e-3)
        del x, y
    return _CEILING[idx]


def _state_copy_bytes(conv, temporal, table, items) -> Callable[[], int]:
    """Deferred: the offsets live on the device, and reading them now would sync the host."""
    rows = conv.shape[2]
    conv_row = conv[0, 0, 0].numel() * conv.element_size()
    t_page = temporal[0, 0].numel() * temporal.element_size()
    n = items.shape[0]
    return lambda: int(2 * (conv_row * (rows * n - int(items[:, 5].sum())) + t_page * n))


def _merge_bytes(o_a, lse_a, o_b, lse_b, *_, **__) -> int:
    return 3 * o_a.numel() * 4 + 3 * lse_a.numel() * 4


def _concat_bytes(entries, slots, cache) -> int:
    return entries.shape[0] * cache.shape[-1] * (entries.element_size() + cache.element_size())


def _gather_bytes(cache, block_row, start, length) -> int:
    return 2 * length * cache.shape[-1] * cache.element_size()


def _mla_bytes(q_lat, q_pe, cache, block_table, seq_lens, *_, **__) -> Callable[[], int]:
    """Latent rows read (deferred: the lengths may live on the device), queries, outputs."""
    row = cache.shape[-1] * cache.element_size()
    fixed = q_lat.numel() * 4 + q_pe.numel() * 4 + q_lat.numel() * 4
    return lambda: int(seq_lens.sum()) * row + fixed


def _reshape_bytes(key, value, slots, k_cache, v_cache) -> int:
    return 2 * key.numel() * (key.element_size() + k_cache.element_size())


def _paged_bytes(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *_, **__) -> int:
    """K and V rows each row reads (its whole sequence; lengths are host tensors), queries, outputs."""
    row = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return int(seq_lens.sum()) * 2 * row + q.numel() * (q.element_size() + 4)


def _block_copy_bytes(pages, pairs) -> int:
    return 2 * pairs.shape[0] * pages.shape[0] * pages.shape[2] * pages.element_size()


BYTES: dict[str, Callable[..., "int | Callable[[], int]"]] = {
    "state_copy": _state_copy_bytes,
    "block_copy": _block_copy_bytes,
    "concat_and_cache": _concat_bytes,
    "gather_cache": _gather_bytes,
    "merge_states": _merge_bytes,
    "mla_decode": _mla_bytes,
    "reshape_and_cache": _reshape_bytes,
    "paged_attention": _paged_bytes,
}


class TimedKernels:
    """Wraps a provider; every kernel call gets a start and end CUDA event and its bytes."""

    def __init__(self, inner, device: torch.device):
        self.inner = inner
        self.name = inner.name
        self.device = device
        self.calls: dict[str, list] = {k: [] for k in BYTES}
        self.untimed: dict[str, int] = {k: 0 for k in BYTES}
        clock_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_980_000
        self.spin_cycles = int(SPIN_S * clock_khz * 1e3)

    def __getattr__(self, attr):
        if attr not in BYTES:
            return getattr(self.inner, attr)
        fn = getattr(self.inner, attr)
        calls = self.calls[attr]
        count = BYTES[attr]
        untimed = self.untimed

        seen = [0]

        def timed(*args, **kwargs):
            seen[0] += 1
            if seen[0] > TIME_FIRST and seen[0] % TIME_EVERY:  # sampled out: no spin, no events
                untimed[attr] += 1
                return fn(*args, **kwargs)
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
        """Per kernel: calls, total/median/p90 time, bytes, GB/s and % of the copy ceiling."""
        torch.cuda.synchronize(self.device)
        ceiling = copy_ceiling(self.device)
        rows = []
        for name, calls in self.calls.items():
            if not calls:
                if self.untimed[name]:
                    rows.append({"kernel": name, "calls": 0, "untimed": self.untimed[name], "total_s": 0.0,
                                 "median_us": 0.0, "p90_us": 0.0, "bytes": 0, "GBps": 0.0, "pct_copy_ceiling": 0.0})
                continue
            times = sorted(s.elapsed_time(e) * 1e-3 for s, e, _ in calls)
            total = sum(times)
            nbytes = sum(b() if callable(b) else b for _, _, b in calls)
            rate = nbytes / total if total else 0.0
            rows.append({"kernel": name, "calls": len(calls), "untimed": self.untimed[name], "total_s": total,
                         "median_us": 1e6 * times[len(times) // 2],
                         "p90_us": 1e6 * times[min(len(times) - 1, int(0.9 * len(times)))],
                         "bytes": nbytes, "GBps": rate / 1e9, "pct_copy_ceiling": 100 * rate / ceiling})
        return {"device": torch.cuda.get_device_name(self.device), "copy_ceiling_TBps": ceiling / 1e12,
                "kernels": rows}
