"""The MLA probe layer: latent KV cache, compute-friendly prefill path, absorbed decode path.

Per token: hidden x = embedding(token); latent entry = [kv_c = x W_DKV | k_pe = rope(x W_KR, pos)];
queries q_nope = x W_QN, q_pe = rope(x W_QR, pos) per head. Keys and values are the
up-projections k_nope = kv_c W_UK, v = kv_c W_UV. The softmax scale is the
pre-absorption one (1/sqrt(nope + rope), or the geometry's, e.g. YaRN for DeepSeek-V3).

Exact where it is checked exactly: embeddings and the down-projections are small integers,
RoPE uses integer fractions of a turn and a fixed-point cos/sin table (``layers.exact``),
and the results are scaled by powers of two, so every latent entry and every query is an
exact float32 value computed the same way on any machine; the cache cast (bf16 for real
models) rounds it deterministically. Attention outputs are compared with a tolerance.

Prefill (compute-friendly): up-project the cached context in page-aligned chunks of
at most ``workspace`` tokens, attend to each chunk and to the new tokens (causal),
merge the partial results by log-sum-exp. Decode (absorbed): q_lat = q_nope W_UK^T,
attention directly over the latent cache, then W_UV. Both must agree.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..model import DTYPE_BYTES, MLAGeometry
from ..device.matmul import matmul_tf32
from .exact import rng, rope_exact, trig_table

TABLE = 4093
TABLE2 = 509
HIDDEN = 64
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
LATENT_SHIFT = 7  # kv_c and q_nope are integers (|.| <= 4096) times 2**-7
ROPE_SHIFT = 17  # rotated integers carry a factor 1024 (the cos/sin table), times 2**-17


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


@dataclass
class MLAWeights:
    emb1: torch.Tensor  # (TABLE, hidden) integers in [-8, 8]
    emb2: torch.Tensor  # (TABLE2, hidden)
    w_dkv: torch.Tensor  # (hidden, kv_lora) integers in [-4, 4]
    w_kr: torch.Tensor  # (hidden, rope)
    w_qn: torch.Tensor  # (hidden, H, nope)
    w_qr: torch.Tensor  # (hidden, H, rope)
    w_uk: torch.Tensor  # (H, nope, kv_lora) integers times a power of two
    w_uv: torch.Tensor  # (H, kv_lora, v)


def _pow2_scale(n: int) -> float:
    """2**-k with 2**k near the spread of a sum of n products of integers in [-4, 4] (std 2.6)."""
    return 2.0 ** -round(math.log2(2.6 * math.sqrt(n)))


class MLAProbe:
    def __init__(self, geo: MLAGeometry, layer: int, seed: int, hidden: int = HIDDEN):
        self.geo = geo
        self.hidden = hidden
        g = rng(seed, 0x31A, layer)
        H, L, R, N, V = geo.heads, geo.kv_lora_rank, geo.qk_rope_head_dim, geo.qk_nope_head_dim, geo.v_head_dim
        def ints(lo: int, hi: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
            """Integers in [lo, hi] (times a power of two): exact in float32."""
            return torch.from_numpy(g.integers(lo, hi + 1, size=shape, dtype=np.int8)).to(torch.float32) * scale

        self.w = MLAWeights(
            emb1=ints(-8, 8, TABLE, hidden), emb2=ints(-8, 8, TABLE2, hidden),
            w_dkv=ints(-4, 4, hidden, L), w_kr=ints(-4, 4, hidden, R),
            w_qn=ints(-4, 4, hidden, H, N), w_qr=ints(-4, 4, hidden, H, R),
            w_uk=ints(-4, 4, H, N, L, scale=_pow2_scale(L)), w_uv=ints(-4, 4, H, L, V, scale=_pow2_scale(L)))
        self.scale = geo.scale()
        self.dtype = torch_dtype(geo.dtype)

    def to(self, device) -> "MLAProbe":
        """A copy of this layer with its weights on ``device``."""
        twin = copy.copy(self)
        twin.w = MLAWeights(**{k: v.to(device) for k, v in self.w.__dict__.items()})
        return twin

    def hidden32(self, tokens: torch.Tensor) -> torch.Tensor:
        """Integer-valued float32 (..., hidden): the token's two embedding rows, summed."""
        t = tokens.long()
        return self.w.emb1[t % TABLE] + self.w.emb2[(t // TABLE) % TABLE2]

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Integer-valued float64 (..., hidden)."""
        return self.hidden32(tokens).double()

    def latent64(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Cache entries [kv_c | k_pe] (n, kv_lora + rope), exact, float64."""
        w = self.w
        return latent_of(self.hidden_states(tokens)[None], w.w_dkv[None].double(), w.w_kr[None].double(), pos)[0]

    def latent(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The same entries in float32 (exactly), before the cache cast."""
        return self.latent64(tokens, pos).to(torch.float32)

    def queries64(self, tokens: torch.Tensor, pos: torch.Tensor):
        """q_nope (n, H, nope), q_pe (n, H, rope), exact, float64."""
        w = self.w
        q_nope, q_pe = queries_of(self.hidden_states(tokens)[None], w.w_qn[None].double(), w.w_qr[None].double(),
                                  pos[:, None])
        return q_nope[0], q_pe[0]

    def project(self, tokens: torch.Tensor, pos: torch.Tensor, n_pos: int | None = None):
        """``latent`` and ``queries`` of the same tokens at once (one embedding lookup), computed in
        float32 and still exact: the products and sums are integers below 2**13, the rotated ones
        below 2**23 (even TF32 inputs hold these small integers exactly). ``n_pos`` bounds the positions."""
        w = self.w
        x = self.hidden32(tokens)[None]
        lat = latent_of(x, w.w_dkv[None], w.w_kr[None], pos, n_pos)[0]
        q_nope, q_pe = queries_of(x, w.w_qn[None], w.w_qr[None], pos[:, None], n_pos)
        return lat, q_nope[0], q_pe[0]

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
        """(..., H, kv_lora) -> (..., H, v)."""
        return torch.einsum("...hl,hlv->...hv", o_lat.float(), self.w.w_uv)

    def cache_entry_bytes(self) -> int:
        return self.geo.entry_dim() * DTYPE_BYTES[self.geo.dtype]


def latent_of(x: torch.Tensor, w_dkv: torch.Tensor, w_kr: torch.Tensor, pos: torch.Tensor,
              n_pos: int | None = None) -> torch.Tensor:
    """[kv_c | k_pe] for hidden states x (layers, ..., hidden) and per-layer weights (layers, hidden, r),
    positions broadcastable to x.shape[1:-1]. Integer sums below 2**13, so exact in float64 in any
    order; the power-of-two scales keep them exact in float32."""
    kv = torch.einsum("l...h,lhr->l...r", x, w_dkv) * 2.0 ** -LATENT_SHIFT
    kr = rope_exact(torch.einsum("l...h,lhr->l...r", x, w_kr), pos, n_pos) * 2.0 ** -ROPE_SHIFT
    return torch.cat([kv, kr], dim=-1)


def queries_of(x: torch.Tensor, w_qn: torch.Tensor, w_qr: torch.Tensor, pos: torch.Tensor,
               n_pos: int | None = None):
    """q_nope (layers, ..., H, nope) and q_pe (layers, ..., H, rope); pos broadcastable to
    x.shape[1:-1] + (H,)."""
    q_nope = torch.einsum("l...h,lhkd->l...kd", x, w_qn) * 2.0 ** -LATENT_SHIFT
    q_pe = rope_exact(torch.einsum("l...h,lhkd->l...kd", x, w_qr), pos, n_pos) * 2.0 ** -ROPE_SHIFT
    return q_nope, q_pe


def token_rows(t1: torch.Tensor, t2: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """t1[:, tok % TABLE] + t2[:, (tok // TABLE) % TABLE2] for per-layer tables (layers, TABLE or TABLE2, d):
    (layers, *tok.shape, d), a fresh tensor. Row lookups in the flattened tables: a CPU gathers those
    several times faster than an advanced index on the middle axis."""
    t = tok.long().reshape(-1)
    first = torch.arange(t1.shape[0], device=t.device)[:, None]
    out = t1.flatten(0, 1).index_select(0, (first * TABLE + t % TABLE).reshape(-1))
    out += t2.flatten(0, 1).index_select(0, (first * TABLE2 + (t // TABLE) % TABLE2).reshape(-1))
    return out.view(t1.shape[0], *tok.shape, t1.shape[-1])


EXPANDED_ELEMS = 1 << 27  # float64 elements of up-projected keys (k_nope and v of one layer) an oracle batch may hold


class MLAStack:
    """Every MLA layer's weights stacked on a leading layer axis, float64, on one device: the
    oracle evaluates all layers in one set of batched operations.

    Keys come from per-token tables: a latent entry is linear in the token's two embedding rows,
    so [emb1 | emb2] @ [W_DKV | W_KR] is tabulated once (integers: the same values as projecting
    the hidden state, exactly), and a key costs two row lookups and its rope."""

    def __init__(self, probes: list[MLAProbe], device):
        st = lambda name: torch.stack([getattr(p.w, name) for p in probes]).to(device, torch.float64)  # noqa: E731
        self.emb1, self.emb2 = st("emb1"), st("emb2")
        self.w_dkv, self.w_kr, self.w_qn, self.w_qr = st("w_dkv"), st("w_kr"), st("w_qn"), st("w_qr")
        self.w_uk, self.w_uv = st("w_uk"), st("w_uv")
        w_key = torch.cat([self.w_dkv, self.w_kr], dim=-1)  # (layers, hidden, kv_lora + rope)
        self.key1, self.key2 = torch.matmul(self.emb1, w_key), torch.matmul(self.emb2, w_key)  # sums < 2**13: exact
        self.scale = probes[0].scale
        self.geo = probes[0].geo
        self.layers = len(probes)
        self.heads = self.geo.heads
        self.key_elems = 2 * self.geo.entry_dim()  # a key's two table rows and its entry
        self._t32: dict[str, torch.Tensor] | None = None  # ``_tables(float32)``, made on first use
        self._int_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ``expansion_weights``

    def hidden(self, tok: torch.Tensor) -> torch.Tensor:
        """(layers, *tok.shape, hidden)."""
        return token_rows(self.emb1, self.emb2, tok)

    def latents(self, tok: torch.Tensor, n_pos: int) -> torch.Tensor:
        """Cache entries [kv_c | k_pe] of tokens tok (b, n) at positions 0..n-1: (layers, b, n, kv_lora + rope),
        the values ``latent_of`` gives."""
        return self.latents_at(tok, torch.arange(tok.shape[1], device=tok.device), n_pos)

    def _tables(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The key tables, embeddings and weights the projections read, in ``dtype``: float64 as
        held, or float32 copies made once (small integers times powers of two: the same values)."""
        names = ("key1", "key2", "emb1", "emb2", "w_qn", "w_qr", "w_uk", "w_uv")
        if dtype == torch.float64:
            return {k: getattr(self, k) for k in names}
        if self._t32 is None:
            self._t32 = {k: getattr(self, k).to(torch.float32) for k in names}
        return self._t32

    def latents_at(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int, layer: int | None = None,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``latents`` of tokens tok (...) at positions pos (broadcastable to tok's last axes), each
        below n_pos: (layers, ..., kv_lora + rope); of one layer only (a leading axis of 1) if ``layer`` is given.
        ``dtype`` float32: the same values (table entries are integers below 2**13, their rotation
        below 2**24: exact in float32), half the bytes."""
        ly = slice(None) if layer is None else slice(layer, layer + 1)
        t = self._tables(dtype)
        lat = token_rows(t["key1"][ly], t["key2"][ly], tok)  # (a fresh tensor: scaled and rotated in place)
        Lr = self.geo.kv_lora_rank
        lat[..., Lr:] = rope_exact(lat[..., Lr:], pos, n_pos) * 2.0 ** -ROPE_SHIFT
        lat[..., :Lr] *= 2.0 ** -LATENT_SHIFT
        return lat

    def queries(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int,
                layer: int | None = None, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope (layers, n, H, nope) and q_pe (layers, n, H, rope), float64 and unscaled, of tokens tok (n,)
        at positions pos (n,) below n_pos; of one layer only (a leading axis of 1) if ``layer`` is given.
        ``dtype`` float32: the same values, the products on TF32 tensor cores where they run (the
        hidden state's integers below 2**5 and the weights' below 2**3 are exact in TF32's 11
        bits, every partial sum an integer below 2**12, the rotation below 2**24)."""
        ly = slice(None) if layer is None else slice(layer, layer + 1)
        t = self._tables(dtype)
        x = token_rows(t["emb1"][ly], t["emb2"][ly], tok)
        with matmul_tf32(dtype == torch.float32):
            return queries_of(x, t["w_qn"][ly], t["w_qr"][ly], pos[:, None], n_pos)

    def absorbed_queries(self, tok: torch.Tensor, pos: torch.Tensor, n_pos: int) -> torch.Tensor:
        """[q_nope W_UK | q_pe] (layers, n, H, kv_lora + rope), unscaled: a query in the latent space,
        whose dot with a latent entry is its score (times the scale)."""
        q_nope, q_pe = self.queries(tok, pos, n_pos)
        return torch.cat([torch.einsum("lqkd,lkdr->lqkr", q_nope, self.w_uk), q_pe], dim=-1)

    def expanded_keys(self, lat: torch.Tensor, layer: int,
                      heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's per-head keys [kv_c W_UK | k_pe] (n, H, nope + rope) and values kv_c W_UV (n, H, v) of its
        latent entries lat (n, kv_lora + rope), in float32, exactly: the values float64 gives. ``heads``:
        only those heads' (a long row's keys for every head at once can be gigabytes).

        kv_c is an integer below 2**12 (times 2**-7) and a weight one of [-4, 4] (times a power of two),
        so with kv_c split into its low 6 bits and the rest, each part an integer below 2**7 (of its
        unit), both products' inputs are exact in TF32 (11 bits), every partial sum is an integer
        below 2**24 of its unit whatever the order, and the parts' sum too (kv_lora_rank <= 1024):
        exact float32 products on the tensor cores (``device.matmul.matmul_tf32``), or on any CPU."""
        Lr = self.geo.kv_lora_rank
        k_nope, v = self.expanded_nope(lat, layer, heads)
        return torch.cat([k_nope, lat[:, None, Lr:].to(torch.float32).expand(-1, k_nope.shape[1], -1)], dim=-1), v

    def expanded_nope(self, lat: torch.Tensor, layer: int,
                      heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """``expanded_keys`` without the rope part: k_nope = kv_c W_UK (n, H, nope) and v (n, H, v), float32,
        exact."""
        Lr = self.geo.kv_lora_rank
        if Lr > 1 << 10:
            raise ValueError(f"kv_lora_rank {Lr}: per-head keys are exact in float32 up to 1024")
        t = self._tables(torch.float32)
        w_uk, w_uv = t["w_uk"][layer, heads], t["w_uv"][layer, heads]
        kv = lat[:, :Lr].to(torch.float32)
        low = torch.remainder(kv * 2.0 ** LATENT_SHIFT, 64.0) * 2.0 ** -LATENT_SHIFT
        high = kv - low
        k_nope = torch.einsum("nr,kdr->nkd", low, w_uk) + torch.einsum("nr,kdr->nkd", high, w_uk)
        v = torch.einsum("nr,krv->nkv", low, w_uv) + torch.einsum("nr,krv->nkv", high, w_uv)
        return k_nope, v

    def query_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """emb1, emb2 (layers, table rows, hidden), W_QN (layers, hidden, H, nope) and W_QR (layers, hidden, H,
        rope) in float32 (small integers: exact): what a kernel projecting queries from token ids reads."""
        t = self._tables(torch.float32)
        return t["emb1"], t["emb2"], t["w_qn"], t["w_qr"]

    def key_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token latent tables key1, key2 (layers, table rows, kv_lora + rope) in float32 (integers
        below 2**13: exact): what a kernel making keys from token ids reads (a key's latent integers are
        key1[tok % TABLE] + key2[(tok // TABLE) % TABLE2], kv_c over 2**-LATENT_SHIFT and k_pe, rotated,
        over ``rope_unit``)."""
        t = self._tables(torch.float32)
        return t["key1"], t["key2"]

    def expansion_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's W_UK (H, nope, kv_lora) and W_UV transposed (H, v, kv_lora) as their integers
        (in [-4, 4], over their power of two) in int8, rows kv_lora-contiguous as the int8 products take
        them; made once a layer."""
        w = self._int_weights.get(layer)
        if w is None:
            unit = _pow2_scale(self.geo.kv_lora_rank)
            t = self._tables(torch.float32)
            w = self._int_weights[layer] = tuple((x / unit).round().to(torch.int8).contiguous() for x in (
                t["w_uk"][layer], t["w_uv"][layer].transpose(1, 2)))
        return w

    # units of the integers the oracle's exact scores take (``kernels/digit_attention_f64.py``): q_nope, q_pe
    # and k_pe are integers times these powers of two, k_nope and the values ones times ``nope_key_unit``
    query_unit = 2.0 ** -LATENT_SHIFT
    rope_unit = 2.0 ** -ROPE_SHIFT

    @property
    def nope_key_unit(self) -> float:
        return 2.0 ** -LATENT_SHIFT * _pow2_scale(self.geo.kv_lora_rank)

    value_unit = nope_key_unit  # (W_UV's power of two is W_UK's)

    @functools.cached_property
    def integer_bounds(self) -> dict[str, float]:
        """The largest magnitude any token's q_nope, q_pe, k_nope, k_pe and values can take, as integers of
        their units (``query_unit``, ``rope_unit``, ``nope_key_unit``, ``value_unit``), over every layer: what
        an exact integer form of the scores and the values must hold (``kernels/digit_attention_f64``'s
        ``digits_fit`` and ``value_digits_fit``). From the tables: a hidden state's entries are at most
        max|emb1| + max|emb2|, a rotated value at most max(|x1|, |x2|) (|cos| + |sin|) over the cos/sin
        table, k_nope's and a value's integer at most kv_c's bound times a column's sum of |W_UK| or |W_UV|
        (over its unit)."""
        Lr = self.geo.kv_lora_rank
        cos_t, sin_t = trig_table()
        trig = float((cos_t.abs() + sin_t.abs()).max())
        x = self.emb1.abs().amax((1, 2)) + self.emb2.abs().amax((1, 2))  # (layers,)
        q_nope = x * self.w_qn.abs().sum(1).amax((1, 2))
        q_pe = x * self.w_qr.abs().sum(1).amax((1, 2)) * trig
        kv_c = self.key1[..., :Lr].abs().amax((1, 2)) + self.key2[..., :Lr].abs().amax((1, 2))
        k_pe = (self.key1[..., Lr:].abs().amax((1, 2)) + self.key2[..., Lr:].abs().amax((1, 2))) * trig
        k_nope = kv_c * (self.w_uk.abs().sum(-1) / _pow2_scale(Lr)).amax((1, 2))
        v = kv_c * (self.w_uv.abs().sum(2) / _pow2_scale(Lr)).amax((1, 2))  # (W_UV: (layers, H, kv_lora, v))
        return {name: float(b.max()) for name, b in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope),
                                                     ("k_pe", k_pe), ("v", v))}

    def expands(self, b: int, q: int, n: int, bounded: bool = True) -> bool:
        """Whether attending q queries over n keys costs fewer operations with every key up-projected
        (k_nope, v per key and head) than absorbed (queries into the latent space): long prefill
        chunks, yes; decode rows, no. ``bounded``: and the batch's up-projected keys fit
        ``EXPANDED_ELEMS`` (the torch path holds them all at once)."""
        H, Lr, R, N, V = self.heads, self.geo.kv_lora_rank, self.geo.qk_rope_head_dim, \
            self.geo.qk_nope_head_dim, self.geo.v_head_dim
        absorbed = q * H * (N * Lr + n * (2 * Lr + R) + Lr * V)
        expanded = n * H * Lr * (N + V) + q * n * H * (N + R + V)
        # on a CPU the up-projection's copies of every key per head cost about as much as products:
        # taken there at half the operations (measured at the tiny presets' sizes)
        factor = 1 if self.emb1.is_cuda else 2
        return factor * expanded < absorbed and (not bounded or b * n * H * (N + V) <= EXPANDED_ELEMS)

    def attend(self, tok: torch.Tensor, qpos: torch.Tensor, expand: bool | None = None,
               lat: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention in float64 for b padded rows: tok (b, n) committed tokens, query
        positions qpos (b, q) (each below its row's length). Returns (layers, b, q, H, v).
        Two associations, equal in real arithmetic: keys up-projected (q_nope . kv_c W_UK and
        p . kv_c W_UV) or queries absorbed ((q_nope W_UK) . kv_c, then W_UV after the sum); the
        cheaper one for the batch's shape is taken unless ``expand`` says which. ``lat``: the tokens'
        ``latents`` (float64), if the caller has made them (a GPU kernel: ``kernels/probe_latents.py``)."""
        b, n = tok.shape
        Lr = self.geo.kv_lora_rank
        if lat is None:
            lat = self.latents(tok, n)  # (Ly, b, n, kv_lora + rope)
        kv, kr = lat[..., :Lr], lat[..., Lr:]
        xq = self.hidden(tok.gather(1, qpos))  # (Ly, b, q, hidden)
        q_nope, q_pe = queries_of(xq, self.w_qn, self.w_qr, qpos[..., None], n)
        pos = torch.arange(n, device=tok.device)
        # 0 where key <= query (also hides padding past each row), -inf elsewhere: (b, q, 1, n)
        bias = torch.where(pos[None, None, :] <= qpos[:, :, None], 0.0, float("-inf")).to(kv.dtype)[:, :, None, :]
        if expand is None:
            expand = self.expands(b, qpos.shape[1], n)
        H = self.heads
        if expand:  # a layer at a time: up-projected keys are the large part
            out = []
            for l in range(self.layers):
                # scores as one product: [q_nope | q_pe] (scaled) . [kv_c W_UK | k_pe] per head
                keys = torch.cat([torch.einsum("bnr,kdr->bnkd", kv[l], self.w_uk[l]),
                                  kr[l][:, :, None, :].expand(-1, -1, H, -1)], dim=-1)
                q = torch.cat([q_nope[l], q_pe[l]], dim=-1) * self.scale
                p = torch.softmax(torch.einsum("bqkd,bnkd->bqkn", q, keys).add_(bias), dim=-1)
                out.append(torch.einsum("bqkn,bnkv->bqkv", p, torch.einsum("bnr,krv->bnkv", kv[l], self.w_uv[l])))
            return torch.stack(out)
        # scores as one product over the whole latent entry: [q_nope W_UK | q_pe] (scaled) . [kv_c | k_pe]
        q = torch.cat([torch.einsum("lbqkd,lkdr->lbqkr", q_nope, self.w_uk), q_pe], dim=-1) * self.scale
        p = torch.softmax(torch.einsum("lbqkr,lbnr->lbqkn", q, lat).add_(bias), dim=-1)
        return torch.einsum("lbqkr,lkrv->lbqkv", torch.einsum("lbqkn,lbnr->lbqkr", p, kv), self.w_uv)


def dense_reference(probe: MLAProbe, tokens: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Un-absorbed causal attention in float64 over the committed tokens (tests: the definition).
    Returns (q, H, v) for the given query positions."""
    n = int(query_positions.max()) + 1
    pos = torch.arange(n, device=tokens.device)
    lat = probe.latent64(tokens[:n], pos)
    L = probe.geo.kv_lora_rank
    kv_c, k_pe = lat[:, :L], lat[:, L:]
    k_nope = torch.einsum("ml,hnl->mhn", kv_c, probe.w.w_uk.double())
    v = torch.einsum("ml,hlv->mhv", kv_c, probe.w.w_uv.double())
    q_nope, q_pe = probe.queries64(tokens[query_positions], query_positions)
    s = (torch.einsum("qhn,mhn->qhm", q_nope, k_nope) + torch.einsum("qhr,mr->qhm", q_pe, k_pe)) * probe.scale
    mask = pos[None, :] <= query_positions[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("qhm,mhv->qhv", torch.softmax(s, dim=-1), v)
