"""Sweeps: many scenarios, seeds and traces across cores (a process pool) or machines (Ray).

A notebook uses the same pieces as ``hybridsim sweep``::

    from hybridsim.sweep import load_sweep, run_sweep
    res = run_sweep(load_sweep("scenarios/sweeps/tiny_grid.yaml"), Path("out"), workers=2)
    res.frame  # one row per cell (pandas)

The names load on first use: ``replay -j`` and ``sweep`` start the process pool's forkserver
(``sweep.pool``) before anything heavy is imported, and pandas alone takes a third of a second.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"SweepResult": ".run", "backend_for": ".run", "run_sweep": ".run",
          "Cell": ".spec", "Sweep": ".spec", "load_sweep": ".spec"}

__all__ = ["Cell", "Sweep", "SweepResult", "backend_for", "load_sweep", "run_sweep"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
