"""Reference kernel provider: plain torch, the semantics every other provider must match.

Kernels see tensors, block ids and lengths; they know nothing about requests.
Block ids are widened to int64 before any address arithmetic.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..device.transfer import upload
from . import paged_attention as paged
from .probe_scan import scan_reference

NEG_INF = float("-inf")
SCORE_ELEMS = 1 << 27  # mla_decode materialises scores of at most this many elements at once
LENGTH_PAD = 1.25  # ``length_groups``: a group's padded keys at most this many times its real ones (plus slack)
LENGTH_SLACK = {"cuda": 4096, "cpu": 256}  # keys of padding one call's fixed cost pays for (a call: ten launches)
PARTIAL_SCORE_ELEMS = 1 << 26  # attention_partial's callers keep its score matrix within this many elements


def length_groups(lens: Sequence[int], slack: int) -> list[list[int]]:
    """Rows of a batched call (their key counts ``lens``) in groups, each padded to its own longest row:
    a group's rows times its longest stay within ``LENGTH_PAD`` times its real keys plus ``slack``.
    Every row in exactly one group, each group's rows in their order in the call. Why: ``mla_decode``
    pads every row to the call's longest, and a decode batch's lengths spread widely (over
    deepseek_v3_mooncake's schedule, 5.8 times the real keys)."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    groups: list[list[int]] = []
    start = 0
    while start < len(order):
        longest = real = lens[order[start]]
        end = start + 1
        while end < len(order) and (end - start + 1) * longest <= LENGTH_PAD * (real + lens[order[end]]) + slack:
            real += lens[order[end]]
            end += 1
        groups.append(sorted(order[start:end]))
        start = end
    return groups


def _softmax_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and the natural-log lse over the last axis of scores ``s`` (-inf where masked). A row
    masked everywhere gives p = 0 and lse = -inf; a row holding a NaN gives p = 0 and lse = NaN (an unwritten
    input stays visible downstream), one holding +inf p = 0 and lse = inf. Torch's softmax, with the lse from
    its largest probability, 1 / its sum (torch's logsumexp would make the exponentials again in a tensor of
    their own): three passes over the scores where a subtract, exp, sum and divide in place took ten
    (bench/history/2026-11-28_session35.md)."""
    m = s.amax(-1)
    p = torch.softmax(s, dim=-1)
    finite = torch.isfinite(m)
    lse = torch.where(finite, m - torch.log(p.amax(-1)), m)
    return p.masked_fill_(~finite[..., None], 0.0), lse


def takes_causal(provider) -> bool:
    """Whether a provider's ``attention_partial`` takes the ``causal`` promise: a plugin's override
    written before the parameter existed does not (it gets the mask alone). Wrappers (timing,
    checking) are looked through to the provider they hold (``inner``)."""
    import inspect

    while hasattr(provider, "inner"):
        provider = provider.inner
    try:
        return "causal" in inspect.signature(provider.attention_partial).parameters
    except (TypeError, ValueError):
        return False


def takes_host_lengths(kernels) -> bool:
    """Whether ``kernels.mla_decode`` takes ``seq_lens_cpu``, the lengths on the host beside the device's
    (the checked kernels do, for their reference's length groups); not looked through wrappers: the
    call goes to the outermost."""
    import inspect

    try:
        return "seq_lens_cpu" in inspect.signature(kernels.mla_decode).parameters
    except (TypeError, ValueError):
        return False


class ReferenceKernels:
    name = "reference"

    # ------------------------------------------------------------------ the Mamba probe's scan
    def mamba_scan(self, tables, launch) -> None:
        """Advance rows through every Mamba probe layer (``probe_scan.ScanLaunch``): torch, chunked."""
        scan_reference(tables, launch)

    # ------------------------------------------------------------------ Mamba state copies
    def state_copy(self, conv: torch.Tensor, temporal: torch.Tensor, table: torch.Tensor,
                   items: torch.Tensor) -> None:
        """Every (request, layer) state copy of one step.

        conv (layers, pages, R, dim) and temporal (layers, pages, ...) hold every Mamba layer;
        table (rows, cols) holds block rows; items (n, 6) are (table row, layer, src col,
        dst col, temporal src col, offset): conv[layer, dst, 0:R-o] = conv[layer, src, o:R]
        (memmove semantics: a same-block left shift is safe) and temporal[layer, dst] =
        temporal[layer, tsrc]. No item may read a page another item writes: the copies of
        one step are independent, which is what lets a kernel run them all at once.
        """
        table = table.to(torch.int64).cpu()
        items = items.to(torch.int64).cpu()
        self.check_copy_items(table, items)
        R = conv.shape[2]
        for row, layer, s_col, d_col, t_col, o in items.tolist():
            s, d, ts = (int(table[row, c]) for c in (s_col, d_col, t_col))
            window = conv[layer, s, o:R].clone()  # clone: same-block left shifts overlap
            conv[layer, d, 0:R - o] = window
            temporal[layer, d] = temporal[layer, ts].clone()

    @staticmethod
    def check_copy_items(table: torch.Tensor, items: torch.Tensor) -> None:
        """Refuse a step whose copies depend on each other: one writes a page another reads
        or writes (its own source may be its destination: an in-place shift)."""
        if items.shape[0] < 2:
            return
        t = table.to(torch.int64).cpu()
        it = items.to(torch.int64).cpu()
        rows, layers = it[:, 0], it[:, 1]
        src, dst, tsrc = t[rows, it[:, 2]], t[rows, it[:, 3]], t[rows, it[:, 4]]
        readers: dict[tuple[int, int], set[int]] = {}
        for k, (l, a, b) in enumerate(zip(layers.tolist(), src.tolist(), tsrc.tolist())):
            readers.setdefault((l, a), set()).add(k)
            readers.setdefault((l, b), set()).add(k)
        written: set[tuple[int, int]] = set()
        for k, (l, d) in enumerate(zip(layers.tolist(), dst.tolist())):
            if (l, d) in written or readers.get((l, d), {k}) - {k}:
                raise ValueError(f"state_copy: copy {k} writes page {d} of layer {l}, which another "
                                 f"copy of the same step reads or writes")
            written.add((l, d))

    # ------------------------------------------------------------------ block copies
    def block_copy(self, pages: torch.Tensor, pairs: torch.Tensor) -> None:
        """Whole-page copies of one step (vLLM's ``kv_cache_block_copies``): pages (slots,
        capacity, elems) of any dtype, pairs (n, 2) of page rows (source, destination):
        pages[s, dst] = pages[s, src] for every slot s, bit for bit. The copies must not depend
        on each other (no page is both written and read or written twice), so they may all run
        at once."""
        p = pairs.to(torch.int64).cpu()
        self.check_block_pairs(p, pages.shape[1])
        if len(p):
            src, dst = p[:, 0].to(pages.device), p[:, 1].to(pages.device)
            pages[:, dst] = pages[:, src]

    @staticmethod
    def check_block_pairs(pairs: torch.Tensor, capacity: int) -> None:
        """Refuse copies that depend on each other or leave the cache (a ValueError naming them)."""
        src, dst = pairs[:, 0].tolist(), pairs[:, 1].tolist()
        for k, (a, b) in enumerate(zip(src, dst)):
            if not (0 <= a < capacity and 0 <= b < capacity):
                raise ValueError(f"block_copy: copy {k} ({a} -> {b}) names a page outside the cache ({capacity})")
        if len(set(dst)) < len(dst) or set(dst) & set(src):
            raise ValueError(f"block_copy: copies {list(zip(src, dst))} write a page twice or write a page "
                             "another copy of the same step reads")

    # ------------------------------------------------------------------ MLA cache ops
    def concat_and_cache(self, entries: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """cache viewed as (num_blocks * block_size, dim): write entries (n, dim) at slots (n,)."""
        flat = cache.view(-1, cache.shape[-1])
        flat[slots.to(cache.device, torch.int64)] = entries.to(cache.device, cache.dtype)

    def gather_cache(self, cache: torch.Tensor, block_row: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """Latent entries of positions [start, start+length) of one request (start page-aligned)."""
        bs = cache.shape[1]
        if start % bs:
            raise ValueError(f"gather_cache: start {start} is not a multiple of the page size {bs}")
        pos = torch.arange(start, start + length, dtype=torch.int64, device=cache.device)
        blocks = block_row.to(cache.device, torch.int64)[pos // bs]
        return cache[blocks, pos % bs]

    # ------------------------------------------------------------------ GQA paged attention
    def reshape_and_cache(self, key, value, slots, k_cache, v_cache) -> None:
        """key/value (n, kv_heads, D) into the paged caches at slots (n,) (``paged_attention.py``)."""
        paged.reshape_and_cache(key, value, slots, k_cache, v_cache)

    def paged_attention(self, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                        max_seq_len=None, num_splits=0, past_end_bug=False):
        """Every row of a step over its block row: q (T, heads, D) -> (T, heads, D) float32;
        lengths are host tensors. ``max_seq_len`` and ``num_splits`` are hints a kernel may use;
        the result does not depend on them."""
        return paged.paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                                     past_end_bug=past_end_bug)

    # ------------------------------------------------------------------ attention pieces
    def merge_states(self, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                     lse_b: torch.Tensor, base2_bug: bool = False, unguarded: bool = False):
        """Merge two partial attentions over disjoint keys. o: (..., H, D), lse: (..., H), natural log.

        An all-masked partial has lse = -inf and contributes nothing; both empty gives
        o = 0 and lse = -inf (never NaN).
        """
        if unguarded:
            m = torch.maximum(lse_a, lse_b)
        else:
            a_inf = torch.isinf(lse_a) & (lse_a < 0)
            b_inf = torch.isinf(lse_b) & (lse_b < 0)
            m = torch.maximum(lse_a, lse_b)
            m = torch.where(a_inf & b_inf, torch.zeros_like(m), m)
        ex = torch.exp2 if base2_bug else torch.exp
        wa = ex(lse_a - m)
        wb = ex(lse_b - m)
        s = wa + wb
        if not unguarded:
            s_safe = torch.where(s == 0, torch.ones_like(s), s)
        else:
            s_safe = s
        out = (o_a * (wa / s_safe)[..., None] + o_b * (wb / s_safe)[..., None])
        lse = m + torch.log(s_safe) if not unguarded else m + torch.log(s)
        if not unguarded:
            empty = s == 0
            lse = torch.where(empty, torch.full_like(lse, NEG_INF), lse)
            out = torch.where(empty[..., None], torch.zeros_like(out), out)
        return out, lse

    def partial_query_rows(self, keys: int, heads: int) -> int:
        """Queries per ``attention_partial`` call over ``keys`` keys: this one materialises their
        (queries, heads, keys) float32 scores, kept within ``PARTIAL_SCORE_ELEMS``."""
        return max(1, PARTIAL_SCORE_ELEMS // (heads * max(keys, 1)))

    def attention_partial(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          mask: torch.Tensor | None, causal: int | None = None):
        """q (n, H, dq), k (m, H, dq) or (m, dq), v (m, H, dv) or (m, dv) -> (out (n, H, dv), lse (n, H)).
        ``causal``: a promise that ``mask`` is the causal one (key j visible to query i where
        j <= i + causal), which a kernel may compute instead of reading; here the mask is read."""
        if k.dim() == 2:
            s = torch.einsum("nhd,md->nhm", q, k) * scale
        else:
            s = torch.einsum("nhd,mhd->nhm", q, k) * scale
        if mask is not None:
            s.masked_fill_(~mask[:, None, :], NEG_INF)
        p, lse = _softmax_lse(s)
        out = torch.einsum("nhm,mhd->nhd", p, v) if v.dim() == 3 else torch.einsum("nhm,md->nhd", p, v)
        return out, lse

    def mla_decode(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, kv_lora_rank: int, scale: float, num_splits: int = 0,
                   max_seq_len: int | None = None):
        """Absorbed MLA over the paged latent cache for a batch of requests with the same query
        count: q_lat (B, nq, H, L), q_pe (B, nq, H, R), block_table (B, cols), seq_lens (B,). The nq
        queries are the last nq positions of each sequence (bottom-right causal mask). Returns
        o_lat (B, nq, H, L) and lse (B, nq, H), natural log.

        With ``num_splits`` > 1 each request's keys are split into that many parts, attended
        separately and merged with ``merge_states`` (the result does not depend on it; the tests
        check that); 0 is the provider's choice, here one pass. ``max_seq_len`` is a speed hint."""
        splits = num_splits if num_splits > 0 else 1
        dev = q_lat.device
        B, nq = q_lat.shape[:2]
        lens = seq_lens.to(dev, torch.int64)
        n = max_seq_len if max_seq_len is not None else (int(lens.max()) if B else 0)
        per = max(1, SCORE_ELEMS // max(1, nq * q_lat.shape[2] * n))
        if B > per:  # a batch whose scores would not fit goes in slices
            parts = [self.mla_decode(q_lat[i:i + per], q_pe[i:i + per], cache, block_table[i:i + per],
                                     seq_lens[i:i + per], kv_lora_rank, scale, num_splits, max_seq_len=n)
                     for i in range(0, B, per)]
            return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
        bs = cache.shape[1]
        H = q_lat.shape[2]
        kpos = torch.arange(n, device=dev)
        # a shorter request's padding reads its own last key again (masked below: its weight is 0), never
        # what its block row names past its end (the NaN null page: 0 x NaN would reach the output)
        at = torch.minimum(kpos[None, :], (lens - 1).clamp_min(0)[:, None])  # (B, n)
        pages = block_table.to(dev, torch.int64).gather(1, at // bs)
        if cache.is_contiguous():  # whole entries by row number: one contiguous copy each
            lat = cache.view(-1, cache.shape[-1]).index_select(0, (pages * bs + at % bs).flatten()).view(B, n, -1)
        else:
            lat = cache[pages, at % bs]
        lat = lat.to(q_lat.dtype)  # (B, n, L+R)
        kv_c = lat[..., :kv_lora_rank]
        # q_lat . kv_c + q_pe . k_pe as one product over the whole entry, the scale applied by the product
        q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).flatten(1, 2)  # (B, nq H, L+R)
        s = torch.empty(B, nq * H, n, dtype=q.dtype, device=dev).baddbmm_(q, lat.transpose(1, 2), beta=0, alpha=scale)
        s = s.view(B, nq, H, n)
        qpos = lens[:, None] - nq + torch.arange(nq, device=dev)[None, :]  # (B, nq)
        visible = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lens[:, None, None])
        if splits == 1:
            p, lse = _softmax_lse(s.masked_fill_(~visible[:, :, None, :], NEG_INF))
            del s
            o = torch.bmm(p.view(B, nq * H, n), kv_c).view(B, nq, H, kv_lora_rank)
            # a request of no keys gives o = 0 (its padding read key 0 of its first page, NaN there: 0 x NaN)
            return o.masked_fill_((lens == 0)[:, None, None, None], 0.0), lse
        per = torch.div(lens + splits - 1, splits, rounding_mode="floor").clamp_min(1)  # (B,)
        part = kpos[None, :] // per[:, None]  # (B, n): which split each key falls in
        # every split's partial attention at once: (splits, B, nq, H, n)
        mask = visible[None] & (part[None] == torch.arange(splits, device=dev)[:, None, None])[:, :, None, :]
        sm = s[None].masked_fill(~mask[:, :, :, None, :], NEG_INF)
        l_part = torch.logsumexp(sm, dim=-1)  # (splits, B, nq, H)
        finite = torch.isfinite(l_part)
        p = torch.exp(sm - torch.where(finite, l_part, 0.0)[..., None]).masked_fill(~finite[..., None], 0.0)
        o_part = torch.einsum("sbqhm,bmd->sbqhd", p, kv_c)
        out = torch.zeros(B, nq, H, kv_lora_rank, dtype=q_lat.dtype, device=dev)
        lse = torch.full((B, nq, H), NEG_INF, dtype=q_lat.dtype, device=dev)
        for sp in range(splits):  # merged in split order
            out, lse = self.merge_states(out, lse, o_part[sp], l_part[sp])
        return out, lse

    def mla_decode_by_length(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: Sequence[int],
                             kv_lora_rank: int, scale: float, num_splits: int = 0):
        """``mla_decode`` with the rows in ``length_groups`` of their lengths (``seq_lens_cpu``: the same
        lengths, on the host), one call a group, each padded only to its own longest row: each row's
        result is what ``mla_decode`` gives it, up to float32 rounding (the products' and the softmax's
        sums may run in another order at another padded length). Returns o_lat, lse in the rows' order."""
        lens = [int(n) for n in seq_lens_cpu]
        assert len(lens) == q_lat.shape[0], "mla_decode_by_length: one host length a row"
        dev = q_lat.device
        groups = length_groups(lens, LENGTH_SLACK.get(dev.type, LENGTH_SLACK["cpu"]))
        if len(groups) <= 1:
            return self.mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits,
                                   max_seq_len=max(lens, default=0))
        o = torch.empty(q_lat.shape[:3] + (kv_lora_rank,), dtype=q_lat.dtype, device=dev)
        lse = torch.empty(q_lat.shape[:3], dtype=q_lat.dtype, device=dev)
        for g in groups:
            idx = upload(g, dev)
            go, gl = self.mla_decode(q_lat.index_select(0, idx), q_pe.index_select(0, idx), cache,
                                     block_table.index_select(0, idx.to(block_table.device)),
                                     seq_lens.index_select(0, idx.to(seq_lens.device)), kv_lora_rank, scale,
                                     num_splits, max_seq_len=max(lens[i] for i in g))
            o.index_copy_(0, idx, go)
            lse.index_copy_(0, idx, gl)
        return o, lse

    def mla_decode_one(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_row: torch.Tensor,
                       seq_len: int, kv_lora_rank: int, scale: float, num_splits: int = 1):
        """``mla_decode`` for one request: q_lat (q, H, L), q_pe (q, H, R) -> (q, H, L), (q, H)."""
        o, lse = self.mla_decode(q_lat[None], q_pe[None], cache, block_row[None],
                                 torch.tensor([seq_len], device=q_lat.device), kv_lora_rank, scale, num_splits)
        return o[0], lse[0]
