"""Kernel providers behind one interface.

``reference`` (plain torch) is always available and is every kernel's oracle.
``triton`` runs the Triton kernels on a GPU, or under the Triton interpreter on a
machine without CUDA (set before the kernels are defined, small sizes only).
"""

from __future__ import annotations

import os

from .reference import ReferenceKernels


def _triton():
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .triton_kernels import TritonKernels

    return TritonKernels


PROVIDERS = {"reference": lambda: ReferenceKernels, "triton": _triton}


def get_kernels(name: str):
    """The provider called ``name``; raises KeyError for one this build does not have."""
    return PROVIDERS[name]()()
