"""Each executor phase's time on the host and, on a GPU, on the device, without waiting for it.

The host's clock around a phase measures launching its work, and whatever wait for the device
happens inside it: on a GPU, where a phase's kernels run after the host has moved on, it says little
about what the phase costs the device (``deepseek_v3_mooncake`` on an H200: 54 ms a step of host time
in its MLA layers against 84 on the device, 99 in the oracle against 70). Here a phase
also records a CUDA event on the current stream where it starts and where it ends; the device time
between the two is the phase's, read once the end event has completed (at a later step's end, or at
the run's), so nothing waits for it. A phase's device time includes the device idling while the host
launches its work; kernels of other streams running meanwhile are not in it. A phase may run inside
another (the kernel checks' references inside a layer's forward): its time is its own, and comes off the
outer phase's, so the phases add up to the time they cover.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Iterator, Optional

import torch


@dataclass
class _Open:
    """A phase under way: its start, and the phases run inside it (their whole spans come off its time)."""

    name: str
    t0: float
    start: Optional[torch.cuda.Event]
    inner_host: float = 0.0
    inner: list = field(default_factory=list)  # (start, end) event pairs of the phases directly inside


class PhaseClock:
    def __init__(self, device: torch.device, phases: tuple[str, ...] = ()):
        self.host: dict[str, float] = dict.fromkeys(phases, 0.0)  # seconds, by phase (in the order declared)
        self.cuda = torch.device(device).type == "cuda"
        # seconds on the device, by phase (GPU only; phases whose events are still pending not yet added)
        self.device: Optional[dict[str, float]] = dict.fromkeys(phases, 0.0) if self.cuda else None
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event, list]] = deque()
        self._open: list[_Open] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time what runs inside as phase ``name``. A phase entered inside another takes its time out of the
        outer one's (each phase's figures are its own work); entered inside itself, it is the same phase."""
        if self._open and self._open[-1].name == name:
            yield
            return
        start = None
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        me = _Open(name, perf_counter(), start)
        self._open.append(me)
        try:
            yield
        finally:
            self._open.pop()
            took = perf_counter() - me.t0
            self.host[name] = self.host.get(name, 0.0) + took - me.inner_host
            outer = self._open[-1] if self._open else None
            if outer is not None:
                outer.inner_host += took
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end, me.inner))
                if outer is not None:
                    outer.inner.append((start, end))

    def collect(self, wait: bool = False) -> None:
        """Add the device times of phases whose end has completed, oldest first (one stream: they complete
        in order, an inner phase before the one around it); ``wait``: every phase's, waiting for the device
        (the run's end)."""
        while self._pending:
            name, start, end, inner = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            took = start.elapsed_time(end) - sum(s.elapsed_time(e) for s, e in inner)
            self.device[name] = self.device.get(name, 0.0) + took * 1e-3
