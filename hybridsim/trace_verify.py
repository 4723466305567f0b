"""The recorded schedule held to the engine's rules before any step of it executes (``sched.recorded``).

A trace is a claim about what a scheduler did. The token accounting (``trace.check_accounting``)
proves the claim adds up; this walk proves it is a schedule the engine could have made, group by
group, from the header's KV-cache groups, pool size and scheduler limits alone:

* blocks: every block id lies inside the pool; a block given to a request is free at that moment,
  or (in an admission's prefix hit) a cached block holding the same prefix at the same column;
  no two live requests hold one block unless it is such a shared cached block; a block a request
  released (finish, preemption, a Mamba column left behind) is never used again unless it is
  given again under the same rules; every scheduled request's rows cover the tokens it computes
  (attention: a block per ``block_size`` tokens; Mamba: the running column and one per draft);
* lifecycle: ``preempted``, ``forced`` and ``finished`` name running requests, each once; a
  request that finished with a step (``done``) is reported in the next step's ``finished`` and
  never scheduled, preempted or given output again; admissions are of waiting requests,
  ``resumed`` exactly when the request ran before; outputs stop at ``max_tokens`` and
  ``max_model_len``, and a request that reaches either finishes with that step;
* limits: running requests <= ``max_num_seqs``, scheduled tokens <= ``max_num_batched_tokens``,
  drafts <= ``num_speculative_tokens``, accepted drafts are the committed tokens they stand for;
* tokens: prompt, draft and output ids inside the vocabulary (``vocab_bounds``); where the header
  names a seeded continuation (``seeded_outputs``) every output equals the workload's true token;
* a vLLM recording's free-block count after every step equals the pool less the blocks held.

Where a rule is vLLM 0.33's own (Mamba column release, draft-column recycling) docs/fidelity.md
("Recorded schedules") says so. The walk is per block and per request, never per token, except
the comparisons of prefixes and outputs, which are slices compared at C speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checks import Checks, Failure
from .config import Scenario, SyntheticWorkload
from .sched.plan import PLACEHOLDER_DRAFT
from .trace import Trace

CHECK = "sched.recorded"
TOKEN_ID_LIMIT = 1 << 31  # (token ids are int32 in vLLM's input batch: the bound where no vocabulary is named)
# trace workload formats whose prompts the tool generates from the scenario's seed (so inside its vocabulary)
_GENERATED_PROMPTS = ("mooncake", "azure", "burstgpt", "vidur")
# ... and those whose outputs are the seeded true continuation (recordings replay their own outputs)
_SEEDED_OUTPUTS = _GENERATED_PROMPTS + ("hybridsim",)

_WAITING, _RUNNING, _PREEMPTED, _DONE, _FINISHED = range(5)
_STATE = {_WAITING: "never admitted", _RUNNING: "running", _PREEMPTED: "preempted (waiting)",
          _DONE: "finished", _FINISHED: "finished"}


class _Broken(Exception):
    """The first broken rule: where and what."""

    def __init__(self, message: str, request: Optional[str] = None, group: Optional[int] = None):
        super().__init__(message)
        self.message = message
        self.request = request
        self.group = group


@dataclass(frozen=True)
class _Group:
    gid: int
    mamba: bool
    bs: int
    num_spec: int


def vocab_bounds(s: Scenario) -> tuple[int, int]:
    """(prompt bound, output bound): the scenario's ``vocab_size`` where the tool made the tokens
    from it, else ``TOKEN_ID_LIMIT`` (real token ids from a file: LLMServingSim, recordings)."""
    wl = s.workload
    if isinstance(wl, SyntheticWorkload):
        return wl.vocab_size, wl.vocab_size
    return (wl.vocab_size if wl.format in _GENERATED_PROMPTS else TOKEN_ID_LIMIT,
            wl.vocab_size if wl.format in _SEEDED_OUTPUTS else TOKEN_ID_LIMIT)


def seeded_outputs(s: Scenario) -> bool:
    """Whether a trace of this scenario commits the seeded true continuation (``outputs.SeededContinuation``)."""
    wl = s.workload
    return isinstance(wl, SyntheticWorkload) or wl.format in _SEEDED_OUTPUTS


def verify_trace(trace: Trace, scenario: Scenario, checks: Checks) -> bool:
    """Walk the trace's schedule; tally ``sched.recorded`` (rules held) in ``checks``, its first
    broken rule as the failure. True when every rule held."""
    tally = checks.get(CHECK)
    walk = _Walk(trace, scenario)
    try:
        walk.run()
    except _Broken as b:
        tally.passed(walk.count)
        tally.failed(Failure(walk.step, b.request, f"{walk.where}: {b.message}",
                             layer=None if b.group is None else f"group {b.group}"))
        return False
    tally.passed(walk.count)
    return True


_INF = 1 << 62


class _Req:
    """What the walk knows of one request."""

    __slots__ = ("rid", "status", "tokens", "num_out", "max_tokens", "rows", "lens", "cached",
                 "q_c", "q_lo", "q_hi", "fill_at")

    def __init__(self, rid: str, max_tokens: int):
        self.rid = rid
        self.status = _WAITING
        self.tokens: list[int] = []
        self.num_out = 0
        self.max_tokens = max_tokens
        # per group: attention -> list of blocks; Mamba -> {column: block} of the live columns
        self.rows: list = []
        self.lens: list[int] = []  # row lengths in columns (a Mamba row is mostly null)
        self.cached: list[int] = []  # attention: leading columns marked full of committed tokens
        # the quiet bounds (a decode step inside them changes nothing the walk tracks): no Mamba
        # column is released while computed <= q_c; the rows cover any step ending in q_lo..q_hi;
        # no block becomes full before the request's known tokens reach fill_at
        self.q_c = self.q_lo = self.q_hi = self.fill_at = 0


class _Walk:
    def __init__(self, trace: Trace, s: Scenario):
        self.trace = trace
        self.path = Path(trace.path)
        self.groups = [_Group(int(g["group_id"]), g["kind"] == "mamba", int(g["block_size"]), int(g.get("num_spec", 0)))
                       for g in trace.header["groups"]]
        self.num_blocks = s.cache.num_blocks
        self.max_seqs = s.scheduler.max_num_seqs
        self.budget = s.scheduler.max_num_batched_tokens
        self.max_len = s.scheduler.max_model_len
        self.num_spec = s.spec_decode.num_speculative_tokens
        self.prompt_vocab, self.out_vocab = vocab_bounds(s)
        self.seeded = seeded_outputs(s)
        self.reqs = {r["id"]: _Req(r["id"], r["max_tokens"]) for r in trace.header["requests"]}
        self.meta = {r["id"]: r for r in trace.header["requests"]}
        self.free_after = trace.free_blocks  # a vLLM recording's counts, one a step
        self.count = 0
        self.step = -1
        self.line = 1
        self.running = 0
        # per block
        self.held: dict[int, dict[str, int]] = {}  # block -> {request: column}
        self.group_of: dict[int, int] = {}  # block -> the group holding it
        self.content: dict[int, tuple[str, int, int, bool]] = {}  # block -> (writer, group, column, full)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def _req(self, rid, key: str) -> _Req:
        r = self.reqs.get(rid) if isinstance(rid, str) else None
        if r is None:
            raise _Broken(f"'{key}' names {rid!r}, not a request of the header")
        return r

    # ------------------------------------------------------------------ the walk
    def run(self) -> None:
        steps = self.trace.steps
        # a trace without 'done' lists (the peer driver's recordings): a request finishes with the
        # step before the one whose 'finished' reports it
        done_lists = [o.finished for _, _, o in steps]
        if not any(done_lists):
            done_lists = [nxt[1].finished for nxt in steps[1:]] + [()]
        due: tuple[str, ...] = ()  # finished with the last step: reported in this one
        free_after = self.free_after
        for i, (ln, plan, outcome) in enumerate(steps):
            self.line, self.step = ln, plan.step
            if plan.preempted or plan.forced_preempted:
                self._preemptions(plan)
            if plan.faults and "reset_prefix_cache" in plan.faults and not self.held:
                self.content.clear()  # (the engine drops every cached prefix once every block is free)
            if plan.finished or due:
                self._finished(plan, due)
            drafts = self._schedule(plan)
            due = self._outcome(outcome, drafts, done_lists[i])
            if free_after is not None and i < len(free_after):
                free = self.num_blocks - 1 - len(self.held)
                self.count += 1
                if free != free_after[i]:
                    raise _Broken(f"the recording has {free_after[i]} free blocks after step {plan.step}, "
                                  f"its schedule leaves {free} of {self.num_blocks - 1} ({len(self.held)} held)")
        if self.seeded:
            self._true_outputs()

    def _preemptions(self, plan) -> None:
        seen = set()
        for key, ids in (("forced", plan.forced_preempted), ("preempted", plan.preempted)):
            for rid in ids:
                self.count += 1
                r = self._req(rid, key)
                if rid in seen:
                    raise _Broken(f"{rid} is preempted twice in one step", rid)
                seen.add(rid)
                if r.status != _RUNNING:
                    raise _Broken(f"'{key}' names {rid}, which is {_STATE[r.status]}, not running", rid)
                self._release(r)
                r.status = _PREEMPTED
                self.running -= 1

    def _finished(self, plan, due: tuple[str, ...]) -> None:
        seen = set()
        for rid in plan.finished:
            self.count += 1
            r = self._req(rid, "finished")
            if rid in seen:
                raise _Broken(f"{rid} is in 'finished' twice", rid)
            seen.add(rid)
            if r.status != _DONE:
                why = {_FINISHED: "was reported finished before",
                       _RUNNING: "is running: it did not finish with the step before ('done')"}.get(
                    r.status, f"is {_STATE[r.status]}")
                raise _Broken(f"'finished' names {rid}, which {why}", rid)
            r.status = _FINISHED
        for rid in due:
            self.count += 1
            if rid not in seen:
                raise _Broken(f"{rid} finished with the step before ('done') but this step's 'finished' does not "
                              "report it", rid)

    def _schedule(self, plan) -> dict[str, tuple[int, ...]]:
        """The step's rows, request by request; returns the drafts of those that had any."""
        total = 0
        drafts: dict[str, tuple[int, ...]] = {}
        reqs = self.reqs
        for s in plan.scheduled:
            rid = s.req_id
            r = reqs[rid]
            c, n = s.num_computed_tokens, s.num_scheduled_tokens
            end = c + n
            total += n
            if s.is_new:
                self._admission(r, s)
                self._uses(r, end)
                self._fill(r, min(end, len(r.tokens)))
                self._bounds(r, end)
            elif r.status != _RUNNING:
                raise _Broken(f"{rid} is scheduled after it finished" if r.status in (_DONE, _FINISHED) else
                              f"{rid} continues but it is {_STATE[r.status]}", rid)
            elif s.new_block_ids is None and c <= r.q_c and r.q_lo <= end <= r.q_hi:
                self.count += 1  # (a step inside its quiet bounds: its rows cover it as they stand)
                if min(end, len(r.tokens)) >= r.fill_at:
                    self._fill(r, min(end, len(r.tokens)))
                    self._bounds(r, end)
            else:
                self._advance(r, s)
                self._uses(r, end)
                self._fill(r, min(end, len(r.tokens)))
                self._bounds(r, end)
            spec = s.spec_token_ids
            if spec:
                self.count += 1
                if len(spec) > self.num_spec:
                    raise _Broken(f"{rid} is scheduled with {len(spec)} drafts; num_speculative_tokens is "
                                  f"{self.num_spec}", rid)
                real = [t for t in spec if t != PLACEHOLDER_DRAFT]
                self._vocab(rid, real, self.out_vocab, "draft token")
                drafts[rid] = spec
        self.count += 2
        if self.running > self.max_seqs:
            raise _Broken(f"{self.running} requests are running after this step's admissions; max_num_seqs is "
                          f"{self.max_seqs}")
        if total > self.budget:
            raise _Broken(f"the step schedules {total} tokens; max_num_batched_tokens is {self.budget}")
        return drafts

    def _admission(self, r: _Req, s) -> None:
        rid = r.rid
        self.count += 1
        if r.status == _RUNNING:
            raise _Broken(f"{rid} is admitted while it is running", rid)
        if r.status in (_DONE, _FINISHED):
            raise _Broken(f"{rid} is admitted again after it finished", rid)
        if bool(s.resumed) != (r.status == _PREEMPTED):
            raise _Broken(f"{rid} is admitted {'as resumed' if s.resumed else 'as new'} but it "
                          f"{'never ran' if r.status == _WAITING else 'was preempted'}", rid)
        if s.new_block_ids is None:
            raise _Broken(f"{rid} is admitted without block rows", rid)
        if r.status == _WAITING:
            r.tokens = list(s.prompt_token_ids or ())
            self._vocab(rid, r.tokens, self.prompt_vocab, "prompt token")
        r.status = _RUNNING
        self.running += 1
        self._admit(r, s)

    def _outcome(self, outcome, drafts: dict, done: tuple[str, ...]) -> tuple[str, ...]:
        reqs = self.reqs
        seen = set()
        for rid in done:
            self.count += 1
            r = reqs.get(rid) if isinstance(rid, str) else None
            if r is None or r.status != _RUNNING:
                raise _Broken(f"'done' names {rid!r}, which this step did not run", rid if r is not None else None)
            if rid in seen:
                raise _Broken(f"{rid} is in 'done' twice", rid)
            seen.add(rid)
        sampled = outcome.sampled
        if sampled:
            vals = [v for v in sampled.values() if v]
            if vals:
                self.count += 1
                if min(map(min, vals)) < 0 or max(map(max, vals)) >= self.out_vocab:
                    for rid, toks in sampled.items():
                        self._vocab(rid, toks, self.out_vocab, "output token")
            max_len = self.max_len
            for rid, toks in sampled.items():
                if not toks:
                    continue
                r = reqs[rid]
                self.count += 1
                spec = drafts.get(rid)
                if spec:
                    acc = outcome.accepted.get(rid, len(toks) - 1)
                    k = min(acc, len(toks))
                    if toks[:k] != spec[:k]:
                        j = next(i for i in range(k) if toks[i] != spec[i])
                        raise _Broken(f"{rid} accepted {acc} drafts but commits {toks[j]} where draft {j} is "
                                      f"{spec[j]}", rid)
                r.num_out += len(toks)
                r.tokens.extend(toks)
                if r.num_out >= r.max_tokens or len(r.tokens) >= max_len:
                    if r.num_out > r.max_tokens:
                        raise _Broken(f"{rid} has {r.num_out} output tokens; its max_tokens is {r.max_tokens}", rid)
                    if len(r.tokens) > max_len:
                        raise _Broken(f"{rid} holds {len(r.tokens)} tokens; max_model_len is {max_len}", rid)
                    if rid not in seen:
                        raise _Broken(f"{rid} reached its max_tokens ({r.max_tokens}) or max_model_len ({max_len}) "
                                      "with this step but does not finish with it", rid)
        for rid in done:
            r = reqs[rid]
            self._release(r)
            r.status = _DONE
            self.running -= 1
        return tuple(done)

    # ------------------------------------------------------------------ blocks
    def _check_id(self, rid: str, g: int, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise _Broken(f"block {b} given to {rid} is outside the pool (cache.num_blocks {self.num_blocks}: "
                          f"ids 0..{self.num_blocks - 1}, 0 the null block)", rid, g)

    def _take_fresh(self, rid: str, g: int, col: int, b: int) -> None:
        """A fresh block: free now; from here on it holds ``rid``'s column ``col``."""
        holders = self.held.get(b)
        if holders:
            other, ocol = next(iter(holders.items()))
            same = " too" if other == rid else ""
            raise _Broken(f"block {b} given to {rid} (column {col}) is held by {other}{same} (group "
                          f"{self.group_of[b]}, column {ocol}): it is not free", rid, g)
        self.held[b] = {rid: col}
        self.group_of[b] = g
        self.content[b] = (rid, g, col, False)

    def _take_hit(self, rid: str, g: int, col: int, b: int, writers: dict) -> None:
        """A block of an admission's prefix hit: cached, holding this very prefix, at this column."""
        cont = self.content.get(b)
        if cont is None or not cont[3] or cont[1] != g or cont[2] != col:
            what = ("was never written" if cont is None else
                    f"holds group {cont[1]}, column {cont[2]} of {cont[0]}" if cont[1] != g or cont[2] != col else
                    f"was not yet full (column {col} of {cont[0]})")
            raise _Broken(f"prefix-hit block {b} of {rid} (column {col}) holds no cached prefix: it {what}", rid, g)
        holders = self.held.get(b)
        if holders:
            if rid in holders:
                raise _Broken(f"block {b} appears twice in {rid}'s row", rid, g)
            for other, ocol in holders.items():
                if ocol != col:
                    raise _Broken(f"prefix-hit block {b} of {rid} (column {col}) is held by {other} at column {ocol}",
                                  rid, g)
            holders[rid] = col
        else:
            self.held[b] = {rid: col}
            self.group_of[b] = g
        upto = (col + 1) * self.groups[g].bs
        if upto > writers.get(cont[0], 0):
            writers[cont[0]] = upto

    def _admit(self, r: _Req, s) -> None:
        rid = r.rid
        hit = s.prefix_hit_tokens
        r.rows, r.lens, r.cached = [], [], []
        writers: dict[str, int] = {}  # writer -> the tokens of its prefix the hit reads
        for g, (grp, row) in enumerate(zip(self.groups, s.new_block_ids)):
            r.lens.append(len(row))
            if grp.mamba:
                live: dict[int, int] = {}
                r.rows.append(live)
                r.cached.append(0)
                hit_col = hit // grp.bs - 1 if hit and hit % grp.bs == 0 else -1
                for col, b in enumerate(row):
                    if b:
                        self.count += 1
                        self._check_id(rid, g, b)
                        if col == hit_col:
                            self._take_hit(rid, g, col, b, writers)
                        else:
                            self._take_fresh(rid, g, col, b)
                        live[col] = b
                if hit_col >= 0 and hit_col not in live:
                    raise _Broken(f"{rid} is admitted with a {hit}-token prefix hit but its Mamba row holds no state "
                                  f"at column {hit_col}", rid, g)
                continue
            blocks: list[int] = []
            r.rows.append(blocks)
            hc = hit // grp.bs
            for col, b in enumerate(row):
                self.count += 1
                self._check_id(rid, g, b)
                if b == 0:
                    raise _Broken(f"{rid}'s attention row holds the null block at column {col}", rid, g)
                if col < hc:
                    self._take_hit(rid, g, col, b, writers)
                else:
                    self._take_fresh(rid, g, col, b)
                blocks.append(b)
            if len(row) < hc:
                raise _Broken(f"{rid} is admitted with a {hit}-token prefix hit but its row holds {len(row)} "
                              "blocks", rid, g)
            r.cached.append(hc)
        mine = r.tokens
        for w, upto in writers.items():  # every hit block holds the same tokens, from the first one on
            self.count += 1
            if len(mine) < upto or w != rid and mine[:upto] != self.reqs[w].tokens[:upto]:
                raise _Broken(f"{rid}'s prefix hit of {hit} tokens reads blocks {w} wrote, whose tokens differ from "
                              f"its own", rid)

    def _advance(self, r: _Req, s) -> None:
        """A running request: Mamba columns left of its state released, then its rows' new tails."""
        rid = r.rid
        c = s.num_computed_tokens
        rows, lens = r.rows, r.lens
        if c > r.q_c:
            for g, grp in enumerate(self.groups):
                if grp.mamba:
                    live = rows[g]
                    keep_from = min((c - 1) // grp.bs, lens[g])
                    for col in [col for col in live if col < keep_from]:
                        self._drop(rid, live.pop(col))
        if s.new_block_ids is None:
            return
        for g, (grp, tail) in enumerate(zip(self.groups, s.new_block_ids)):
            if not tail:
                continue
            row = rows[g]
            prev = lens[g]
            lens[g] = prev + len(tail)
            if grp.mamba:
                for k, b in enumerate(tail):
                    if not b:
                        continue
                    self.count += 1
                    self._check_id(rid, g, b)
                    col = prev + k
                    mine = self.held.get(b)
                    if mine is not None and rid in mine and self.group_of[b] == g:
                        old = mine[rid]
                        if not prev - grp.num_spec <= old < prev or row.get(old) != b:
                            raise _Broken(f"block {b} moves to column {col} of {rid}'s row from column {old}, not from "
                                          f"a draft column ({max(prev - grp.num_spec, 0)}..{prev - 1})", rid, g)
                        del row[old]
                        mine[rid] = col
                        self.content[b] = (rid, g, col, False)
                    else:
                        self._take_fresh(rid, g, col, b)
                    row[col] = b
            else:
                for k, b in enumerate(tail):
                    self.count += 1
                    self._check_id(rid, g, b)
                    if b == 0:
                        raise _Broken(f"{rid}'s attention row gets the null block at column {prev + k}", rid, g)
                    self._take_fresh(rid, g, prev + k, b)
                    row.append(b)

    def _uses(self, r: _Req, end: int) -> None:
        """The columns the step computes into hold live blocks of the request."""
        self.count += 1
        for g, grp in enumerate(self.groups):
            row = r.rows[g]
            if grp.mamba:
                run = (end - 1) // grp.bs
                for col in range(run, run + 1 + grp.num_spec):
                    if col not in row:
                        raise _Broken(f"{r.rid} computes up to token {end} but its Mamba row holds no block at column "
                                      f"{col} (running state{' and drafts' if grp.num_spec else ''}: columns {run}.."
                                      f"{run + grp.num_spec})", r.rid, g)
            elif len(row) * grp.bs < end:
                raise _Broken(f"{r.rid} computes up to token {end} but its row holds {len(row)} blocks of "
                              f"{grp.bs} tokens", r.rid, g)

    def _fill(self, r: _Req, known: int) -> None:
        """Blocks full of the request's known tokens once this step is scheduled hold a cached prefix
        from now on (the engine caches them when it schedules them)."""
        content = self.content
        rid = r.rid
        for g, grp in enumerate(self.groups):
            full = known // grp.bs
            row = r.rows[g]
            if grp.mamba:
                for col, b in row.items():
                    if col < full:
                        cont = content.get(b)
                        if cont is not None and not cont[3] and cont[0] == rid and cont[2] == col:
                            content[b] = (rid, g, col, True)
                continue
            top = min(full, len(row))
            for col in range(r.cached[g], top):
                b = row[col]
                cont = content.get(b)
                if cont is not None and cont[0] == rid and cont[2] == col:
                    content[b] = (rid, g, col, True)
            if top > r.cached[g]:
                r.cached[g] = top

    def _bounds(self, r: _Req, end: int) -> None:
        """The request's quiet bounds around a step that ended at ``end`` (see ``_Req``)."""
        q_c = q_hi = fill_at = _INF
        q_lo = 1
        content = self.content
        for g, grp in enumerate(self.groups):
            row, bs = r.rows[g], grp.bs
            if grp.mamba:
                if not row:
                    q_hi = 0
                    continue
                q_c = min(q_c, (min(row) + 1) * bs)
                top = bottom = (end - 1) // bs
                top += grp.num_spec
                while top + 1 in row:
                    top += 1
                while bottom - 1 in row:
                    bottom -= 1
                q_lo = max(q_lo, bottom * bs + 1)
                q_hi = min(q_hi, (top - grp.num_spec + 1) * bs)
                for col, b in row.items():
                    cont = content.get(b)
                    if cont is not None and not cont[3] and cont[0] == r.rid and cont[2] == col:
                        fill_at = min(fill_at, (col + 1) * bs)
            else:
                q_hi = min(q_hi, len(row) * bs)
                if r.cached[g] < len(row):
                    fill_at = min(fill_at, (r.cached[g] + 1) * bs)
        r.q_c, r.q_lo, r.q_hi, r.fill_at = q_c, q_lo, q_hi, fill_at

    def _drop(self, rid: str, b: int) -> None:
        holders = self.held[b]
        del holders[rid]
        if not holders:
            del self.held[b]
            del self.group_of[b]

    def _release(self, r: _Req) -> None:
        for row in r.rows:
            for b in (row.values() if isinstance(row, dict) else row):
                h = self.held.get(b)
                if h is not None and r.rid in h:
                    self._drop(r.rid, b)
        r.rows, r.lens, r.cached = [], [], []
        r.q_c = r.q_lo = r.q_hi = r.fill_at = 0

    # ------------------------------------------------------------------ tokens
    def _vocab(self, rid: str, toks, bound: int, what: str) -> None:
        if not toks:
            return
        lo, hi = min(toks), max(toks)
        if lo < 0 or hi >= bound:
            bad = lo if lo < 0 else hi
            name = "token ids (int32)" if bound == TOKEN_ID_LIMIT else "vocabulary"
            raise _Broken(f"{rid}: {what} {bad} is outside the {name} (0..{bound - 1})", rid)

    def _true_outputs(self) -> None:
        """Every committed token against the workload's true continuation (seeded, one stream a request)."""
        from .workload.tokens import token_segments

        rs = [r for r in self.reqs.values() if r.num_out]
        if not rs:
            return
        streams = token_segments([int(self.meta[r.rid].get("output_seed", 0)) for r in rs],
                                 [r.num_out for r in rs], self.out_vocab)
        bad = {}
        for r, want in zip(rs, streams):
            self.count += 1
            got = r.tokens[len(r.tokens) - r.num_out:]
            if got != want:
                i = next(k for k in range(len(want)) if got[k] != want[k])
                bad[r.rid] = (i, got[i], want[i])
        if not bad:
            return
        seen = dict.fromkeys(bad, 0)  # outputs committed so far, per request in question
        for ln, plan, outcome in self.trace.steps:  # (the step that committed the first wrong token)
            for rid, toks in outcome.sampled.items():
                if rid in bad:
                    i, got, want = bad[rid]
                    if seen[rid] <= i < seen[rid] + len(toks):
                        self.step, self.line = plan.step, ln
                        raise _Broken(f"{rid}'s output token {i} is {got}; the workload's true continuation "
                                      f"(output_seed {self.meta[rid].get('output_seed', 0)}) has {want} there", rid)
                    seen[rid] += len(toks)


__all__ = ["CHECK", "verify_trace", "vocab_bounds", "seeded_outputs", "TOKEN_ID_LIMIT"]
