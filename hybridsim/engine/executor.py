"""The executor: runs every StepPlan on real tensors and checks it against the oracle.

It knows tensors, never policy: block rows come from the plan, states are read,
copied and written where the cache-mode bookkeeping says, the probe layers run the
scheduled tokens, and after the step's outcome every committed token, every
resumable state, every boundary state and every prefix hit handed out is compared
with values recomputed from the committed tokens alone. The Mamba, GQA attention and MLA
layers live in ``mamba_exec``, ``attn_exec`` and ``mla_exec``; this module keeps the
requests' token sequences and block rows and drives a step through each.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..checks import Checks, Failure
from ..config import Scenario
from ..errors import EnvironmentProblem, InputError
from ..sched.plan import PLACEHOLDER_DRAFT, StepOutcome, StepPlan
from .attn_exec import AttentionExecution
from .cache import BlockMap, PageArena
from .mamba_exec import BadAccess, MambaExecution
from .mamba_state import Bugs
from .metadata import build_batch
from .memory import arena_layout
from .mla_exec import MLAExecution
from ..device.clock import PhaseClock
from ..kernels.checked import CHECKS_PHASE, CheckedKernels
from ..device.verdicts import Verdicts


@dataclass
class GroupInfo:
    group_id: int
    kind: str
    block_size: int
    layers: tuple[int, ...]


class TokenBuffer:
    """A request's committed token ids, growing in place (numpy, so slices are views)."""

    def __init__(self, tokens):
        a = np.asarray(tokens, dtype=np.int64)
        self.a = np.zeros(max(16, 2 * len(a)), dtype=np.int64)
        self.a[: len(a)] = a
        self.n = len(a)

    def extend(self, toks) -> None:
        k = len(toks)
        if self.n + k > len(self.a):
            grown = np.zeros(2 * (self.n + k), dtype=np.int64)
            grown[: self.n] = self.a[: self.n]
            self.a = grown
        self.a[self.n:self.n + k] = toks
        self.n += k

    def __len__(self) -> int:
        return self.n

    def view(self) -> np.ndarray:
        return self.a[: self.n]

    def __getitem__(self, s):
        return self.a[: self.n][s]


class ExecRequest:
    __slots__ = ("rid", "tokens", "prompt_len", "rows")

    def __init__(self, rid: str, prompt: list[int]):
        self.rid = rid
        self.tokens = TokenBuffer(prompt)
        self.prompt_len = len(prompt)
        self.rows: list[list[int]] = []


