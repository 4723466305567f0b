"""Kernel providers behind one interface, found by name. Torch-free (it lives outside the kernels
package, whose import loads torch): the scenario schema and a sweep's driver check provider names
with it.

``reference`` (plain torch) is always available and is every kernel's oracle.
``triton`` runs hybridsim's Triton kernels on a GPU, or under the Triton interpreter on a
machine without CUDA (set before the kernels are defined, small sizes only).
``vllm`` runs the installed vLLM's own kernels op by op (``vllm_engine.py``).

Other packages add providers without touching hybridsim: an entry point in the group
``hybridsim.kernels`` names a provider class (a ``ReferenceKernels`` subclass; the ops it does
not override stay the reference's), e.g. in the plugin's pyproject.toml::

    [project.entry-points."hybridsim.kernels"]
    flashinfer = "my_package.hybridsim_provider:FlashInferKernels"
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

ENTRY_POINT_GROUP = "hybridsim.kernels"

# Every op a provider may supply; the executor calls nothing else.
OPS = ("state_copy", "mamba_scan", "concat_and_cache", "gather_cache", "reshape_and_cache", "paged_attention",
       "merge_states", "attention_partial", "mla_decode")


def _reference():
    from .kernels.reference import ReferenceKernels

    return ReferenceKernels


def _triton():
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .kernels.triton_kernels import TritonKernels

    return TritonKernels


def _vllm():
    _triton()  # (the interpreter switch, and the fallback ops' module)
    from .kernels.vllm_engine import VllmKernels

    return VllmKernels


@dataclass(frozen=True)
class Provider:
    name: str
    load: Callable[[], type]  # the provider class (imports happen here, not at listing)
    origin: str  # "built in" or the distribution and entry point that registered it


BUILT_IN = {
    "reference": Provider("reference", lambda: _reference(), "built in"),
    "triton": Provider("triton", _triton, "built in"),
    "vllm": Provider("vllm", _vllm, "built in (the installed vLLM's kernels)"),
}


def _entry_points() -> dict[str, Provider]:
    from importlib.metadata import entry_points

    out = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILT_IN or ep.name == "auto":
            continue  # a plugin cannot shadow a built-in provider
        dist = getattr(ep, "dist", None)
        owner = f"{dist.name} {dist.version}" if dist is not None else "a plugin"
        out[ep.name] = Provider(ep.name, ep.load, f"{owner} ({ep.value})")
    return out


def providers() -> dict[str, Provider]:
    """Every provider this environment has: the built-in ones, then plugins by name."""
    found = dict(BUILT_IN)
    found.update(sorted(_entry_points().items()))
    return found


def provider_names() -> tuple[str, ...]:
    return tuple(providers())


def get_kernels(name: str):
    """An instance of the provider called ``name``. KeyError for a name no provider has;
    ImportError (with a sentence saying how to get it) for one that cannot load here."""
    from .kernels.reference import ReferenceKernels

    cls = providers()[name].load()
    if not (isinstance(cls, type) and issubclass(cls, ReferenceKernels)):
        raise ImportError(f"provider {name!r} ({providers()[name].origin}) is not a ReferenceKernels subclass")
    return cls()


def op_sources(k) -> dict[str, str]:
    """Whose code each op runs, for a provider instance: its own ``op_sources`` where it keeps
    one (the vLLM provider knows which engine function each op called), else the class that
    defines the op's method."""
    own = getattr(k, "op_sources", None)
    if callable(own):
        return own()
    out = {}
    for op in OPS:
        owner = next(c for c in type(k).__mro__ if op in c.__dict__)
        out[op] = getattr(owner, "name", owner.__name__)
    return out
