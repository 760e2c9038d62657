"""Block geometry: which part of a (q segment, kv segment) pair a global mask leaves, as one
backend call. Pure functions of integers; no tensors.

A global mask ``lo <= j - i <= hi`` (causal: ``hi = 0``; window (left, right): ``lo = -left``,
``hi = right``) restricted to q tokens ``[a, a+m)`` and kv tokens ``[c, c+n)`` is a band
``lo' <= j' - i' <= hi'`` in segment coordinates (``lo' = lo - (c - a)``). Trimmed to the rows and
columns that see anything, the band always contains the bottom-right corner, so it is exactly a
FlashAttention call: ``causal`` (bottom-right) and/or a window ``(left, right)`` with both >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .memo import cached_method

__all__ = ["Block", "band_block", "coalesce", "copy_unless_there", "global_band", "whole_block"]


@dataclass(frozen=True)
class Block:
    """One backend call of a ring step: local q rows ``[q0, q1)`` against local kv rows ``[k0, k1)``
    with FA-convention ``causal`` and ``window`` on that sub-block."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    window: tuple[int | None, int | None] = (None, None)

    @property
    def full(self) -> bool:
        return not self.causal and self.window == (None, None)

    # -- geometry on dense tensors: q (b, s, h, d), lse (b, h, s); the ring's calls (ring/calls.py)
    # slice through these and make the kernel calls themselves --
    token_dim: ClassVar[int] = 1
    q_is_view: ClassVar[bool] = True  # q_rows / lse_rows are views: results land in place
    k_is_view: ClassVar[bool] = True  # k_rows too: gradients can be added into the kv accumulators
    home: ClassVar[bool] = False  # its K/V rows travel (dense: every row does)

    def covers(self, rows: int) -> bool:
        """All ``rows`` local query rows, as one slice (the first block may be copied, not merged)."""
        return self.q0 == 0 and self.q1 == rows

    @cached_method
    def spec(self, base, device=None):
        """``base`` with this block's causal / window (``device`` unused: the varlen call's needs it)."""
        return base.replace(causal=self.causal, window=self.window)

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This block's query rows of a ``(b, s, ...)`` tensor (a view; ``x`` itself for all of them)."""
        return x if self.q0 == 0 and self.q1 == x.shape[1] else x[:, self.q0:self.q1]

    def k_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This block's key rows of a ``(b, s_k, ...)`` tensor (a view; ``x`` itself for all of them)."""
        return x if self.k0 == 0 and self.k1 == x.shape[1] else x[:, self.k0:self.k1]

    def lse_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This block's rows of an lse ``(b, h, s)`` or planes ``(b, h, 2, s)`` tensor (a view;
        ``x`` itself for all of them)."""
        return x if self.q0 == 0 and self.q1 == x.shape[-1] else x[..., self.q0:self.q1]

    def put_q(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy_unless_there(self.q_rows(dst), src)

    def put_lse(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy_unless_there(self.lse_rows(dst), src)

    def add_q(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.q_rows(dst).add_(src)

    def add_k(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.k_rows(dst).add_(src)

    @property
    def work(self) -> int:
        """Visible (query, key) pairs: the block's attention work."""
        m, n = self.q1 - self.q0, self.k1 - self.k0
        left, right = self.window
        right = 0 if self.causal else right
        shift = n - m
        lo = -math.inf if left is None else shift - left
        hi = math.inf if right is None else shift + right
        return sum(max(0, min(n - 1, i + hi) - max(0, i + lo) + 1) for i in range(m)) if (
            left is not None or right is not None) else m * n


def copy_unless_there(dst, src) -> None:
    """``dst.copy_(src)`` unless ``src`` already is ``dst`` (a backend that honoured ``out=``)."""
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)


def global_band(causal: bool, window: tuple[int | None, int | None]) -> tuple[float, float]:
    """``(lo, hi)`` of the visible ``key - query`` positions for a full-sequence mask."""
    left, right = window
    lo = -math.inf if left is None else -left
    hi = 0 if causal else (math.inf if right is None else right)
    if causal and right is not None:
        hi = min(hi, right)
    return lo, hi


def band_block(q_seg: tuple[int, int, int], k_seg: tuple[int, int, int], lo: float, hi: float
               ) -> Block | None:
    """The call for q segment ``(local_start, global_start, length)`` against kv segment likewise,
    under the global band ``[lo, hi]``; None when nothing is visible."""
    qa, qg, m = q_seg
    ka, kg, n = k_seg
    if m == 0 or n == 0:
        return None
    lo, hi = lo - (kg - qg), hi - (kg - qg)  # segment coordinates
    if lo > hi:
        return None
    r0 = 0 if hi == math.inf else max(0, -int(hi))
    r1 = m - 1 if lo == -math.inf else min(m - 1, n - 1 - int(lo))
    c0 = 0 if lo == -math.inf else max(0, int(lo))
    c1 = n - 1 if hi == math.inf else min(n - 1, m - 1 + int(hi))
    if r0 > r1 or c0 > c1:
        return None
    lo, hi = lo - (c0 - r0), hi - (c0 - r0)  # trimmed block coordinates
    sq, sk = r1 - r0 + 1, c1 - c0 + 1
    shift = sk - sq
    # lo <= shift <= hi holds here (the bottom-right corner is visible); drop bounds that never bind
    left = None if lo == -math.inf or shift - lo >= sk - 1 else int(shift - lo)
    right = None if hi == math.inf or hi - shift >= sq - 1 else int(hi - shift)
    causal = right == 0
    window = (left, None if causal else right)
    return Block(qa + r0, qa + r1 + 1, ka + c0, ka + c1 + 1, causal, window)


def whole_block(start: int, length: int, lo: float, hi: float) -> Block | None:
    """The call of a whole document held at local rows ``[start, start + length)`` against itself
    under the global band ``[lo, hi]``: its full square, with the flags a document of unbounded
    length gets (a shorter one sees every key those flags would mask anyway, since FA windows
    always keep the diagonal), so all whole documents of a rank share one call whatever their
    lengths (a 1-token document included). None when empty."""
    if length == 0:
        return None
    big = 1 << 40
    flags = band_block((0, 0, big), (0, 0, big), lo, hi)
    return Block(start, start + length, start, start + length, flags.causal, flags.window)


def coalesce(blocks: list[Block]) -> list[Block]:
    """Join full blocks that share a q range and have adjacent kv ranges, then those that share a kv
    range and have adjacent q ranges (e.g. zigzag's two full quarter-blocks of a step)."""
    masked = [b for b in blocks if not b.full]
    full = sorted((b for b in blocks if b.full), key=lambda b: (b.q0, b.q1, b.k0))
    for key, same, adjacent, join in (
        (lambda b: (b.q0, b.q1, b.k0), lambda a, b: (a.q0, a.q1) == (b.q0, b.q1), lambda a, b: a.k1 == b.k0,
         lambda a, b: Block(a.q0, a.q1, a.k0, b.k1)),
        (lambda b: (b.k0, b.k1, b.q0), lambda a, b: (a.k0, a.k1) == (b.k0, b.k1), lambda a, b: a.q1 == b.q0,
         lambda a, b: Block(a.q0, b.q1, a.k0, a.k1)),
    ):
        full.sort(key=key)
        joined: list[Block] = []
        for b in full:
            if joined and same(joined[-1], b) and adjacent(joined[-1], b):
                joined[-1] = join(joined[-1], b)
            else:
                joined.append(b)
        full = joined
    return sorted(full + masked, key=lambda b: (b.q0, b.k0))
