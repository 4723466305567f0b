"""The Mamba probe layer: a causal conv window plus a selective SSM recurrence.

Per token t (all float32):

    u_t   = embedding(token_t)                         (conv_dim)
    z_t   = b + sum_k w[k] * u_{t-K+1+k}               (depthwise causal conv, k in order)
    x, B, C = split(z_t)                               (H*P, G*N, G*N)
    a_t, g_t = decay(token_t), step(token_t)           (per head, from tables)
    h_t   = a_t * h_{t-1} + g_t * (x_t outer B_t)      (H, P, N)
    y_t   = sum_n h_t[..., n] * C_t[n] + D * x_t       (n in order)

Only ``+`` and ``*`` run per token, in one fixed order, and the decays come from
tables computed once (``exp`` in float64, rounded), so computing a token from a
cached state is bit-identical to computing it from scratch, whatever the batch
shape. The state is (conv window of the last K-1 inputs, h).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model import MambaGeometry
from ..workload.tokens import combine

TABLE = 4093  # embedding rows; a token uses rows (t % TABLE) and (t // TABLE % TABLE2)
TABLE2 = 509


@dataclass
class MambaWeights:
    emb1: torch.Tensor  # (TABLE, conv_dim)
    emb2: torch.Tensor  # (TABLE2, conv_dim)
    conv_w: torch.Tensor  # (K, conv_dim)
    conv_b: torch.Tensor  # (conv_dim,)
    decay: torch.Tensor  # (TABLE, H)  exp(dt * A), in (0, 1)
    step: torch.Tensor  # (TABLE, H)  dt
    D: torch.Tensor  # (H,)
    bc: torch.Tensor | None = None  # Mamba1: (TABLE, 2N) input-dependent B and C (no room in the conv)


def make_weights(geo: MambaGeometry, layer: int, seed: int) -> MambaWeights:
    rng = np.random.default_rng(combine(seed, 0x3A3A, layer) % (1 << 63))
    dim = geo.conv_dim()
    H = geo.heads if geo.kind != "mamba1" else 1
    f32 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))  # noqa: E731
    dt = rng.uniform(0.01, 0.2, size=(TABLE, H))
    A = -rng.uniform(0.5, 4.0, size=(H,))
    return MambaWeights(
        emb1=f32(rng.standard_normal((TABLE, dim)) * 0.5),
        emb2=f32(rng.standard_normal((TABLE2, dim)) * 0.5),
        conv_w=f32(rng.standard_normal((geo.conv_kernel, dim)) / geo.conv_kernel),
        conv_b=f32(rng.standard_normal(dim) * 0.1),
        decay=f32(np.exp(dt * A[None, :])),
        step=f32(dt),
        D=f32(rng.standard_normal(H)),
        bc=f32(rng.standard_normal((TABLE, 2 * geo.d_state)) * 0.5) if geo.kind == "mamba1" else None,
    )


class MambaProbe:
    """Runs tokens through one probe layer from an explicit state (no cache knowledge)."""

    def __init__(self, geo: MambaGeometry, layer: int, seed: int):
        self.geo = geo
        self.w = make_weights(geo, layer, seed)
        if geo.kind == "mamba1":
            self.H, self.P = 1, geo.heads * geo.head_dim
            self.G, self.N = 1, geo.d_state
        else:
            self.H, self.P = geo.heads, geo.head_dim
            self.G, self.N = geo.n_groups, geo.d_state
        self.K = geo.conv_kernel
        self.dim = geo.conv_dim()

    def to(self, device) -> "MambaProbe":
        """A copy of this layer with its weights on ``device`` (same values, bit for bit)."""
        import copy
        twin = copy.copy(self)
        twin.w = MambaWeights(**{k: (v.to(device) if v is not None else None) for k, v in self.w.__dict__.items()})
        return twin

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.long()
        return self.w.emb1[t % TABLE] + self.w.emb2[(t // TABLE) % TABLE2]

    def zero_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.w.conv_w.device
        return (torch.zeros(batch, self.K - 1, self.dim, device=dev),
                torch.zeros(batch, self.H, self.P, self.N, device=dev))

    def split(self, z: torch.Tensor, tokens: torch.Tensor):
        """x (b, G, H/G, P), B and C (b, G, N): heads grouped so B/C broadcast without copies."""
        if self.w.bc is not None:  # Mamba1: the conv carries x only
            bc = self.w.bc[tokens.long() % TABLE]
            return z.reshape(-1, 1, 1, self.P), bc[:, None, :self.N], bc[:, None, self.N:]
        hp = self.H * self.P
        gn = self.G * self.N
        x = z[:, :hp].reshape(-1, self.G, self.H // self.G, self.P)
        Bm = z[:, hp:hp + gn].reshape(-1, self.G, self.N)
        Cm = z[:, hp + gn:hp + 2 * gn].reshape(-1, self.G, self.N)
        return x, Bm, Cm

    def token_step(self, window: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor):
        """One token for each of ``batch`` rows. window: (b, K-1, dim) oldest first; h: (b, H, P, N).

        Returns (y (b, H*P), new window, new h). Only ``+`` and ``*`` run, and every sum
        has a fixed order that depends on the layer's sizes alone (a pairwise tree over
        N), so results do not depend on how many rows are batched.
        """
        b = tokens.shape[0]
        G, R, P, N = self.G, self.H // self.G, self.P, self.N
        u = self.embed(tokens)  # (b, dim)
        w = self.w.conv_w
        z = self.w.conv_b + w[0] * window[:, 0] if self.K > 1 else self.w.conv_b + 0 * u
        for k in range(1, self.K - 1):
            z = z + w[k] * window[:, k]
        z = z + w[self.K - 1] * u
        x, Bm, Cm = self.split(z, tokens)  # x (b, G, R, P)
        idx = tokens.long() % TABLE
        a = self.w.decay[idx].reshape(b, G, R)[..., None, None]
        g = self.w.step[idx].reshape(b, G, R)[..., None, None]
        hg = h.reshape(b, G, R, P, N)
        hg = a * hg + g * (x[..., None] * Bm[:, :, None, None, :])
        prod = hg * Cm[:, :, None, None, :]
        width = N
        while width > 1:  # fixed pairwise tree over the state dim
            half = width // 2
            summed = prod[..., :half] + prod[..., half:2 * half]
            prod = torch.cat([summed, prod[..., 2 * half:width]], dim=-1) if width % 2 else summed
            width = half + width % 2
        y = prod[..., 0] + self.w.D.reshape(G, R)[None, :, :, None] * x
        new_window = torch.cat([window[:, 1:], u[:, None, :]], dim=1)
        return y.reshape(b, -1), new_window, hg.reshape(b, self.H, P, N)
