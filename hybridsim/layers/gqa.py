"""The GQA probe layer: grouped-query attention over a paged K/V cache.

Per token: hidden x = embedding(token); per KV head k = rope(x W_K, pos), v = x W_V; per
query head q = rope(x W_Q, pos). Query head h reads KV head h // (heads / kv_heads), as
the engines group them. The softmax scale is 1/sqrt(head_dim).

Exact where it is checked exactly, as the MLA probe: embeddings and projections are
small integers (every sum below 2**13 before RoPE), RoPE uses integer fractions of a
turn and a fixed-point cos/sin table (``layers.exact``), and results are scaled by
powers of two. So every K, V and Q element is an exact float32 value computed the same
way on every machine, and the cache cast (bf16 for real models) rounds it
deterministically: a cached block can be compared bit for bit with the K/V its tokens
must give. Attention outputs are compared with a tolerance.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ..model import AttentionGeometry
from .exact import rng, rope_exact
from .mla import HIDDEN, ROPE_SHIFT, TABLE, TABLE2, token_rows, torch_dtype

V_SHIFT = 7  # v is an integer (|.| <= 4096) times 2**-7; k and q carry RoPE's 2**-17


class GQAProbe:
    """One attention layer's integer weights (float32 on the CPU)."""

    def __init__(self, geo: AttentionGeometry, layer: int, seed: int, hidden: int = HIDDEN):
        self.geo = geo
        g = rng(seed, 0x6A7, layer)

        def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
            return torch.from_numpy(g.integers(lo, hi + 1, size=shape, dtype=np.int8)).to(torch.float32)

        H, K, D = geo.heads, geo.kv_heads, geo.head_dim
        self.emb1, self.emb2 = ints(-8, 8, TABLE, hidden), ints(-8, 8, TABLE2, hidden)
        self.w_q, self.w_k, self.w_v = ints(-4, 4, hidden, H, D), ints(-4, 4, hidden, K, D), ints(-4, 4, hidden, K, D)