class Executor:
    def __init__(self, scenario: Scenario, groups: list[GroupInfo], kernels, checks: Checks,
                 check: str = "full", bugs: Optional[set[str]] = None, device: str = "cpu",
                 oracle_scan=None, digests: bool = False, capacity: Optional[int] = None):
        self.s = scenario
        self.geo = scenario.geometry()
        self.groups = groups
        self.k = kernels
        self.checks = checks
        self.check = check
        self.bugs = Bugs(bugs or set())
        self.device = torch.device(device)
        if self.device.type == "cuda":  # (the peak reported is this run's, not an earlier one's in this process)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.reqs: dict[str, ExecRequest] = {}
        self.blocks = BlockMap(capacity or scenario.cache.num_blocks)
        self.kernel_timer = None  # a TimedKernels on a GPU: per-kernel CUDA-event timings
        self.finish_notes = None  # a callable adding the run's closing notes (e.g. which ops ran whose code)
        self.memory_plan = None  # engine/memory.py's plan, set by whoever sized the run
        self.mamba: Optional[MambaExecution] = None
        self.mla: Optional[MLAExecution] = None
        self.attn: Optional[AttentionExecution] = None
        layout = arena_layout(scenario, groups)
        arena = PageArena(layout[0], self.blocks.capacity, layout[1], self.device) if layout is not None else None
        self.arena = arena
        if self.geo.mamba is not None:
            MambaExecution.needs_executing(scenario)
            if oracle_scan is None:
                from ..kernels.probe_scan import scan_reference
                oracle_scan = scan_reference
            self.mamba = MambaExecution(scenario, groups, kernels, checks, check, self.bugs, self.device,
                                        self.blocks, oracle_scan, arena)
            if digests:
                self.mamba.output_digest = hashlib.sha256()
        if self.geo.attention is not None:
            self.attn = AttentionExecution(scenario, groups, kernels, checks, self.bugs, self.device, self.blocks,
                                           arena)
        if self.geo.mla is not None:
            self.mla = MLAExecution(scenario, groups, kernels, checks, self.bugs, self.device, self.blocks,
                                    scenario.execution.mla_workspace_tokens)
        # on a GPU the step's verdicts are read one step late (device/verdicts.py)
        self.verdicts = Verdicts(1 if self.device.type == "cuda" else 0)
        # one phase clock for every part (device/clock.py), the checked kernels' references and comparisons
        # a phase of their own wherever they run (inside a layer's forward too: its time comes off the layer's)
        parts = [p for p in (self.mamba, self.attn, self.mla) if p is not None]
        kernel_checks = (CHECKS_PHASE,) if isinstance(kernels, CheckedKernels) else ()
        self.clock = PhaseClock(self.device, tuple(n for p in parts for n in p.PHASES) + kernel_checks)
        self.oracle_phases = tuple(n for p in parts for n in p.ORACLE_PHASES)  # (the oracles' share of the loop)
        # every phase that checks rather than runs the system: the oracles, the cross-checks, the kernel checks
        self.check_phases = self.oracle_phases + tuple(n for p in parts for n in p.CHECK_PHASES) + kernel_checks
        for part in (*parts, kernels):
            if hasattr(part, "verdicts"):
                part.verdicts = self.verdicts
            if hasattr(part, "clock"):
                part.clock = self.clock

    @property
    def last_copies(self) -> int:
        """State copies (request x layer) made by the last step."""
        return self.mamba.last_copies if self.mamba is not None else 0

    @property
    def timings(self) -> dict[str, float]:
        out = dict(self.clock.host)
        if self.verdicts.lag:
            out["device wait"] = self.verdicts.wait_s  # the host waiting for the step a lag behind to finish
            out["verdicts"] = self.verdicts.tally_s  # reading a step's results back, one step late, and tallying
        return out

    @property
    def device_timings(self) -> Optional[dict[str, float]]:
        """On a GPU, each phase's device time in seconds (``device/clock.py``: CUDA events at its start and
        end), the phases whose events have completed; complete after ``finish``. None on a CPU."""
        return dict(self.clock.device) if self.clock.device is not None else None

    def finish(self) -> None:
        """Tally what is still pending: call after the last step, before reading the checks."""
        with torch.inference_mode():
            self.verdicts.drain()
        self.clock.collect(wait=True)
        if self.finish_notes is not None:
            self.finish_notes()

    # ------------------------------------------------------------------ step
    def step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        with torch.inference_mode():  # (no autograd bookkeeping on any of a step's operations)
            self._guarded_step(plan, outcome)

    def _guarded_step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        try:
            self._step(plan, outcome)
        except torch.OutOfMemoryError as e:  # an environment limit, not a failed check
            raise EnvironmentProblem(_oom_message(self, plan.step, e)) from None
        finally:
            flush = getattr(self.k, "flush", None)  # checked kernels: the step's verdicts, one transfer
            if flush is not None:
                flush(plan.step)
            self.verdicts.end_step()
            self.clock.collect()  # (the phases' device times whose events have completed: no waiting)

    def _step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        if self.mamba is not None:
            self.mamba.last_copies = 0
        resumed = [s.req_id for s in plan.scheduled if s.is_new and s.resumed]
        if self.attn is not None:
            for rid in (*plan.finished, *plan.preempted, *plan.forced_preempted):
                r = self.reqs.get(rid)
                if r is not None:
                    self.attn.release(rid, r.rows)
        for rid in plan.finished:
            self.reqs.pop(rid, None)
        if self.mamba is not None:
            self.mamba.cleanup(plan.finished, plan.preempted, resumed)
        for s in plan.scheduled:
            r = self.reqs.get(s.req_id)
            if s.is_new:
                if r is None:
                    if s.prompt_token_ids is None:
                        raise InputError(f"step {plan.step}: {s.req_id} admitted without a known prompt")
                    r = self.reqs[s.req_id] = ExecRequest(s.req_id, list(s.prompt_token_ids))
                r.rows = [list(g) for g in s.new_block_ids]
                if self.mamba is not None:
                    self.mamba.admit(s.req_id)
            elif s.new_block_ids is not None:
                for row, tail in zip(r.rows, s.new_block_ids):
                    row.extend(tail)
            if s.new_block_ids is not None:  # give every block a cache row before any tensor is held
                for tail in s.new_block_ids:
                    for b in tail:
                        self.blocks.row(b)
        late = "block_copy_after_writes" in self.bugs
        if plan.block_copies and not late:
            self._block_copies(plan)
        if not plan.scheduled:
            return
        reqs = [self.reqs[s.req_id] for s in plan.scheduled]
        inputs = []
        for s, r in zip(plan.scheduled, reqs):
            c, n, d = s.num_computed_tokens, s.num_scheduled_tokens, len(s.spec_token_ids)
            known = r.tokens[c:c + n - d]
            if len(known) != n - d:
                raise InputError(f"step {plan.step}: {s.req_id} schedules {n} tokens from position {c} "
                                 f"but only {len(r.tokens) - c} are known")
            # a placeholder draft (padding) is computed from token 0 and then rejected, as any draft
            drafts = np.array([t if t != PLACEHOLDER_DRAFT else 0 for t in s.spec_token_ids], dtype=np.int64)
            inputs.append(np.concatenate([known, drafts]))
        meta = build_batch([(s.num_computed_tokens, s.num_scheduled_tokens, len(s.spec_token_ids))
                            for s in plan.scheduled], self.s.spec_decode.num_speculative_tokens)
        mamba_fwd = mla_fwd = attn_fwd = None
        if self.mamba is not None:
            self.mamba.check_chunk_meta(plan, meta)
            try:
                mamba_fwd = self.mamba.forward(plan, reqs, inputs)
            except BadAccess as e:  # the bookkeeping pointed at a column holding no block
                self.checks.get("ssm.running_state").failed(Failure(plan.step, None, str(e)))
        if self.attn is not None:
            attn_fwd = self.attn.forward(plan, reqs, inputs)
        if self.mla is not None:
            mla_fwd = self.mla.forward(plan, reqs, inputs, meta)
        if plan.block_copies and late:  # (the injected bug: the copies land on this step's writes)
            self._block_copies(plan)
        # -- outcome: commit tokens, then check everything committed
        committed = []
        for s, r in zip(plan.scheduled, reqs):
            toks = outcome.sampled.get(s.req_id, ())
            d = len(s.spec_token_ids)
            r.tokens.extend(toks)
            if toks:
                acc = outcome.accepted.get(s.req_id, len(toks) - 1)
                # positions whose input is a committed token (a length cap may drop accepted drafts)
                committed.append(min(s.num_scheduled_tokens - (d - acc), len(r.tokens) - s.num_computed_tokens))
            else:
                committed.append(s.num_scheduled_tokens)
        if mamba_fwd is not None:
            try:
                self.mamba.after(plan, outcome, reqs, committed, mamba_fwd)
            except BadAccess as e:
                self.checks.get("ssm.running_state").failed(Failure(plan.step, None, str(e)))
        if attn_fwd is not None:
            self.attn.check(plan, reqs, attn_fwd, committed)
        if mla_fwd is not None:
            self.mla.check(plan, reqs, mla_fwd, committed)

    def _block_copies(self, plan: StepPlan) -> None:
        """The step's private copies of partly hit blocks (``StepPlan.block_copies``), made as the
        engine's worker makes them before the step's writes: every page of the source block, in
        every cache tensor (each group's pages are whichever tensor holds the block), copied
        whole onto the copy's page by one provider call per tensor."""
        pairs = [(self.blocks.row(src), self.blocks.row(dst)) for src, dst in plan.block_copies]
        if "block_copy_wrong_source" in self.bugs:  # (injected: the source index is never advanced)
            pairs = [(pairs[0][0], b) for _, b in pairs]
        t = torch.tensor(pairs, dtype=torch.int64)
        try:
            for pages in self._page_tensors():
                self.k.block_copy(pages, t)
        except ValueError as e:  # copies that depend on each other: the plan is inconsistent
            raise InputError(f"step {plan.step}: block copies {list(plan.block_copies)}: {e}") from None

    def _page_tensors(self) -> list[torch.Tensor]:
        """Every cache tensor as (slots, pages, elements) views: the shared arena (Mamba states and
        attention K/V), or the Mamba state tensors, and each MLA layer's latent pages."""
        out = []
        cap = self.blocks.capacity
        if self.arena is not None:
            out.append(self.arena.data)
        else:
            if self.mamba is not None:
                out += [self.mamba.cache.conv.data.flatten(2), self.mamba.cache.temporal.data.flatten(2)]
            if self.attn is not None:
                out += [c.view(1, cap, -1) for kv in self.attn.caches for c in kv]
        if self.mla is not None:
            out += [c.data.view(1, cap, -1) for c in self.mla.caches]
        return out

    def memory_report(self) -> Optional[dict]:
        """The memory plan, with the device's measured peak on a GPU."""
        if self.memory_plan is None:
            return None
        out = self.memory_plan.as_dict()
        if self.device.type == "cuda":
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        return out

    def state_digests(self) -> dict[str, str]:
        """sha256 of every cache page, in physical block order, per slot (Mamba) and layer (MLA),
        and of every checked Mamba output: exact values only, so the same on every machine."""
        order = [self.blocks.rows[b] for b in sorted(self.blocks.rows) if b != 0]
        out = {}
        if self.mamba is not None:
            out.update(self.mamba.state_digests(order))
            if self.mamba.output_digest is not None:
                out["outputs"] = self.mamba.output_digest.hexdigest()
        if self.attn is not None:
            out.update(self.attn.cache_digests(order))
        if self.mla is not None:
            out.update(self.mla.cache_digests(order))
        return out


def _oom_message(ex: Executor, step: int, e: Exception) -> str:
    planned = getattr(ex, "memory_plan", None)
    plan = f"; the run planned {planned.total / 2**30:,.1f} GiB for its caches and buffers" if planned else ""
    where = str(ex.device)
    if ex.device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(ex.device)}, {torch.cuda.max_memory_allocated(ex.device) / 2**30:,.1f} GiB peak)"
    first = str(e).splitlines()[0] if str(e) else "out of memory"
    return f"{where}: out of memory at step {step}{plan}: {first}"
