"""``hybridsim kernels check PROVIDER``: every op of a provider against the reference, on
adversarial inputs.

Each case draws fresh random inputs (never zeros), pages of 16, 64 and 1056 tokens, batches from
1 up, context lengths on and beside page edges, block tables that are shuffled and strided (a
column view of a wider table), and every page no row owns poisoned with NaN, so a kernel that
reads past a row's end or through the wrong table entry turns its output NaN. Outputs the
provider allocates are NaN-filled before each launch (``poison``). State copies and cache writes
must be bit-exact; attention pieces within the dtype's tolerance, with NaN/inf positions equal.

On a CPU the providers' Triton kernels run under the interpreter, so the sizes are small; on a
GPU they are the real models' (Nemotron-H-8B states, DeepSeek-V3 latents) and each case is timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .reference import ReferenceKernels, takes_causal
from .segments import bits_differ

PAGES = (16, 64, 1056)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@dataclass
class OpResult:
    op: str
    cases: int = 0
    failed: int = 0
    worst: float = 0.0  # worst relative error (exact ops: elements that differ)
    exact: bool = False
    first_failure: str = ""
    seconds: list[float] = field(default_factory=list)  # GPU time per case (events), when on a GPU

    @property
    def verdict(self) -> str:
        return "fail" if self.failed else ("pass" if self.cases else "no case")


@dataclass
class Sizes:
    batches: tuple[int, ...]
    pages: tuple[int, ...]
    heads: int
    head_dim: int
    kv_heads: int
    lat: int  # MLA latent rank
    rope: int
    mla_heads: int
    conv: tuple[int, int]  # conv window rows, dim
    temporal: tuple[int, ...]
    layers: int
    dtype: torch.dtype


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if device.type == "cuda" and not quick:
        return Sizes((1, 8, 64, 256), PAGES, 32, 128, 8, 512, 64, 128, (3, 8192 + 2 * 128), (128, 64, 128), 24,
                     torch.bfloat16)
    return Sizes((1, 3) if quick else (1, 5, 256), PAGES, 4, 16, 2, 32, 16, 4, (3, 12), (2, 4, 6), 2, torch.float32)


def _rand(shape, dtype, dev, gen) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1).add_(0.01).to(dev, dtype)


def _table(lens: list[int], page: int, pool: int, gen, dev) -> tuple[torch.Tensor, set[int]]:
    """Shuffled distinct pages per row, as a column view of a wider int32 table (a stride the
    kernel must honour); padding names page 0 (poisoned, like every page no row owns)."""
    need = [max(1, -(-n // page)) for n in lens]
    perm = torch.randperm(pool - 1, generator=gen)[: sum(need)] + 1
    cols = max(need)
    wide = torch.zeros(len(lens), 2 * cols + 1, dtype=torch.int32)
    at = 0
    for r, k in enumerate(need):
        wide[r, 1:1 + k] = perm[at:at + k].to(torch.int32)
        at += k
    return wide.to(dev)[:, 1:1 + cols], set(perm.tolist())


def _poison_unowned(cache: torch.Tensor, owned: set[int]) -> None:
    keep = torch.zeros(cache.shape[0], dtype=torch.bool)
    keep[list(owned)] = True
    cache[~keep.to(cache.device)] = float("nan")


def _lens(batch: int, page: int, gen, most: int) -> list[int]:
    """Context lengths on and beside page edges (k * page - 1, k * page, k * page + 1), and random."""
    edges = []
    for k in (1, 2, 3):
        edges += [k * page - 1, k * page, k * page + 1]
    edges = [n for n in edges if 1 <= n <= most] or [1]
    out = [edges[i % len(edges)] if i % 2 == 0 else int(torch.randint(1, most + 1, (1,), generator=gen))
           for i in range(batch)]
    return out


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[bool, float]:
    got, want = got.float().cpu(), want.float().cpu()
    special = bool((torch.isnan(got) != torch.isnan(want)).any() | (torch.isinf(got) != torch.isinf(want)).any()
                   | (torch.isinf(want) & (got != want)).any())
    fin = torch.isfinite(want) & torch.isfinite(got)
    err = float((got[fin] - want[fin]).abs().max()) if bool(fin.any()) else 0.0
    rel = err / max(float(want[fin].abs().max()) if bool(fin.any()) else 1.0, 1e-30)
    return (not special and rel <= tol), (float("inf") if special else rel)


class Checker:
    def __init__(self, k, device: torch.device, quick: bool, seed: int = 0,
                 on_case: Callable[[str, int, str], None] | None = None):
        self.k = k
        self.ref = ReferenceKernels()
        self.dev = device
        self.s = sizes_for(device, quick)
        self.gen = torch.Generator().manual_seed(seed)
        self.results: dict[str, OpResult] = {}
        self.on_case = on_case  # (op, cases done, the last case): progress, for a run that takes minutes

    def _timed(self, fn: Callable[[], object]):
        if self.dev.type != "cuda":
            return fn(), None
        fn()  # a warm-up call (each case's shapes compile once); every case's op leaves the same result twice
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        return out, a.elapsed_time(b) / 1e3

    def _record(self, op: str, ok: bool, err: float, what: str, secs, exact: bool = False) -> None:
        r = self.results.setdefault(op, OpResult(op, exact=exact))
        r.cases += 1
        if self.on_case is not None:
            self.on_case(op, r.cases, what.split(":")[0])
        r.worst = max(r.worst, err)
        if secs is not None:
            r.seconds.append(secs)
        if not ok:
            r.failed += 1
            r.first_failure = r.first_failure or what

    # ------------------------------------------------------------------ the ops
    def state_copy(self) -> None:
        """The executor's layout: a layer slot shared by the same-numbered layer of every Mamba
        group, a block row per (request, group), a copy's items listed group by group, slot by
        slot; offsets from 0 to the conv window (0 copies between columns, others shift)."""
        s = self.s
        R, dim = s.conv
        slots = 2
        for B in s.batches:
            groups = 1 if B > 64 else 3
            pool = 3 * B * groups + 2
            conv = _rand((slots, pool, R, dim), torch.float32, self.dev, self.gen)
            temporal = _rand((slots, pool, *s.temporal), torch.float32, self.dev, self.gen)
            perm = (torch.randperm(pool - 1, generator=self.gen)[: 3 * B * groups] + 1).view(B * groups, 3)
            table = torch.zeros(B * groups, 5, dtype=torch.int64)
            table[:, :3] = perm
            items = []
            for r in range(B):
                off = r % (R + 1)
                src, dst = (0, 1) if off else (0, 2)
                for g in range(groups):
                    for slot in range(slots):
                        items.append((r * groups + g, slot, src, dst, src + off, off))
            items_t = torch.tensor(items, dtype=torch.int64)
            want_c, want_t = conv.clone(), temporal.clone()
            self.ref.state_copy(want_c, want_t, table, items_t)
            _, secs = self._timed(lambda: self.k.state_copy(conv, temporal, table.to(self.dev), items_t.to(self.dev)))
            diff = int(bits_differ(conv, want_c).sum()) + int(bits_differ(temporal, want_t).sum())
            self._record("state_copy", diff == 0, float(diff), f"batch {B}: {diff} elements differ", secs, True)
            del conv, temporal, want_c, want_t

    def reshape_and_cache(self) -> None:
        s = self.s
        for page in s.pages:
            for B in s.batches[:2]:
                n = B * 3
                pool = max(4, -(-n // page) + 3)
                kc = _rand((pool, page, s.kv_heads, s.head_dim), s.dtype, self.dev, self.gen)
                vc = _rand((pool, page, s.kv_heads, s.head_dim), s.dtype, self.dev, self.gen)
                slots = torch.randperm(pool * page, generator=self.gen)[:n].to(self.dev)
                key = _rand((n, s.kv_heads, s.head_dim), s.dtype, self.dev, self.gen)
                val = _rand((n, s.kv_heads, s.head_dim), s.dtype, self.dev, self.gen)
                wk, wv = kc.clone(), vc.clone()
                self.ref.reshape_and_cache(key, val, slots, wk, wv)
                _, secs = self._timed(lambda: self.k.reshape_and_cache(key, val, slots, kc, vc))
                diff = int(bits_differ(kc, wk).sum()) + int(bits_differ(vc, wv).sum())
                self._record("reshape_and_cache", diff == 0, float(diff), f"page {page}, {n} tokens: {diff} differ",
                             secs, True)

    def concat_and_cache(self) -> None:
        s = self.s
        for page in s.pages:
            n = 7
            pool = -(-n // page) + 3
            cache = _rand((pool, page, s.lat + s.rope), s.dtype, self.dev, self.gen)
            slots = torch.randperm(pool * page, generator=self.gen)[:n].to(self.dev)
            entries = _rand((n, s.lat + s.rope), s.dtype, self.dev, self.gen)
            want = cache.clone()
            self.ref.concat_and_cache(entries, slots, want)
            _, secs = self._timed(lambda: self.k.concat_and_cache(entries, slots, cache))
            diff = int(bits_differ(cache, want).sum())
            self._record("concat_and_cache", diff == 0, float(diff), f"page {page}: {diff} differ", secs, True)

    def gather_cache(self) -> None:
        s = self.s
        for page in s.pages:
            for n in _lens(3, page, self.gen, 3 * page + 1):
                table, owned = _table([n], page, -(-n // page) + 4, self.gen, self.dev)
                cache = _rand((-(-n // page) + 4, page, s.lat + s.rope), s.dtype, self.dev, self.gen)
                _poison_unowned(cache, owned)
                want = self.ref.gather_cache(cache, table[0], 0, n)
                got, secs = self._timed(lambda: self.k.gather_cache(cache, table[0], 0, n))
                diff = int(bits_differ(got, want).sum())
                self._record("gather_cache", diff == 0, float(diff), f"page {page}, length {n}: {diff} differ",
                             secs, True)

    def paged_attention(self) -> None:
        s = self.s
        tol = TOL[s.dtype]
        for page in s.pages:
            for B in s.batches:
                lens = _lens(B, page, self.gen, 3 * page + 1)
                qn = [1 if r % 3 else min(lens[r], 1 + r % 5) for r in range(B)]  # decodes, verification rows, chunks
                pool = sum(-(-n // page) for n in lens) + 2
                table, owned = _table(lens, page, pool, self.gen, self.dev)
                kc = _rand((pool, page, s.kv_heads, s.head_dim), s.dtype, self.dev, self.gen)
                vc = _rand((pool, page, s.kv_heads, s.head_dim), s.dtype, self.dev, self.gen)
                _poison_unowned(kc, owned)
                _poison_unowned(vc, owned)
                qsl = torch.tensor([0] + qn, dtype=torch.int64).cumsum(0)
                q = _rand((int(qsl[-1]), s.heads, s.head_dim), s.dtype, self.dev, self.gen)
                seq = torch.tensor(lens, dtype=torch.int64)
                scale = s.head_dim ** -0.5
                want = self.ref.paged_attention(q, kc, vc, table, qsl, seq, scale)
                got, secs = self._timed(lambda: self.k.paged_attention(q, kc, vc, table, qsl, seq, scale))
                ok, err = _close(got, want, tol)
                self._record("paged_attention", ok, err, f"page {page}, batch {B}: rel error {err:.2e}", secs)

    def merge_states(self) -> None:
        s = self.s
        for B in s.batches:
            shape = (B, 2, s.heads)
            oa, ob = (_rand((*shape, s.lat), torch.float32, self.dev, self.gen) for _ in range(2))
            la, lb = (_rand(shape, torch.float32, self.dev, self.gen) * 8 for _ in range(2))
            la[0, 0, 0] = float("-inf")  # an empty partial on either side, and both
            lb[-1, -1, -1] = float("-inf")
            la[-1, 0, 0] = lb[-1, 0, 0] = float("-inf")
            want = self.ref.merge_states(oa, la, ob, lb)
            got, secs = self._timed(lambda: self.k.merge_states(oa, la, ob, lb))
            ok_o, e_o = _close(got[0], want[0], 1e-6)
            ok_l, e_l = _close(got[1], want[1], 1e-6)
            self._record("merge_states", ok_o and ok_l, max(e_o, e_l), f"batch {B}: rel error {max(e_o, e_l):.2e}",
                         secs)

    def mla_decode(self) -> None:
        s = self.s
        tol = TOL[s.dtype]
        for page in s.pages:
            for B in s.batches:
                for nq in (1, 2):
                    lens = [max(n, nq) for n in _lens(B, page, self.gen, 3 * page + 1)]
                    pool = sum(-(-n // page) for n in lens) + 2
                    table, owned = _table(lens, page, pool, self.gen, self.dev)
                    cache = _rand((pool, page, s.lat + s.rope), s.dtype, self.dev, self.gen)
                    _poison_unowned(cache, owned)
                    q_lat = _rand((B, nq, s.mla_heads, s.lat), torch.float32, self.dev, self.gen)
                    q_pe = _rand((B, nq, s.mla_heads, s.rope), torch.float32, self.dev, self.gen)
                    seq = torch.tensor(lens, dtype=torch.int64, device=self.dev)
                    scale = (s.lat + s.rope) ** -0.5
                    want = self.ref.mla_decode(q_lat, q_pe, cache, table, seq, s.lat, scale)
                    got, secs = self._timed(lambda: self.k.mla_decode(q_lat, q_pe, cache, table, seq, s.lat, scale))
                    ok_o, e_o = _close(got[0], want[0], tol)
                    ok_l, e_l = _close(got[1], want[1], tol)
                    self._record("mla_decode", ok_o and ok_l, max(e_o, e_l),
                                 f"page {page}, batch {B}, {nq} quer{'y' if nq == 1 else 'ies'}: rel error {max(e_o, e_l):.2e}", secs)

    def attention_partial(self) -> None:
        s = self.s
        for n, m in ((1, 1), (5, 17), (33, 64)):
            q = _rand((n, s.heads, s.head_dim), torch.float32, self.dev, self.gen)
            k = _rand((m, s.heads, s.head_dim), torch.float32, self.dev, self.gen)
            v = _rand((m, s.heads, s.head_dim), torch.float32, self.dev, self.gen)
            mask = torch.rand((n, m), generator=self.gen).to(self.dev) < 0.8
            mask[0] = False  # a row that sees nothing
            self._partial_case(q, k, v, mask, None, f"{n} x {m}")
        # the prefill path's new tokens over themselves: the causal mask, promised (``causal``)
        n, m = 37, 45
        q = _rand((n, s.heads, s.head_dim), torch.float32, self.dev, self.gen)
        k = _rand((m, s.heads, s.head_dim), torch.float32, self.dev, self.gen)
        v = _rand((m, s.heads, s.head_dim), torch.float32, self.dev, self.gen)
        mask = torch.arange(m, device=self.dev)[None, :] <= torch.arange(n, device=self.dev)[:, None] + (m - n)
        self._partial_case(q, k, v, mask, m - n, f"{n} x {m}, causal")

    def _partial_case(self, q, k, v, mask, causal, what: str) -> None:
        s = self.s
        want = self.ref.attention_partial(q, k, v, s.head_dim ** -0.5, mask)
        promise = {"causal": causal} if causal is not None and takes_causal(self.k) else {}
        got, secs = self._timed(lambda: self.k.attention_partial(q, k, v, s.head_dim ** -0.5, mask, **promise))
        ok_o, e_o = _close(got[0], want[0], 1e-5)
        ok_l, e_l = _close(got[1], want[1], 1e-5)
        self._record("attention_partial", ok_o and ok_l, max(e_o, e_l), f"{what}: rel error {max(e_o, e_l):.2e}",
                     secs)

    ORDER = ("state_copy", "reshape_and_cache", "paged_attention", "concat_and_cache", "gather_cache",
             "merge_states", "mla_decode", "attention_partial")

    def run(self, only: tuple[str, ...] = ()) -> Iterator[OpResult]:
        for op in self.ORDER:
            if only and op not in only:
                continue
            try:
                getattr(self, op)()
            except Exception as e:  # a provider that crashes fails its op, with what it raised
                r = self.results.setdefault(op, OpResult(op))
                r.cases += 1
                r.failed += 1
                r.worst = float("inf")
                r.first_failure = r.first_failure or f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            yield self.results[op]
