"""Continuous-batching scheduler with the semantics of the engine's V1 scheduler.

One ``schedule()`` call makes one immutable ``StepPlan``: running requests
first (decodes, drafts, unfinished prefill chunks), preempting from the back
when the pool runs dry, then waiting requests (new and preempted) while seats,
budget and blocks last. ``update()`` applies what the model produced: spec
rollback, new tokens, finished requests. Policy lives here; block bookkeeping
lives in ``KVCacheManager``; tensors live nowhere near.
"""

from __future__ import annotations

import bisect
from bisect import bisect_left, bisect_right
from collections import deque
from heapq import heappop, heappush
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from . import partial
from .kv_cache import NO_BOUND, KVCacheManager, PrefixHit
from .plan import (PLACEHOLDER_DRAFT, Cruise, ScheduledRequest, SpecRun, StepOutcome, StepPlan, checkpoint_at,
                   keeps_state_at, prefill_checkpoint, prefill_end)
from .request import Request, Status

_Sched = ScheduledRequest  # built with tuple.__new__ on the hot path (all ten fields, in order)
_new = tuple.__new__
_AFTER_PASS = 1 << 62  # a seat after every running request's (admissions)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    num_speculative_tokens: int = 0
    align_split: bool = False  # hybrid model in align mode: chunk ends on block boundaries
    # prompt tokens past a chunk the drafter reads (MTP / EAGLE); above 1 (multi-module MTP) a
    # prefill chunk never ends fewer than this many tokens before the prefill's end
    prefill_lookahead: int = 0


class _PriorityQueue:
    """Waiting queue ordered by (priority, arrival, index); lower runs first."""

    def __init__(self):
        self._keys: list[tuple] = []
        self._items: list[Request] = []

    def _key(self, r: Request) -> tuple:
        return (r.priority, r.arrival_step, r.index)

    def append(self, r: Request) -> None:
        k = self._key(r)
        i = bisect.bisect(self._keys, k)
        self._keys.insert(i, k)
        self._items.insert(i, r)

    appendleft = append

    def popleft(self) -> Request:
        self._keys.pop(0)
        return self._items.pop(0)

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


def _seat(req: Request) -> int:
    return req.seat


