"""When padded batching pays on a CPU.

Rows of different lengths go through one batched product padded to the largest. On a GPU the
calls are the cost and padding is nearly free; a CPU computes every padded element at full
price, and a batch whose float64 scores leave one core's L2 (2 MiB) slows down by about half
again. Measured on the 2-core dev machine with the tiny presets' MLA oracle: a call costs about
0.38 ms plus 7.7 ns per score element, up to 2**18 elements, and about twice as much per
element past that. So on a CPU two pieces share a call only where that costs less than two calls.
"""

from __future__ import annotations

CPU_CALL_ELEMS = 3 << 14  # the elements one call's fixed cost pays for
CPU_BATCH_ELEMS = 1 << 18  # score elements of a merged batch at most (a piece alone may pass it)


def worth_merging(merged: int, apart: int, scores: int) -> bool:
    """On a CPU: a batch of ``merged`` elements (padded) instead of two costing ``apart`` together,
    with ``scores`` score elements in the merged batch."""
    return merged <= apart + CPU_CALL_ELEMS and scores <= CPU_BATCH_ELEMS
