"""hybridsim: simulate, execute and check LLM-serving schedules for hybrid and MLA models."""

import os as _os

# torch's OpenMP threads otherwise spin between parallel regions. A checked run on a CPU is
# thousands of small operations, so they spin most of the time; on a machine whose cores are
# busy with other work the spinning takes those cores and a run goes 5-10x slower (measured in
# bench/RESULTS.md). Waiting threads sleep instead. Takes effect only if torch is imported
# after hybridsim (the CLI always is); a value the user set is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
