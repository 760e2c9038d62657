"""Ring steps over packed documents: per (rank, step), the varlen calls of all documents.

At step 0 a rank meets its own K/V: its pieces of split documents and its whole documents (one
``home`` call, computed while the first hop is in flight); at later steps only the travelling
pieces of the source rank, so a pack whose documents all stay whole runs one step and no hop.

For every document, each (q segment, kv segment) pair of the step is trimmed by
:func:`band_block` under the global mask in document coordinates; blocks with the same FA settings
and the same (q part, kv part) become one varlen call. Thanks to the part-major local order their
ranges tile contiguous local rows (one slice). Where some document drops out (an empty chunk, a
causal pair with nothing visible, or a window) the group is cut into calls of contiguous query rows
(:func:`q_runs`): an extra launch costs less than gathering q, out, dout and lse and scattering dq
and the merge back (measured on the H200: the long-tail pack's row gathers and indexed adds were
about 8% of a rank's forward+backward kernel time); key rows that skip may still be gathered. No
call ever holds an empty segment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels.host_copy import to_device
from ..kernels.validate import mark_valid
from .blocks import band_block, copy_unless_there, global_band, whole_block
from .memo import cached_method
from .packing import Packing, Segment

__all__ = ["PackSchedule", "PackedRingSchedule", "VarlenCall", "q_runs"]


@dataclass(frozen=True)
class VarlenCall:
    """One varlen backend call: ``pairs`` of (q0, q1, k0, k1) local row ranges, all nonempty;
    ``home``: the rank's whole documents against its own K/V (rows that never travel)."""

    pairs: tuple[tuple[int, int, int, int], ...]
    causal: bool
    window: tuple[int | None, int | None]
    home: bool = False

    @functools.cached_property
    def q_contiguous(self) -> bool:
        return all(a[1] == b[0] for a, b in zip(self.pairs, self.pairs[1:]))

    @functools.cached_property
    def k_contiguous(self) -> bool:
        return all(a[3] == b[2] for a, b in zip(self.pairs, self.pairs[1:]))

    @cached_method
    def _meta(self, device: torch.device):
        cu_q, cu_k = [0], [0]
        for q0, q1, k0, k1 in self.pairs:
            cu_q.append(cu_q[-1] + q1 - q0)
            cu_k.append(cu_k[-1] + k1 - k0)
        qi = None if self.q_contiguous else to_device(torch.cat([torch.arange(a, b) for a, b, _, _ in self.pairs]),
                                                     device)
        ki = self._key_index(device)
        mq, mk = max(b - a for a, b, _, _ in self.pairs), max(d - c for _, _, c, d in self.pairs)
        cq, ck = (to_device(torch.tensor(x, dtype=torch.int32), device) for x in (cu_q, cu_k))
        mark_valid(cq, mq)  # built here: valid by construction, so block calls never sync to check
        mark_valid(ck, mk)
        return cq, ck, mq, mk, qi, ki

    def _key_index(self, device: torch.device) -> torch.Tensor | None:
        """The key rows to gather (int64), None where they are one slice."""
        return None if self.k_contiguous else to_device(torch.cat([torch.arange(c, d) for _, _, c, d in self.pairs]),
                                                        device)

    @cached_method
    def spec(self, base, device):
        cu_q, cu_k, mq, mk, _, _ = self._meta(device)
        return base.replace(causal=self.causal, window=self.window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=mq, max_seqlen_k=mk)

    # -- geometry on packed q (t, h, d), lse (h, t); the ring's calls (ring/calls.py) slice through
    # these: views where the call's rows are contiguous, else gathered copies put back by put_* --
    token_dim: ClassVar[int] = 0

    @property
    def q_is_view(self) -> bool:
        return self.q_contiguous

    @property
    def k_is_view(self) -> bool:
        return self.k_contiguous

    def covers(self, rows: int) -> bool:
        return self.q_contiguous and self.pairs[0][0] == 0 and self.pairs[-1][1] == rows

    def _rows(self, x, which: str, dim: int = 0):
        if which == "q" and self.q_contiguous:
            return x.narrow(dim, self.pairs[0][0], self.pairs[-1][1] - self.pairs[0][0])
        if which == "k" and self.k_contiguous:
            return x.narrow(dim, self.pairs[0][2], self.pairs[-1][3] - self.pairs[0][2])
        return x.index_select(dim, self._meta(x.device)[4 if which == "q" else 5])

    def k_index(self, device: torch.device) -> torch.Tensor | None:
        """The int64 key rows :meth:`k_rows` gathers (None where they are one slice)."""
        return self._meta(device)[5]

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(x, "q")

    def k_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(x, "k")

    def lse_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(x, "q", 1)

    def put_q(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.q_contiguous:
            copy_unless_there(self.q_rows(dst), src)
        else:
            dst.index_copy_(0, self._meta(dst.device)[4], src.to(dst.dtype))

    def put_lse(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.q_contiguous:
            copy_unless_there(self.lse_rows(dst), src)
        else:
            dst.index_copy_(1, self._meta(dst.device)[4], src.to(dst.dtype))

    def add_q(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.q_contiguous:
            self.q_rows(dst).add_(src)
        else:
            dst.index_add_(0, self._meta(dst.device)[4], src.to(dst.dtype))

    def add_k(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.k_contiguous:
            self.k_rows(dst).add_(src)
        else:
            dst.index_add_(0, self._meta(dst.device)[5], src.to(dst.dtype))


@dataclass(frozen=True, eq=False)
class PackSchedule:
    """What every schedule over a :class:`Packing` shares: the pack, the mask, row counts."""

    pack: Packing
    causal: bool
    window: tuple[int | None, int | None] = (None, None)

    @property
    def world_size(self) -> int:
        return self.pack.world_size

    def graph_key(self) -> tuple:
        """The schedule by value: its kind, the pack's boundaries, layout and placement rule, the mask
        (a new ``cp.pack`` of the same cu_seqlens has the same key)."""
        return (type(self).__name__, self.pack.cu, self.pack.layout, self.pack.balanced, self.causal, self.window)

    def graph_sightings(self) -> int:
        """Every pack is a new schedule: captured only when the same pack comes a second time."""
        return 2

    def rows(self, rank: int) -> int:
        return self.pack.rows(rank)

    @property
    def max_rows(self) -> int:
        return self.pack.max_rows

    def travel_rows(self, rank: int) -> int:
        return self.pack.travel_rows(rank)

    @property
    def max_travel_rows(self) -> int:
        return self.pack.max_travel_rows


@dataclass(frozen=True, eq=False)
class PackedRingSchedule(PackSchedule):
    """The ring schedule over a :class:`Packing` (same interface as ``RingSchedule``)."""

    @property
    def num_steps(self) -> int:
        return self.pack.world_size

    source = staticmethod(lambda rank, step, world_size: (rank - step) % world_size)

    @cached_method
    def blocks(self, rank: int, step: int) -> tuple[VarlenCall, ...]:
        src = self.source(rank, step, self.world_size)
        lo, hi = global_band(self.causal, self.window)
        kv_by_doc: dict[int, list] = {}
        for s in self.pack.segments(src):
            kv_by_doc.setdefault(s.doc, []).append(s)
        groups: dict[tuple, list] = {}
        for qs in self.pack.segments(rank):
            for ks in kv_by_doc.get(qs.doc, ()):
                if qs.part == Segment.WHOLE:  # at step 0, against itself: one call for all of them
                    b = whole_block(qs.local, qs.length, lo, hi)
                else:
                    b = band_block((qs.local, qs.pos, qs.length), (ks.local, ks.pos, ks.length), lo, hi)
                if b is not None:
                    groups.setdefault((qs.part, ks.part, b.causal, b.window), []).append((b.q0, b.q1, b.k0, b.k1))
        return tuple(VarlenCall(run, key[2], key[3], key[0] == Segment.WHOLE)
                     for key, p in sorted(groups.items(), key=str) for run in q_runs(p))


def q_runs(pairs: list[tuple[int, int, int, int]]) -> list[tuple[tuple[int, int, int, int], ...]]:
    """``pairs`` (q0, q1, k0, k1) sorted and cut where the query rows stop being contiguous."""
    runs: list[list] = []
    for pair in sorted(pairs):
        if runs and runs[-1][-1][1] == pair[0]:
            runs[-1].append(pair)
        else:
            runs.append([pair])
    return [tuple(r) for r in runs]
