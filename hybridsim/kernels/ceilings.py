"""The card's measured limits, and the floor they set under a kernel's time.

Three rates are measured on the device, in the process that reports against them:

- **read**: a read-only streaming kernel (``read_stream_kernel``): each program sums one
  contiguous tile to a single float, so it writes 4 bytes per tile (at most 1/8192 of what it
  reads, at the tile sizes of ``READ_CONFIGS``). A kernel that mostly reads can beat the copy rate, so the copy rate
  alone is no floor for it (paged decode reported up to 107% "of the floor" against it).
- **copy**: a device-to-device ``copy_`` (bytes read + bytes written, per second).
- **matmul**: a large bf16 matmul (FLOP/s).

Every rate is the best of several runs: a floor must be the least time the card can take, so
the fastest run of the probe is the one that counts.

A kernel's floor is ``max(read / read rate + written / write side, FLOPs / matmul rate)``.
The write side is derived from the copy and the read rate, not measured by a write-only kernel:
in the additive model a copy of N bytes takes ``N / read + N / write = 2N / copy``, so
``1 / write = 2 / copy - 1 / read``. Derived this way, the card's own copy sits at exactly 100%
of its floor and a read-only kernel at most at 100% of the read rate: the model agrees with
every measurement it was built from. A write-only stream runs at its own rate, which says
nothing about what writes cost when they share the bus with reads (the case of every kernel
here), and a floor built on it could put a plain copy above 100%. Where the copy is at least
twice the read rate (the reads of a copy would be faster than the read probe: the probe is
wrong) the write side is unbounded and the floor counts reads only; the table then shows a
copy above 100%, which is the visible sign of that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# (BLOCK, TILE, num_warps) tried for the read probe; the fastest counts. 16 to 64 floats per thread
# per iteration: enough loads in flight per SM to cover the memory latency at full occupancy. The
# last two load their whole tile at once (no loop: every load of a program issued together, many
# short programs), the other common shape of a streaming kernel
READ_CONFIGS = ((4096, 65536, 8), (8192, 131072, 8), (8192, 65536, 4), (2048, 32768, 4), (16384, 262144, 8),
                (8192, 8192, 8), (16384, 16384, 8))


@triton.jit
def read_stream_kernel(x, sums, n, TILE: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """sums[p] = sum of x[p*TILE : (p+1)*TILE] (elements past n count as 0), in float32."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, TILE, BLOCK):
        idx = base + start + tl.arange(0, BLOCK).to(tl.int64)
        if EVEN:
            acc += tl.load(x + idx).to(tl.float32)
        else:
            acc += tl.load(x + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(sums + pid, tl.sum(acc, 0))


def read_stream(x: torch.Tensor, tile: int, block: int, num_warps: int = 4,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-tile sums of a contiguous 1-D tensor, one program per tile (``read_stream_reference``)."""
    if x.dim() != 1 or not x.is_contiguous() or tile % block:
        raise ValueError("read_stream: x must be 1-D and contiguous, tile a multiple of block")
    n = x.numel()
    tiles = -(-n // tile)
    if out is None:
        out = torch.empty(tiles, dtype=torch.float32, device=x.device)
    read_stream_kernel[(tiles,)](x, out, n, TILE=tile, BLOCK=block, EVEN=n % tile == 0, num_warps=num_warps)
    return out


def read_stream_reference(x: torch.Tensor, tile: int) -> torch.Tensor:
    """The torch meaning of ``read_stream``: x zero-padded to whole tiles, each tile summed."""
    tiles = -(-x.numel() // tile)
    padded = torch.zeros(tiles * tile, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x.float()
    return padded.view(tiles, tile).sum(1)


def best_seconds(fn, runs: int = 5, reps: int = 10) -> float:
    """Least per-call GPU time of ``fn`` over ``runs`` batches of ``reps`` calls (CUDA events)."""
    for _ in range(3):
        fn()
    best = math.inf
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3 / reps)
    return best


@dataclass(frozen=True)
class Floor:
    """The least time a call can take, and which limit set it."""

    seconds: float
    bound: str  # "bandwidth" or "compute"

    def pct(self, measured_s: float) -> float:
        """Per cent of the floor reached; above 100 means the floor is wrong (reported, never clamped)."""
        return 100 * self.seconds / measured_s if measured_s > 0 else 0.0


@dataclass(frozen=True)
class Ceilings:
    """Measured rates of one device: bytes/s read, bytes/s copied (read + written), bf16 FLOP/s."""

    read_Bps: float
    copy_Bps: float
    matmul_flops: float

    @property
    def write_Bps(self) -> float:
        """The write side derived from copy and read (module docstring); inf where unbounded."""
        inv = 2 / self.copy_Bps - 1 / self.read_Bps
        return 1 / inv if inv > 0 else math.inf

    def floor(self, read: float, written: float, flops: float = 0.0) -> Floor:
        bandwidth = read / self.read_Bps + written / self.write_Bps
        compute = flops / self.matmul_flops
        return Floor(compute, "compute") if compute > bandwidth else Floor(bandwidth, "bandwidth")

    def as_dict(self) -> dict:
        w = self.write_Bps
        return {"read_TBps": self.read_Bps / 1e12, "copy_TBps": self.copy_Bps / 1e12,
                "write_TBps": None if math.isinf(w) else w / 1e12, "matmul_TFLOPs": self.matmul_flops / 1e12}

    def line(self) -> str:
        w = self.write_Bps
        ws = "unbounded" if math.isinf(w) else f"{w / 1e12:.2f} TB/s"
        return (f"read {self.read_Bps / 1e12:.2f} TB/s, copy {self.copy_Bps / 1e12:.2f} TB/s "
                f"(write side {ws}, derived), bf16 matmul {self.matmul_flops / 1e12:.0f} TFLOP/s")


def measure_read(device: torch.device, nbytes: int, runs: int = 5) -> float:
    """Best read rate (bytes/s) of the streaming probe over ``READ_CONFIGS`` on ``nbytes`` of float32."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    best = math.inf
    for block, tile, warps in READ_CONFIGS:
        out = torch.empty(-(-x.numel() // tile), dtype=torch.float32, device=device)
        best = min(best, best_seconds(lambda b=block, t=tile, w=warps, o=out: read_stream(x, t, b, w, o), runs))
    rate = x.numel() * 4 / best
    del x
    return rate


def measure_copy(device: torch.device, nbytes: int, runs: int = 5) -> float:
    """Best device-to-device copy rate (bytes read + written per second) on ``nbytes`` copied."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    t = best_seconds(lambda: y.copy_(x), runs)
    del x, y
    return 2 * (nbytes // 4) * 4 / t


def measure_matmul(device: torch.device, n: int = 8192, runs: int = 5) -> float:
    """Best bf16 matmul rate (FLOP/s) of an n x n x n product."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t = best_seconds(lambda: a @ b, runs, reps=5)
    del a, b
    return 2 * n ** 3 / t


def measure(device: torch.device, nbytes: int = 2 ** 29, runs: int = 5) -> Ceilings:
    """All three rates; ``nbytes`` (default 512 MiB, ten times an H200's L2) sizes the streams."""
    c = Ceilings(measure_read(device, nbytes, runs), measure_copy(device, nbytes, runs),
                 measure_matmul(device, runs=runs))
    torch.cuda.empty_cache()
    return c
