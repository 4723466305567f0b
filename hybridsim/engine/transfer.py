"""Host-to-device uploads of the small index tensors a step builds.

A copy from ordinary (pageable) host memory makes the host wait for the device's queue
to drain, which would serialise host and device at every upload; from pinned memory with
``non_blocking`` it is queued like a kernel and the host runs on.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, without waiting for the device (pinned staging)."""
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def upload(data, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A list, numpy array or host tensor as a ``dtype`` tensor on ``device`` (see ``to_device``)."""
    if isinstance(data, torch.Tensor):
        t = data.to(dtype)
    elif isinstance(data, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
    else:
        t = torch.tensor(data, dtype=dtype)
    return to_device(t, device)
