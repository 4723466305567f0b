"""The Mamba probe layer: a causal conv window plus a selective SSM recurrence, over the
integers modulo the prime Q (``layers.exact``), so every state is exact on every machine.

Per token t with id ``tok`` (every quantity a residue mod Q):

    u_t   = embed(tok)                               (conv_dim)   a keyed hash of tok per channel
    z_t   = bias + sum_k w[k] * u_{t-K+1+k}          (depthwise causal conv over the window)
    x, B, C = split(z_t)                             (H*P, G*N, G*N)  (Mamba1: B, C hashed from tok)
    a_t   = gamma ** e(tok, head)                    decay: a power of a generator of (Z/Q)*
    g_t   = step(tok, head)                          in [1, Q)
    h_t   = a_t * h_{t-1} + (g_t x_t) outer B_t      (H, P, N)
    y_t   = h_t . C_t + D * x_t                      (H*P)

The state is (conv window of the last K-1 inputs u, h). Every element of a state depends
on the whole token history, decays are never zero (nothing is forgotten), and because
the arithmetic is exact, resuming from a cached state, batching rows, chunking the
sequence or summing in any order give the same residues — on a CPU in int64 or float64
matrix products, and on a GPU in int32 (``kernels/probe_scan.py``).

``token_step`` below is the definition, one token at a time; the batched forms in
``kernels/probe_scan.py`` are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..model import MambaGeometry
from .exact import MAX_STATE_DIM, Q, pow_table, residues, rng


@dataclass
class MambaTables:
    """One layer's integer tables (int64). Channels hash a token with (alpha, beta, delta, eps):
    v = (t_lo*alpha + t_hi*beta + delta) mod Q, u = (v*v + eps) mod Q, where t_lo = tok mod Q and
    t_hi = (tok div Q) mod Q. Heads derive the decay exponent and the step the same way."""

    emb: torch.Tensor  # (dim, 4)
    conv_w: torch.Tensor  # (K, dim)
    conv_b: torch.Tensor  # (dim,)
    head: torch.Tensor  # (H, 6): rho, sigma, tau (decay exponent mod Q-1), mu, nu, kappa (step)
    D: torch.Tensor  # (H,)
    bc: Optional[torch.Tensor] = None  # Mamba1: (2N, 4) B and C hashed from the token (no conv)

    def to(self, device) -> "MambaTables":
        return MambaTables(**{k: (v.to(device) if v is not None else None) for k, v in self.__dict__.items()})


def make_tables(geo: MambaGeometry, layer: int, seed: int) -> MambaTables:
    g = rng(seed, 0x3A3A, layer)
    dim = geo.conv_dim()
    H = 1 if geo.kind == "mamba1" else geo.heads
    return MambaTables(
        emb=residues(g, (dim, 4)),
        conv_w=residues(g, (geo.conv_kernel, dim)),
        conv_b=residues(g, (dim,)),
        head=residues(g, (H, 6)),
        D=residues(g, (H,)),
        bc=residues(g, (2 * geo.d_state, 4)) if geo.kind == "mamba1" else None,
    )


def token_parts(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tok mod Q, (tok div Q) mod Q), in int64 or, for float64 token ids, float64 (exact: below 2**53;
    a CPU divides float64 vectors far faster than int64 ones)."""
    t = tokens if tokens.dtype == torch.float64 else tokens.to(torch.int64)
    return t % Q, torch.div(t, Q, rounding_mode="floor") % Q


def _remainder(x: torch.Tensor) -> torch.Tensor:
    return x % Q


def hash_channels(tokens: torch.Tensor, params: torch.Tensor, mod=_remainder) -> torch.Tensor:
    """(n,) tokens x (..., C, 4) channel keys (any leading layer axes) -> (..., n, C) residues.
    ``mod`` reduces mod Q (the batched scans pass ``exact.mod_q``, the same values, faster)."""
    lo, hi = token_parts(tokens)
    p = params[..., None, :, :]
    v = mod(lo[:, None] * p[..., 0] + hi[:, None] * p[..., 1] + p[..., 2])
    return mod(v * v + p[..., 3])


