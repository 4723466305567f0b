"""The machine-phase calibration shared by the planner benchmark and the vLLM peer driver
(standard library only: the peer runs in its own environment)."""

from __future__ import annotations

import random
import time
import types


def calibrate() -> float:
    """Seconds for a fixed object-heavy pure-Python loop (scattered attribute, list and dict
    accesses, like the planner's): this machine class has slow and fast phases, and this
    figure, taken next to each measurement, tells which one a result came from."""
    rnd = random.Random(0)
    objs = [types.SimpleNamespace(a=i, b=[i] * 8, c={i: i}) for i in range(50_000)]
    order = list(range(len(objs)))
    rnd.shuffle(order)
    t0 = time.perf_counter()
    total = 0
    for _ in range(4):
        for i in order:
            o = objs[i]
            total += o.a + o.b[3] + o.c[o.a]
            o.b.append(total & 7)
            o.b.pop()
    return time.perf_counter() - t0
