"""The host process: the cores it may use, and the C allocator's settings for a replay's host memory
(glibc only; elsewhere nothing changes).

A checked CPU replay frees and allocates the same few large tensors every step. With glibc's default
settings, every tensor over 128 KiB is a fresh ``mmap`` (zeroed pages, one page fault per 4 KiB), and
memory freed at the top of the heap goes back to the kernel at once, so the next step faults it in
again. Measured on the 2-core dev machine (``mla_long_context``, one torch thread): 1.5 million page
faults and 2.6 s of system time in a 7.5 s replay; with the settings below, 0.3 million and 0.5 s.
A fresh process pays this in full, so it mattered most for ``replay -j`` and sweeps (a process per
trace or cell), but a serial replay gains too.

The settings: blocks up to 32 MiB come from the heap (glibc's largest mmap threshold), and up to
256 MiB of freed heap stays with the process for the next step. Someone who set the allocator
through the environment (``MALLOC_*_``, ``GLIBC_TUNABLES``) keeps their settings.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20

_done = False


def usable_cores() -> int:
    """The cores this process may run on (a container's or a ``taskset``'s share, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def tune_malloc() -> bool:
    """Apply the settings once per process (a forked child inherits them); True where they apply."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or _user_settings():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # (glibc; musl has no mallopt)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    _done = ok
    return ok


def _user_settings() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ)
