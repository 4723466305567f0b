"""Each executor phase's time on the host and, on a GPU, on the device, without waiting for it.

The host's clock around a phase measures launching its work, and whatever wait for the device
happens inside it: on a GPU, where a phase's kernels run after the host has moved on, it says little
about what the phase costs the device (``deepseek_v3_mooncake`` on an H200: 85 ms a step of host time
in its MLA layers against about 120 on the device, 100 in the oracle against about 70). Here a phase
also records a CUDA event on the current stream where it starts and where it ends; the device time
between the two is the phase's, read once the end event has completed (at a later step's end, or at
the run's), so nothing waits for it. A phase's device time includes the device idling while the host
launches its work; kernels of other streams running meanwhile are not in it. Phases must not nest
(their device times would count twice).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from time import perf_counter
from typing import Iterator, Optional

import torch


class PhaseClock:
    def __init__(self, device: torch.device, phases: tuple[str, ...] = ()):
        self.host: dict[str, float] = dict.fromkeys(phases, 0.0)  # seconds, by phase (in the order declared)
        self.cuda = torch.device(device).type == "cuda"
        # seconds on the device, by phase (GPU only; phases whose events are still pending not yet added)
        self.device: Optional[dict[str, float]] = dict.fromkeys(phases, 0.0) if self.cuda else None
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._inside: Optional[str] = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._inside is not None:
            raise RuntimeError(f"phase {name!r} inside phase {self._inside!r}: phases do not nest")
        self._inside = name
        t0 = perf_counter()
        start = None
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            yield
        finally:
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
            self.host[name] = self.host.get(name, 0.0) + perf_counter() - t0
            self._inside = None

    def collect(self, wait: bool = False) -> None:
        """Add the device times of phases whose end has completed, oldest first (one stream: they complete
        in order); ``wait``: every phase's, waiting for the device (the run's end)."""
        while self._pending:
            name, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self.device[name] = self.device.get(name, 0.0) + start.elapsed_time(end) * 1e-3
