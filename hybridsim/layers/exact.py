"""Arithmetic that gives the same bits on every machine.

Exactly checked quantities (Mamba states and outputs, MLA latent cache entries) must
come out identical on any CPU (x86-64 or arm64, any BLAS, any thread count) and on a
GPU. Floating-point results of BLAS reductions, libm's ``cos``/``exp`` and FMA
contraction are not; integers are. So:

* The Mamba probe computes in the integers modulo a prime ``Q`` (2039): every product
  of two residues is below 2**22 and every sum the probe forms stays below 2**31, so
  int32 on a GPU, int64 on a CPU and float64 matrix products all give the exact value,
  in any order. Residues are stored in the float32 state cache exactly.
* Tables (weights, embeddings) are integers drawn from numpy's PCG64 generator, which
  yields the same integers on every platform.
* RoPE angles are integer fractions of a turn and cos/sin come from a 4096-entry
  table of 10-bit fixed-point values computed once with ``decimal`` (software
  arithmetic, identical everywhere) — never from the platform's libm.
"""

from __future__ import annotations

import functools
import hashlib
from decimal import Decimal, localcontext

import numpy as np
import torch

Q = 2039  # prime; residues < 2**11, so two products and a residue fit int32 with room
MAX_STATE_DIM = 512  # sum_n h*C over d_state terms stays below 2**31 (512 * (Q-1)**2 < 2**31)


FAST_MOD_MIN = 2048  # elements: below this, one remainder call costs less than four


def mod_q(x: torch.Tensor) -> torch.Tensor:
    """x mod Q, in [0, Q), for float64 tensors holding integers with |x| < 2**51: the same values
    as ``torch.remainder(x, Q)`` at a third of the cost on a CPU (a remainder is a division).

    k = floor(x / Q + 1/(2Q)) is the exact quotient: x / Q is k + r/Q with r in [0, Q), so the sum
    lies in [k + 1/(2Q), k + 1 - 1/(2Q)], and the product x * fl(1/Q) is off by less than
    |x| / Q * 2**-52 < 1/(2Q). Then x - Q k is exact (integers below 2**53)."""
    if x.dtype != torch.float64 or x.numel() < FAST_MOD_MIN:
        return torch.remainder(x, float(Q))
    k = x * (1.0 / Q)
    k.add_(0.5 / Q).floor_()
    return x.sub(k, alpha=Q)


