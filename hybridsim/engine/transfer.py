"""Host-to-device uploads of the small index tensors a step builds."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-built index tensors go up asynchronously (pinned staging): no stream sync."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
