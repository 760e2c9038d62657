"""The ring schedule: at step t rank r holds the K/V of rank ``(r - t) mod P`` and computes the
blocks the global mask leaves between its q and that K/V. Pure functions; the executor runs them.

Forward: P steps, K/V hop to rank+1 between steps. Backward: the same steps again, with the fp32
dK/dV of the K/V a rank holds travelling with it and arriving at its owner after the last step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..blocks import Block, band_block, coalesce, global_band
from ..layouts import Layout
from ..memo import cached_method

__all__ = ["RingSchedule", "ring_schedule"]


@dataclass(frozen=True)
class RingSchedule:
    """Which blocks rank ``rank`` computes at each of the ``P`` ring steps.

    layout: how the sequence is split; seq_len: full sequence length; causal / window: the
    full-sequence mask (FA convention, window (left, right) with None = unbounded).
    """

    layout: Layout
    seq_len: int
    causal: bool
    window: tuple[int | None, int | None] = (None, None)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_steps(self) -> int:
        return self.layout.world_size

    def graph_key(self) -> tuple:
        """The schedule by value: layout, length and mask."""
        return ("ring", self.layout, self.seq_len, self.causal, self.window)

    def graph_sightings(self) -> int:
        """A dense call's shapes repeat every layer: captured at its first call."""
        return 1

    @cached_method
    def rows(self, rank: int) -> int:
        """Local tokens of ``rank``."""
        return sum(n for _, n in self.layout.segments(self.seq_len, rank))

    @property
    def max_rows(self) -> int:
        return max(self.rows(r) for r in range(self.world_size))

    def travel_rows(self, rank: int) -> int:
        """Every local token's K/V travel."""
        return self.rows(rank)

    @property
    def max_travel_rows(self) -> int:
        return self.max_rows

    @staticmethod
    def source(rank: int, step: int, world_size: int) -> int:
        """The rank whose K/V ``rank`` holds at ``step``."""
        return (rank - step) % world_size

    def _segments(self, rank: int) -> list[tuple[int, int, int]]:
        out, local = [], 0
        for start, n in self.layout.segments(self.seq_len, rank):
            out.append((local, start, n))
            local += n
        return out

    @cached_method
    def blocks(self, rank: int, step: int) -> tuple[Block, ...]:
        """Calls of ``rank`` at ``step`` in local coordinates (empty: skip, K/V unused)."""
        src = self.source(rank, step, self.world_size)
        q_segs, k_segs = self._segments(rank), self._segments(src)
        if src == rank and self.causal and self.window[0] is None:
            # own K/V: the local order is increasing, so the local causal mask is the global one
            n = sum(s[2] for s in q_segs)
            return (Block(0, n, 0, n, causal=True),)
        lo, hi = global_band(self.causal, self.window)
        found = [b for qs in q_segs for ks in k_segs if (b := band_block(qs, ks, lo, hi)) is not None]
        return tuple(coalesce(found))

    def work(self, rank: int) -> int:
        """(query, key) pairs ``rank`` computes over all steps (load-balance checks)."""
        return sum(b.work for t in range(self.num_steps) for b in self.blocks(rank, t))


@functools.lru_cache(maxsize=64)
def ring_schedule(layout: Layout, seq_len: int, causal: bool, window: tuple) -> RingSchedule:
    """The shared schedule for these arguments: every layer of a step reuses its computed blocks."""
    return RingSchedule(layout, seq_len, causal, tuple(window))
