"""Immutable step plans: everything the executor needs, nothing about how it was decided.

A ``StepPlan`` is what the scheduler emits before a step runs; a ``StepOutcome``
is what the (simulated) model produced. A trace line is the two together.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


PLACEHOLDER_DRAFT = -1
"""A draft position with no draft behind it. With drafts on, vLLM 0.33 pads a newly admitted
request that has one token to compute to ``1 + num_speculative_tokens`` tokens unless a running
request continues its prefill in the step (uniform decode batches; the rule in full is
``Scheduler._schedule_waiting``'s); the padding is scheduled and computed as drafts that are never
accepted. Plans and traces write such drafts as -1."""


def prefill_end(num_prompt_tokens: int, num_tokens: int) -> int:
    """Where a request's prefill ends: its prompt, or for a resumed request that replays its
    outputs, every token but the last (which the first decode step computes)."""
    return max(num_prompt_tokens, num_tokens - 1)


def prefill_checkpoint(num_tokens: int, bs: int, lookahead: int = 1) -> int:
    """Where align mode keeps the checkpoint state of a prefill of ``num_tokens`` tokens (see
    ``prefill_end``): the last block boundary that
    leaves at least one token to compute, ``(num_tokens - 1) // bs * bs`` (vLLM 0.33; for a
    length that is a multiple of ``bs``, one block before the end). A final prefill chunk
    that passes it keeps a state there (``checkpoint_at`` says where exactly), and the
    engine's scheduler stops a final chunk that does not pass it before its last token.
    ``lookahead``: with MTP of several modules the boundary's block hash covers that many
    tokens after it, which must exist: ``(num_tokens - lookahead) // bs * bs``."""
    return (num_tokens - (lookahead if lookahead > 1 else 1)) // bs * bs


def checkpoint_at(start: int, end: int, prefill_end: int, bs: int, lookahead: int = 1) -> Optional[int]:
    """Where a prefill chunk from ``start`` to ``end`` keeps a checkpoint state, or None (vLLM
    0.33's Mamba manager): only a final chunk (``end >= prefill_end``) does, at the last block
    boundary before its end that leaves a token to compute, ``prefill_checkpoint(end)``, when
    the chunk passes it; the state is held in that boundary's column, ``at // bs - 1``. For a
    chunk ending where the prefill ends this is the prefill's checkpoint; a resumed request's
    final chunk also computes its last token, one past its prefill, and when the prefill ends
    on a block boundary its checkpoint is that boundary. Scheduler and executor both read it."""
    if end < prefill_end or start % bs:
        # (a chunk that starts inside a block, possible when a block is longer than a chunk
        # may be, writes no checkpoint: vLLM 0.33 takes one only from a block boundary)
        return None
    if lookahead > 1 and not start < prefill_checkpoint(prefill_end, bs, lookahead) < end:
        # (multi-module MTP: the checkpoint must be a boundary whose block hash the prompt
        # completes; the column itself is the usual one)
        return None
    at = prefill_checkpoint(end, bs)
    return at if start < at < end else None


def keeps_state_at(pos: int, junction: int, num_prompt_tokens: int, bs: int) -> bool:
    """Whether align mode publishes a request's Mamba state at boundary ``pos`` (vLLM 0.33 keeps
    two "reachable" boundaries of a request): the prompt's replay point (``prefill_checkpoint``
    of the prompt) or the junction (the longest attention hit at admission; for a resumed
    request it may lie in its own outputs). Both a chunk's end state and a checkpoint column
    are published only there."""
    return pos == junction or pos == prefill_checkpoint(num_prompt_tokens, bs)


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


class SpecRun:
    """A bulk run of speculative decoding, known in advance: the acceptance of every round
    is a function of the request and the round, so its computed tokens at each step are."""

    __slots__ = ("start", "computed", "accepted", "round0")

    def __init__(self, start: int, computed: list[int], accepted: list[int], round0: int):
        self.start = start  # the run's first step
        self.computed = computed  # [j]: computed tokens when step start + j is scheduled
        self.accepted = accepted  # [j]: drafts of step start + j that will be accepted
        self.round0 = round0  # the request's draft round when the run started


