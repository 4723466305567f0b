"""Prefix block hashes of many prompts at once, equal to ``Request.update_hashes``.

A request's block hashes are chained: block i's hash is ``parent * P + hash(tuple(block))``
modulo 2**64, with the previous block's hash as parent (0 for the first). Two different
prefixes meet with odds of about 2**-64: a difference in block j alone shifts block i's
hash by P**(i-j) times a nonzero tuple-hash difference, and P is odd, so invertible.

Hashing block by block in Python costs about a microsecond a block, most of building a
simulation on a big trace; this module computes the very same values with numpy. The
chain is linear so that every prompt's chain comes from one running sum
(``s_i = P**i * sum_t u_t * P**-t``) instead of one numpy pass per block level. A
block's own hash is CPython's tuple hash: a fixed xxHash-style mix of its items' hashes
(Objects/tupleobject.c, unchanged since Python 3.8), an int's hash being its value
modulo 2**61 - 1 with its sign. Before first use the vectorised version is compared with
block-by-block hashing on a sample; if they differ (another Python implementation),
callers fall back to hashing block by block.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import numpy as np

_U = np.uint64
_MASK = (1 << 64) - 1
_MOD = _U((1 << 61) - 1)  # ints hash to their value modulo this prime
_P1 = _U(11400714785074694791)
_P2 = _U(14029467366897019727)
_P5 = _U(2870177450012600261)
_LEN_SALT = 2870177450012600261 ^ 3527539  # the tuple length is mixed in with this
_ALL_ONES = _U(_MASK)
_FOR_ALL_ONES = _U(1546275796)  # a tuple hash of -1 is replaced by this
# the chain's multiplier: odd (invertible modulo 2**64) and 5 modulo 8, so that two runs of
# one repeated block, m blocks apart in length, meet only if 2**64 divides the block's hash
# times m (m's factors of two are all that 1 + P + ... + P**(m-1) has)
_CHAIN = 0x9E3779B97F4A7C15
_CHAIN_INV = pow(_CHAIN, -1, 1 << 64)
_verified: Optional[bool] = None


def _int_hash(v: np.ndarray) -> np.ndarray:
    """hash() of every int64 of ``v``, as uint64 bit patterns (Py_hash_t two's complement)."""
    u = v.view(_U)
    neg = v < 0
    a = np.where(neg, ~u + _U(1), u)  # |v|
    r = (a & _MOD) + (a >> _U(61))  # |v| mod p, folded (2**61 = 1 mod p) ...
    r[r >= _MOD] -= _MOD  # ... and reduced
    r = np.where(neg, ~r + _U(1), r)  # the sign comes back
    r[r == _ALL_ONES] = _ALL_ONES - _U(1)  # -1 is reserved: hash(-1) == -2
    return r


def _mix(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """One item into a tuple hash, in place: acc = rotl(acc + lane * P2, 31) * P1."""
    acc += lane * _P2
    high = acc >> _U(33)
    acc <<= _U(31)
    acc |= high
    acc *= _P1
    return acc


def _finish(acc: np.ndarray, n: int) -> np.ndarray:
    acc = acc + _U(n ^ _LEN_SALT)
    acc[acc == _ALL_ONES] = _FOR_ALL_ONES
    return acc


def _powers(base: int, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) modulo 2**64."""
    out = np.full(n, base, dtype=_U)
    out[0] = 1
    return np.cumprod(out, dtype=_U)


def block_hashes_many(tokens: np.ndarray, starts: Sequence[int], lengths: Sequence[int],
                      block_size: int) -> Optional[list[list[int]]]:
    """Chained block hashes of prompts ``tokens[starts[i] : starts[i] + lengths[i]]`` (one flat
    int64 array), every full block of each; None if this Python hashes differently."""
    if not _check():
        return None
    return _hashes(tokens, starts, lengths, block_size)


def _hashes(tokens: np.ndarray, starts: Sequence[int], lengths: Sequence[int], bs: int) -> list[list[int]]:
    nblocks = np.asarray(lengths, dtype=np.int64) // bs
    total = int(nblocks.sum())
    if total == 0:
        return [[] for _ in nblocks]
    with np.errstate(over="ignore"):
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        # the tokens of every full block, prompt after prompt
        sizes = (nblocks * bs).tolist()
        blocks = np.concatenate([tokens[a:a + n] for a, n in zip(starts, sizes)]).reshape(total, bs)
        small = int(blocks.min()) >= 0 and int(blocks.max()) < int(_MOD)  # ids hash to themselves
        inner = np.empty(total, dtype=_U)  # hash(tuple(block)) of every block
        step = max(1, (1 << 17) // bs)  # blocks per slice: few numpy calls, lanes (1 MiB) still in cache
        for lo in range(0, total, step):
            lanes = np.ascontiguousarray(blocks[lo:lo + step].T)  # lanes[k]: token k of each block
            lanes = lanes.view(_U) if small else _int_hash(lanes)
            acc = np.full(lanes.shape[1], _P5, dtype=_U)
            for k in range(bs):
                _mix(acc, lanes[k])
            inner[lo:lo + step] = _finish(acc, bs)
        # every chain at once: block g of a prompt whose blocks start at f has the hash
        # sum_{t=f..g} inner_t * P**(g-t) = P**g * (W_g - W_{f-1}), W the running sum of inner_t * P**-t
        weighted = inner * _powers(_CHAIN_INV, total)
        run = np.cumsum(weighted, dtype=_U)
        first = np.cumsum(nblocks) - nblocks
        has = nblocks > 0
        before = run[first[has]] - weighted[first[has]]  # W_{f-1} of each prompt with blocks
        out = (run - np.repeat(before, nblocks[has])) * _powers(_CHAIN, total)
    flat = out.tolist()
    return [flat[a:a + n] for a, n in zip(first.tolist(), nblocks.tolist())]


def _check() -> bool:
    """Does the vectorised hash equal block-by-block hashing with this interpreter's ``hash``
    (asked once)?"""
    global _verified
    if _verified is None:
        rnd = random.Random(7)
        prompts = [[rnd.randrange(0, 1 << rnd.choice((8, 31, 62))) for _ in range(rnd.randrange(0, 90))]
                   for _ in range(40)]
        prompts.append([-1, -2, (1 << 63) - 1, -(1 << 63)] * 5)  # sign and reserved values
        flat = np.array([t for p in prompts for t in p], dtype=np.int64)
        lengths = [len(p) for p in prompts]
        starts = np.cumsum([0] + lengths[:-1]).tolist()
        got = _hashes(flat, starts, lengths, 4)
        want = [chained_hashes(p, 4) for p in prompts]
        _verified = got == want
    return _verified


def chained_hashes(tokens: Sequence[int], bs: int, parent: int = 0) -> list[int]:
    """Block by block (what ``Request.update_hashes`` extends a request's hashes with, and the
    reference the vectorised version is checked against). Hashes are ints in [0, 2**64)."""
    out = []
    for i in range(len(tokens) // bs):
        parent = (parent * _CHAIN + hash(tuple(tokens[i * bs:(i + 1) * bs]))) & _MASK
        out.append(parent)
    return out
