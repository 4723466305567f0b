"""Kernel variants built while a loop ran: what a run's wall time includes besides its work.

Triton builds a kernel the first time a launch meets a new specialisation (its constexprs, and
each integer argument's class: 1, a multiple of 16, other), compiling it or loading it from its
disk cache, inside whatever timed loop made the launch. A first run on a machine compiles for
tens of seconds inside its loop; a count that changes class between steps compiled a kernel
again in the middle of a real-scale run (bench/history/2026-11-27_session29.md). Counting the
variants held in memory before and after a loop says whether the loop's time includes building.
"""

from __future__ import annotations

import os
import sys

# modules whose kernels a run may launch: hybridsim's own, and the engine's (``--kernels vllm``)
PREFIXES = ("hybridsim.", "vllm.")


def held_variants(prefixes: tuple[str, ...] = PREFIXES):
    """(module name, kernel, its built variants) for every loaded Triton or Gluon kernel defined in a
    module under ``prefixes`` that holds any: what this process built (compiled, or loaded from
    Triton's cache). A kernel imported into another module is listed once, under the module that
    defines it. Nothing where Triton is not loaded."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(prefixes):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, jit.JITFunction) and obj.fn.__module__ == mod_name:
                built = [k for caches in getattr(obj, "device_caches", {}).values()
                         for k in _kernel_cache(caches).values()]
                if built:
                    yield mod_name, obj, built


def built_variants() -> dict[str, int]:
    """Variants in memory now, per loaded Triton or Gluon kernel ('module.name'). Empty where Triton
    is not loaded (no kernel was built, and a run with the reference kernels need not pay its import,
    a third of a second); kernels under Triton's interpreter build nothing."""
    return {f"{mod_name.rsplit('.', 1)[-1]}.{obj.fn.__name__}": len(built)
            for mod_name, obj, built in held_variants()}


def _kernel_cache(entry) -> dict:
    """A device's entry in ``JITFunction.device_caches``: a tuple whose first dict maps a
    specialisation to its built kernel (Triton 3.x), or that dict itself."""
    if isinstance(entry, dict):
        return entry
    return next((c for c in entry if isinstance(c, dict)), {}) if isinstance(entry, tuple) else {}


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Variants built between two counts, per kernel (kernels that built none left out)."""
    return {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n > before.get(k, 0)}


def cache_entries() -> set[str] | None:
    """The entries of Triton's disk cache (each a compiled kernel variant or launcher): a loop that
    adds entries compiled them, one that adds none loaded what it built. None where Triton is not
    loaded or has no such cache (older versions, another cache manager)."""
    knobs = sys.modules.get("triton.knobs")
    if knobs is None or getattr(getattr(knobs, "cache", None), "manager_class", None) is not None:
        return None
    try:
        folder = knobs.cache.dir
        return set(os.listdir(folder)) if os.path.isdir(folder) else set()
    except Exception:
        return None
