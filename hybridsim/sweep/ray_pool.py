"""The Ray backend: each job a Ray task, one CPU each (one GPU where it runs kernels on a GPU).

Results come back through the same ``Outcome`` as the local pool, so rows are written
exactly as locally. A task whose worker or node died is retried once by Ray itself
(``max_retries=1``); a second loss is the job's ``died`` outcome. Ray is optional: without
it, asking for it is an environment problem that says how to install it.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any, Iterable, Iterator, Optional

from ..errors import EnvironmentProblem
from ..hostmem import tune_malloc
from .jobs import DIED, ENVIRONMENT, Job, Outcome, exit_on_signals, guarded, set_threads

INSTALL = "pip install 'hybridsim[ray]' (or: pip install 'ray>=2.9')"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EnvironmentProblem(f"--ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def _task(job: Job) -> tuple[str, Any]:
    tune_malloc()
    set_threads(1)  # (Ray gives the task one CPU)
    return guarded(job.fn, job.arg)


def _import_path() -> str:
    """This source tree first, then whatever PYTHONPATH already says."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


class RayBackend:
    """Start or join Ray (``address`` None: a local instance; else a cluster's address).

    ``background=True`` starts Ray in a thread and returns at once; ``ready()`` waits for it (and
    raises what starting raised). A local instance takes 2-3 s to start on the 2-core dev machine,
    which the caller's own imports and set-up then overlap. The thread lives until ``close()``:
    Ray ties the processes it starts to the thread that started them (Linux's parent-death
    signal), so they would die with it."""

    def __init__(self, address: Optional[str] = None, background: bool = False):
        self.address = address
        self.started = False  # ray.init called here: close() calls ray.shutdown()
        self.own = False  # ... and it started a new local instance (not one started with `ray start`)
        self.start_s = 0.0
        self.inherited = False  # that instance's workers inherit the import path
        self.gpus = 0.0
        self._ready = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._up = threading.Event()  # started (or failed to)
        self._done = threading.Event()  # closed: the starting thread may end
        if not background:
            self._start()
            self.ready()
            return
        exit_on_signals()  # (what ray.init sets, from the main thread only: close() still runs)
        self._thread = threading.Thread(target=self._start_and_hold, name="hybridsim-ray", daemon=True)
        self._thread.start()

    def _start_and_hold(self) -> None:
        try:
            self._start()
        except BaseException as e:  # (raised again in the caller's thread by ready())
            self._error = e
        finally:
            self._up.set()
        self._done.wait()

    def _start(self) -> None:
        self.ray = import_ray()
        if self.ray.is_initialized():
            return
        t0 = perf_counter()
        saved = os.environ.get("PYTHONPATH")
        local = self.address is None and "RAY_ADDRESS" not in os.environ
        if local:
            # the workers Ray starts with the instance then serve the tasks at once (a task with a
            # runtime_env waits for workers started for that environment: seconds on 2 cores)
            os.environ["PYTHONPATH"] = _import_path()
        try:
            self.ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                          logging_level=logging.ERROR, configure_logging=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = self.address or "a local instance"
            raise EnvironmentProblem(f"cannot start or join Ray at {where}: {e}") from None
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        self.start_s = perf_counter() - t0
        self.started = True
        self.own = _started_an_instance(self.ray)  # (auto joins an instance `ray start` left running)
        self.inherited = local and self.own

    def ready(self) -> "RayBackend":
        """Wait until Ray has started or been joined; raise what starting it raised."""
        if self._thread is not None:
            self._up.wait()
        if self._error is not None:
            raise self._error
        if not self._ready:
            self.gpus = float(self.ray.cluster_resources().get("GPU", 0))
            self._ready = True
        return self

    def _runtime_env(self) -> Optional[dict]:
        """A local instance's workers import this very package (a source tree need not be installed);
        a cluster's nodes have hybridsim installed (README: Sweeps)."""
        if self.address not in (None, "auto", "local") or self.inherited:
            return None
        return {"env_vars": {"PYTHONPATH": _import_path()}}

    def run(self, jobs: Iterable[Job], per_gpu: int = 1) -> Iterator[Outcome]:
        """Each job a task; one that runs kernels on a GPU asks for 1/``per_gpu`` of one."""
        ray = self.ready().ray
        task = ray.remote(_task)
        env = self._runtime_env()
        refs: dict[Any, tuple[Job, float]] = {}
        for job in jobs:
            gpu = job.gpu and self.gpus > 0
            opts: dict[str, Any] = {"num_cpus": 0 if gpu else 1, "num_gpus": 1 / per_gpu if gpu else 0,
                                    "max_retries": 1, "retry_exceptions": False}
            if env is not None:
                opts["runtime_env"] = env
            refs[task.options(**opts).remote(job)] = (job, perf_counter())
        try:
            while refs:
                done, _ = ray.wait(list(refs), num_returns=1)
                for ref in done:
                    job, t0 = refs.pop(ref)
                    yield self._outcome(ref, job, perf_counter() - t0)
        finally:
            # interrupted: on a cluster this joined, cancel what is left; an instance started here is
            # shut down whole by close() (cancelling first races with tasks that are just finishing:
            # Ray 2.60's driver then aborts on "Tried to complete task that was not pending")
            if not self.own:
                for ref in refs:
                    ray.cancel(ref, force=True)

    def _outcome(self, ref: Any, job: Job, seconds: float) -> Outcome:
        ex = self.ray.exceptions
        try:
            kind, value = self.ray.get(ref)
        except (ex.WorkerCrashedError, ex.NodeDiedError, ex.ObjectLostError, ex.OwnerDiedError) as e:
            return Outcome(job.key, DIED, message=f"the Ray worker died twice ({type(e).__name__})", attempts=2,
                           seconds=seconds)
        except ex.RayError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return Outcome(job.key, ENVIRONMENT, message=f"Ray: {first}", seconds=seconds)
        return Outcome(job.key, kind, value if kind == "ok" else None, "" if kind == "ok" else str(value), 1, seconds)

    def close(self) -> None:
        """Shut down what this backend started (waiting for a start still under way); leave an
        instance it joined alone."""
        if self._thread is not None:
            self._up.wait()
        if self.started:
            self.started = False
            if self.own:
                _stop_autoscaler_monitor(self.ray)
            self.ray.shutdown()  # (stops an instance started here; leaves one it joined)
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None