class Cruise(NamedTuple):
    """Requests the scheduler advanced in bulk this step (one decode token each, or with
    drafts one token plus ``num_spec`` drafts each): their rows are built only when someone
    reads ``StepPlan.scheduled``."""

    running: tuple  # the running queue after the running pass (its order is the rows' order)
    explicit: tuple  # the rows the running pass built one by one, in its order
    bases: dict  # Request -> (computed tokens at base_step, base_step), or its SpecRun
    grown: dict = {}  # Request -> new block ids of a bulk row that took a block this step
    num_spec: int = 0  # drafts in every bulk row
    accepted: int = 0  # drafts accepted over this step's bulk rows
    drafts: object = None  # callable(req, output index, num drafts, num right) -> drafts


_new = tuple.__new__


class StepPlan:
    """One step's plan (immutable). ``scheduled`` lists every row in the engine's order."""

    __slots__ = ("step", "_rows", "preempted", "finished", "faults", "forced_preempted", "_cruise", "_explicit",
                 "num_rows", "num_bulk", "block_copies")

    def __init__(self, step: int, scheduled: tuple[ScheduledRequest, ...], preempted: tuple[str, ...] = (),
                 finished: tuple[str, ...] = (), faults: tuple[str, ...] = (),
                 forced_preempted: tuple[str, ...] = (), cruise: Optional[Cruise] = None,
                 admitted: tuple[ScheduledRequest, ...] = (), block_copies: tuple[tuple[int, int], ...] = ()):
        set_ = object.__setattr__
        set_(self, "step", step)
        # (source, copy) block ids the worker copies, whole pages in every group, before the
        # step's writes: the private copies of partly hit blocks (vLLM 0.33's KVCacheBlockCopy)
        set_(self, "block_copies", block_copies)
        set_(self, "preempted", preempted)
        set_(self, "finished", finished)  # finished after the previous step (their blocks are free)
        set_(self, "faults", faults)
        set_(self, "forced_preempted", forced_preempted)  # preempted outside the scheduler
        set_(self, "_cruise", cruise)
        if cruise is None:
            set_(self, "_rows", scheduled)
            set_(self, "_explicit", scheduled)
            set_(self, "num_rows", len(scheduled))
            set_(self, "num_bulk", 0)
        else:  # ``scheduled``: the running pass's own rows; ``admitted``: the waiting pass's
            set_(self, "_rows", None)
            set_(self, "_explicit", cruise.explicit + admitted)
            set_(self, "num_rows", len(self._explicit) + len(cruise.bases))
            set_(self, "num_bulk", len(cruise.bases))  # rows advanced in bulk: one decode token each

    def __setattr__(self, name, value):
        raise AttributeError("StepPlan is immutable")

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]:
        rows = self._rows
        if rows is None:
            rows = tuple(self._cruise_rows()) + self._explicit[len(self._cruise.explicit):]
            object.__setattr__(self, "_rows", rows)
        return rows

    def _cruise_rows(self):
        cr = self._cruise
        explicit = {r.req_id: r for r in cr.explicit}
        bases = cr.bases
        grown = cr.grown
        step = self.step
        S = cr.num_spec
        for req in cr.running:
            row = explicit.get(req.req_id)
            if row is not None:
                yield row
                continue
            base = bases.get(req)
            if base is None:
                continue
            if type(base) is tuple:
                yield _new(ScheduledRequest, (req.req_id, base[0] + step - base[1], 1, grown.get(req), False, False,
                                              0, (), None, 0))
            else:
                j = step - base.start
                c = base.computed[j]
                drafts = tuple(cr.drafts(req, c + 1 - req.num_prompt_tokens, S, base.accepted[j]))
                yield _new(ScheduledRequest, (req.req_id, c, 1 + S, grown.get(req), False, False, 0, drafts,
                                              None, 0))

    @property
    def bulk(self) -> Optional[Cruise]:
        """What was advanced in bulk this step (None: every row was built one by one)."""
        return self._cruise

    @property
    def explicit_rows(self):
        """Rows built one by one (all of them when nothing was advanced in bulk)."""
        return self._explicit

    @property
    def total_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return (self.step, self.scheduled, self.preempted, self.finished, self.faults, self.forced_preempted,
                self.block_copies) == (other.step, other.scheduled, other.preempted, other.finished, other.faults,
                                       other.forced_preempted, other.block_copies)

    __hash__ = None

    def __repr__(self) -> str:
        return (f"StepPlan(step={self.step}, scheduled={self.scheduled!r}, preempted={self.preempted!r}, "
                f"finished={self.finished!r}, faults={self.faults!r}, forced_preempted={self.forced_preempted!r}"
                + (f", block_copies={self.block_copies!r})" if self.block_copies else ")"))


