"""What a backend runs and what it hands back: plain data, the same for processes and Ray tasks.

A job's function never raises into the backend: ``guarded`` turns our error types into an
outcome kind, so a bad cell, a missing device and a bug in a cell are told apart from a
worker that died (killed, segfault, node lost), which is the only thing a backend retries.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

# outcome kinds
OK, INPUT, ENVIRONMENT, ERROR, DIED = "ok", "input", "environment", "error", "died"


@dataclass(frozen=True)
class Job:
    key: str
    fn: Callable[[Any], Any]  # a module-level function (pickled by reference)
    arg: Any
    gpu: bool = False  # a Ray task asks for one GPU


@dataclass
class Outcome:
    key: str
    kind: str  # ok | input | environment | error | died
    value: Any = None
    message: str = ""  # what went wrong (not ok)
    attempts: int = 1
    seconds: float = 0.0  # from submission to result, as the driver saw it


def guarded(fn: Callable[[Any], Any], arg: Any) -> tuple[str, Any]:
    """Call ``fn(arg)`` and classify how it ended (runs in the worker)."""
    from ..errors import EnvironmentProblem, InputError

    try:
        return OK, fn(arg)
    except InputError as e:
        return INPUT, str(e)
    except EnvironmentProblem as e:
        return ENVIRONMENT, str(e)
    except MemoryError:
        return ENVIRONMENT, "out of memory"
    except Exception as e:  # a bug in a cell: reported in its row, the others go on
        tb = traceback.extract_tb(e.__traceback__)
        at = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
        return ERROR, f"{type(e).__name__}: {e}{at}"


def runs_on_gpu(execution: dict) -> bool:
    """Whether a run with these execution settings (a sweep cell's ``execution`` section, or a fanned-out
    replay's keyword arguments) runs kernels on a GPU where there is one: checks on, and device cuda or
    auto, with the scenario schema's defaults for what is not set. One rule for the local pool's GPU
    workers and Ray's GPU requests."""
    from ..config import ExecutionSection

    fields = ExecutionSection.model_fields
    device = execution.get("device", fields["device"].default)
    return execution.get("check", fields["check"].default) != "off" and device in ("cuda", "auto")


def set_threads(threads: Optional[int]) -> None:
    """One torch thread per cell: cells are the parallel unit, and a cell's tensors are small. Measured
    on the 2-core machine with another process busy: two torch threads per cell made the tiny grid's
    cells take 9-74 s instead of 1-3 s (the threads wait on each other for a core)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def exit_on_signals() -> None:
    """Make SIGTERM (a batch scheduler's time limit, ``kill``) unwind this process like an exception,
    so that the rows written so far get their results.parquet, workers are stopped and a Ray instance
    started here shuts down; exit status 143 (128 + SIGTERM). Ctrl-C (SIGINT) still raises
    KeyboardInterrupt, but both wait for a ``signals_held`` section to end. Only from the main thread,
    and only where nobody chose other handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_exit)


_held = 0  # (inside ``signals_held``: a signal is noted, and raised when the section ends)
_noted: Optional[BaseException] = None


def _raise_exit(signum: int, frame: Any) -> None:
    global _noted
    exc = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
    if _held:
        _noted = _noted or exc
        return
    raise exc


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGTERM's exit (and Ctrl-C's) until the section ends: starting a worker and recording it
    is one step, so a worker is never started without the driver knowing it must be stopped, nor
    left reading half of its job. (A signal mask would not do: Python runs handlers in the main
    thread whichever thread the signal reached.)"""
    global _held, _noted
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _noted is not None:
            exc, _noted = _noted, None
            raise exc
