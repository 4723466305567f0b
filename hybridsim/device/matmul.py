"""Float32 matrix products on the tensor cores (TF32) for a block of code: the executor's
low-precision paths, and exact integer products whose inputs TF32 holds exactly."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def matmul_tf32(enabled: bool = True):
    """Allow TF32 float32 matrix products inside the block (restored after)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled or before
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