class StepOutcome:
    """Tokens the model committed per request (bonus included) and drafts accepted.

    With a bulk-advanced plan, ``sampled`` and ``accepted`` are built on first read: the
    rows the model handled one by one, plus every bulk row's true-continuation tokens (one,
    or one more than its accepted drafts), in row order."""

    __slots__ = ("_sampled", "_accepted", "finished", "_plan")

    def __init__(self, sampled: Optional[dict] = None, accepted: Optional[dict] = None,
                 finished: tuple[str, ...] = (), plan: Optional[StepPlan] = None):
        set_ = object.__setattr__
        set_(self, "_sampled", {} if sampled is None else sampled)
        set_(self, "_accepted", {} if accepted is None else accepted)
        set_(self, "finished", finished)
        set_(self, "_plan", plan if plan is not None and plan.num_bulk else None)

    def __setattr__(self, name, value):
        raise AttributeError("StepOutcome is immutable")

    @property
    def sampled(self) -> dict[str, tuple[int, ...]]:
        if self._plan is not None:
            self._build()
        return self._sampled

    @property
    def accepted(self) -> dict[str, int]:
        if self._plan is not None:
            self._build()
        return self._accepted

    def _build(self) -> None:
        plan = self._plan
        own, own_acc = self._sampled, self._accepted
        bases = plan._cruise.bases
        byid = {req.req_id: req for req in bases}
        out, acc = {}, {}
        step = plan.step
        for row in plan.scheduled:
            rid = row[0]
            toks = own.get(rid)
            if toks is not None:
                out[rid] = toks
                a = own_acc.get(rid)
                if a is not None:
                    acc[rid] = a
                continue
            req = byid.get(rid)
            if req is None:
                continue
            o = row[1] + 1 - req.num_prompt_tokens  # a bulk row: the continuation after its c + 1 tokens
            base = bases[req]
            if type(base) is tuple:
                out[rid] = (req.out_stream[o],)
            else:
                k = base.accepted[step - base.start]
                out[rid] = tuple(req.out_stream[o:o + k + 1])
                acc[rid] = k
        object.__setattr__(self, "_sampled", out)
        object.__setattr__(self, "_accepted", acc)
        object.__setattr__(self, "_plan", None)

    @property
    def own_sampled(self) -> dict[str, tuple[int, ...]]:
        """Only the rows the model handled one by one (what the scheduler's update applies)."""
        return self._sampled

    @property
    def own_accepted(self) -> dict[str, int]:
        return self._accepted

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepOutcome):
            return NotImplemented
        return (self.sampled, self.accepted, self.finished) == (other.sampled, other.accepted, other.finished)

    __hash__ = None

    def __repr__(self) -> str:
        return f"StepOutcome(sampled={self.sampled!r}, accepted={self.accepted!r}, finished={self.finished!r})"
