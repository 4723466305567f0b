"""The planning loop: workload → scheduler → (StepPlan, StepOutcome) per step.

This drives the scheduler the way the engine's core loop does (add arrivals,
apply faults, schedule, run the model, update, propose drafts) with a simulated
model whose outputs are the requests' true continuations. The executor (the
kernels and the oracle) consumes the same plans, whether they come from here or
from a trace file.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, Iterator, Optional

import numpy as np

from .config import PreemptFault, ResetPrefixCacheFault, Scenario
from .outputs import (Continuation, DraftSource, ModelDrafts, RecordedContinuation, SeededContinuation, acceptance_model,
                      make_drafter)
from .sched.groups import GroupSpec, scenario_groups
from .sched.hashing import block_hashes_many
from .sched.kv_cache import KVCacheManager
from .sched.plan import PLACEHOLDER_DRAFT, StepOutcome, StepPlan
from .sched.request import Request, Status
from .sched.scheduler import Scheduler, SchedulerConfig
from .workload.base import Workload


@dataclass
class RunStats:
    steps: int = 0
    last_step: int = -1
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    forced_preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_queries: int = 0
    drafts_scheduled: int = 0
    drafts_accepted: int = 0
    padded_rows: int = 0  # admissions padded with placeholder drafts (PLACEHOLDER_DRAFT), not counted above
    peak_blocks_in_use: int = 0
    evictions: int = 0
    stalled: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / self.drafts_scheduled if self.drafts_scheduled else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["hit_rate"] = round(self.hit_rate, 6)
        d["acceptance_rate"] = round(self.acceptance_rate, 6)
        return d


def scheduler_config(s: Scenario) -> SchedulerConfig:
    geo = s.geometry()
    mode = s.cache.resolved_mode()
    return SchedulerConfig(
        max_num_batched_tokens=s.scheduler.max_num_batched_tokens,
        max_num_seqs=s.scheduler.max_num_seqs,
        max_model_len=s.scheduler.max_model_len,
        enable_chunked_prefill=s.scheduler.enable_chunked_prefill,
        long_prefill_token_threshold=s.scheduler.long_prefill_token_threshold,
        policy=s.scheduler.policy,
        num_speculative_tokens=s.spec_decode.num_speculative_tokens,
        align_split=geo.mamba is not None and mode == "align" and s.cache.enable_prefix_caching,
        prefill_lookahead=s.spec_decode.prefill_lookahead,
    )


STALL_STEPS = 1000  # steps with nothing scheduled, no arrival to come: the run has stalled


class StallWatch:
    """The stall rule every planner's loop keeps (ours, and another engine's driven live): after
    ``STALL_STEPS`` steps in a row with nothing scheduled and no arrival to come, the run is marked
    stalled and its loop yields that step and stops."""

    def __init__(self) -> None:
        self.idle = 0

    def stalled(self, rows: int, arrivals_left: bool, stats: "RunStats", step: int) -> bool:
        self.idle = 0 if rows else self.idle + 1
        if self.idle <= STALL_STEPS or arrivals_left:
            return False
        stats.stalled = True
        stats.notes.append(f"stalled: nothing schedulable for {STALL_STEPS} steps (at step {step})")
        return True


class FaultBook:
    """A scenario's faults by step, as every planner's loop applies them (ours, and another engine's
    driven live), and what the run says of a fault that did nothing: a ``preempt`` fault acts only on
    requests running at its step, and a fault at a step the run never reached never acted. An idle
    stretch (nothing to schedule until the next arrival) is not skipped past a fault's step: a prefix
    cache reset there still drops what was cached."""

    def __init__(self, faults) -> None:
        self.by_step: dict[int, list] = {}
        for f in faults:
            self.by_step.setdefault(f.at_step, []).append(f)
        self.notes: list[str] = []

    def __contains__(self, step: int) -> bool:
        return step in self.by_step

    def __getitem__(self, step: int) -> list:
        return self.by_step[step]

    def next_step(self, step: int, arrival: int) -> int:
        """Where an idle loop at ``step`` goes on: the next arrival's step, or an earlier fault's."""
        later = [s for s in self.by_step if step < s < arrival]
        return max(step + 1, min(later, default=arrival))

    def missed(self, step: int, names: list[str], why: Callable[[str], str]) -> None:
        """A preempt fault's requests it could not preempt at ``step``, each with ``why`` (its state)."""
        if names:
            self.notes.append(f"fault at step {step}: preempt did not preempt "
                              + "; ".join(f"{rid} ({why(rid)})" for rid in names)
                              + ": it acts on running requests only")

    def ended(self, last_step: int) -> list[str]:
        """Notes for the faults past the run's last step, with the ones ``missed`` found."""
        late = sorted(s for s in self.by_step if s > last_step)
        if late:
            self.notes.append(f"fault{'s' if len(late) > 1 else ''} at step{'s' if len(late) > 1 else ''} "
                              f"{', '.join(map(str, late))} never acted: the run ended at step {last_step}")
        return self.notes


