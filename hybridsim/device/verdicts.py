"""Check results read back one step late, so the device and the host overlap.

A step's checks end in device tensors (mismatch counts, error maxima) that the host must
read to tally. Reading them at once makes the host wait for the step's oracle, and the
device then idles while the host prepares the next step. With a lag of one step the
copies of step n's results to pinned host memory are queued right behind step n's work,
with an event after them; the host reads them at the end of step n+1, waiting for that
event only, so step n+1's work stays queued on the device while the host prepares step
n+2. (A plain ``.cpu()`` there would queue its copy behind step n+1's work and wait for
all of it: no overlap at all.) Tallies happen in the same order as without the lag; only
later.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable, Optional

import torch

from .transfer import events_after

Tally = Callable[[torch.Tensor], None]
Item = tuple[torch.Tensor, Tally, Optional[torch.cuda.Stream]]  # (result, its tally, the stream that made it)


class Verdicts:
    def __init__(self, lag: int):
        self.lag = lag
        self.current: list[Item] = []
        # per step: its results on their way to the host, and the events after their copies
        self.queue: list[tuple[list[tuple[torch.Tensor, Tally]], list[torch.cuda.Event]]] = []
        self.wait_s = 0.0  # time spent waiting for the device to finish a step whose results are due
        self.tally_s = 0.0  # time spent reading results back and tallying them

    def add(self, result: torch.Tensor, tally: Tally) -> None:
        """``tally`` gets ``result`` on the host once it is read back (at once without a lag). A device
        result is copied on the stream current here, the one whose work made it."""
        item = (result, tally, torch.cuda.current_stream(result.device) if result.is_cuda else None)
        if self.lag == 0:
            self._resolve(_start_copies([item]))
        else:
            self.current.append(item)

    def end_step(self) -> None:
        """The step's results start for the host, behind its work; steps past the lag are tallied."""
        self.queue.append(_start_copies(self.current))
        self.current = []
        while len(self.queue) > self.lag:
            self._resolve(self.queue.pop(0))

    def drain(self) -> None:
        """Every pending step's tallies, in step order (the run's end, or before reporting)."""
        if self.current:
            self.end_step()
        while self.queue:
            self._resolve(self.queue.pop(0))

    def _resolve(self, pending) -> None:
        t0 = perf_counter()
        items, done = pending
        try:
            for event in done:
                event.synchronize()
        finally:
            t1 = perf_counter()
            self.wait_s += t1 - t0
        try:
            for result, tally in items:
                tally(result)
        finally:
            self.tally_s += perf_counter() - t1


def _start_copies(items: list[Item]):
    """Queue each device result's copy into pinned host memory on the stream that made it (no wait)
    and record an event after the copies on each of those streams; host results are kept as they are."""
    out, streams = [], {}
    for result, tally, stream in items:
        if stream is not None:
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(result, non_blocking=True)
            streams[stream.cuda_stream] = stream
            result = host
        out.append((result, tally))
    return out, events_after(streams.values())
