"""Deterministic token ids: pure functions of integer seeds (splitmix64).

No stateful RNG is involved, so a token depends only on (seed, index): the same
scenario gives the same tokens on every machine and in any generation order,
and two requests that share a prefix seed share those tokens exactly.
"""

from __future__ import annotations

import numpy as np

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix(x: int) -> int:
    """splitmix64 finaliser of ``x`` (a well-spread 64-bit hash of an integer)."""
    z = (x + _GOLDEN) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def mix_many(x: np.ndarray) -> np.ndarray:
    """``mix`` of every element of a uint64 array."""
    with np.errstate(over="ignore"):
        return _finalize(x + np.uint64(_GOLDEN))


def combine(*parts: int) -> int:
    """A seed derived from several integers (order matters)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = mix(h ^ (p & _M))
    return h


def combine_many(prefix: tuple[int, ...], last: np.ndarray) -> np.ndarray:
    """``combine(*prefix, x)`` for every x of ``last`` (uint64) in one vectorised pass."""
    return mix_many(last.astype(np.uint64) ^ np.uint64(combine(*prefix)))


def _finalize(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (``mix`` without its increment)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def token_block(seed: int, n: int, vocab: int, start: int = 0) -> np.ndarray:
    """Tokens ``start .. start+n`` of the stream named by ``seed``, in [1, vocab)."""
    with np.errstate(over="ignore"):
        z = _finalize(np.arange(start, start + n, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(seed & _M))
    return _to_vocab(z, vocab)


def _to_vocab(z: np.ndarray, vocab: int) -> np.ndarray:
    """Hashes to token ids in [1, vocab)."""
    return (z % np.uint64(vocab - 1) + np.uint64(1)).astype(np.int64)


def token_rows(seeds: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """``token_block(seed, n, vocab)`` for many seeds at once: one row per seed."""
    with np.errstate(over="ignore"):
        z = _finalize(np.arange(n, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN)
                      + (seeds.astype(np.uint64) & np.uint64(_M))[:, None])
    return _to_vocab(z, vocab)


def token_segments(seeds: list[int], lengths: list[int], vocab: int) -> list[list[int]]:
    """``token_block(seed, n, vocab).tolist()`` for many (seed, n) pairs in one vectorised pass."""
    lens = np.asarray(lengths, dtype=np.int64)
    total = int(lens.sum())
    starts = np.cumsum(lens) - lens
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, lens)
    seed_rep = np.repeat(np.asarray([s & _M for s in seeds], dtype=np.uint64), lens)
    with np.errstate(over="ignore"):
        z = _finalize(pos.astype(np.uint64) * np.uint64(_GOLDEN) + seed_rep)
    flat = _to_vocab(z, vocab).tolist()
    return [flat[a:a + n] for a, n in zip(starts.tolist(), lengths)]


def stream_token(seed: int, index: int, vocab: int) -> int:
    """Scalar twin of ``token_block`` (same value as ``token_block(seed, 1, vocab, index)[0]``)."""
    z = (index * _GOLDEN + seed) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    z ^= z >> 31
    return z % (vocab - 1) + 1
