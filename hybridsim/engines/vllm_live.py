"""A scenario planned by vLLM's own scheduler, step by step: ``VllmPlanner`` yields
``(StepPlan, StepOutcome)`` as ``simulate.Simulation`` does, so ``runner.plan_scenario`` records,
executes and checks vLLM's plans as it does ours.

The loop is ours (``Simulation.__iter__``): the step's arrivals, the faults, a step only when
there is work (an idle stretch before the next arrival is skipped, as ours skips it), schedule,
the simulated model, update, drafts. What is vLLM's is every decision: which requests run with
how many tokens, prefix hits, preemptions, block ids. The faults are driven through vLLM's own
entry points: ``reset_prefix_cache`` through ``Scheduler.reset_prefix_cache(reset_running_requests
=True)``, ``preempt`` by taking the request off vLLM's running queue and handing it to its
preemption routine (``Scheduler._preempt_request``), which is what its scheduling pass does.
"""

from __future__ import annotations

from time import perf_counter
from typing import Iterator, Optional

from ..checks import Checks, CheckTally, Failure
from ..config import PreemptFault, ResetPrefixCacheFault, Scenario
from ..convert import recorded_step
from ..errors import InputError
from ..outputs import RecordedContinuation, SeededContinuation, acceptance_model, make_drafter
from ..sched.plan import PLACEHOLDER_DRAFT, StepOutcome, StepPlan
from ..sched.request import Request as Mirror
from ..simulate import FaultBook, RunStats, StallWatch, kv_groups
from ..trace import Trace, check_accounting, header_dict
from ..workload.base import Workload
from .vllm import (in_schedule_order, make_scheduler, model_outputs, recording_step, request_hasher, runner_output,
                   scenario_shape)

PLAN_CHECK = "plan.accounting"
ENGINE_CHECK = "vllm.scheduler"  # fails when vLLM's scheduler raises (an assertion of its own)


class _PoolView:
    """What the run loop reads of the block pool (``runner.plan_scenario``): vLLM's free count."""

    def __init__(self, sched, num_blocks: int):
        self._pool = sched.kv_cache_manager.block_pool
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.get_num_free_blocks()


class PlanChecker:
    """``plan.accounting``: what must hold of any engine's plans, read off the plans and vLLM's own
    pool. Per step, right after vLLM's ``schedule``: the token budget and the seats; no block in more of
    vLLM's rows than its reference count says, and the blocks in use plus free within the pool. At the end, the
    trace's token accounting (``trace.check_accounting``, as ``replay`` verifies a trace), its
    first inconsistency a failure at its step."""

    def __init__(self, planner: "VllmPlanner", tally: CheckTally):
        self.p = planner
        self.tally = tally
        self.records: list[tuple[int, StepPlan, StepOutcome]] = []

    def _fail(self, step: int, req: Optional[str], msg: str) -> None:
        self.tally.failed(Failure(step, req, msg))

    def after_schedule(self, step: int, out) -> None:
        """Right after vLLM's ``schedule`` (its ``SchedulerOutput``), before the model runs."""
        s = self.p.scenario.scheduler
        sched = self.p.scheduler
        total = sum(out.num_scheduled_tokens.values())
        if total > s.max_num_batched_tokens:
            self._fail(step, None, f"{total} tokens scheduled, budget {s.max_num_batched_tokens}")
        if len(sched.running) > s.max_num_seqs:
            self._fail(step, None, f"{len(sched.running)} running, max_num_seqs {s.max_num_seqs}")
        self._check_blocks(step)
        self.tally.passed(2)

    def _check_blocks(self, step: int) -> None:
        mgr = self.p.scheduler.kv_cache_manager
        owners: dict[int, int] = {}
        ref: dict[int, int] = {}
        for m in mgr.coordinator.single_type_managers:
            for row in m.req_to_blocks.values():
                for b in row:
                    if b.is_null:
                        continue
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
                    ref[b.block_id] = b.ref_cnt
        for b, n in owners.items():
            if ref[b] < n:  # (a row may be let go of later in the step: a copy-on-write source)
                self._fail(step, None, f"block {b} is in {n} of vLLM's rows but its ref count is {ref[b]}")
        pool = mgr.block_pool
        if len(owners) + pool.get_num_free_blocks() > pool.num_gpu_blocks - 1:
            self._fail(step, None, f"{len(owners)} blocks in use + {pool.get_num_free_blocks()} free > "
                                   f"{pool.num_gpu_blocks - 1}")
        self.tally.passed(len(owners) + 1)

    def after_update(self, plan: StepPlan, outcome: StepOutcome) -> None:
        self.records.append((plan.step, plan, outcome))
        self.tally.passed(1)

    def finish(self) -> None:
        p = self.p
        trace = Trace(p.source, header_dict(p.scenario.model_dump(mode="json"), p.groups, p.workload.requests,
                                            "vllm"), self.records)
        try:
            check_accounting(trace)  # (messages name "<source>:<step>")
        except InputError as e:
            step = int(str(e.where).rsplit(":", 1)[1]) if e.where else -1
            self._fail(step, None, e.message)
        else:
            self.tally.passed(len(self.records))


