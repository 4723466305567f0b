"""Workload requests: plain data handed from the workload builders to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)