@functools.lru_cache(maxsize=None)
def primitive_root(q: int = Q) -> int:
    """The smallest generator of the multiplicative group mod q (q prime)."""
    n = q - 1
    factors = {p for p in range(2, n + 1) if n % p == 0 and all(p % d for d in range(2, int(p ** 0.5) + 1))}
    for g in range(2, q):
        if all(pow(g, n // p, q) != 1 for p in factors):
            return g
    raise ValueError(f"{q} has no primitive root")


@functools.lru_cache(maxsize=None)
def pow_table() -> torch.Tensor:
    """POW[e] = gamma**e mod Q for e in [0, Q-1): decays are powers of the generator, so a
    product of decays is a sum of exponents (what the chunked form needs)."""
    g = primitive_root()
    out = np.empty(Q - 1, dtype=np.int64)
    v = 1
    for e in range(Q - 1):
        out[e] = v
        v = v * g % Q
    return torch.from_numpy(out)


def rng(*key: int) -> np.random.Generator:
    """A generator seeded by integers (PCG64: the same stream on every platform)."""
    return np.random.default_rng([k & 0xFFFFFFFF for k in key] + [k >> 32 & 0xFFFFFFFF for k in key])


def residues(gen: np.random.Generator, shape, lo: int = 0, hi: int = Q) -> torch.Tensor:
    return torch.from_numpy(gen.integers(lo, hi, size=shape, dtype=np.int64))


# ----------------------------------------------------------------------------- RoPE tables

TURN_BITS = 32  # a rope angle is an integer fraction of a turn, in units of 2**-32
ANGLE_STEPS = 4096  # cos/sin are tabulated at 4096 angles of a turn
TRIG_BITS = 10  # cos/sin as integers in [-1024, 1024] over 1024

_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899")


def _dec_cos_sin(x: Decimal) -> tuple[Decimal, Decimal]:
    """Taylor series in decimal arithmetic (|x| <= pi/2 here): same digits on every machine."""
    c, s = Decimal(0), Decimal(0)
    term_c, term_s = Decimal(1), x
    k = 0
    while term_c != 0 or term_s != 0:
        c += term_c
        s += term_s
        term_c = -term_c * x * x / ((2 * k + 1) * (2 * k + 2))
        term_s = -term_s * x * x / ((2 * k + 2) * (2 * k + 3))
        k += 1
        if k > 60:
            break
    return c, s


@functools.lru_cache(maxsize=None)
def trig_table() -> tuple[torch.Tensor, torch.Tensor]:
    """(COS, SIN) int64 (ANGLE_STEPS,): round(cos/sin(2 pi k / 4096) * 1024), half away from zero."""
    quarter = ANGLE_STEPS // 4
    cos_q = np.empty(quarter + 1, dtype=np.int64)
    with localcontext() as ctx:
        ctx.prec = 40
        for k in range(quarter + 1):
            c, _ = _dec_cos_sin(2 * _PI * k / ANGLE_STEPS)
            v = c * (1 << TRIG_BITS)
            cos_q[k] = int(v.to_integral_value(rounding="ROUND_HALF_UP"))
    cos_full = np.empty(ANGLE_STEPS, dtype=np.int64)
    for k in range(ANGLE_STEPS):  # symmetries of the circle; exact
        r = k % ANGLE_STEPS
        if r <= quarter:
            cos_full[k] = cos_q[r]
        elif r <= 2 * quarter:
            cos_full[k] = -cos_q[2 * quarter - r]
        elif r <= 3 * quarter:
            cos_full[k] = -cos_q[r - 2 * quarter]
        else:
            cos_full[k] = cos_q[ANGLE_STEPS - r]
    sin_full = np.roll(cos_full, quarter)  # sin(t) = cos(t - quarter turn)
    return torch.from_numpy(cos_full), torch.from_numpy(sin_full)


@functools.lru_cache(maxsize=None)
def rope_phases(dim: int, base: float = 10000.0) -> torch.Tensor:
    """Per frequency i < dim/2: base**(-2i/dim) radians per position, as an integer number of
    2**-32 turns, computed in decimal arithmetic (int64, (dim/2,))."""
    out = []
    with localcontext() as ctx:
        ctx.prec = 40
        ln_base = Decimal(repr(base)).ln()
        for i in range(dim // 2):
            rad = (-(Decimal(2 * i) / Decimal(dim)) * ln_base).exp()
            turns = rad / (2 * _PI) * (1 << TURN_BITS)
            out.append(int(turns.to_integral_value(rounding="ROUND_HALF_EVEN")))
    return torch.tensor(out, dtype=torch.int64)


def rope_cos_sin(pos: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer cos/sin (over 1024) for positions ``pos`` (any shape S) and the frequencies of a
    ``dim``-wide rope: S + (dim/2,) int64 each, on pos's device. Pure integer arithmetic."""
    phases, cos_t, sin_t = _rope_tables(dim, str(pos.device))
    turn = (pos.to(torch.int64)[..., None] * phases) % (1 << TURN_BITS)
    shift = TURN_BITS - 12  # ANGLE_STEPS = 2**12
    idx = ((turn + (1 << (shift - 1))) >> shift) % ANGLE_STEPS
    return cos_t[idx], sin_t[idx]


@functools.lru_cache(maxsize=None)
def _rope_tables(dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The phases and the cos/sin table, copied to ``device`` once."""
    cos_t, sin_t = trig_table()
    return rope_phases(dim).to(device), cos_t.to(device), sin_t.to(device)


_ROTATION: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def rotation_tables(dim: int, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[cos | cos] and [-sin | sin] (times 1024) for positions 0..n-1 at least, cached per device:
    rope is then one gather and three element-wise operations."""
    key = (dim, str(device), dtype)
    cached = _ROTATION.get(key)
    if cached is None or cached[0].shape[0] < n:
        size = 1 << max(10, (n - 1).bit_length())
        c, s = rope_cos_sin(torch.arange(size, device=device), dim)
        cached = _ROTATION[key] = (torch.cat([c, c], dim=-1).to(dtype), torch.cat([-s, s], dim=-1).to(dtype))
    return cached


def prepare_rope(dim: int, n_pos: int, device, dtype: torch.dtype = torch.float64) -> None:
    """Build the rotation tables for ``n_pos`` positions now (a run's set-up), not at the first
    step that needs them: the decimal trig table alone takes tens of milliseconds."""
    rotation_tables(dim, n_pos, torch.device(device), dtype)


def rope_exact(x: torch.Tensor, pos: torch.Tensor, n_pos: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE of integer-valued ``x`` (..., d) by positions ``pos`` (broadcastable to
    x.shape[:-1]), returning the rotated values times 1024 as exact integers in x's dtype
    (float64 or int64); callers scale by a power of two, so the result is exact in float32
    too while |x| <= 2**12. Each element is one product of x, one of its rotated partner, and
    one sum: x1*cos - x2*sin and x2*cos + x1*sin. ``n_pos`` bounds the positions (max + 1); a caller
    that knows it saves reading ``pos`` back from the device."""
    d = x.shape[-1]
    if n_pos is None:
        n_pos = int(pos.max()) + 1 if pos.numel() else 1
    cc, ss = rotation_tables(d, n_pos, x.device, x.dtype)
    p = pos.to(torch.int64)
    rotated = torch.cat([x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cc[p] + rotated * ss[p]


# ----------------------------------------------------------------------------- digests


def fingerprint_rows(t: torch.Tensor) -> torch.Tensor:
    """An exact int64 fingerprint of each row of ``t`` (rows on dim 0) from its bit patterns:
    sum over elements of (low 16 bits * w1 + high 16 bits * w2) with fixed 16-bit weights.
    Every product is below 2**32 and a row of up to 2**20 elements sums below 2**53, so the
    value is the same on any device and in any summation order."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1)
    if flat.dtype in (torch.float32, torch.int32):
        bits = flat.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    elif flat.dtype in (torch.bfloat16, torch.float16, torch.int16):
        bits = flat.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    elif flat.dtype == torch.int64:
        bits = flat & 0xFFFFFFFF
    else:
        raise TypeError(f"fingerprint of {flat.dtype}")
    n = bits.shape[1]
    idx = torch.arange(n, dtype=torch.int64, device=t.device)
    w1 = (idx * 40503 + 7) % 65521
    w2 = (idx * 52361 + 11) % 65519
    out = torch.zeros(rows, dtype=torch.int64, device=t.device)
    step = 1 << 20
    for s in range(0, n, step):  # sums of at most 2**20 terms, then exact int64 additions
        b = bits[:, s:s + step]
        out += ((b & 0xFFFF) * w1[s:s + step] + (b >> 16) * w2[s:s + step]).sum(dim=1)
    return out


def pages_digest(tensors: list[torch.Tensor], rows: torch.Tensor) -> str:
    """sha256 over the exact fingerprints of the given rows (pages) of each tensor, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(fingerprint_rows(t[rows]).cpu().numpy().tobytes())
    return h.hexdigest()


__all__ = ["Q", "MAX_STATE_DIM", "mod_q", "pow_table", "primitive_root", "rng", "residues", "rope_exact",
           "rope_cos_sin", "trig_table", "rope_phases", "prepare_rope", "fingerprint_rows", "pages_digest"]