def kv_groups(s: Scenario) -> list[GroupSpec]:
    """The scenario's KV cache groups, as the engine forms them (sched/groups.py)."""
    return scenario_groups(s)


_STREAM_BATCH_TOKENS = 1 << 16


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, and back as it was after.

    What the block made (token lists of a whole trace: millions of items) goes straight to
    the collector's oldest generation, as ``gc.freeze`` + ``gc.unfreeze`` does: re-enabled
    as is, the collector would first walk all of it as young objects (~14 ms after building
    2,000 Mooncake requests), then again as middle-aged ones, although it outlives the run.
    Cycles made meanwhile are still collected, but only by the next full collection, which
    can be far off: so a simulation holds no reference cycle (dropping one frees it at once;
    tests/test_scheduler.py). Skipped when the program has frozen objects of its own
    (unfreezing would thaw those too)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _make_requests(workload: Workload, hash_bs: int, hash_lookahead: int = 0, block_size: int = 0) -> list[Request]:
    """The scheduler's requests, with the prompts' block hashes computed in one vectorised
    pass when the workload has its prompts as one array. The garbage collector is paused
    meanwhile: it would otherwise walk the growing token lists again and again."""
    wreqs = workload.requests
    with _collector_paused():
        hashes = None
        flat = workload.prompt_tokens
        if flat is not None and not hash_lookahead:
            lengths = [len(w.prompt) for w in wreqs]
            if flat.size == sum(lengths):
                hashes = block_hashes_many(flat, np.cumsum([0] + lengths[:-1]).tolist(), lengths, hash_bs)
        return [Request(w.req_id, i, w.arrival_step, w.prompt, w.max_tokens, w.priority,
                        w.output_seed, hash_bs, hashes[i] if hashes is not None else None, hash_lookahead,
                        block_size)
                for i, w in enumerate(wreqs)]


class _TrueOutputs:
    """The requests' true continuations (what the model commits), generated on first need.

    Shared by the simulated model and bulk decode (``Scheduler.enable_cruise``); it holds no
    reference to the Simulation, so a dropped Simulation is freed at once, without waiting
    for the cyclic collector."""

    __slots__ = ("cont", "requests", "extra")

    def __init__(self, cont: Continuation, requests: list[Request], num_speculative_tokens: int):
        self.cont = cont
        self.requests = requests
        self.extra = num_speculative_tokens + 2  # drafts are verified past max_tokens

    def tokens(self, req: Request, start: int, count: int) -> list[int]:
        """Output tokens start .. start+count-1 as the model commits them (bulk decode)."""
        stream = req.out_stream
        if stream is None:
            stream = self.stream(req)
        return stream[start:start + count]

    def stream(self, req: Request) -> list[int]:
        """The request's true continuation, long enough to verify drafts past max_tokens.

        A seeded continuation is generated for this and the following requests at once
        (they usually start sampling soon after it), up to ~64k tokens a batch."""
        extra = self.extra
        if not isinstance(self.cont, SeededContinuation):
            req.out_stream = self.cont.stream(req, req.max_tokens + extra)
            return req.out_stream
        batch, lengths, total = [], [], 0
        reqs = self.requests
        for i in range(req.index, len(reqs)):
            r = reqs[i]
            if r.out_stream is not None:
                break  # the batch that reached here already covers what follows
            n = r.max_tokens + extra
            if batch and total + n > _STREAM_BATCH_TOKENS:
                break
            batch.append(r)
            lengths.append(n)
            total += n
        for r, s in zip(batch, self.cont.streams(batch, lengths)):
            r.out_stream = s
        return req.out_stream