class GQAStack:
    """Every attention layer's weights stacked on a leading layer axis, on one device: the
    executor projects all layers' K, V and Q of a step in one set of operations (float32: every
    input is an integer of at most 5 bits and every sum below 2**24, so the values are exact
    even where matrix products round their inputs to TF32), and the oracle evaluates all
    layers' attention at once (float64)."""

    def __init__(self, probes: list[GQAProbe], device, dtype: torch.dtype = torch.float64):
        st = lambda name: torch.stack([getattr(p, name) for p in probes]).to(device, dtype)  # noqa: E731
        self.emb1, self.emb2 = st("emb1"), st("emb2")
        self.w_q, self.w_k, self.w_v = st("w_q"), st("w_k"), st("w_v")
        self.geo = probes[0].geo
        self.layers = len(probes)
        self.heads = self.geo.heads
        self.key_elems = 2 * self.geo.kv_heads * self.geo.head_dim + self.emb1.shape[-1]  # K, V, hidden per key
        self.scale = self.geo.scale()
        self.dtype = torch_dtype(self.geo.dtype)  # the cache's

    def cast(self, dtype: torch.dtype) -> "GQAStack":
        """The same layers with their tables in ``dtype`` (every value is a small integer: exact)."""
        twin = copy.copy(self)
        for name in ("emb1", "emb2", "w_q", "w_k", "w_v"):
            setattr(twin, name, getattr(self, name).to(dtype))
        return twin

    def hidden(self, tok: torch.Tensor) -> torch.Tensor:
        """(layers, *tok.shape, hidden), integer-valued."""
        return token_rows(self.emb1, self.emb2, tok)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor, n_pos: int | None):
        """K and V (layers, ..., kv_heads, D) of hidden states x (layers, ..., hidden) at pos (...)."""
        k = rope_exact(torch.einsum("l...h,lhkd->l...kd", x, self.w_k), pos[..., None], n_pos) * 2.0 ** -ROPE_SHIFT
        v = torch.einsum("l...h,lhkd->l...kd", x, self.w_v) * 2.0 ** -V_SHIFT
        return k, v

    def _q(self, x: torch.Tensor, pos: torch.Tensor, n_pos: int | None) -> torch.Tensor:
        return rope_exact(torch.einsum("l...h,lhkd->l...kd", x, self.w_q), pos[..., None], n_pos) * 2.0 ** -ROPE_SHIFT

    def project(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int | None = None):
        """K, V (layers, n, kv_heads, D) and Q (layers, n, heads, D) of tokens at positions, exact
        float64 (one embedding lookup for all three)."""
        x = self.hidden(tok)
        k, v = self._kv(x, pos, n_pos)
        return k, v, self._q(x, pos, n_pos)

    def attend(self, tok: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """Causal attention in float64 for b padded rows: tok (b, n) committed tokens, query
        positions qpos (b, q) (each below its row's length). Returns (layers, b, q, heads, D)."""
        b, n = tok.shape
        pos = torch.arange(n, device=tok.device)
        x = self.hidden(tok)  # (Ly, b, n, hidden)
        k, v = self._kv(x, pos, n)  # (Ly, b, n, K, D)
        xq = x[:, torch.arange(b, device=tok.device)[:, None], qpos]  # (Ly, b, q, hidden)
        return self.attention(self._q(xq, qpos, n), k, v, qpos)

    def queries(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int) -> torch.Tensor:
        """Q (layers, n, heads, D), float64, of tokens tok (n,) at positions pos (n,) below n_pos."""
        return self._q(self.hidden(tok), pos, n_pos)

    def keys(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (layers, n, K, D), float64, of tokens tok (n,) at positions pos (n,) below n_pos."""
        return self._kv(self.hidden(tok), pos, n_pos)

    def attend_keys(self, k: torch.Tensor, v: torch.Tensor, qtok: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """One row's causal attention over keys it already has (``keys`` of its tokens 0..n-1):
        k, v (layers, n, K, D), queries of tokens qtok at positions qpos (q,) below n.
        Returns (layers, 1, q, heads, D), the values ``attend`` gives."""
        n = k.shape[1]
        q = self._q(self.hidden(qtok[None]), qpos[None], n)
        return self.attention(q, k[:, None], v[:, None], qpos[None])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """q (Ly, b, q, H, D), k and v (Ly, b, n, K, D), qpos (b, q) -> (Ly, b, q, H, D)."""
        Ly, b, nq = q.shape[:3]
        K, D = self.geo.kv_heads, self.geo.head_dim
        q = q.view(Ly, b, nq, K, self.geo.group, D)
        s = torch.einsum("lbqkgd,lbnkd->lbqkgn", q, k) * self.scale
        pos = torch.arange(k.shape[2], device=k.device)
        mask = pos[None, None, :] <= qpos[:, :, None]  # (b, q, n): also hides padding past each row
        s = s.masked_fill(~mask[None, :, :, None, None, :], float("-inf"))
        o = torch.einsum("lbqkgn,lbnkd->lbqkgd", torch.softmax(s, dim=-1), v)
        return o.reshape(Ly, b, nq, self.heads, D)


def dense_reference(probe: GQAProbe, tokens: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """One layer's causal attention in float64, head by head with its KV head repeated (tests:
    the definition, written apart from ``GQAStack.attend``'s grouped form). Returns (q, H, D)."""
    geo = probe.geo
    n = int(query_positions.max()) + 1
    pos = torch.arange(n)
    x = (probe.emb1[tokens[:n].long() % TABLE] + probe.emb2[(tokens[:n].long() // TABLE) % TABLE2]).double()
    k = rope_exact(torch.einsum("nh,hkd->nkd", x, probe.w_k.double()), pos[:, None]) * 2.0 ** -ROPE_SHIFT
    v = torch.einsum("nh,hkd->nkd", x, probe.w_v.double()) * 2.0 ** -V_SHIFT
    xq = x[query_positions]
    q = rope_exact(torch.einsum("qh,hkd->qkd", xq, probe.w_q.double()), query_positions[:, None]) * 2.0 ** -ROPE_SHIFT
    k = k.repeat_interleave(geo.group, dim=1)  # (n, H, D): head h reads KV head h // group
    v = v.repeat_interleave(geo.group, dim=1)
    s = torch.einsum("qhd,nhd->qhn", q, k) * geo.scale()
    s = s.masked_fill(~(pos[None, :] <= query_positions[:, None])[:, None, :], float("-inf"))
    return torch.einsum("qhn,nhd->qhd", torch.softmax(s, dim=-1), v)
