"""The local backend: every job in its own process, at most ``workers`` at a time.

Not ``concurrent.futures``: one dead worker breaks a ``ProcessPoolExecutor`` and every job
still pending in it. Here each job has its own process and pipe; a process that ends
without sending its result died, its job is retried once, and the other jobs never notice.
Processes fork from a ``forkserver`` that has imported torch and the engine once, so a job
costs a fork, not an interpreter start (about 2 s of imports on the dev machine).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from multiprocessing.connection import Connection, wait
from time import perf_counter
from typing import Callable, Iterable, Iterator, Optional

from .jobs import DIED, Job, Outcome, guarded, set_threads

PRELOAD = ["hybridsim.sweep.cell"]  # imports torch, the planner and the executor


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _child(job: Job, conn: Connection, threads: Optional[int]) -> None:
    set_threads(threads)
    conn.send(guarded(job.fn, job.arg))
    conn.close()


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


def run_local(jobs: Iterable[Job], workers: int, retries: int = 1) -> Iterator[Outcome]:
    """Run jobs in separate processes, yielding each outcome as it finishes (not in order)."""
    ctx = _context()
    threads = 1  # (see set_threads)
    pending: deque[tuple[Job, int]] = deque((j, 1) for j in jobs)
    running: dict[Connection, tuple[Job, int, mp.process.BaseProcess, float]] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                job, attempt = pending.popleft()
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(job, send, threads), daemon=True)
                proc.start()
                send.close()  # (the child holds the only write end: its death is EOF here)
                running[recv] = (job, attempt, proc, perf_counter())
            for conn in wait(list(running)):
                job, attempt, proc, t0 = running.pop(conn)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    kind, value = DIED, None
                conn.close()
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
        for _, _, proc, _ in running.values():  # (interrupted: leave no orphans)
            proc.kill()
            proc.join()


def _death(exitcode: Optional[int], attempts: int) -> str:
    how = f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit status {exitcode}"
    return f"the worker process died {attempts} times ({how})"


Runner = Callable[[list[Job]], Iterator[Outcome]]
