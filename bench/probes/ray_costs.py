"""Ray's fixed costs on this machine: start a local instance, run two trivial tasks, shut down.

    python bench/probes/ray_costs.py [--plain]

Prints the import, ``ray.init``, the first two tasks and the shutdown, with the time each process
type took to stop. By default the autoscaler monitor is stopped first, as ``RayBackend.close``
does; ``--plain`` shuts down in Ray's own order (the monitor then waits out a 1 s grace).
"""

from __future__ import annotations

import logging
import sys
import time


def main() -> None:
    t = time.perf_counter()
    import ray
    from ray._private import node as ray_node

    from hybridsim.sweep.ray_pool import _stop_autoscaler_monitor

    t_import = time.perf_counter() - t
    stops: list[tuple[str, float]] = []
    kill = ray_node.Node._kill_process_type

    def timed_kill(self, process_type, *a, **k):
        t0 = time.perf_counter()
        out = kill(self, process_type, *a, **k)
        stops.append((process_type, time.perf_counter() - t0))
        return out

    ray_node.Node._kill_process_type = timed_kill
    t = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    t_init = time.perf_counter() - t

    @ray.remote
    def one() -> int:
        return 1

    t = time.perf_counter()
    ray.get([one.remote() for _ in range(2)])
    t_tasks = time.perf_counter() - t
    t = time.perf_counter()
    if "--plain" not in sys.argv:
        _stop_autoscaler_monitor(ray)
    ray.shutdown()
    t_stop = time.perf_counter() - t
    print(f"import {t_import:.2f} s, ray.init {t_init:.2f} s, first two tasks {t_tasks:.2f} s, "
          f"shutdown {t_stop:.2f} s ({'plain' if '--plain' in sys.argv else 'monitor first'})")
    print("  stopping: " + ", ".join(f"{name} {s:.2f} s" for name, s in stops))


if __name__ == "__main__":
    main()
