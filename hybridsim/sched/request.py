"""A request as the scheduler sees it: token ids, progress, block hashes.

The scheduler never sees tensors. Token ids are kept because prefix hashes are
computed from them (chained per block, committed tokens only: drafts are never
hashed).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Sequence

from .hashing import chained_hashes


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    __slots__ = ("req_id", "index", "arrival_step", "max_tokens", "priority", "token_ids",
                 "num_prompt_tokens", "num_computed_tokens", "spec_token_ids", "block_hashes",
                 "status", "num_preemptions", "resumed", "output_seed", "admitted_once",
                 "hash_block_size", "draft_round", "junction", "quiet_total", "quiet_computed", "quiet_by", "out_stream", "cruising",
                 "seat", "cruise_run", "cruise_end", "prompt_ids", "prefill_chunk",
                 "hash_lookahead", "plain_hashes", "scale", "unit_hashes")

    def __init__(self, req_id: str, index: int, arrival_step: int, prompt: Sequence[int], max_tokens: int,
                 priority: int = 0, output_seed: int = 0, hash_block_size: int = 16,
                 block_hashes: list[int] | None = None, hash_lookahead: int = 0, block_size: int = 0):
        """``hash_block_size``: the hashing unit (vLLM's ``prefix_match_unit``). With a
        ``block_size`` above it (partial-block prefix hits) ``unit_hashes`` holds a hash every
        unit (``block_hashes`` given: those) and ``block_hashes`` the hash at each block's end
        (the unit hash there, which covers the block's whole prefix, as in vLLM 0.33)."""
        self.req_id = req_id
        self.index = index
        self.arrival_step = arrival_step
        self.max_tokens = max_tokens
        self.priority = priority
        self.token_ids: list[int] = list(prompt)
        self.prompt_ids = prompt if type(prompt) is tuple else tuple(prompt)  # (for the first admission's plan row)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        # (given: the prompt's block hashes, computed for many requests at once by sched.hashing)
        self.scale = block_size // hash_block_size if block_size > hash_block_size else 1
        self.block_hashes: list[int] = block_hashes if block_hashes is not None else []
        self.unit_hashes = self.block_hashes
        if self.scale > 1:
            self.block_hashes = self.unit_hashes[self.scale - 1::self.scale]
        self.status = Status.WAITING
        self.num_preemptions = 0
        self.resumed = False
        self.output_seed = output_seed
        self.admitted_once = False
        self.hash_block_size = hash_block_size
        self.draft_round = 0
        self.junction = 0  # cached-prefix length seen at admission (align chunking stops there)
        # decode fast path: no KV group acts while total <= quiet_total and computed <= quiet_computed
        self.quiet_total = -1
        self.quiet_computed = -1
        self.quiet_by: list | None = None  # per KV group (max total, max computed)
        self.out_stream: list[int] | None = None  # true continuation, filled by the simulated model
        self.cruising = False  # advanced in bulk by the scheduler (its counters lag; see Scheduler._land)
        self.seat = 0  # order of (re)entry into the running queue: the running queue is in seat order
        self.cruise_run = -1  # which bulk run the request is in (side events of older runs are void)
        self.cruise_end = -1  # the step its bulk run ends (it is woken then)
        # its last scheduled chunk ended before its tokens did (vLLM's is_prefill_chunk: a step
        # that runs such a request pads no admission to a uniform draft row)
        self.prefill_chunk = False
        # MTP / EAGLE (vLLM 0.33's lookahead block hashes): a block's hash also covers the
        # ``hash_lookahead`` tokens after it (the drafter's KV at the block's last position
        # depends on them), so it exists only once they do
        self.hash_lookahead = hash_lookahead
        self.plain_hashes: list[int] = []  # (with a lookahead: the chain without it)
        self.update_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    def update_hashes(self) -> None:
        """Extend the chained block hashes over every full block of committed tokens."""
        bs = self.hash_block_size
        hashes = self.unit_hashes
        if self.scale > 1:
            self._update_units()
            k = self.scale
            blocks = self.block_hashes
            blocks.extend(hashes[(len(blocks) + 1) * k - 1::k])
            return
        la = self.hash_lookahead
        if la:
            toks = self.token_ids
            plain = self.plain_hashes
            full = (len(toks) - la) // bs
            i = len(plain)
            if full > i:
                plain.extend(chained_hashes(toks[i * bs:full * bs], bs, plain[-1] if plain else 0))
                _M = (1 << 64) - 1
                for j in range(i, full):
                    look = hash(tuple(toks[(j + 1) * bs:(j + 1) * bs + la]))
                    hashes.append((plain[j] * 0x9E3779B97F4A7C15 + look + 0x5bd1e995) & _M)
            return
        full = len(self.token_ids) // bs
        i = len(hashes)
        if full > i:
            hashes.extend(chained_hashes(self.token_ids[i * bs:full * bs], bs, hashes[-1] if hashes else 0))

    def _update_units(self) -> None:
        """``update_hashes`` over units (partial-block prefix hits)."""
        scale, self.scale = self.scale, 1
        blocks, self.block_hashes = self.block_hashes, self.unit_hashes
        try:
            self.update_hashes()
        finally:
            self.scale, self.block_hashes = scale, blocks

    @property
    def hashed_tokens(self) -> int:
        """Tokens the block hashes cover (every unit of them)."""
        return len(self.unit_hashes) * self.hash_block_size

    def append_output(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)
        if len(self.token_ids) // self.hash_block_size > len(self.unit_hashes):
            self.update_hashes()

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Request({self.req_id}, c={self.num_computed_tokens}, tokens={self.num_tokens}, "
                f"status={self.status.name})")