def head_terms(tokens: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decay exponent in [0, Q-1), step in [1, Q)), each (..., n, H) for head keys (..., H, 6)."""
    lo, hi = token_parts(tokens)
    p = head[..., None, :, :]
    e = (lo[:, None] * p[..., 0] + hi[:, None] * p[..., 1] + p[..., 2]) % (Q - 1)
    g = 1 + (lo[:, None] * p[..., 3] + hi[:, None] * p[..., 4] + p[..., 5]) % (Q - 1)
    return e, g


class MambaProbe:
    """One probe layer's geometry and tables; ``token_step`` is the arithmetic's definition."""

    def __init__(self, geo: MambaGeometry, layer: int, seed: int):
        self.geo = geo
        self.layer = layer
        if geo.kind == "mamba1":
            self.H, self.P = 1, geo.heads * geo.head_dim
            self.G, self.N = 1, geo.d_state
        else:
            self.H, self.P = geo.heads, geo.head_dim
            self.G, self.N = geo.n_groups, geo.d_state
        if self.N > MAX_STATE_DIM:
            raise ValueError(f"d_state {self.N} is above the probe's exact-arithmetic limit {MAX_STATE_DIM}")
        self.K = geo.conv_kernel
        self.dim = geo.conv_dim()
        self.bc_from_conv = geo.kind != "mamba1"
        self.w = make_tables(geo, layer, seed)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return hash_channels(tokens, self.w.emb)

    def zero_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(batch, self.K - 1, self.dim, dtype=torch.int64),
                torch.zeros(batch, self.H, self.P, self.N, dtype=torch.int64))

    def token_step(self, window: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor):
        """One token for each of ``b`` rows. window (b, K-1, dim) oldest first, h (b, H, P, N),
        residues in int64. Returns (y (b, H*P), new window, new h)."""
        b = tokens.shape[0]
        G, R, P, N = self.G, self.H // self.G, self.P, self.N
        u = self.embed(tokens)
        inputs = torch.cat([window, u[:, None, :]], dim=1)  # (b, K, dim)
        z = (self.w.conv_b + (self.w.conv_w[None] * inputs).sum(dim=1)) % Q
        if self.bc_from_conv:
            hp, gn = self.H * P, G * N
            x = z[:, :hp].reshape(b, G, R, P)
            Bm = z[:, hp:hp + gn].reshape(b, G, N)
            Cm = z[:, hp + gn:hp + 2 * gn].reshape(b, G, N)
        else:
            x = z.reshape(b, 1, 1, P)
            bc = hash_channels(tokens, self.w.bc)
            Bm, Cm = bc[:, None, :N], bc[:, None, N:]
        e, g = head_terms(tokens, self.w.head)
        a = pow_table()[e].reshape(b, G, R)
        xp = g.reshape(b, G, R)[..., None] * x % Q
        hg = (a[..., None, None] * h.reshape(b, G, R, P, N) + xp[..., None] * Bm[:, :, None, None, :]) % Q
        y = ((hg * Cm[:, :, None, None, :]).sum(-1) % Q + self.w.D.reshape(G, R)[None, :, :, None] * x) % Q
        return y.reshape(b, -1), inputs[:, 1:], hg.reshape(b, self.H, P, N)

    def run(self, tokens: list[int]):
        """The definition over a whole sequence from the zero state: (outputs (n, H*P), window, h)."""
        window, h = self.zero_state(1)
        ys = []
        for tok in tokens:
            y, window, h = self.token_step(window, h, torch.tensor([tok]))
            ys.append(y[0])
        return torch.stack(ys) if ys else torch.zeros(0, self.H * self.P, dtype=torch.int64), window[0], h[0]


@dataclass
class StackedTables:
    """Every Mamba layer's tables stacked on a leading layer axis, on one device: what the
    batched scans read (one launch covers all layers)."""

    emb: torch.Tensor  # (L, dim, 4)
    conv_w: torch.Tensor  # (L, K, dim)
    conv_b: torch.Tensor  # (L, dim)
    head: torch.Tensor  # (L, H, 6)
    D: torch.Tensor  # (L, H)
    bc: Optional[torch.Tensor]  # (L, 2N, 4) for Mamba1
    H: int
    P: int
    G: int
    N: int
    K: int
    dim: int
    bc_from_conv: bool
    derived: dict = field(default_factory=dict)  # providers' own layouts of these tables, built once

    @property
    def layers(self) -> int:
        return self.emb.shape[0]


def stack_tables(probes: list[MambaProbe], device) -> StackedTables:
    p0 = probes[0]
    st = lambda name: torch.stack([getattr(p.w, name) for p in probes]).to(device)  # noqa: E731
    return StackedTables(emb=st("emb"), conv_w=st("conv_w"), conv_b=st("conv_b"), head=st("head"), D=st("D"),
                         bc=st("bc") if p0.w.bc is not None else None, H=p0.H, P=p0.P, G=p0.G, N=p0.N, K=p0.K,
                         dim=p0.dim, bc_from_conv=p0.bc_from_conv)