class Simulation:
    """Iterate over ``(plan, outcome)``; ``stats`` fills in as it goes."""

    def __init__(self, scenario: Scenario, workload: Workload, *,
                 continuation: Optional[Continuation] = None,
                 drafter: Optional[DraftSource] = None,
                 groups: Optional[list[GroupSpec]] = None,
                 sched_cfg: Optional[SchedulerConfig] = None,
                 num_blocks: Optional[int] = None,
                 checker=None, check_every: int = 1, bulk_decode: bool = True, fused_events: bool = True):
        self.scenario = scenario
        self.workload = workload
        self.groups = groups or kv_groups(scenario)
        cfg = sched_cfg or scheduler_config(scenario)
        drafter_model = scenario.spec_decode.method != "ngram"
        # a draft model (MTP / EAGLE): lookahead slots, lookahead hashes; planned step by step
        # (the fused and bulk paths know neither)
        lookahead = scenario.spec_decode.prefill_lookahead if scenario.cache.enable_prefix_caching else 0
        self.kv = KVCacheManager(self.groups, num_blocks or scenario.cache.num_blocks,
                                 scenario.cache.enable_prefix_caching, fused_events and not drafter_model,
                                 max_model_len=scenario.scheduler.max_model_len,
                                 # (only vLLM's one-group coordinator holds the re-prefillable
                                 # tail back; a drafter's group makes every layout hybrid)
                                 reprefill=max(scenario.spec_decode.prefill_lookahead - 1, 0)
                                 if len(self.groups) == 1 else 0, hash_lookahead=lookahead,
                                 unit=scenario.cache.prefix_match_unit or 0,
                                 # (MTP with several modules: vLLM 0.33's Mamba rules read off one
                                 # by one, sched.partial, as with partial-block hits)
                                 mirror=drafter_model and scenario.spec_decode.prefill_lookahead > 1)
        if drafter_model or self.kv.partial:  # (partial-block hits: step by step too)
            bulk_decode = False
        self.scheduler = Scheduler(cfg, self.kv)
        if continuation is None:
            continuation = (RecordedContinuation(workload.outputs, workload.vocab_size) if workload.outputs is not None
                            else SeededContinuation(workload.vocab_size))
        self.cont = continuation
        if drafter is None and cfg.num_speculative_tokens > 0:
            drafter = make_drafter(cfg.num_speculative_tokens, self.cont,
                                   acceptance_model(scenario.spec_decode.acceptance, scenario.seed),
                                   workload.vocab_size, cfg.max_model_len)
        self.drafter = drafter
        self.requests = _make_requests(workload, self.kv.unit, lookahead, self.kv.block_size)
        self.outputs = _TrueOutputs(self.cont, self.requests, cfg.num_speculative_tokens)
        if bulk_decode:  # steady decodes advanced in bulk (same plans; see Scheduler.enable_cruise)
            self.scheduler.enable_cruise(self.outputs.tokens, drafter if isinstance(drafter, ModelDrafts) else None)
        self.max_steps = scenario.execution.max_steps
        self.checker = checker  # sched.invariants (None: not checked)
        self.check_every = max(1, check_every)
        self.schedule_s = 0.0
        self.update_s = 0.0
        self.last_tokens = (0, 0)  # (prefill, decode) tokens of the last step
        self.faults = FaultBook(scenario.faults)
        self.stats = RunStats(requests=len(self.requests),
                              prompt_tokens=sum(r.num_prompt_tokens for r in self.requests))
        self.stats.notes.extend(workload.notes)

    def __iter__(self) -> Iterator[tuple[StepPlan, StepOutcome]]:
        sched = self.scheduler
        pool = self.kv.pool
        stats = self.stats
        drafter = self.drafter
        reqs = self.requests
        usable = pool.num_blocks - 1
        nxt = 0
        step = 0
        stall = StallWatch()
        while step < self.max_steps:
            while nxt < len(reqs) and reqs[nxt].arrival_step <= step:
                sched.add_request(reqs[nxt])
                nxt += 1
            fault_names: tuple[str, ...] = ()
            forced: tuple[str, ...] = ()
            if step in self.faults:
                fault_names, forced = self._apply_faults(step)
            if not sched.has_work():
                if nxt >= len(reqs):
                    break
                step = self.faults.next_step(step, reqs[nxt].arrival_step)
                continue
            t0 = perf_counter()
            plan = sched.schedule(step, fault_names, forced)
            t1 = perf_counter()
            self.schedule_s += t1 - t0
            checking = self.checker is not None and stats.steps % self.check_every == 0
            if checking:
                self.checker.after_schedule(plan)
            sampled, accepted = self._model_step(plan)
            in_use = usable - pool.num_free
            if in_use > stats.peak_blocks_in_use:
                stats.peak_blocks_in_use = in_use
            t2 = perf_counter()
            finished = sched.update(plan, StepOutcome(sampled, accepted))
            outcome = StepOutcome(sampled, accepted, tuple(finished), plan)
            if self.checker is not None:  # cheap; keeps the monotonicity baseline current
                self.checker.after_update(plan, outcome)
            self.update_s += perf_counter() - t2
            stats.finished += len(finished)
            stats.preemptions += len(plan.preempted)
            if drafter is not None:
                byid = sched.requests
                live = [req for req in map(byid.__getitem__, sampled) if req.status == Status.RUNNING]
                if live:
                    many = getattr(drafter, "propose_many", None)
                    proposals = many(live) if many is not None else [drafter.propose(r) for r in live]
                    for req, drafts in zip(live, proposals):
                        req.spec_token_ids = drafts
            stats.steps += 1
            stats.last_step = step
            if stall.stalled(plan.num_rows, nxt < len(reqs), stats, step):
                yield plan, outcome
                break
            yield plan, outcome
            step += 1
        sched.sync()  # requests advanced in bulk: their counters and tokens, as of the last step
        stats.prefill_tokens = stats.scheduled_tokens - stats.decode_tokens
        stats.evictions = pool.evictions
        stats.notes.extend(self.faults.ended(stats.last_step))
        unfinished = sum(1 for r in reqs if r.status != Status.FINISHED)
        if unfinished:
            stats.notes.append(f"{unfinished} request(s) unfinished at max_steps ({self.max_steps})")

    def _model_step(self, plan: StepPlan) -> tuple[dict, dict]:
        """The simulated forward pass: for every request whose chunk reached its end, the
        tokens the model commits (drafts verified against the true continuation)."""
        stats = self.stats
        byid = self.scheduler.requests
        max_len = self.scheduler.cfg.max_model_len
        stream_of = self.outputs.stream
        sampled: dict[str, tuple[int, ...]] = {}
        accepted: dict[str, int] = {}
        bulk = plan.num_bulk  # rows advanced in bulk: one decode token (+ drafts) each, sampled when read
        scheduled_tokens = decode_tokens = out_tokens = bulk
        if bulk:
            cruise = plan.bulk
            if cruise.num_spec:
                scheduled_tokens = decode_tokens = bulk * (1 + cruise.num_spec)
                out_tokens += cruise.accepted
                stats.drafts_scheduled += bulk * cruise.num_spec
                stats.drafts_accepted += cruise.accepted
        for s in plan.explicit_rows:
            rid, c, n = s[0], s[1], s[2]
            scheduled_tokens += n
            if s[4] and not s[5]:  # first admission: prefix-cache query
                stats.prefix_queries += s[9]
                stats.prefix_hit_tokens += s[6]
            req = byid[rid]
            toks_list = req.token_ids
            ntok = len(toks_list)
            if req.num_computed_tokens < ntok:
                continue  # a prefill chunk that did not reach the end samples nothing
            if c >= ntok - 1:
                decode_tokens += n
            o = ntok - req.num_prompt_tokens
            stream = req.out_stream
            if stream is None:
                stream = stream_of(req)
            drafts = s[7]
            if drafts:
                k = 0
                nd = len(drafts)
                while k < nd and drafts[k] == stream[o + k]:
                    k += 1
                toks = tuple(stream[o:o + k + 1])
                accepted[rid] = k  # what the verifier accepted, before any length cap
                if drafts[0] == PLACEHOLDER_DRAFT:  # padding, never a proposal (and never accepted)
                    stats.padded_rows += 1
                else:
                    stats.drafts_scheduled += nd
                    stats.drafts_accepted += k
            else:
                toks = (stream[o],)
            room = req.max_tokens - o
            if max_len - ntok < room:
                room = max_len - ntok
            if len(toks) > room:
                toks = toks[:room]  # committed tokens stop at max_tokens / max_model_len
            sampled[rid] = toks
            out_tokens += len(toks)
        stats.scheduled_tokens += scheduled_tokens
        stats.decode_tokens += decode_tokens
        stats.output_tokens += out_tokens
        self.last_tokens = (scheduled_tokens - decode_tokens, decode_tokens)
        return sampled, accepted

    def _whereabouts(self, rid: str) -> str:
        """Where a request stands, for a fault that could not preempt it."""
        req = self.scheduler.requests.get(rid)
        if req is None:  # (not arrived; or, in a shrunk trace's workload, gone)
            arrival = next((r.arrival_step for r in self.requests if r.req_id == rid), None)
            return "not in the workload" if arrival is None else f"arrives at step {arrival}"
        return {Status.WAITING: "waiting", Status.PREEMPTED: "waiting to resume",
                Status.FINISHED: "finished"}.get(req.status, req.status.name.lower())

    def _apply_faults(self, step: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        names, forced = [], []
        for f in self.faults[step]:
            if isinstance(f, ResetPrefixCacheFault):
                got = self.scheduler.reset_prefix_cache()
                forced.extend(got)
                self.stats.forced_preemptions += len(got)
                names.append("reset_prefix_cache")
            elif isinstance(f, PreemptFault):
                got = self.scheduler.force_preempt(f.requests)
                self.stats.forced_preemptions += len(got)
                names.append(f"preempt:{','.join(f.requests)}")
                self.faults.missed(step, [r for r in f.requests if r not in got], self._whereabouts)
        return tuple(names), tuple(forced)

    def run(self) -> RunStats:
        """Plan the whole run. The cyclic garbage collector is paused meanwhile (and restored
        after): planning makes many short-lived objects and no reference cycles (all freed by
        reference counting; a test checks), and the collector's passes over the long-lived
        ones (token lists, block rows) cost 3-6% of a trace's planning, more when a full
        collection lands in it."""
        with _collector_paused():
            for _ in self:
                pass
        return self.stats
