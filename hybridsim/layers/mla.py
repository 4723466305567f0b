"""The MLA probe layer: latent KV cache, compute-friendly prefill path, absorbed decode path.

Per token: hidden x = embedding(token); latent entry = [kv_c = x W_DKV | k_pe = rope(x W_KR, pos)];
queries q_nope = x W_QN, q_pe = rope(x W_QR, pos) per head. Keys and values are the
up-projections k_nope = kv_c W_UK, v = kv_c W_UV. The softmax scale is the
pre-absorption one (1/sqrt(nope + rope), or the geometry's, e.g. YaRN for DeepSeek-V3).

Prefill (compute-friendly): up-project the cached context in page-aligned chunks of
at most ``workspace`` tokens, attend to each chunk and to the new tokens (causal),
merge the partial results by log-sum-exp. Decode (absorbed): q_lat = q_nope W_UK^T,
attention directly over the latent cache, then W_UV. Both must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model import DTYPE_BYTES, MLAGeometry
from ..workload.tokens import combine

TABLE = 4093
TABLE2 = 509
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


@dataclass
class MLAWeights:
    emb1: torch.Tensor
    emb2: torch.Tensor
    w_dkv: torch.Tensor  # (hidden, kv_lora)
    w_kr: torch.Tensor  # (hidden, rope)
    w_qn: torch.Tensor  # (hidden, H, nope)
    w_qr: torch.Tensor  # (hidden, H, rope)
    w_uk: torch.Tensor  # (H, nope, kv_lora)
    w_uv: torch.Tensor  # (H, kv_lora, v)


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE on the last dim; pos (n,) aligned with x's first dim."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cos(ang).to(x.dtype)
    sin = torch.sin(ang).to(x.dtype)
    while cos.dim() < x.dim():
        cos = cos.unsqueeze(-2)
        sin = sin.unsqueeze(-2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAProbe:
    def __init__(self, geo: MLAGeometry, layer: int, seed: int, hidden: int = 64):
        self.geo = geo
        self.hidden = hidden
        rng = np.random.default_rng(combine(seed, 0x31A, layer) % (1 << 63))
        H, L, R, N, V = geo.heads, geo.kv_lora_rank, geo.qk_rope_head_dim, geo.qk_nope_head_dim, geo.v_head_dim
        t = lambda *shape, s=1.0: torch.from_numpy((rng.standard_normal(shape) * s).astype(np.float32))  # noqa: E731
        self.w = MLAWeights(
            emb1=t(TABLE, hidden), emb2=t(TABLE2, hidden, s=0.5),
            w_dkv=t(hidden, L, s=hidden ** -0.5), w_kr=t(hidden, R, s=hidden ** -0.5),
            w_qn=t(hidden, H, N, s=hidden ** -0.5), w_qr=t(hidden, H, R, s=hidden ** -0.5),
            w_uk=t(H, N, L, s=L ** -0.5), w_uv=t(H, L, V, s=L ** -0.5))
        self.scale = geo.scale()
        self.dtype = torch_dtype(geo.dtype)

    def to(self, device) -> "MLAProbe":
        """A copy of this layer with its weights on ``device``."""
        import copy
        twin = copy.copy(self)
        twin.w = MLAWeights(**{k: v.to(device) for k, v in self.w.__dict__.items()})
        return twin

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.long()
        return self.w.emb1[t % TABLE] + self.w.emb2[(t // TABLE) % TABLE2]

    def latent(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Cache entries [kv_c | k_pe] (n, kv_lora + rope), float32 before the cache cast."""
        x = self.hidden_states(tokens)
        return torch.cat([x @ self.w.w_dkv, rope(x @ self.w.w_kr, pos)], dim=-1)

    def queries(self, tokens: torch.Tensor, pos: torch.Tensor):
        x = self.hidden_states(tokens)
        q_nope = torch.einsum("nh,hkd->nkd", x, self.w.w_qn)
        q_pe = rope(torch.einsum("nh,hkd->nkd", x, self.w.w_qr), pos)
        return q_nope, q_pe

    def up_project(self, lat: torch.Tensor):
        """Latent (m, L+R) -> k (m, H, nope+rope), v (m, H, v), in float32."""
        L = self.geo.kv_lora_rank
        lat = lat.float()
        kv_c, k_pe = lat[:, :L], lat[:, L:]
        k_nope = torch.einsum("ml,hnl->mhn", kv_c, self.w.w_uk)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.geo.heads, -1)], dim=-1)
        v = torch.einsum("ml,hlv->mhv", kv_c, self.w.w_uv)
        return k, v

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        return torch.einsum("qhn,hnl->qhl", q_nope, self.w.w_uk)

    def unabsorb(self, o_lat: torch.Tensor) -> torch.Tensor:
        return torch.einsum("qhl,hlv->qhv", o_lat.float(), self.w.w_uv)

    def cache_entry_bytes(self) -> int:
        return self.geo.entry_dim() * DTYPE_BYTES[self.geo.dtype]


def dense_reference(probe: MLAProbe, tokens: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """The oracle: un-absorbed causal attention in float64 over the committed tokens, no cache.

    tokens: the committed sequence (at least up to the last query position). Returns (q, H, v).
    """
    n = int(query_positions.max()) + 1
    pos = torch.arange(n)
    lat = probe.latent(tokens[:n], pos).double()
    L = probe.geo.kv_lora_rank
    kv_c, k_pe = lat[:, :L], lat[:, L:]
    w_uk, w_uv = probe.w.w_uk.double(), probe.w.w_uv.double()
    k_nope = torch.einsum("ml,hnl->mhn", kv_c, w_uk)
    v = torch.einsum("ml,hlv->mhv", kv_c, w_uv)
    qt = tokens[query_positions]
    x = probe.hidden_states(qt).double()
    q_nope = torch.einsum("nh,hkd->nkd", x, probe.w.w_qn.double())
    q_pe = rope(torch.einsum("nh,hkd->nkd", x, probe.w.w_qr.double()), query_positions)
    s = (torch.einsum("qhn,mhn->qhm", q_nope, k_nope) + torch.einsum("qhr,mr->qhm", q_pe, k_pe)) * probe.scale
    mask = pos[None, :] <= query_positions[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("qhm,mhv->qhv", p, v)
