"""Sweeps: many scenarios, seeds and traces across cores (a process pool) or machines (Ray).

A notebook uses the same pieces as ``hybridsim sweep``::

    from hybridsim.sweep import load_sweep, run_sweep
    res = run_sweep(load_sweep("scenarios/sweeps/tiny_grid.yaml"), Path("out"), workers=2)
    res.frame  # one row per cell (pandas)
"""

from .run import SweepResult, backend_for, run_sweep
from .spec import Cell, Sweep, load_sweep

__all__ = ["Cell", "Sweep", "SweepResult", "backend_for", "load_sweep", "run_sweep"]
