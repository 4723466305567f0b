"""The Ray backend: each job a Ray task, one CPU each (one GPU where it runs kernels on a GPU).

Results come back through the same ``Outcome`` as the local pool, so rows are written
exactly as locally. A task whose worker or node died is retried once by Ray itself
(``max_retries=1``); a second loss is the job's ``died`` outcome. Ray is optional: without
it, asking for it is an environment problem that says how to install it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from time import perf_counter
from typing import Any, Iterable, Iterator, Optional

from ..errors import EnvironmentProblem
from ..hostmem import tune_malloc
from .jobs import DIED, ENVIRONMENT, Job, Outcome, guarded, set_threads

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
    """Start or join Ray (``address`` None: a local instance; else a cluster's address)."""

    def __init__(self, address: Optional[str] = None):
        self.ray = import_ray()
        self.address = address
        self.started = False
        self.start_s = 0.0
        self.inherited = False  # a local instance started here: its workers inherit the import path
        if not self.ray.is_initialized():
            t0 = perf_counter()
            saved = os.environ.get("PYTHONPATH")
            if address is None and "RAY_ADDRESS" not in os.environ:
                # the workers Ray starts with the instance then serve the tasks at once (a task with a
                # runtime_env waits for workers started for that environment: seconds on 2 cores)
                os.environ["PYTHONPATH"] = _import_path()
                self.inherited = True
            try:
                self.ray.init(address=address, include_dashboard=False, log_to_driver=False,
                              logging_level=logging.ERROR, configure_logging=True)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = address or "a local instance"
                raise EnvironmentProblem(f"cannot start or join Ray at {where}: {e}") from None
            finally:
                if saved is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = saved
            self.start_s = perf_counter() - t0
            self.started = True
        self.gpus = float(self.ray.cluster_resources().get("GPU", 0))

    def _runtime_env(self) -> Optional[dict]:
        """A local instance's workers import this very package (a source tree need not be installed);
        a cluster's nodes have hybridsim installed (README: Sweeps)."""
        if self.address not in (None, "auto", "local") or self.inherited:
            return None
        return {"env_vars": {"PYTHONPATH": _import_path()}}

    def run(self, jobs: Iterable[Job]) -> Iterator[Outcome]:
        ray = self.ray
        task = ray.remote(_task)
        env = self._runtime_env()
        refs: dict[Any, tuple[Job, float]] = {}
        for job in jobs:
            gpu = job.gpu and self.gpus > 0
            opts: dict[str, Any] = {"num_cpus": 0 if gpu else 1, "num_gpus": 1 if gpu else 0,
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
            for ref in refs:  # (interrupted: cancel what is left)
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
        """Shut down what this backend started; leave an instance it joined alone."""
        if self.started:
            self.ray.shutdown()