def start_ray(ray: str, background: bool = False) -> RayBackend:
    """Start or join Ray for ``--ray`` (auto: a local instance, started or joined; else a cluster
    address). In the background, the caller's own work overlaps Ray's start-up."""
    return RayBackend(None if ray == "auto" else ray, background=background)


@contextmanager
def ray_in_background(ray: Optional[str]) -> Iterator[Optional[RayBackend]]:
    """``--ray``'s backend for a command: Ray starts (or is joined) in the background while the command
    goes on setting up, and what was started is stopped on the way out, however the command ends.
    Without ``--ray`` (None), nothing."""
    if ray is None:
        yield None
        return
    backend = start_ray(ray, background=True)
    try:
        yield backend
    finally:
        backend.close()


def _started_an_instance(ray: Any) -> bool:
    """Whether ``ray.init`` started a new local instance rather than joining a running one: this
    driver then holds the head node. Ray's internals again; where they differ, the answer is
    "joined", the safe one (tasks get the import path explicitly; an interrupt cancels them)."""
    try:
        node = ray._private.worker._global_node
        return bool(node is not None and node.is_head())
    except Exception:  # (another Ray version's internals)
        return False


def _stop_autoscaler_monitor(ray: Any) -> None:
    """Stop the autoscaler monitor of a local instance while its GCS still answers.

    ``ray.shutdown()`` stops the GCS before the monitor, whose SIGTERM handler then writes to the
    stopped GCS until Ray kills it a second later: 1.0 of the 1.3 s a shutdown took on the dev
    machine (Ray 2.60); stopped first, the whole shutdown takes 0.1 s. This uses Ray's internals
    (the head node's process table); where they differ, nothing happens here and the shutdown is
    the plain one."""
    try:
        node = ray._private.worker._global_node
        if node is not None and node.is_head():
            node.kill_monitor(check_alive=False)
    except Exception:  # (another Ray version's internals)
        pass
