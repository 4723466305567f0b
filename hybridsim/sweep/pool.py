"""The local backend: every job in its own process, at most ``workers`` at a time.

Not ``concurrent.futures``: one dead worker breaks a ``ProcessPoolExecutor`` and every job
still pending in it. Here each job has its own process and pipe; a process that ends
without sending its result died, its job is retried once, and the other jobs never notice.
Processes fork from a ``forkserver`` that has imported torch and the engine once, so a job
costs a fork, not an interpreter start (about 2 s of imports on the dev machine).

Jobs that run kernels on a GPU are the exception: worker processes on each GPU (``per_gpu`` of
them) run such jobs one after another, so CUDA's context and the loaded Triton kernels are paid
for once, not per job (a fresh process took 7-10 s for a tiny checked cell on an H200, a warm one
0.8-2.9 s). One that dies takes only its job with it (retried once, in a fresh worker).
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

from ..hostmem import tune_malloc, usable_cores
from .jobs import DIED, Job, Outcome, guarded, set_threads, signals_held

# torch, the planner and the executor (what a cell and a golden trace run; sweep/cell.py itself is
# light); the CLI, which a child of the `hybridsim` script imports again as its __main__ (0.04 s a
# job otherwise); constant tables (sweep/preload.py)
PRELOAD = ["hybridsim.runner", "hybridsim.execute", "hybridsim.golden", "hybridsim.sweep.cell", "hybridsim.cli",
           "hybridsim.sweep.preload"]


default_workers = usable_cores  # (the cores this process may use; tests replace it here)


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


def _gpu_worker(conn: Connection, more: Connection, gpu: str) -> None:
    """Run the jobs sent on ``conn`` one after another on one GPU, keeping its CUDA context."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # (before anything initialises CUDA)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tune_malloc()
    _listen_to_driver(more, None)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # (the driver has no more jobs)
            return
        set_threads(1)  # (a previous job's share of cores is not this one's)
        result = guarded(job.fn, job.arg)
        try:
            conn.send(result)
        except OSError:
            os._exit(1)


def _listen_to_driver(more: Connection, sent: Optional[threading.Event]) -> None:
    """A helper thread takes what the driver says on ``more``. A number: cores came free, raise this
    job's torch threads (``run_local``); the main thread sets it (torch's thread count is the calling
    thread's), in a signal handler that Python runs between two of the job's operations. The pipe
    closing before the result is sent: the driver is gone (SIGKILL, out of memory) or gave the job up,
    so the job ends at once rather than running on for nobody. (The forkserver cannot end it: each
    of its children holds the forkserver's own lifeline pipe, so it outlives the driver as long as
    they live.)"""
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
            if sent is None or not sent.is_set():  # (a GPU worker: the driver is done with it)
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


