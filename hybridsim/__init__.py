"""hybridsim: simulate, execute and check LLM-serving schedules for hybrid and MLA models."""

import os as _os

# torch's OpenMP threads (GNU libgomp in the Linux wheels) spin for a while after each parallel
# region before they sleep. A checked run on a CPU is thousands of small operations, so with
# the default spin they spin most of the time; on a machine whose other cores are busy the
# spinning takes the time the work needed and a run goes 5-10x slower. A short spin keeps
# nearly all of the default's speed on a quiet machine and stays as fast as not spinning at all
# on a busy one (bench/history/2026-11-25_sessions-17-20.md, session 19). Takes effect only if torch is imported after hybridsim (the
# CLI always is); settings the user made are kept.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "5000"

__version__ = "0.1.0"