class VllmPlanner:
    """Iterate over ``(plan, outcome)`` planned by vLLM's scheduler; ``stats`` fills in as it goes."""

    def __init__(self, scenario: Scenario, workload: Workload, source: str = "<vLLM plan>",
                 checks: Optional[Checks] = None):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.scenario = scenario
        self.workload = workload
        self.source = source
        self.groups = kv_groups(scenario)
        shape = scenario_shape(scenario, self.groups)
        self.scheduler = make_scheduler(shape)
        self.kv = _KVView(self.scheduler, scenario.cache.num_blocks)
        hasher = request_hasher(shape, self.scheduler)
        wreqs = workload.requests
        n = len(wreqs)
        # hybridsim's view of each request (token ids as vLLM holds them): what our drafter and
        # acceptance model read (no block hashes: a hashing unit longer than any request)
        self.mirrors = {w.req_id: Mirror(w.req_id, i, w.arrival_step, w.prompt, w.max_tokens, w.priority,
                                         w.output_seed, hash_block_size=1 << 62) for i, w in enumerate(wreqs)}
        self.requests = [(w.arrival_step, Request(
            w.req_id, list(w.prompt), SamplingParams(max_tokens=w.max_tokens, ignore_eos=True), None,
            # (the priority policy breaks ties by arrival, then by the request's place in the workload)
            arrival_time=w.arrival_step + i / (n + 1), priority=w.priority, block_hasher=hasher))
            for i, w in enumerate(wreqs)]
        S = scenario.spec_decode.num_speculative_tokens
        self.cont = (RecordedContinuation(workload.outputs, workload.vocab_size) if workload.outputs is not None
                     else SeededContinuation(workload.vocab_size))
        self.drafter = make_drafter(S, self.cont, acceptance_model(scenario.spec_decode.acceptance, scenario.seed),
                                    workload.vocab_size, scenario.scheduler.max_model_len)
        self._extra = S + 2  # (drafts are verified past max_tokens)
        self.prompts = {w.req_id: tuple(w.prompt) for w in wreqs}
        self.max_steps = scenario.execution.max_steps
        self.checker = None
        self.check_every = 1
        self.schedule_s = 0.0
        self.update_s = 0.0
        self.last_tokens = (0, 0)
        self.faults = FaultBook(scenario.faults)
        self.stats = RunStats(requests=n, prompt_tokens=sum(len(w.prompt) for w in wreqs))
        self.stats.notes.extend(workload.notes)
        self._preempted: list[str] = []  # every preemption, in vLLM's order (its routine, observed)
        self._evictions = 0
        self._observe(self.scheduler)
        self.checks = checks  # (where a crash of vLLM's scheduler is reported: ENGINE_CHECK)

    def _observe(self, sched) -> None:
        """Note each preemption (vLLM reports a step's as a set; plans list them in order) and
        each eviction of a cached block, as vLLM's own routines make them."""
        preempt = sched._preempt_request
        pool = sched.kv_cache_manager.block_pool
        evict = pool._maybe_evict_cached_block

        def preempting(request, *a, **k):
            self._preempted.append(request.request_id)
            return preempt(request, *a, **k)

        def evicting(block, *a, **k):
            done = evict(block, *a, **k)
            self._evictions += bool(done)
            return done

        sched._preempt_request = preempting
        pool._maybe_evict_cached_block = evicting

    def truth(self, rid: str) -> list[int]:
        """The request's true continuation, long enough to verify drafts past max_tokens."""
        m = self.mirrors[rid]
        if m.out_stream is None:
            m.out_stream = self.cont.stream(m, m.max_tokens + self._extra)
        return m.out_stream

    def _has_work(self) -> bool:
        sched = self.scheduler
        return sched.has_unfinished_requests() or bool(sched.finished_req_ids)

    def _whereabouts(self, rid: str) -> str:
        """Where a request stands, for a fault that could not preempt it (as ``Simulation``'s says)."""
        arrival, req = next(((a, r) for a, r in self.requests if r.request_id == rid), (None, None))
        if req is None:
            return "not in the workload"
        if req.is_finished():
            return "finished"
        if rid not in self.scheduler.requests:
            return f"arrives at step {arrival}"
        state = req.status.name.lower()
        return "waiting to resume" if state == "preempted" else state

    def _apply_faults(self, step: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """The step's faults through vLLM's entry points: (names, forced by a reset, preempted)."""
        sched = self.scheduler
        names, forced, preempted = [], [], []
        for f in self.faults[step]:
            if isinstance(f, ResetPrefixCacheFault):
                del self._preempted[:]
                sched.reset_prefix_cache(reset_running_requests=True)
                got = self._preempted[::-1]  # (popped from the back: listed in running order)
                forced.extend(got)
                self.stats.forced_preemptions += len(got)
                names.append("reset_prefix_cache")
            elif isinstance(f, PreemptFault):
                got = []
                for rid in f.requests:
                    req = sched.requests.get(rid)
                    if req is not None and req in sched.running:
                        sched.running.remove(req)
                        sched._preempt_request(req, 0.0)
                        got.append(rid)
                preempted.extend(got)
                self.stats.forced_preemptions += len(got)
                names.append(f"preempt:{','.join(f.requests)}")
                self.faults.missed(step, [r for r in f.requests if r not in got], self._whereabouts)
        return tuple(names), tuple(forced), tuple(preempted)

    def __iter__(self) -> Iterator[tuple[StepPlan, StepOutcome]]:
        from vllm.v1.outputs import DraftTokenIds

        sched = self.scheduler
        stats = self.stats
        reqs = self.requests
        usable = self.scenario.cache.num_blocks - 1
        admitted: set[str] = set()
        finished_before: list[str] = []  # finished by the previous step, in the order they finished
        nxt = 0
        step = 0
        stall = StallWatch()
        while step < self.max_steps:
            while nxt < len(reqs) and reqs[nxt][0] <= step:
                sched.add_request(reqs[nxt][1])
                nxt += 1
            faults: tuple[str, ...] = ()
            forced: tuple[str, ...] = ()
            by_fault: tuple[str, ...] = ()
            if step in self.faults:
                faults, forced, by_fault = self._apply_faults(step)
            if not self._has_work():
                if nxt >= len(reqs):
                    break
                step = self.faults.next_step(step, reqs[nxt][0])
                continue
            del self._preempted[:]
            t0 = perf_counter()
            try:
                out = sched.schedule()
            except Exception as e:  # (the system under test failed: a check failure, not ours to crash on)
                self._crashed(step, "schedule", e)
                break
            t1 = perf_counter()
            self.schedule_s += t1 - t0
            if self.checker is not None:
                self.checker.after_schedule(step, out)
            line = in_schedule_order(recording_step(step, out), out)
            reported = set(out.preempted_req_ids or ()) - set(forced)
            line["preempted_req_ids"] = [r for r in by_fault + tuple(self._preempted) if r in reported]
            line["preempted_req_ids"] += sorted(reported - set(line["preempted_req_ids"]))
            done_before = set(out.finished_req_ids)
            line["finished_req_ids"] = [r for r in finished_before if r in done_before] + \
                sorted(done_before - set(finished_before))
            line.update(faults=list(faults), forced=list(forced))
            ids, given, accepted = model_outputs(sched, out, self.truth)
            committed = {}
            for rid, toks in zip(ids, given):
                if toks:
                    req = sched.requests[rid]
                    room = min(req.max_tokens - req.num_output_tokens, self.scenario.scheduler.max_model_len
                               - req.num_tokens)
                    committed[rid] = toks if len(toks) <= room else toks[:room]  # (as ours commits)
            line.update(sampled_token_ids=committed, accepted=accepted)
            in_use = usable - self.kv.pool.num_free  # (as ours: after the step ran, before its update frees)
            t2 = perf_counter()
            try:
                sched.update_from_output(out, runner_output(ids, given))
            except Exception as e:
                self._crashed(step, "update_from_output", e)
                break
            finished = [rid for rid in ids if rid not in sched.requests or sched.requests[rid].is_finished()]
            line["finished_this_step"] = finished
            plan, outcome = recorded_step(line, self.prompts, admitted)
            for rid, toks in committed.items():
                self.mirrors[rid].token_ids.extend(toks)
            if self.drafter is not None:
                live = [rid for rid in committed if rid in sched.requests and not sched.requests[rid].is_finished()]
                if live:
                    sched.update_draft_token_ids(DraftTokenIds(live, [self.drafter.propose(self.mirrors[r])
                                                                      for r in live]))
            self.update_s += perf_counter() - t2
            if self.checker is not None:
                self.checker.after_update(plan, outcome)
            finished_before = finished
            self._count(plan, outcome, in_use)
            if stall.stalled(plan.num_rows, nxt < len(reqs), stats, step):
                yield plan, outcome
                break
            yield plan, outcome
            step += 1
        stats.prefill_tokens = stats.scheduled_tokens - stats.decode_tokens
        stats.evictions = self._evictions
        stats.notes.extend(self.faults.ended(stats.last_step))
        unfinished = sum(1 for _, r in reqs if not r.is_finished())
        if unfinished:
            stats.notes.append(f"{unfinished} request(s) unfinished at max_steps ({self.max_steps})")
        if self.checker is not None:
            self.checker.finish()

    def _crashed(self, step: int, where: str, e: Exception) -> None:
        """vLLM's scheduler raised: the run stops there, and ``ENGINE_CHECK`` fails with what it said."""
        import traceback

        frame = traceback.extract_tb(e.__traceback__)[-1]
        msg = (f"vLLM's Scheduler.{where} raised {type(e).__name__}"
               + (f": {e}" if str(e) else "") + f" ({frame.filename.rsplit('/site-packages/', 1)[-1]}:{frame.lineno})")
        self.stats.notes.append(f"step {step}: {msg}; the run stopped there")
        if self.checks is not None:
            self.checks.get(ENGINE_CHECK).failed(Failure(step, None, msg))

    def _count(self, plan: StepPlan, outcome: StepOutcome, in_use: int) -> None:
        """The run's totals, counted as ``Simulation`` counts its own plans."""
        st = self.stats
        st.steps += 1
        st.last_step = plan.step
        st.finished += len(outcome.finished)
        st.preemptions += len(plan.preempted)
        st.peak_blocks_in_use = max(st.peak_blocks_in_use, in_use)
        prefill = decode = 0
        for s in plan.scheduled:
            n = s.num_scheduled_tokens
            if s.is_new and not s.resumed:  # first admission: prefix-cache query
                st.prefix_queries += s.num_prompt_tokens
                st.prefix_hit_tokens += s.prefix_hit_tokens
            mirror = self.mirrors[s.req_id]
            out = outcome.sampled.get(s.req_id)
            if out:
                # (the tokens before this step's: the row decodes when it starts at the last one)
                if s.num_computed_tokens >= mirror.num_tokens - len(out) - 1:
                    decode += n
                st.output_tokens += len(out)
                if s.spec_token_ids:
                    if s.spec_token_ids[0] == PLACEHOLDER_DRAFT:
                        st.padded_rows += 1
                    else:
                        st.drafts_scheduled += len(s.spec_token_ids)
                        st.drafts_accepted += outcome.accepted.get(s.req_id, 0)
            prefill += n
        st.scheduled_tokens += prefill
        st.decode_tokens += decode
        self.last_tokens = (prefill - decode, decode)


class _KVView:
    """``planner.kv.pool``: where the run loop looks for the pool (as on ``Simulation``)."""

    def __init__(self, sched, num_blocks: int):
        self.pool = _PoolView(sched, num_blocks)
