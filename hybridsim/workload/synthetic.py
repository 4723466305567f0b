"""Synthetic workloads: arrival processes, length distributions, shared prefixes."""

from __future__ import annotations

import math
import random

import numpy as np

from ..config import (ChoiceDist, FixedArrival, FixedDist, PoissonArrival, StepsArrival,
                      SyntheticWorkload, UniformDist)
from .base import Workload, WorkloadRequest
from .tokens import combine, token_block


def draw_length(dist, rng: random.Random) -> int:
    if isinstance(dist, UniformDist):
        return rng.randint(dist.min, dist.max)
    if isinstance(dist, FixedDist):
        return dist.value
    if isinstance(dist, ChoiceDist):
        return rng.choice(dist.values)
    raise TypeError(dist)  # pragma: no cover


def arrival_steps(arrival, n: int, rng: random.Random) -> list[int]:
    """Arrival step per request, non-decreasing."""
    if isinstance(arrival, FixedArrival):
        return [i // arrival.per_step for i in range(n)]
    if isinstance(arrival, StepsArrival):
        return sorted(arrival.steps)
    if isinstance(arrival, PoissonArrival):
        t, out = 0.0, []
        for _ in range(n):
            out.append(math.floor(t))
            t += rng.expovariate(arrival.rate_per_step)
        return out
    raise TypeError(arrival)  # pragma: no cover


def build_synthetic(wl: SyntheticWorkload, seed: int, max_model_len: int) -> Workload:
    rng = random.Random(combine(seed, 0x5157))
    steps = arrival_steps(wl.arrival, wl.num_requests, rng)
    prefixes: list[np.ndarray] = []
    if wl.shared_prefix is not None:
        for k in range(wl.shared_prefix.count):
            prefixes.append(token_block(combine(seed, 0x9F, k), wl.shared_prefix.len, wl.vocab_size))
    reqs = []
    arrays = []
    next_prefix = 0
    for i in range(wl.num_requests):
        plen = draw_length(wl.prompt_len, rng)
        olen = draw_length(wl.output_len, rng)
        prio = rng.randrange(wl.priorities)
        use_prefix = bool(prefixes) and rng.random() < wl.shared_prefix.fraction
        unique = token_block(combine(seed, 0xA1, i), plen, wl.vocab_size)
        if use_prefix:
            pre = prefixes[next_prefix % len(prefixes)]
            next_prefix += 1
            k = min(len(pre), plen - 1)
            unique[:k] = pre[:k]
        arrays.append(unique)
        reqs.append(WorkloadRequest(f"r{i}", steps[i], tuple(unique.tolist()), olen, prio,
                                    combine(seed, 0xB2, i)))
    return Workload(reqs, wl.vocab_size, "synthetic", prompt_tokens=np.concatenate(arrays) if arrays else None)
