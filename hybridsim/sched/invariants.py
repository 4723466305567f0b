"""``sched.invariants``: what must hold after every schedule and every update.

Budget and seat limits; every block owned by exactly as many rows as its
reference count says, shared only when it holds a cached prefix; free-queue
conservation; computed tokens that only grow (except preemption); align-mode
chunk ends on block boundaries; Mamba rows with only the live columns the
cache mode allows; draft and acceptance accounting; hit lengths aligned and
below the request length (research/vllm-hybrid.md §8).
"""

from __future__ import annotations

from collections import Counter

from ..checks import CheckTally, Failure
from .block_pool import NULL_BLOCK
from .plan import PLACEHOLDER_DRAFT, StepOutcome, StepPlan
from .request import Status
from .scheduler import Scheduler

NAME = "sched.invariants"


class InvariantChecker:
    def __init__(self, sched: Scheduler, tally: CheckTally):
        self.sched = sched
        self.tally = tally
        self.before: dict[str, int] = {}

    def _fail(self, step: int, req: str | None, msg: str) -> None:
        self.tally.failed(Failure(step, req, msg))

    def after_schedule(self, plan: StepPlan) -> None:
        s = self.sched
        cfg = s.cfg
        step = plan.step
        ok = 0
        total = sum(r.num_scheduled_tokens for r in plan.scheduled)
        if total > cfg.max_num_batched_tokens:
            self._fail(step, None, f"{total} tokens scheduled, budget {cfg.max_num_batched_tokens}")
        else:
            ok += 1
        if len(s.running) > cfg.max_num_seqs:
            self._fail(step, None, f"{len(s.running)} running, max_num_seqs {cfg.max_num_seqs}")
        else:
            ok += 1
        # a victim of this step's pass gets no row in it (a request preempted by a fault
        # before the pass may be admitted again in the same step)
        both = {r.req_id for r in plan.scheduled}.intersection(s.pass_preempted)
        if both:
            self._fail(step, min(both), f"{len(both)} request(s) both scheduled and preempted by this step's pass")
        else:
            ok += 1
        bs = s.bs
        unit = s.kv.unit  # (the hashing unit: the block size unless partial-block hits are on)
        S = cfg.num_speculative_tokens
        for r in plan.scheduled:
            req = s.requests[r.req_id]
            if r.num_drafts > S:
                self._fail(step, r.req_id, f"{r.num_drafts} drafts scheduled, num_speculative_tokens {S}")
            if PLACEHOLDER_DRAFT in r.spec_token_ids and (
                    not r.is_new or r.spec_token_ids != (PLACEHOLDER_DRAFT,) * S
                    or r.num_scheduled_tokens != 1 + S or r.num_computed_tokens != req.num_tokens - 1):
                self._fail(step, r.req_id, "placeholder drafts outside a padded admission (a new row of one token "
                                           f"and {S} placeholders): {r.num_computed_tokens} computed, "
                                           f"{r.num_scheduled_tokens} scheduled, drafts {list(r.spec_token_ids)}")
            if r.is_new:
                if r.prefix_hit_tokens % unit or r.prefix_hit_tokens > max(req.num_tokens - 1, 0):
                    self._fail(step, r.req_id, f"prefix hit {r.prefix_hit_tokens} not unit-aligned or "
                                               f"not below the request length {req.num_tokens}")
            else:
                prev = self.before.get(r.req_id)
                if prev is not None and r.num_computed_tokens < prev:
                    self._fail(step, r.req_id, f"computed tokens went back from {prev} to "
                                               f"{r.num_computed_tokens} without preemption")
            end = r.num_computed_tokens + r.num_scheduled_tokens
            prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
            if cfg.align_split and r.num_computed_tokens < prefill_end and end < prefill_end and end % bs \
                    and not self._unit_stop(req, r.num_computed_tokens, end):
                self._fail(step, r.req_id, f"align-mode prefill chunk ends at {end}, not a multiple of {bs}")
            ok += 1
        self._check_blocks(step)
        if s.kv.fine:
            self._check_unit_writes(plan)
        self.tally.passed(ok)

    def _unit_stop(self, req, start: int, end: int) -> bool:
        """Partial-block hits (``sched.partial``): a chunk may also stop at the prompt's unit
        checkpoint, or a whole number of blocks after a start inside a block (a hit's end)."""
        kv = self.sched.kv
        if not kv.fine:
            return False
        from .partial import checkpoint_position

        look = kv.mamba[0].lookahead if kv.mamba else 0
        return end == checkpoint_position(req.num_prompt_tokens, kv.unit, look) or (end - start) % self.sched.bs == 0

    def _check_unit_writes(self, plan: StepPlan) -> None:
        """Partial-block hits: a block may be shared up to a unit boundary inside it (a hit there),
        but whoever writes past that boundary writes into a block of its own — the private copy.
        No scheduled row writes into an attention block another row holds."""
        s = self.sched
        ref = s.kv.pool.ref_cnt
        ok = 0
        for r in plan.scheduled:
            req = s.requests[r.req_id]
            c, n = r.num_computed_tokens, r.num_scheduled_tokens
            for m in s.kv.attn:
                row = m.rows.get(req.index, ())
                for col in range(c // m.bs, min(-(-(c + n) // m.bs), len(row))):
                    b = row[col]
                    if b != NULL_BLOCK and ref[b] > 1:
                        self._fail(plan.step, r.req_id, f"writes from position {c} into block {b} (column {col} of "
                                                        f"group {m.spec.group_id}), which {ref[b]} rows hold: a hit "
                                                        "inside a block took no private copy")
                    else:
                        ok += 1
        self.tally.passed(ok)

    def _check_blocks(self, step: int) -> None:
        s = self.sched
        pool = s.kv.pool
        owners: Counter = Counter()
        for m in s.kv.managers:
            spec = m.spec
            for idx, row in m.rows.items():
                seen_here = set()
                live = 0
                for b in row:
                    if b == NULL_BLOCK:
                        continue
                    live += 1
                    if b in seen_here:
                        self._fail(step, None, f"block {b} appears twice in one row of group {spec.group_id}")
                    seen_here.add(b)
                    owners[b] += 1
                if spec.is_mamba and spec.mode == "align" and live > 3 + spec.num_spec:
                    self._fail(step, None, f"align-mode Mamba row holds {live} blocks (at most {3 + spec.num_spec})")
        for b, n in owners.items():
            if pool.ref_cnt[b] != n:
                self._fail(step, None, f"block {b} is in {n} rows but its ref count is {pool.ref_cnt[b]}")
            elif n > 1 and pool.block_key[b] is None:
                self._fail(step, None, f"block {b} is shared by {n} rows but holds no cached prefix")
            elif n > 1 and pool.ktok.get(b, 0) % s.bs:
                # (partial-block hits: a block cached up to a unit boundary inside it is reused only
                # through a private copy; its owner goes on writing past that boundary)
                self._fail(step, None, f"block {b} is shared by {n} rows but its cached prefix ends inside it "
                                       f"({pool.ktok[b]} tokens): a hit inside a block took no private copy")
            if b in pool.free_queue:
                self._fail(step, None, f"block {b} is in use and in the free queue")
        in_use = len(owners)
        if in_use + pool.num_free != pool.num_blocks - 1:
            self._fail(step, None, f"{in_use} blocks in use + {pool.num_free} free != {pool.num_blocks - 1}")
        self.tally.passed(len(owners) + 1)

    def after_update(self, plan: StepPlan, outcome: StepOutcome) -> None:
        s = self.sched
        s.sync()  # requests advanced in bulk: bring their counters up to date before reading them
        step = plan.step
        for r in plan.scheduled:
            acc = outcome.accepted.get(r.req_id)
            if acc is not None and acc > r.num_drafts:
                self._fail(step, r.req_id, f"{acc} drafts accepted of {r.num_drafts}")
            if acc and PLACEHOLDER_DRAFT in r.spec_token_ids[:acc]:
                self._fail(step, r.req_id, f"{acc} drafts accepted, placeholders among them")
            toks = outcome.sampled.get(r.req_id, ())
            if len(toks) > r.num_drafts + 1:
                self._fail(step, r.req_id, f"{len(toks)} tokens committed from {r.num_drafts} drafts")
        self.before = {req.req_id: req.num_computed_tokens for req in s.running
                       if req.status == Status.RUNNING}
        self.tally.passed(len(plan.scheduled))
