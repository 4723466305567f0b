"""Worker-side Mamba state bookkeeping: where each request's state is read, written and copied.

Columns index a request's Mamba block row; the executor resolves them to block ids
per group. The semantics are the engine's (research/vllm-hybrid.md §3, seeds
001-003), one strategy class per cache mode:

* ``align``: the running state lives in the block of the last scheduled token
  (column ``curr = cdiv(c+n, bs) - 1``). Before the forward, a state left in the
  previous running column is copied forward (conv window shifted by the previous
  step's accept bias, temporal state taken from the bias column) and the accepted
  count resets to 1. Draft rows write the state after each query token into
  ``curr + t``; after acceptance, a state that lands on a block boundary is copied
  into that boundary's block. A final prefill chunk passing its checkpoint (the last block
  boundary before the chunk's last token, ``sched.plan.checkpoint_at``) also writes the state
  there into that boundary's column (vLLM 0.33).
* ``none``: column 0 is the running state, columns 1..S the draft states; a step
  without drafts after an accepted run migrates column A-1 into column 0.
* ``all``: a state at every block boundary the chunk crosses; the running state is
  read from the block of the last computed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..sched.plan import checkpoint_at


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Copy:
    """Copy a state between columns: conv rows shifted by ``offset``, temporal from ``t_src``."""

    src: int
    dst: int
    offset: int
    t_src: int


@dataclass
class RowPlan:
    req_id: str
    c: int
    n: int
    drafts: int
    pre: list[Copy] = field(default_factory=list)
    has_state: bool = False
    read_col: int = 0  # conv window column
    read_offset: int = 0  # conv row offset (= temporal column offset)
    read_t_col: int = 0  # temporal state column
    final_col: Optional[int] = None  # prefill rows: final state here
    token_cols: Optional[list[int]] = None  # draft rows: state after token t -> column
    conv_col: Optional[int] = None  # draft rows: shifted window (K-2+q rows) here
    boundary: list[tuple[int, int]] = field(default_factory=list)  # (token index, column)

    @property
    def is_decode_row(self) -> bool:
        return self.token_cols is not None


class Bugs:
    """Known-wrong variants of the bookkeeping, switched on by ``--inject-bug``."""

    def __init__(self, names: set[str]):
        self.names = names

    def __contains__(self, name: str) -> bool:
        return name in self.names


class MambaStateTracker:
    """Per-request worker state: the previous running column and the accepted count."""

    def __init__(self, block_size: int, num_spec: int, bugs: Bugs, lookahead: int = 1):
        self.bs = block_size
        self.S = num_spec
        self.lookahead = lookahead  # prompt tokens past a chunk the drafter reads (multi-module MTP)
        self.bugs = bugs
        self.state_idx: dict[str, int] = {}
        self.num_accepted: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------
    def cleanup(self, finished, preempted, resumed) -> None:
        drop = set(finished) | set(preempted)
        if "stale_state_index" not in self.bugs:
            drop |= set(resumed)
        for rid in drop:
            self.state_idx.pop(rid, None)
            self.num_accepted.pop(rid, None)

    def admit(self, rid: str) -> None:
        self.num_accepted[rid] = 1

    def accepted_offset(self, rid: str) -> int:
        return max(self.num_accepted.get(rid, 1) - 1, 0)

    # -- per step ----------------------------------------------------------------------
    def plan_row(self, rid: str, c: int, n: int, drafts: int) -> RowPlan:
        raise NotImplementedError

    def post(self, plan: RowPlan, accepted: int, sampled: bool) -> list[Copy]:
        """After acceptance: copies to make, and the accepted count for the next step."""
        self.num_accepted[plan.req_id] = (accepted + 1) if sampled else 0
        return []

    def resume_location(self, rid: str, c: int) -> tuple[int, int, int]:
        """(conv column, conv offset, temporal column) the next step reads from."""
        raise NotImplementedError


class AlignTracker(MambaStateTracker):
    def plan_row(self, rid, c, n, drafts):
        bs = self.bs
        curr = cdiv(c + n, bs) - 1
        prev = self.state_idx.get(rid)
        if prev is None:
            prev = (c - 1) // bs if c > 0 else -1
        self.state_idx[rid] = curr
        p = RowPlan(rid, c, n, drafts)
        off = self.accepted_offset(rid)
        if prev != -1 and prev != curr and "align_precopy_skipped" not in self.bugs:
            b = 0 if "no_conv_shift_on_accept" in self.bugs else off
            t_src = prev if "temporal_without_bias" in self.bugs else prev + off
            p.pre.append(Copy(prev, curr, b, t_src))
            self.num_accepted[rid] = 1
            off = 0
        p.has_state = c > 0
        p.read_col, p.read_offset, p.read_t_col = curr, off, curr + off
        if drafts:
            p.token_cols = [curr + t for t in range(n)]
            p.conv_col = curr
        else:
            p.final_col = curr
        return p

    def checkpoint(self, p: RowPlan, prefill_end: int) -> None:
        """0.33: a final prefill chunk passing its checkpoint (``checkpoint_at``) also keeps
        the state there."""
        at = checkpoint_at(p.c, p.c + p.n, prefill_end, self.bs, self.lookahead)
        if at is not None:
            p.boundary.append((at - p.c - 1, at // self.bs - 1))

    def post(self, p, accepted, sampled):
        super().post(p, accepted, sampled)
        if not sampled or not p.drafts:
            return []
        bs = self.bs
        R = p.c + p.n - p.drafts
        A = accepted + 1
        new_c = R + A - 1
        aligned = new_c // bs * bs
        if aligned < R:
            return []
        b = aligned - R
        src = self.state_idx[p.req_id]
        dest = aligned // bs - 1
        if src == dest:
            self.num_accepted[p.req_id] = 1
            if b == 0:
                return []
        conv_b = 0 if "no_conv_shift_on_accept" in self.bugs else b
        t_src = src if "temporal_without_bias" in self.bugs else src + b
        return [Copy(src, dest, conv_b, t_src)]

    def resume_location(self, rid, c):
        col = self.state_idx[rid]
        off = self.accepted_offset(rid)
        return col, off, col + off


class NoneTracker(MambaStateTracker):
    def plan_row(self, rid, c, n, drafts):
        p = RowPlan(rid, c, n, drafts)
        off = self.accepted_offset(rid)
        if drafts == 0 and off > 0 and c > 0:
            # no drafts follow an accepted run: bring the accepted state back to column 0
            p.pre.append(Copy(0, 0, off, off))
            self.num_accepted[rid] = 1
            off = 0
        p.has_state = c > 0
        p.read_col, p.read_offset, p.read_t_col = 0, off, off
        if drafts:
            p.token_cols = list(range(n))
            p.conv_col = 0
        else:
            p.final_col = 0
        return p

    def resume_location(self, rid, c):
        off = self.accepted_offset(rid)
        return 0, off, off


class AllTracker(MambaStateTracker):
    def plan_row(self, rid, c, n, drafts):
        bs = self.bs
        p = RowPlan(rid, c, n, drafts)
        last_computed = max(cdiv(c, bs) - 1, 0)
        last_sched = max(cdiv(c + n, bs) - 1, 0)
        p.has_state = c > 0
        p.read_col = p.read_t_col = last_computed
        p.final_col = last_sched
        for t in range(n):
            pos = c + t + 1
            if pos % bs == 0 and pos // bs - 1 != last_sched:
                p.boundary.append((t, pos // bs - 1))
        return p

    def resume_location(self, rid, c):
        col = max(cdiv(c, self.bs) - 1, 0)
        return col, 0, col


TRACKERS = {"align": AlignTracker, "none": NoneTracker, "all": AllTracker}
