"""The local backend: every job in its own process, at most ``workers`` at a time.

Not ``concurrent.futures``: one dead worker breaks a ``ProcessPoolExecutor`` and every job
still pending in it. Here each job has its own process and pipe; a process that ends
without sending its result died, its job is retried once, and the other jobs never notice.
Processes fork from a ``forkserver`` that has imported torch and the engine once, so a job
costs a fork, not an interpreter start (about 2 s of imports on the dev machine).
"""

from __future__ import annotations

import _thread
import multiprocessing as mp
import os
import signal
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from time import perf_counter
from typing import Callable, Iterable, Iterator, Optional

from ..hostmem import tune_malloc
from .jobs import DIED, Job, Outcome, guarded, set_threads, sigterm_held

# torch, the planner and the executor (what a cell and a golden trace run; sweep/cell.py itself is
# light); the CLI, which a child of the `hybridsim` script imports again as its __main__ (0.04 s a
# job otherwise); constant tables (sweep/preload.py)
PRELOAD = ["hybridsim.runner", "hybridsim.execute", "hybridsim.golden", "hybridsim.sweep.cell", "hybridsim.cli",
           "hybridsim.sweep.preload"]


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _child(job: Job, conn: Connection, threads: Optional[int], more: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the whole group: the driver stops jobs)
    tune_malloc()
    set_threads(threads)
    sent = threading.Event()
    _listen_to_driver(more, sent)
    result = guarded(job.fn, job.arg)
    sent.set()  # (from here a closed pipe is the driver's normal goodbye)
    try:
        conn.send(result)
        conn.close()
    except OSError:  # (the driver is gone: nobody wants the result, and there is nobody to tell)
        os._exit(1)


def _listen_to_driver(more: Connection, sent: threading.Event) -> None:
    """A helper thread takes what the driver says on ``more``. A number: cores came free, raise this
    job's torch threads (``run_local``); the main thread sets it (torch's thread count is the calling
    thread's), in a signal handler that Python runs between two of the job's operations. The pipe
    closing before the result is sent: the driver is gone (SIGKILL, out of memory) or gave the job up,
    so the job ends at once rather than running on for nobody. (A forkserver child holds the
    forkserver's lifeline pipe itself, so the forkserver cannot outlive it, nor end it.)"""
    want = [0]

    def apply(signum, frame) -> None:
        if want[0]:
            set_threads(want[0])

    signal.signal(signal.SIGUSR1, apply)

    def listen() -> None:
        try:
            while True:
                want[0] = int(more.recv())
                _thread.interrupt_main(signal.SIGUSR1)  # (no signal is sent: the handler is just run)
        except (EOFError, OSError):
            if not sent.is_set():
                os._exit(1)

    threading.Thread(target=listen, name="hybridsim-driver", daemon=True).start()


def _context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")  # pragma: no cover - not POSIX


def warm_up() -> None:
    """Start the forkserver now, so that its imports overlap the caller's own work (validating
    cells) instead of delaying the first job."""
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


@dataclass
class _Running:
    job: Job
    attempt: int
    proc: mp.process.BaseProcess
    more: Connection  # (the driver's end: a larger torch thread count for the job)
    t0: float
    threads: int


def run_local(jobs: Iterable[Job], workers: int, retries: int = 1) -> Iterator[Outcome]:
    """Run jobs in separate processes, yielding each outcome as it finishes (not in order).

    Each job starts with one torch thread (``set_threads``). Once no job is waiting, the cores of
    the finished ones go to those still running (with -j 2, the last job gets two threads), so a
    long job at the end does not run on one core while the other idles."""
    ctx = _context()
    threads = 1  # (see set_threads)
    cores = max(1, min(workers, default_workers()))
    pending: deque[tuple[Job, int]] = deque((j, 1) for j in jobs)
    running: dict[Connection, _Running] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                job, attempt = pending.popleft()
                with sigterm_held():  # (a child started is a child in `running`, which `finally` stops)
                    recv, send = ctx.Pipe(duplex=False)
                    more_r, more_w = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_child, args=(job, send, threads, more_r), daemon=True)
                    proc.start()
                    send.close()  # (the child holds the only write end: its death is EOF here)
                    more_r.close()
                    running[recv] = _Running(job, attempt, proc, more_w, perf_counter(), threads)
            _share_cores(running, pending, cores)
            for conn in wait(list(running)):
                r = running.pop(conn)
                job, attempt, proc, t0 = r.job, r.attempt, r.proc, r.t0
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    kind, value = DIED, None
                conn.close()
                r.more.close()
                proc.join()
                if kind == DIED:
                    if attempt <= retries:
                        pending.appendleft((job, attempt + 1))
                        continue
                    yield Outcome(job.key, DIED, message=_death(proc.exitcode, attempt), attempts=attempt,
                                  seconds=perf_counter() - t0)
                    continue
                yield Outcome(job.key, kind, value if kind == "ok" else None,
                              "" if kind == "ok" else str(value), attempt, perf_counter() - t0)
    finally:
        for r in running.values():  # (interrupted: leave no orphans)
            r.proc.kill()
            r.proc.join()
            r.more.close()


def _share_cores(running: dict[Connection, _Running], pending: deque, cores: int) -> None:
    """No job waiting: the running jobs share the pool's cores (more threads, never fewer)."""
    if pending or not running:
        return
    share = max(1, cores // len(running))
    for r in running.values():
        if share > r.threads:
            try:
                r.more.send(share)
                r.threads = share
            except OSError:  # (it has just finished)
                pass


def _death(exitcode: Optional[int], attempts: int) -> str:
    how = f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit status {exitcode}"
    return f"the worker process died {attempts} times ({how})"


Runner = Callable[[list[Job]], Iterator[Outcome]]
