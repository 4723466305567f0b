"""Check results read back one step late, so the device and the host overlap.

A step's checks end in device tensors (mismatch counts, error maxima) that the host must
read to tally. Reading them at once makes the host wait for the step's oracle, and the
device then idles while the host prepares the next step. With a lag of one step the host
queues step n+1's work first and only then reads step n's verdicts, which by then are
(mostly) done. Tallies happen in the same order as without the lag; only later.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable

import torch


class Verdicts:
    def __init__(self, lag: int):
        self.lag = lag
        self.current: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self.queue: list[list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]] = []
        self.wait_s = 0.0  # time spent reading results back and tallying them

    def add(self, result: torch.Tensor, tally: Callable[[torch.Tensor], None]) -> None:
        """``tally`` gets ``result`` on the host once it is read back (at once without a lag)."""
        if self.lag == 0:
            self._resolve([(result, tally)])
        else:
            self.current.append((result, tally))

    def end_step(self) -> None:
        self.queue.append(self.current)
        self.current = []
        while len(self.queue) > self.lag:
            self._resolve(self.queue.pop(0))

    def drain(self) -> None:
        """Every pending step's tallies, in step order (the run's end, or before reporting)."""
        if self.current:
            self.end_step()
        while self.queue:
            self._resolve(self.queue.pop(0))

    def _resolve(self, items) -> None:
        t0 = perf_counter()
        try:
            for result, tally in items:
                tally(result.cpu())
        finally:
            self.wait_s += perf_counter() - t0
