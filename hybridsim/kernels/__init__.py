"""Kernel providers behind one interface; ``reference`` (plain torch) is always available."""

from __future__ import annotations

from .reference import ReferenceKernels

PROVIDERS = {"reference": ReferenceKernels}


def get_kernels(name: str):
    """The provider called ``name``; raises KeyError for one this build does not have."""
    return PROVIDERS[name]()
