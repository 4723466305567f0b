"""The head every kernel test module shares: the Triton interpreter where there is no GPU (set
before any kernel module is imported, so import this first), the reference provider and a
Triton provider that poisons its outputs (an element a kernel fails to write shows as NaN), and
the device the tests run on."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels.reference import ReferenceKernels  # noqa: E402
from hybridsim.kernels.triton_kernels import TritonKernels  # noqa: E402

REF = ReferenceKernels()
TRI = TritonKernels(poison=True)
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