def visible_gpus() -> list[str]:
    """The GPUs jobs may be given, found without loading torch or CUDA here: the entries of
    CUDA_VISIBLE_DEVICES where it is set (up to the first invalid one, as CUDA reads it), else one
    per GPU the NVIDIA driver lists (/proc/driver/nvidia/gpus); none where there is no NVIDIA GPU."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for part in (p.strip() for p in env.split(",")):
            if not part or part.startswith("-"):
                break
            ids.append(part)
        return ids
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


Slot = tuple[str, int]  # (a GPU, which of its per_gpu workers)


@dataclass
class _Running:
    job: Job
    attempt: int
    proc: mp.process.BaseProcess
    more: Connection  # (the driver's end: a larger torch thread count for the job)
    t0: float
    threads: int
    slot: Optional[Slot]  # (the job runs in that GPU worker)


@dataclass
class _GpuWorker:
    proc: mp.process.BaseProcess
    conn: Connection  # jobs out, results back
    more: Connection  # thread counts; its closing tells the worker the driver is gone


class _GpuWorkers:
    """The driver's side of the GPU workers, ``per_gpu`` per GPU: each started on its slot's first
    job, replaced when it dies."""

    def __init__(self, ctx: mp.context.BaseContext):
        self.ctx = ctx
        self.by_slot: dict[Slot, _GpuWorker] = {}

    def send(self, slot: Slot, job: Job) -> _GpuWorker:
        w = self.by_slot.get(slot)
        if w is not None:
            try:
                w.conn.send(job)
                return w
            except OSError:  # (it died while idle)
                self.drop(slot)
        w = self._start(slot)
        try:
            w.conn.send(job)
        except OSError:  # (it died at once: the driver reads EOF, and the job counts as died)
            pass
        return w

    def _start(self, slot: Slot) -> _GpuWorker:
        ours, theirs = self.ctx.Pipe()
        more_r, more_w = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_gpu_worker, args=(theirs, more_r, slot[0]), daemon=True)
        proc.start()
        theirs.close()  # (the worker holds the only other end: its death is EOF here)
        more_r.close()
        self.by_slot[slot] = w = _GpuWorker(proc, ours, more_w)
        return w

    def drop(self, slot: Slot) -> None:
        """Forget a worker that died (or stop one), and reap it."""
        w = self.by_slot.pop(slot)
        w.conn.close()
        w.more.close()
        w.proc.join(10)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()

    def close(self) -> None:
        """No more jobs: idle workers exit on EOF, a busy one (interrupted) when its lifeline closes."""
        for slot in list(self.by_slot):
            self.drop(slot)


def run_local(jobs: Iterable[Job], workers: int, retries: int = 1,
              gpus: Optional[list[str]] = None, per_gpu: int = 1) -> Iterator[Outcome]:
    """Run jobs in separate processes, yielding each outcome as it finishes (not in order).

    Each job starts with one torch thread (``set_threads``). Once no job is waiting, the cores of
    the finished ones go to those still running (with -j 2, the last job gets two threads), so a
    long job at the end does not run on one core while the other idles.

    A job that runs kernels on a GPU (``Job.gpu``) gets one of ``gpus`` (default: ``visible_gpus()``)
    as its only visible device and runs in one of that GPU's ``per_gpu`` worker processes; it waits
    for one to come free while jobs behind it that need none go ahead. One job per GPU by default:
    a checked run plans its memory on the whole card, so two large ones at once would not fit.
    Without GPUs here, such a job runs as any other (its scenario then says what a missing GPU means)."""
    ctx = _context()
    threads = 1  # (see set_threads)
    cores = max(1, min(workers, default_workers()))
    gpus = visible_gpus() if gpus is None else gpus
    free_slots: deque[Slot] = deque((g, k) for k in range(per_gpu) for g in gpus)  # (GPUs first, then sharing)
    by_gpu = bool(free_slots)
    pending: deque[tuple[Job, int]] = deque((j, 1) for j in jobs)
    running: dict[Connection, _Running] = {}
    on_gpus = _GpuWorkers(ctx)
    try:
        while pending or running:
            while len(running) < workers and (nxt := _next_job(pending, free_slots, by_gpu)) is not None:
                job, attempt, slot = nxt
                with signals_held():  # (a child started is a child in `running`, which `finally` stops)
                    if slot is not None:
                        w = on_gpus.send(slot, job)
                        running[w.conn] = _Running(job, attempt, w.proc, w.more, perf_counter(), threads, slot)
                        continue
                    recv, send = ctx.Pipe(duplex=False)
                    more_r, more_w = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_child, args=(job, send, threads, more_r), daemon=True)
                    proc.start()
                    send.close()  # (the child holds the only write end: its death is EOF here)
                    more_r.close()
                    running[recv] = _Running(job, attempt, proc, more_w, perf_counter(), threads, None)
            _share_cores(running, pending, cores)
            for conn in wait(list(running)):
                r = running.pop(conn)
                job, attempt, proc, t0 = r.job, r.attempt, r.proc, r.t0
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    kind, value = DIED, None
                if r.slot is None:
                    conn.close()
                    r.more.close()
                    proc.join()
                else:
                    if kind == DIED:
                        on_gpus.drop(r.slot)  # (the slot's next job starts a fresh worker)
                    free_slots.append(r.slot)
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
            if r.slot is None:
                r.proc.join()
                r.more.close()
        on_gpus.close()  # (reaps those, and stops the idle GPU workers)


def _next_job(pending: deque, free_slots: deque, by_gpu: bool) -> Optional[tuple[Job, int, Optional[Slot]]]:
    """The first waiting job that can start now, with the GPU worker it gets (None: it needs none)."""
    for i, (job, attempt) in enumerate(pending):
        if job.gpu and by_gpu:
            if not free_slots:
                continue
            del pending[i]
            return job, attempt, free_slots.popleft()
        del pending[i]
        return job, attempt, None
    return None


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
