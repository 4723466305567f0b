"""Host-to-device uploads of the small index tensors a step builds.

A copy from ordinary (pageable) host memory makes the host wait for the device's queue
to drain, which would serialise host and device at every upload; from pinned memory with
``non_blocking`` it is queued like a kernel and the host runs on. Pinning a fresh buffer
per upload costs more than the copy itself (a step makes dozens), so small uploads are
staged through one pinned ring per device (``PinnedRing``), reused once the device has
read it.
"""

from __future__ import annotations

import numpy as np
import torch

RING_SEGMENT = 1 << 21  # bytes; uploads larger than this are pinned on their own
RING_SEGMENTS = 4
ALIGN = 64


class PinnedRing:
    """Pinned host memory in ``RING_SEGMENTS`` segments, filled in turn. Leaving a segment
    records an event after the copies that read it, on each stream that queued one; coming
    back to it waits for those events (long done in practice: three segments of uploads were
    queued since)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buf = torch.empty(RING_SEGMENT * RING_SEGMENTS, dtype=torch.uint8, pin_memory=True)
        self.bytes = self.buf.numpy()
        self.done: list[list] = [[] for _ in range(RING_SEGMENTS)]
        self.streams: dict = {}  # the streams that queued copies from the segment being filled, by handle
        self.seg, self.off = 0, 0

    def put(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        n = a.nbytes
        if self.off + n > RING_SEGMENT:
            self.done[self.seg] = events_after(self.streams.values())
            self.streams = {}
            self.seg = (self.seg + 1) % RING_SEGMENTS
            self.off = 0
            for ev in self.done[self.seg]:
                ev.synchronize()
        stream = torch.cuda.current_stream(self.device)
        self.streams[stream.cuda_stream] = stream
        start = self.seg * RING_SEGMENT + self.off
        self.bytes[start:start + n] = a.reshape(-1).view(np.uint8)
        self.off += -(-n // ALIGN) * ALIGN
        host = self.buf[start:start + n].view(dtype).reshape(a.shape)
        return host.to(self.device, non_blocking=True)


_RINGS: dict[torch.device, PinnedRing] = {}


_NP_DTYPES: dict = {}


def events_after(streams) -> list:
    """One CUDA event recorded on each of ``streams``, after the work queued there so far."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


def _numpy_dtype(dtype: torch.dtype):
    if dtype not in _NP_DTYPES:
        try:
            _NP_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # (bfloat16 and others numpy lacks)
            _NP_DTYPES[dtype] = None
    return _NP_DTYPES[dtype]


def _stage(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if a.size == 0:
        return torch.empty(a.shape, dtype=dtype, device=device)
    if a.nbytes > RING_SEGMENT:
        return torch.from_numpy(a).pin_memory().to(device, non_blocking=True)
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = PinnedRing(device)
    return ring.put(a, dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a host tensor without waiting for the device (pinned staging), a tensor
    already on a device moved as torch moves it."""
    device = torch.device(device)
    if t.device.type != "cpu":
        return t.to(device)
    if device.type != "cuda":
        return t
    np_dtype = _numpy_dtype(t.dtype)
    if np_dtype is None:
        return t.pin_memory().to(device, non_blocking=True)
    return _stage(np.ascontiguousarray(t.numpy()), t.dtype, device)


def upload(data, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A list, numpy array or host tensor as a ``dtype`` tensor on ``device`` (see ``to_device``)."""
    device = torch.device(device)
    np_dtype = _numpy_dtype(dtype)
    if device.type == "cuda" and np_dtype is not None:
        a = data.to(dtype).numpy() if isinstance(data, torch.Tensor) else np.asarray(data, dtype=np_dtype)
        return _stage(np.ascontiguousarray(a), dtype, device)
    if isinstance(data, torch.Tensor):
        t = data.to(dtype)
    elif isinstance(data, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
    else:
        t = torch.tensor(data, dtype=dtype)
    return to_device(t, device)


def upload_many(arrays: list, device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Several host arrays as ``dtype`` tensors on ``device`` in one upload. Each starts on a
    16-byte boundary of the shared buffer, as a separately allocated tensor would (Triton
    specialises a kernel on its pointers' alignment)."""
    parts = [np.asarray(a, dtype=_numpy_dtype(dtype)) for a in arrays]
    per = max(1, 16 // torch.empty(0, dtype=dtype).element_size())
    sizes = [-(-p.size // per) * per for p in parts]
    flat = np.zeros(sum(sizes), dtype=_numpy_dtype(dtype))
    at = 0
    for p, n in zip(parts, sizes):
        flat[at:at + p.size] = p.reshape(-1)
        at += n
    whole = upload(flat, device, dtype)
    out, at = [], 0
    for p, n in zip(parts, sizes):
        out.append(whole[at:at + p.size].view(p.shape))
        at += n
    return out
