"""Workload requests: plain data handed from the workload builders to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class WorkloadRequest:
    req_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    output_seed: int = 0  # names the request's true continuation (see engine.outputs)


@dataclass
class Workload:
    requests: list[WorkloadRequest]
    vocab_size: int
    source: str
    notes: list[str] = field(default_factory=list)  # e.g. how many prompts were clipped
    # every prompt's tokens end to end, in request order, when the builder made them as one
    # array: block hashes are then computed in one vectorised pass (sched.hashing)
    prompt_tokens: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    # per request id, the output tokens a trace recorded (the simulated model commits them, then
    # its seeded stream past their end); None: every continuation is seeded
    outputs: Optional[dict[str, list[int]]] = field(default=None, repr=False, compare=False)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)