def _unschedule(scheduled: list[ScheduledRequest], req_id: str) -> int:
    """Drop ``req_id``'s row from this pass, if it has one; returns its token count."""
    for k in range(len(scheduled) - 1, -1, -1):
        if scheduled[k][0] == req_id:
            return scheduled.pop(k)[2]
    return 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager):
        self.cfg = cfg
        self.kv = kv
        self.bs = kv.block_size
        self.waiting = _PriorityQueue() if cfg.policy == "priority" else deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last: list[str] = []
        self._pending_preempted: list[str] = []
        self.pass_preempted: tuple[str, ...] = ()  # victims of the last schedule pass (not faults)
        self.num_preemptions = 0
        # Bulk decode ("cruise"): a request that will decode one token a step for the next J
        # steps (until the step it finishes) is advanced without per-step work; its rows and
        # tokens are built when read, and its block events run as side events (below). Needs
        # the true continuation: see ``enable_cruise``.
        self._cruise: dict[Request, tuple[int, int]] = {}  # req -> (computed tokens, at step)
        self._wake_at: dict[int, list[Request]] = {}
        # a bulk request's block events (take a block, publish a full one, release the Mamba
        # column left behind) run in its place in the pass, without waking it
        self._side_at: dict[int, list[tuple[Request, int]]] = {}  # step -> (req, its bulk run)
        self._grown: dict[Request, tuple] = {}  # this step's bulk rows that took blocks
        self._runs = 0
        self._seats = 0
        self.num_side_events = 0
        self._awake: set[Request] = set()  # running requests not in bulk mode (the pass's own work)
        self._tokens = None  # callable(req, first output index, count) -> list of output tokens
        self._now = 0  # the step being scheduled, or the next one after an update
        # bulk speculative decoding: every bulk row is 1 + S tokens; its run (SpecRun) is
        # computed when it starts, from the drafter's acceptance of each future round
        self._drafter = None
        self._bulk_n = 1  # tokens of a bulk row
        self._spec_candidates: list[Request] = []  # sampled last step: may start a run
        self._acc_by_step = np.zeros(0, dtype=np.int64)  # drafts accepted by bulk rows, per step
        # Deferred publishing (fused layouts): a bulk request publishes its full attention
        # blocks only when something could tell (``_flush_publishing``), not in events of its
        # own. _pub_at: step -> bulk requests whose next block is due then; _pub_steps: a heap
        # of those steps. _at_seat: where the pass is (seats below it were processed in step
        # ``_now``), which says what the step-by-step path would have published by now.
        self._deferring = kv.fused and kv.enable_caching  # (caching off: nothing to publish)
        self._pub_at: dict[int, list[tuple[int, int, Request]]] = {}  # (seat, run, request)
        self._pub_steps: list[int] = []
        self._at_seat = -1

    def enable_cruise(self, tokens, drafter=None) -> None:
        """Advance steady decodes in bulk. ``tokens(req, start, count)`` returns the output
        tokens the model will commit (its true continuation). With drafts, ``drafter`` must
        say in advance how many drafts each round will have accepted (``accepted_runs``) and
        rebuild a round's drafts (``drafts_at``); otherwise nothing runs in bulk."""
        S = self.cfg.num_speculative_tokens
        thr = self.cfg.long_prefill_token_threshold
        if S == 0:
            self._tokens = tokens
        elif drafter is not None and not 0 < thr < 1 + S:  # a threshold must not cut bulk rows
            self._tokens = tokens
            self._drafter = drafter
            self._bulk_n = 1 + S

    def _land(self, req: Request, stay: bool) -> None:
        """Bring a cruising request's counters and tokens up to date (``stay``: keep cruising)."""
        pub = self._pub_steps
        if pub and (pub[0] < self._now or pub[0] == self._now and self._at_seat >= 0):
            self._flush_publishing()  # (in the pass, or what earlier steps left)
        base = self._cruise[req]
        if type(base) is not tuple:
            self._land_spec(req, base, stay)
            return
        base_c, base_step = base
        k = self._now - base_step
        if k > 0:
            req.num_computed_tokens = base_c + k
            self._catch_up(req, base_c + k + 1)
        if stay:
            self._cruise[req] = (base_c + k, self._now)
        else:
            self._leave_bulk(req)

    def _land_spec(self, req: Request, run: SpecRun, stay: bool) -> None:
        """``_land`` for a run of speculative decoding: counters, tokens, draft round and the
        drafts the request holds when step ``_now`` is scheduled."""
        j = self._now - run.start
        c = run.computed[j]
        npt = req.num_prompt_tokens
        self._catch_up(req, c + 1)
        req.num_computed_tokens = c
        d = self.cfg.max_model_len - 2 - c  # what the last proposal could draft
        S = self.cfg.num_speculative_tokens
        if d > S:
            d = S
        if d > 0:
            req.draft_round = run.round0 + j
            k = run.accepted[j]
            req.spec_token_ids = self._drafter.drafts_at(req, c + 1 - npt, d, k if k < d else d)
        else:  # (only at the run's end) that proposal drafted nothing and kept its round
            req.draft_round = run.round0 + j - 1
            req.spec_token_ids = []
        if not stay:
            end = req.cruise_end
            if self._now < end:  # the rest of the run is not bulk any more
                self._acc_by_step[self._now:end] -= run.accepted[j:end - run.start]
            self._leave_bulk(req)

    def sync(self) -> None:
        """Make every cruising request's attributes current (for observers such as sched.invariants)."""
        for req in list(self._cruise):
            self._land(req, True)

    def _wake_all(self) -> None:
        for req in list(self._cruise):
            self._land(req, False)

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Request) -> None:
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Anything to schedule, or finished requests still to report (the engine steps for those)."""
        return bool(self.running or self.waiting or self._finished_since_last)

    # ------------------------------------------------------------------ faults
    def force_preempt(self, req_ids: Iterable[str]) -> list[str]:
        """Preempt named running requests before the next schedule (they show as preempted)."""
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is not None and req.status == Status.RUNNING:
                self.running.remove(req)
                self._preempt(req)
                done.append(rid)
        self._pending_preempted.extend(done)
        return done

    def reset_prefix_cache(self) -> list[str]:
        """Preempt every running request outside ``schedule`` and drop all cached prefixes.

        As upstream, these requests never appear in a step's preempted list; they
        come back later marked resumed.
        """
        forced = []
        while self.running:
            req = self.running.pop()
            self._preempt(req)
            forced.append(req.req_id)
        self.kv.reset_prefix_cache()
        return forced[::-1]

    # ------------------------------------------------------------------ schedule
    def schedule(self, step: int, faults: tuple[str, ...] = (), forced: tuple[str, ...] = ()) -> StepPlan:
        cfg = self.cfg
        kv = self.kv
        kv.pool.new_step()
        self._now = step
        self._at_seat = -1
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        running = self.running
        # the long-prefill threshold keeps a long prefill from starving other requests: with
        # one request running or waiting there is nobody to starve (vLLM 0.33)
        long_thr = cfg.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        max_len = cfg.max_model_len
        align = cfg.align_split

        if self._spec_candidates:
            self._start_spec_runs(step)
        cruise = self._cruise
        order = running
        sides = False  # bulk requests with a block event in this pass
        bulk_n = self._bulk_n
        if cruise:
            for req in self._wake_at.pop(step, ()):
                if req.cruising:
                    self._land(req, False)
            side = self._side_at.pop(step, None)
            self._grown = {}
            # the bulk rows are only exact if no row can be cut short by the budget
            order = sorted(self._awake, key=_seat)  # = running requests not in bulk, in order
            demand = len(cruise) * bulk_n
            for req in order:
                want = len(req.token_ids) + len(req.spec_token_ids) - req.num_computed_tokens
                if want > 0:
                    demand += want
            if demand > budget:
                self._wake_all()
                order = running
            else:
                budget -= len(cruise) * bulk_n
                if side:
                    side = [req for req, run in side if req.cruising and req.cruise_run == run]
                    self.num_side_events += len(side)
                    if side:
                        order = sorted(order + side, key=_seat)
                        sides = True
        if order is running:
            order = list(running)
        before = None  # the running order before this pass's first preemption (bulk mode only)

        append = scheduled.append
        stopped = None
        prefill_ran = False  # a running request continued its prefill (vLLM: no padded admission)
        for req in order:
            if sides and req.cruising:
                if self._side_event(req, step):
                    continue
                # the pool is short: it takes this step the normal way (preempting as needed),
                # its prepaid bulk row back in the budget
                self._at_seat = req.seat
                self._land(req, False)
                budget += bulk_n
            if budget <= 0:
                # with bulk rows prepaid, every request left in this pass wants no token
                if sides:
                    continue  # (bulk requests further on may still have their block event)
                break
            if req.status != Status.RUNNING:
                continue  # preempted as a victim earlier in this pass
            c = req.num_computed_tokens
            ntok = len(req.token_ids)
            spec = req.spec_token_ids
            n = ntok + len(spec) - c
            if 0 < long_thr < n:
                n = long_thr
            if n > budget:
                n = budget
            if n > max_len - 1 - c:
                n = max_len - 1 - c
            checkpoint, publish = None, False
            if c >= ntok - 1 and c >= req.num_prompt_tokens:  # decoding
                if n <= 0:
                    continue
                if c + n <= req.quiet_total and c <= req.quiet_computed:
                    # inside its current blocks: no group allocates, publishes or releases
                    drafts = ()
                    if spec:
                        nd = n + c - ntok
                        if nd > 0:
                            drafts = tuple(spec[:nd])
                        req.spec_token_ids = []
                    append(_new(_Sched, (req.req_id, c, n, None, False, False, 0, drafts, None, 0)))
                    req.num_computed_tokens = c + n
                    budget -= n
                    if req.prefill_chunk:  # (a resumed prefill that stopped one token short)
                        prefill_ran = True
                        req.prefill_chunk = False
                    continue
            else:
                if align:
                    n, checkpoint, publish = self._align_split(req, c, n, None)
                if cfg.prefill_lookahead > 1:
                    n, checkpoint, publish = self._reserve_lookahead(req, c, n, None, checkpoint, publish)
                if n <= 0:
                    continue
            self._at_seat = req.seat
            if self._pub_steps and self._pub_steps[0] <= step:
                self._flush_publishing()  # what bulk requests published before this one does
            while True:
                new_blocks = kv.allocate_running(req, c, n, checkpoint, publish)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                if cruise and before is None:
                    before = list(running)
                running.remove(victim)
                if victim.cruising:
                    budget += bulk_n  # its bulk row was prepaid
                elif victim is not req:
                    # priority policy: the victim may already have its row in this pass; as
                    # upstream, it is unscheduled and its tokens go back to the budget
                    budget += _unschedule(scheduled, victim.req_id)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                if cfg.policy == "priority":
                    # it was the lowest-priority running request and preempted itself: those after
                    # it rank higher and may fit in what it freed (vLLM 0.33 goes on with them)
                    continue
                stopped = req
                break
            num_drafts = n + c - ntok
            drafts = tuple(spec[:num_drafts]) if num_drafts > 0 else ()
            append(_new(_Sched, (req.req_id, c, n, tuple(map(tuple, new_blocks)) if new_blocks else None,
                                 False, False, 0, drafts, None, 0)))
            req.num_computed_tokens = c + n
            req.spec_token_ids = []
            budget -= n
            if req.prefill_chunk:
                prefill_ran = True
            req.prefill_chunk = c + n < ntok

        snapshot = None
        if cruise:
            if stopped is not None:
                # the pass stopped at a request that could not get blocks even by preempting
                # itself: no request after it gets a row this step
                if before is None:
                    before = running
                for req in before[before.index(stopped) + 1:]:
                    if req.cruising:
                        self._land(req, False)
                        budget += bulk_n
            if cruise:
                acc = self._acc_by_step
                snapshot = (tuple(running), tuple(scheduled), dict(cruise), self._grown, bulk_n - 1,
                            int(acc[step]) if bulk_n > 1 and step < len(acc) else 0,
                            self._drafter.drafts_at if bulk_n > 1 else None)

        self._at_seat = _AFTER_PASS
        if not preempted:
            # vLLM 0.33 pads a one-token admission to a uniform draft row unless a running
            # request continues its prefill in this step
            pad = cfg.num_speculative_tokens > 0 and not prefill_ran
            self._schedule_waiting(scheduled, budget, long_thr, pad, bool(scheduled or cruise))

        copies = kv.end_schedule() if kv.partial else ()
        self.pass_preempted = tuple(r.req_id for r in preempted)  # for sched.invariants
        preempted_ids = tuple(self._pending_preempted) + self.pass_preempted
        self._pending_preempted = []
        self.num_preemptions += len(preempted)
        finished = tuple(self._finished_since_last)
        self._finished_since_last = []
        if snapshot is None:
            return StepPlan(step, tuple(scheduled), preempted_ids, finished, faults, forced, block_copies=copies)
        n_running_rows = len(snapshot[1])
        return StepPlan(step, (), preempted_ids, finished, faults, forced, cruise=Cruise(*snapshot),
                        admitted=tuple(scheduled[n_running_rows:]), block_copies=copies)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int, long_thr: int,
                          pad: bool = False, ran: bool = False) -> None:
        """Admit waiting requests in order while seats, budget and blocks last. ``pad``: a
        request with one token to compute is padded to ``1 + num_speculative_tokens`` tokens
        (placeholder drafts), if running requests were scheduled (``ran``) or it has a prefix
        hit, and the padded row leaves room for the sampled token."""
        cfg = self.cfg
        S = cfg.num_speculative_tokens
        kv = self.kv
        waiting = self.waiting
        if (waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and self._pub_steps
                and self._pub_steps[0] <= self._now):
            self._flush_publishing()  # prefix lookups and admissions see the step's publishing
        skipped: list[Request] = []
        try:
            self._admit(scheduled, budget, long_thr, pad, ran, skipped)
        finally:
            for r in reversed(skipped):  # back at the front, in their order
                waiting.appendleft(r)

    def _admit(self, scheduled: list[ScheduledRequest], budget: int, long_thr: int, pad: bool, ran: bool,
               skipped: list[Request]) -> None:
        """The admission loop of ``_schedule_waiting``; ``skipped`` collects the requests it
        passes over (multi-module MTP: no chunk that stays clear of the prefill's end)."""
        cfg = self.cfg
        S = cfg.num_speculative_tokens
        kv = self.kv
        waiting = self.waiting
        while waiting and budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            req = waiting[0]
            hit = kv.lookup(req)
            if hit.tokens < 0:  # its cached state is written by this very step
                break
            c = hit.tokens
            ntok = len(req.token_ids)
            n = ntok - c
            padded = False
            if n == 1 and pad and (ran or c > 0) and c + S + 2 <= cfg.max_model_len:
                if 1 + S > budget:
                    break  # the engine would rather not schedule it than schedule it unpadded
                n = 1 + S
                padded = True
            if 0 < long_thr < n:
                n = long_thr
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            checkpoint, publish = None, False
            if cfg.align_split:
                n, checkpoint, publish = self._align_split(req, c, n, hit)
            if n <= 0:
                break
            if cfg.prefill_lookahead > 1:
                n, checkpoint, publish = self._reserve_lookahead(req, c, n, hit, checkpoint, publish)
                if n <= 0:  # (the engine passes over it to the requests behind it)
                    skipped.append(waiting.popleft())
                    continue
            if padded and n != 1 + S:
                # a cut padded row loses its padding, not its token (vLLM drops it after the
                # align-mode split; without that split it would fail an assertion instead)
                padded = False
                n = 1
                if cfg.align_split:
                    n, checkpoint, publish = self._align_split(req, c, 1, hit)
            req.junction = hit.attention_tokens  # (read by the Mamba managers' publishing)
            # room for the whole sequence, every token of a resumed one included (the engine's
            # full-sequence check counts ``num_tokens``, one more than its prefill)
            new_blocks = kv.allocate(req, c, n, hit, checkpoint, publish,
                                     admit_tokens=min(len(req.token_ids), cfg.max_model_len))
            if new_blocks is None:
                break
            waiting.popleft()
            req.seat = self._seats
            self._seats += 1
            self.running.append(req)
            self._awake.add(req)
            req.status = Status.RUNNING
            first = not req.admitted_once
            req.admitted_once = True
            scheduled.append(ScheduledRequest(
                req.req_id, c, n, tuple(map(tuple, new_blocks)), is_new=True, resumed=req.resumed,
                prefix_hit_tokens=c, spec_token_ids=(PLACEHOLDER_DRAFT,) * S if padded else (),
                prompt_token_ids=req.prompt_ids if first else None,
                num_prompt_tokens=req.num_prompt_tokens))
            req.num_computed_tokens = c + n
            req.prefill_chunk = c + n < ntok
            budget -= n

    @property
    def _max_prefill(self) -> int:
        """The most tokens a prefill chunk may have: the budget, or the long-prefill threshold."""
        cfg = self.cfg
        thr = cfg.long_prefill_token_threshold
        return min(cfg.max_num_batched_tokens, thr) if thr > 0 else cfg.max_num_batched_tokens

    def _reserve_lookahead(self, req: Request, c: int, n: int, hit: Optional[PrefixHit],
                           checkpoint: Optional[int], publish: bool) -> tuple[int, Optional[int], bool]:
        """Multi-module MTP (vLLM 0.33's ``_reserve_prefill_lookahead``): a chunk that would end
        fewer than ``prefill_lookahead`` tokens before the request's last token is shortened to
        leave that many; the align-mode checkpoint and publishing follow the shorter chunk."""
        P = self.cfg.prefill_lookahead
        remaining = len(req.token_ids) - c - n
        if not 0 < remaining < P:
            return n, checkpoint, publish
        n = max(n - (P - remaining), 0)
        if n and self.cfg.align_split and not self.kv.partial:
            # vLLM 0.33 splits no more: the shorter chunk (not a final one, so it writes no
            # checkpoint) may end inside a block; its end state is kept if it is a reachable
            # boundary (partial-hit mode: the managers decide all this themselves)
            junction = hit.attention_tokens if hit is not None else req.junction
            return n, None, keeps_state_at(c + n, junction, req.num_prompt_tokens, self.bs)
        return n, checkpoint, publish

    def _align_split(self, req: Request, start: int, n: int,
                     hit: Optional[PrefixHit]) -> tuple[int, Optional[int], bool]:
        """Align-mode chunking (vLLM 0.33): a prefill chunk that does not finish the prefill
        ends on a block boundary; it also stops at the end of the longest cached prefix (the
        junction with another request's blocks) so that the state there is materialised and
        published. A final chunk that passes its checkpoint (``checkpoint_at``: the last
        block boundary before the chunk's last token) gets a column holding the state there;
        one that does not pass the prefill's checkpoint (``prefill_checkpoint`` of
        ``prefill_end``) stops at the sequence's last boundary before its last token. The
        chunk's end state is published when the chunk ends at the prompt's replay point or
        at the junction.

        The junction is measured once, when the request is admitted (the
        recorded engine keeps it even after the blocks behind it are evicted).

        Returns (tokens, checkpoint column or None, publish the chunk-end state).
        """
        bs = self.bs
        la = self.cfg.prefill_lookahead  # (align split: prefix caching is on)
        if self.kv.partial:  # (partial-block prefix hits: the unit rules, sched.partial)
            junction = hit.attention_tokens if hit is not None else req.junction
            return partial.split(req, start, n, bs, self.kv.unit, la, self._max_prefill, junction), None, False
        end_of_prefill = prefill_end(req.num_prompt_tokens, len(req.token_ids))
        if start >= end_of_prefill:
            return n, None, False
        whole = start + n
        end = whole
        junction = hit.attention_tokens if hit is not None else req.junction
        if start < junction < end:
            end = junction
        elif end < end_of_prefill:
            aligned = end // bs * bs
            # a block longer than any chunk may be (budget, long-prefill threshold) is filled
            # over several chunks that keep a private running state (vLLM 0.33)
            if aligned > start or bs <= self._max_prefill:
                end = aligned
        if start % bs and checkpoint_at(start, end, end_of_prefill, bs, la) is None:
            nxt = (start // bs + 1) * bs  # (a chunk that started mid-block stops at its end)
            if nxt < end:
                end = nxt
        point = prefill_checkpoint(end_of_prefill, bs, la)
        if whole >= end_of_prefill and point <= start:
            # a final chunk with no checkpoint column to write: never past the sequence's last
            # block boundary before its last token (a resumed prefill ending on a boundary
            # stops there, one token short of the end)
            last = prefill_checkpoint(len(req.token_ids), bs, la)
            if start < last < end:
                end = last
        if end <= start:
            return 0, None, False
        at = checkpoint_at(start, end, end_of_prefill, bs, la)
        checkpoint = None if at is None else at // bs - 1
        # the state at the chunk's end is kept if it is at the prompt's replay point or at the
        # junction, whether the chunk was cut there or ends there anyway (end > start here)
        return end - start, checkpoint, keeps_state_at(end, junction, req.num_prompt_tokens, bs)

    def _pick_victim(self) -> Request:
        if self.cfg.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_step, r.index))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        if req.cruising:
            self._land(req, False)
        self._awake.discard(req)
        if self.cfg.num_speculative_tokens and not self.kv.partial:  # (what the engine cached after
            self.kv.publish_computed(req)  # the last update; partial-hit mode caches right then)
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.resumed = True
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, outcome: StepOutcome) -> list[str]:
        """Apply the model's output; returns ids finished in this step."""
        finished = []
        max_len = self.cfg.max_model_len
        reqs = self.requests
        sampled_get = outcome.own_sampled.get  # bulk rows need nothing: they are applied when read
        accepted = outcome.own_accepted
        steady = [] if self._tokens is not None else None  # candidates for bulk decode
        spec = self._drafter is not None
        for s in plan.explicit_rows:
            tokens = sampled_get(s[0])
            if not tokens:
                continue
            req = reqs[s[0]]
            drafts = s[7]
            generated = len(tokens)
            if drafts:
                acc = accepted.get(s[0], len(tokens) - 1)
                generated = acc + 1  # (the model's outputs may already stop short of these)
                rejected = len(drafts) - acc
                if rejected > 0 and req.num_computed_tokens > 0:
                    req.num_computed_tokens -= rejected
            toks = req.token_ids
            room = min(req.max_tokens - (len(toks) - req.num_prompt_tokens), max_len - len(toks))
            if room < len(tokens):
                tokens = tokens[:max(room, 0)]
            if len(tokens) < generated:
                # a stop inside the new tokens: the computed count covers the kept ones but
                # the last (vLLM 0.33; it bounds what the finished request publishes)
                req.num_computed_tokens -= generated - len(tokens)
            toks.extend(tokens)
            if len(toks) // req.hash_block_size > len(req.unit_hashes):
                req.update_hashes()
                if req.hash_lookahead:
                    self.kv.publish_pending(req)
            if self.kv.partial and self.cfg.num_speculative_tokens:  # (cached after the update)
                self.kv.cache_partial(req, min(req.num_computed_tokens, len(toks)))
            if len(toks) - req.num_prompt_tokens >= req.max_tokens or len(toks) >= max_len:
                finished.append(req)
            elif steady is not None and (spec or len(tokens) == 1):
                steady.append(req)
        for req in finished:
            self.running.remove(req)
            self._awake.discard(req)
            req.status = Status.FINISHED
            if self.cfg.num_speculative_tokens and not self.kv.partial:  # cached after the update,
                self.kv.publish_computed(req)  # then freed (vLLM 0.33; partial-hit mode: in the loop)
            self.kv.free(req)
            self._finished_since_last.append(req.req_id)
        self._now = plan.step + 1
        self._at_seat = -1
        if steady:
            if spec:  # they start once the drafter has proposed their next drafts
                self._spec_candidates = steady
            else:
                self._start_cruise(steady)
        return [r.req_id for r in finished]

    def _side_event(self, req: Request, step: int) -> bool:
        """A bulk request's block event, in its place in the pass: the call the step-by-step
        path makes for its one token, after which it stays in bulk (new blocks go into its
        row of this step) and its next event is booked. False, with nothing taken, when
        the pool is short (it must then take the step the normal way, which may preempt)."""
        base = self._cruise[req]
        if type(base) is tuple:
            c = base[0] + step - base[1]
        else:
            c = base.computed[step - base.start]
        kv = self.kv
        if kv.fused:
            got = kv.bulk_event(req, c, c + self._bulk_n)  # (publishing deferred)
        else:
            self._land(req, True)  # its tokens and block hashes as of this step
            got = kv.allocate_running(req, c, self._bulk_n, None, False)
        if got is None:
            return False
        if got:
            self._grown[req] = tuple(map(tuple, got))
        if type(base) is tuple:
            self._book_side(req, c, step)
        else:
            self._book_spec_side(req, base, step - base.start + 1)
        return True

    def _catch_up(self, req: Request, ntok: int) -> None:
        """Extend a bulk request's lagging token list (and block hashes) to ``ntok`` tokens."""
        have = len(req.token_ids)
        if ntok > have:
            req.append_output(self._tokens(req, have - req.num_prompt_tokens, ntok - have))

    def _book_side(self, req: Request, c: int, step: int) -> None:
        """Book the run's next block event: the first step whose token passes one of the
        request's quiet bounds (total or computed), if that is before the run's end."""
        at = step + req.quiet_computed - c + 1
        k = step + req.quiet_total - c
        if k < at:
            at = k
        if at < step:
            at = step
        if at < req.cruise_end:
            self._side_at.setdefault(at, []).append((req, req.cruise_run))

    def _start_cruise(self, reqs: list[Request]) -> None:
        """Put decoding requests that have J >= 2 unfinished steps ahead into bulk mode
        (their block events run as side events in the pass)."""
        max_len = self.cfg.max_model_len
        nxt = self._now
        for req in reqs:
            if req.status != Status.RUNNING or req.spec_token_ids:
                continue
            ntok = len(req.token_ids)
            c = req.num_computed_tokens
            if c != ntok - 1 or c < req.num_prompt_tokens:
                continue
            # step j of the run schedules c + j (one token); the request must not finish in
            # it (the finishing step goes the normal way)
            j = req.max_tokens - (ntok - req.num_prompt_tokens) - 1
            k = max_len - ntok - 1
            if k < j:
                j = k
            if j < 2:
                continue
            self._enter_bulk(req, (c, nxt), nxt + j)
            self._book_side(req, c, nxt)

    def _enter_bulk(self, req: Request, base, end: int) -> None:
        """Start a bulk run (``base``: (computed tokens, step) or a SpecRun) that is woken at
        step ``end``, the first it does not cover."""
        self._cruise[req] = base
        req.cruising = True
        self._awake.discard(req)
        req.cruise_run = self._runs
        self._runs += 1
        req.cruise_end = end
        self._wake_at.setdefault(end, []).append(req)
        if self._deferring:
            self.kv.defer_publishing(req)
            self._book_publish(req, base[1] if type(base) is tuple else base.start)

    def _leave_bulk(self, req: Request) -> None:
        """End the request's bulk run (``_land`` brought it up to date): the pass handles it
        again, and it publishes at each block boundary again."""
        del self._cruise[req]
        req.cruising = False
        self._awake.add(req)
        if self._deferring:
            self.kv.resume_publishing(req)

    # ------------------------------------------------------------------ deferred publishing
    def _due_step(self, req: Request, computed: int, frm: int) -> int:
        """The first step from ``frm`` on at which the bulk request has ``computed`` tokens."""
        base = self._cruise[req]
        if type(base) is tuple:
            d = base[1] + computed - base[0]
            return d if d > frm else frm
        lo = frm - base.start
        return base.start + bisect_left(base.computed, computed, lo if lo > 0 else 0, req.cruise_end - base.start)

    def _book_publish(self, req: Request, frm: int, at: Optional[int] = None) -> None:
        """Book the step, from ``frm`` on, at which the bulk request's next attention block is
        full (the step-by-step path would publish it in that step's pass); ``at``: the
        computed tokens that fill it, if known."""
        if at is None:
            at = self.kv.next_publish_at(req)
        if at >= NO_BOUND:  # (no attention group)
            return
        d = self._due_step(req, at, frm)
        if d < req.cruise_end:
            item = (req.seat, req.cruise_run, req)  # (seats and runs are unique: never compares req)
            bucket = self._pub_at.get(d)
            if bucket is None:
                self._pub_at[d] = [item]
                heappush(self._pub_steps, d)
            else:
                bucket.append(item)

    def _flush_publishing(self) -> None:
        """Publish every deferred block the step-by-step path would have published before
        the pass reached ``(_now, _at_seat)``, in its order.

        Requests are handled one after another, each up to now; that order only matters
        between blocks that hold the same prefix (identical token sequences), and then the
        blocks are published one by one in step, seat and group order. Any block published
        without deferral came before these: this runs before every such publishing."""
        s, p = self._now, self._at_seat
        heap, at = self._pub_steps, self._pub_at
        batch = []
        while heap and heap[0] <= s:
            d = heap[0]
            items = at[d]
            if d == s:  # due in this step: only the requests the pass has been through
                items.sort()
                k = bisect_left(items, (p,))
                if k == 0:
                    break
                if k < len(items):
                    at[d] = items[k:]
                    del items[k:]
                else:
                    heappop(heap)
                    del at[d]
                batch.extend(items)
                break
            heappop(heap)
            del at[d]
            batch.extend(items)
        cruise = self._cruise
        todo = []  # (request, committed tokens, last step it was processed in)
        for seat, run, req in batch:
            if not req.cruising or req.cruise_run != run:
                continue  # (booked in an earlier run)
            last = s if seat < p else s - 1
            base = cruise[req]
            if type(base) is tuple:
                ntok = base[0] + last - base[1] + 1
            else:  # (due means processed at or after the run's first step: the index is >= 0)
                ntok = base.computed[last - base.start] + 1
            if ntok // req.hash_block_size > len(req.unit_hashes):
                self._catch_up(req, ntok)  # block hashes over its committed tokens
            todo.append((req, ntok, last))
        if len(todo) > 1 and not self._distinct_keys(todo):
            self._publish_in_order(todo)
            for req, _, last in todo:
                self._book_publish(req, last + 1)
        else:
            publish = self.kv.publish_deferred
            for req, ntok, last in todo:
                self._book_publish(req, last + 1, publish(req, ntok))

    def _distinct_keys(self, todo: list) -> bool:
        """Whether no two deferred blocks of ``todo`` hold the same prefix."""
        keys = []
        for req, ntok, _ in todo:
            hashes = req.block_hashes
            for m, lo, hi in self.kv.unpublished(req, ntok):
                keys.extend(map(m.key, hashes[lo:hi]))
        return len(set(keys)) == len(keys)

    def _publish_in_order(self, todo: list) -> None:
        """Publish ``todo``'s deferred blocks one by one in the step-by-step order: by the
        step each became full, then seat, then group, then position."""
        blocks = []
        for req, ntok, _ in todo:
            for m, lo, hi in self.kv.unpublished(req, ntok):
                for i in range(lo, hi):
                    d = self._due_step(req, (i + 1) * m.bs - 1, 0)
                    blocks.append((d, req.seat, m.gid, i, req, m))
        blocks.sort(key=lambda b: b[:4])
        for _, _, _, i, req, m in blocks:
            self.kv.publish_block(req, m, i)

    def _book_spec_side(self, req: Request, run: SpecRun, j: int) -> None:
        """``_book_side`` for a run of speculative decoding: the first of its steps from
        ``start + j`` on whose computed or total tokens pass a quiet bound."""
        cs = run.computed
        end = req.cruise_end - run.start
        at = bisect_right(cs, req.quiet_computed, j, end)
        k = bisect_right(cs, req.quiet_total - self._bulk_n, j, at)
        if k < at:
            at = k
        if at < end:
            self._side_at.setdefault(run.start + at, []).append((req, req.cruise_run))

    def _start_spec_runs(self, step: int) -> None:
        """Put requests that sampled last step into bulk speculative decoding, each for the
        steps before the first that could finish it (or shorten its drafts), at most 1,024.
        The runs of all of them are computed in one vectorised pass."""
        cands = self._spec_candidates
        self._spec_candidates = []
        cfg = self.cfg
        S = cfg.num_speculative_tokens
        max_len = cfg.max_model_len
        reqs, k0s, counts = [], [], []
        for req in cands:
            if req.status != Status.RUNNING or req.cruising:
                continue
            spec = req.spec_token_ids
            ntok = len(req.token_ids)
            c = req.num_computed_tokens
            npt = req.num_prompt_tokens
            if len(spec) != S or c != ntok - 1 or c < npt:
                continue
            count = min(req.max_tokens - (ntok - npt), max_len - ntok, 1024)
            if count < 16:  # a run of a few steps costs more to set up than it saves
                continue
            truth = self._tokens(req, ntok - npt, S)
            k0 = 0
            while k0 < S and spec[k0] == truth[k0]:
                k0 += 1
            reqs.append(req)
            k0s.append(k0)
            counts.append(count)
        if not reqs:
            return
        m = len(reqs)
        counts = np.array(counts, dtype=np.int64)
        later = self._drafter.accepted_runs(reqs, np.array([r.draft_round for r in reqs], dtype=np.int64), counts)
        if later is None:
            return
        # run i: entries j = 0 .. counts[i] (step start + j), concatenated
        lens = counts + 1
        first = np.cumsum(lens) - lens
        owner = np.repeat(np.arange(m), lens)
        local = np.arange(int(lens.sum()), dtype=np.int64) - first[owner]
        ks = np.empty(len(owner), dtype=np.int64)
        ks[first] = k0s
        ks[local > 0] = later
        step_tokens = ks + 1
        ends = np.cumsum(step_tokens)
        before = ends - step_tokens  # tokens of earlier entries, concatenated
        c0 = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        cs = c0[owner] + before - before[first][owner]
        # step j could finish the request (max_tokens / max_model_len) or its next proposal
        # could have fewer than S drafts: the run ends before it
        after = cs + 2 + ks  # tokens after step j
        limit = np.array([r.max_tokens + r.num_prompt_tokens for r in reqs], dtype=np.int64)
        stop = (after >= limit[owner]) | (after >= max_len) | (cs + 1 + S > max_len - 1)
        Js = np.minimum.reduceat(np.where(stop, local, counts[owner]), first).tolist()
        ks_all = ks.tolist()
        cs_all = cs.tolist()
        first = first.tolist()
        lens = lens.tolist()
        acc = self._acc_by_step
        need = step + max(Js)
        if len(acc) < need:
            grown = np.zeros(max(2 * len(acc), need + 1024), dtype=np.int64)
            grown[:len(acc)] = acc
            self._acc_by_step = acc = grown
        run_len = np.array(Js, dtype=np.int64)
        run_len[run_len < 2] = 0  # too short to be worth a run
        take = local < run_len[owner]  # entries inside their run
        np.add.at(acc, step + local[take], ks[take])
        for i, req in enumerate(reqs):
            J = Js[i]
            if J < 2:
                continue
            a, b = first[i], first[i] + lens[i]
            run = SpecRun(step, cs_all[a:b], ks_all[a:b], req.draft_round)
            self._enter_bulk(req, run, step + J)
            self._book_spec_side(req, run, 0)
