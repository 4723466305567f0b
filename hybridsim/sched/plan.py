"""Immutable step plans: everything the executor needs, nothing about how it was decided.

A ``StepPlan`` is what the scheduler emits before a step runs; a ``StepOutcome``
is what the (simulated) model produced. A trace line is the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class ScheduledRequest(NamedTuple):
    """One request's share of a step (a NamedTuple: immutable and cheap on the hot path)."""

    req_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int  # includes drafts
    # per KV group: the new tail of the block row (first admission: the whole row); None = unchanged
    new_block_ids: Optional[tuple[tuple[int, ...], ...]]
    is_new: bool = False  # first admission or resume: rows are complete, state starts fresh
    resumed: bool = False
    prefix_hit_tokens: int = 0
    spec_token_ids: tuple[int, ...] = ()
    prompt_token_ids: Optional[tuple[int, ...]] = None  # on the request's first admission only
    num_prompt_tokens: int = 0

    @property
    def num_drafts(self) -> int:
        return len(self.spec_token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()  # finished after the previous step (their blocks are free)
    faults: tuple[str, ...] = ()
    forced_preempted: tuple[str, ...] = ()  # preempted outside the scheduler (reset_prefix_cache)

    @property
    def total_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """Tokens the model committed per request (bonus included) and drafts accepted."""

    sampled: dict[str, tuple[int, ...]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    finished: tuple[str, ...] = ()
