"""The oracle: values recomputed from nothing but each request's committed tokens.

No cache, block table or copy is involved. Mamba: every layer's state and output
advanced token by token from the zero state, with snapshots at every block
boundary, so any position's expected state is at hand. MLA: dense, un-absorbed
attention in float64 over the committed prefix (``layers.mla.dense_reference``).
"""

from __future__ import annotations

import torch

from .layers.mamba import MambaProbe
from .layers.mla import MLAProbe, dense_reference


class _Track:
    __slots__ = ("pos", "window", "h", "outputs", "snapshots")

    def __init__(self, probe: MambaProbe):
        self.pos = 0
        self.window, self.h = probe.zero_state(1)
        self.outputs: list[torch.Tensor] = []
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {0: (self.window, self.h)}


class MambaOracle:
    def __init__(self, probes: list[MambaProbe], block_size: int):
        self.probes = probes
        self.bs = block_size
        self.tracks: dict[str, list[_Track]] = {}

    def _tracks(self, rid: str) -> list[_Track]:
        t = self.tracks.get(rid)
        if t is None:
            t = self.tracks[rid] = [_Track(p) for p in self.probes]
        return t

    def advance(self, rid: str, tokens: list[int], upto: int) -> None:
        """Process committed tokens up to position ``upto`` (exclusive)."""
        for probe, tr in zip(self.probes, self._tracks(rid)):
            while tr.pos < upto:
                y, tr.window, tr.h = probe.token_step(tr.window, tr.h, torch.tensor([tokens[tr.pos]]))
                tr.outputs.append(y[0])
                tr.pos += 1
                if tr.pos % self.bs == 0:
                    tr.snapshots[tr.pos] = (tr.window, tr.h)

    def advance_many(self, work: list[tuple[str, list[int], int]]) -> None:
        """``advance`` for several requests at once, batched token slot by token slot."""
        rows = [(rid, toks, upto) for rid, toks, upto in work if self._tracks(rid)[0].pos < upto]
        if not rows:
            return
        for layer, probe in enumerate(self.probes):
            tracks = [self.tracks[rid][layer] for rid, _, _ in rows]
            start = [tr.pos for tr in tracks]
            todo = [upto - tr.pos for tr, (_, _, upto) in zip(tracks, rows)]
            window = torch.cat([tr.window for tr in tracks])
            h = torch.cat([tr.h for tr in tracks])
            for t in range(max(todo)):
                act = [i for i, n in enumerate(todo) if n > t]
                idx = torch.tensor(act, dtype=torch.int64)
                tok = torch.tensor([rows[i][1][start[i] + t] for i in act], dtype=torch.int64)
                y, w2, h2 = probe.token_step(window[idx], h[idx], tok)
                window[idx] = w2
                h[idx] = h2
                for j, i in enumerate(act):
                    tr = tracks[i]
                    tr.outputs.append(y[j])
                    tr.pos += 1
                    if tr.pos % self.bs == 0:
                        tr.snapshots[tr.pos] = (window[i:i + 1].clone(), h[i:i + 1].clone())
            for i, tr in enumerate(tracks):
                tr.window, tr.h = window[i:i + 1].clone(), h[i:i + 1].clone()

    def output(self, rid: str, layer: int, pos: int) -> torch.Tensor:
        return self._tracks(rid)[layer].outputs[pos]

    def state(self, rid: str, layer: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(window (K-1, dim), h) after ``pos`` tokens: the frontier or a block boundary."""
        tr = self._tracks(rid)[layer]
        if pos == tr.pos:
            return tr.window[0], tr.h[0]
        snap = tr.snapshots.get(pos)
        if snap is None:
            raise KeyError(f"oracle has no state of {rid} at {pos} (frontier {tr.pos})")
        return snap[0][0], snap[1][0]

    def forget(self, rid: str) -> None:
        self.tracks.pop(rid, None)


def mla_expected(probe: MLAProbe, tokens: list[int], positions: list[int]) -> torch.Tensor:
    return dense_reference(probe, torch.tensor(tokens, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64))
