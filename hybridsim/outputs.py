"""The simulated model's outputs: the true continuation, drafts and their acceptance.

Every request has a deterministic *true* continuation (a seeded function of the
request and the output position). Drafts are true tokens with a wrong token
placed where the acceptance model says the draft diverges, so the number
accepted is really the length of the matching prefix, and rejected drafts are
really wrong tokens.
"""

from __future__ import annotations

from typing import Optional, Protocol

import numpy as np

from .config import BernoulliAcceptance, NoAcceptance, PatternAcceptance
from .sched.request import Request
from .workload.tokens import combine, mix, mix_many, stream_token, token_block, token_segments

_M64 = (1 << 64) - 1
_LANE_SHIFTS = np.array([0, 16, 32, 48], dtype=np.uint64)


class Continuation(Protocol):
    def token(self, req: Request, out_index: int) -> int: ...

    def stream(self, req: Request, length: int) -> list[int]:
        """Output tokens 0 .. length-1 (same values as ``token``)."""


class SeededContinuation:
    """Output token ``i`` of a request = hash(output_seed, i) mod vocab."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def token(self, req: Request, out_index: int) -> int:
        return stream_token(req.output_seed, out_index, self.vocab)

    def stream(self, req: Request, length: int) -> list[int]:
        return token_block(req.output_seed, length, self.vocab).tolist()

    def streams(self, reqs: list[Request], lengths: list[int]) -> list[list[int]]:
        """``stream`` for several requests in one vectorised pass."""
        return token_segments([r.output_seed for r in reqs], lengths, self.vocab)


class RecordedContinuation:
    """Outputs read from a recording (falls back to the seeded stream past its end)."""

    def __init__(self, streams: dict[str, list[int]], vocab: int):
        self.streams = streams
        self.fallback = SeededContinuation(vocab)

    def token(self, req: Request, out_index: int) -> int:
        s = self.streams.get(req.req_id)
        if s is not None and out_index < len(s):
            return s[out_index]
        return self.fallback.token(req, out_index)

    def stream(self, req: Request, length: int) -> list[int]:
        s = list(self.streams.get(req.req_id, ()))[:length]
        if len(s) < length:
            s.extend(token_block(req.output_seed, length, self.fallback.vocab)[len(s):].tolist())
        return s


class Acceptance(Protocol):
    def accepted(self, req: Request, num_drafts: int) -> int:
        """How many leading drafts of this proposal round will be correct."""


def _run_rounds(firsts, counts) -> tuple[np.ndarray, np.ndarray]:
    """Rounds ``firsts[i] .. firsts[i]+counts[i]-1`` of each run, concatenated, and the run
    each belongs to."""
    counts = np.asarray(counts, dtype=np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.asarray(firsts, dtype=np.int64)[owner] + within, owner


class BernoulliModel:
    """Each draft matches with probability ``rate`` given the previous one did.

    One 64-bit hash per proposal round supplies 16-bit uniform draws for four
    drafts (a further hash per four more), so a round costs one or two mixes.
    """

    def __init__(self, rate: float, seed: int):
        self.threshold = int(rate * 65536)
        self.seed = seed
        self._base: dict[int, int] = {}

    def _bases(self, reqs) -> list[int]:
        """Each request's acceptance hash base (the round and draft index are added to it)."""
        bases = self._base
        seed = self.seed
        out = []
        for r in reqs:
            base = bases.get(r.index)
            if base is None:
                base = bases[r.index] = combine(seed, 0xACC, r.index)
            out.append(base)
        return out

    def accepted(self, req: Request, num_drafts: int) -> int:
        base = self._bases((req,))[0]
        thr = self.threshold
        k = 0
        word = 0
        while k < num_drafts:
            if k % 4 == 0:
                word = mix(base + (req.draft_round << 8) + k)
            if (word >> (16 * (k % 4))) & 0xFFFF >= thr:
                break
            k += 1
        return k

    def accepted_runs(self, reqs: list[Request], firsts: np.ndarray, counts: np.ndarray,
                      num_drafts: int) -> np.ndarray:
        """``accepted`` for rounds ``firsts[i] .. firsts[i]+counts[i]-1`` of each request (the
        rounds a bulk run of speculative decoding will go through), concatenated, in one
        vectorised pass."""
        bs = self._bases(reqs)
        rounds, owner = _run_rounds(firsts, counts)
        total = len(rounds)
        rounds = rounds.astype(np.uint64) << np.uint64(8)
        groups = -(-num_drafts // 4)
        xs = (rounds + np.array(bs, dtype=np.uint64)[owner])[:, None] + \
            np.arange(0, 4 * groups, 4, dtype=np.uint64)[None, :]
        words = mix_many(xs)  # (rounds, groups): draft k reads lane k % 4 of word k // 4
        lanes = ((words[:, :, None] >> _LANE_SHIFTS[None, None, :]) & np.uint64(0xFFFF)).reshape(total, -1)
        run = np.cumprod(lanes[:, :num_drafts] < np.uint64(self.threshold), axis=1).sum(axis=1)
        return run.astype(np.int64)

    def accepted_many(self, reqs: list[Request], num_drafts: list[int]) -> list[int]:
        """``accepted`` for many requests of one proposal round each, vectorised (up to
        four drafts: one hash per request; more go one by one)."""
        if max(num_drafts) > 4:
            return [self.accepted(r, d) for r, d in zip(reqs, num_drafts)]
        xs = [(base + (r.draft_round << 8)) & _M64 for r, base in zip(reqs, self._bases(reqs))]
        words = mix_many(np.array(xs, dtype=np.uint64))
        lanes = (words[:, None] >> _LANE_SHIFTS[None, :]) & np.uint64(0xFFFF)
        run = np.cumprod(lanes < np.uint64(self.threshold), axis=1).sum(axis=1)
        return np.minimum(run, np.asarray(num_drafts)).tolist()


class PatternModel:
    def __init__(self, pattern: list[int]):
        self.pattern = pattern

    def accepted(self, req: Request, num_drafts: int) -> int:
        return min(self.pattern[req.draft_round % len(self.pattern)], num_drafts)

    def accepted_runs(self, reqs: list[Request], firsts: np.ndarray, counts: np.ndarray,
                      num_drafts: int) -> np.ndarray:
        rounds, _ = _run_rounds(firsts, counts)
        p = self.pattern
        return np.minimum(np.array(p, dtype=np.int64)[rounds % len(p)], num_drafts)


class RejectAll:
    def accepted(self, req: Request, num_drafts: int) -> int:
        return 0

    def accepted_runs(self, reqs: list[Request], firsts: np.ndarray, counts: np.ndarray,
                      num_drafts: int) -> np.ndarray:
        return np.zeros(int(np.sum(counts)), dtype=np.int64)


def acceptance_model(spec, seed: int) -> Acceptance:
    if isinstance(spec, BernoulliAcceptance):
        return BernoulliModel(spec.rate, seed)
    if isinstance(spec, PatternAcceptance):
        return PatternModel(spec.accepted)
    if isinstance(spec, NoAcceptance):
        return RejectAll()
    raise TypeError(spec)  # pragma: no cover


class DraftSource(Protocol):
    def propose(self, req: Request) -> list[int]: ...


class ModelDrafts:
    """An EAGLE/MTP-like drafter: ``num_spec`` drafts every decode step."""

    def __init__(self, num_spec: int, continuation: Continuation, acceptance: Acceptance, vocab: int,
                 max_model_len: int):
        self.num_spec = num_spec
        self.cont = continuation
        self.acc = acceptance
        self.vocab = vocab
        self.max_model_len = max_model_len

    def propose(self, req: Request) -> list[int]:
        d = min(self.num_spec, self.max_model_len - 1 - req.num_tokens)
        if d <= 0:
            return []
        return self._round(req, d, self.acc.accepted(req, d))

    def _round(self, req: Request, d: int, k: int) -> list[int]:
        """One proposal round of ``d`` drafts of which the first ``k`` are right."""
        req.draft_round += 1
        return self.drafts_at(req, len(req.token_ids) - req.num_prompt_tokens, d, k)

    def drafts_at(self, req: Request, o: int, d: int, k: int) -> list[int]:
        """The ``d`` drafts proposed after output token ``o - 1``, the first ``k`` right."""
        stream = req.out_stream
        drafts = stream[o:o + d] if stream is not None and o + d <= len(stream) else \
            [self.cont.token(req, o + j) for j in range(d)]
        if k < d:
            drafts[k] = drafts[k] % (self.vocab - 1) + 1  # a different, valid token: the divergence
        return drafts

    def accepted_runs(self, reqs: list[Request], firsts: np.ndarray, counts: np.ndarray) -> Optional[np.ndarray]:
        """Drafts accepted in rounds ``firsts[i] .. firsts[i]+counts[i]-1`` of each request with
        ``num_spec`` drafts a round, concatenated (None if the acceptance model cannot say
        in advance)."""
        runs = getattr(self.acc, "accepted_runs", None)
        return None if runs is None else runs(reqs, firsts, counts, self.num_spec)

    def propose_many(self, reqs: list[Request]) -> list[list[int]]:
        """``propose`` for every request sampled this step (the acceptance draws vectorised)."""
        many = getattr(self.acc, "accepted_many", None)
        if many is None or len(reqs) < 8:
            return [self.propose(r) for r in reqs]
        limit = self.max_model_len - 1
        S = self.num_spec
        ds = [min(S, limit - len(r.token_ids)) for r in reqs]
        live = [i for i, d in enumerate(ds) if d > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if not live:
            return out
        ks = many([reqs[i] for i in live], [ds[i] for i in live])
        for i, k in zip(live, ks):
            out[i] = self._round(reqs[i], ds[i], k)
        return out


class RecordedDrafts:
    """Drafts replayed from a recording, keyed by (request, tokens so far)."""

    def __init__(self, drafts: dict[tuple[str, int], list[int]]):
        self.drafts = drafts

    def propose(self, req: Request) -> list[int]:
        return list(self.drafts.get((req.req_id, req.num_tokens), ()))


def make_drafter(num_spec: int, cont: Continuation, acc: Optional[Acceptance], vocab: int,
                 max_model_len: int) -> Optional[DraftSource]:
    if num_spec <= 0:
        return None
    return ModelDrafts(num_spec, cont, acc or RejectAll(), vocab, max_model_len)
