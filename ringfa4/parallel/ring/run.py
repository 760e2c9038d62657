"""The state of one ring attention call (everything but the tensors) and the small helpers every
part of the ring reads it through. A leaf: it imports nothing of the ring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...kernels.spec import AttnSpec, BlockBackend
from ...options import RingOptions
from ..transport import Transport

__all__ = ["RingRun", "Schedule", "acc_dtype", "active_steps", "cap_of", "lse_shape", "row_dim", "rows_of",
           "travel_of", "with_rows", "direct_home"]


class Schedule(Protocol):
    """What the ring loop needs of a schedule (dense :class:`~.schedule.RingSchedule`, packed
    :class:`~ringfa4.parallel.varlen.PackedRingSchedule`)."""

    @property
    def world_size(self) -> int: ...

    @property
    def num_steps(self) -> int: ...

    @property
    def max_rows(self) -> int: ...

    def source(self, rank: int, step: int, world_size: int) -> int: ...

    def blocks(self, rank: int, step: int) -> tuple: ...

    def rows(self, rank: int) -> int: ...

    def travel_rows(self, rank: int) -> int:
        """The prefix of ``rank``'s local rows whose K/V leave it (dense: all; a balanced pack: its
        split documents' pieces; the rest is only ever read at step 0, from the inputs)."""

    @property
    def max_travel_rows(self) -> int: ...

    def graph_key(self) -> tuple:
        """The schedule by value (what a CUDA graph of a call over it depends on; :mod:`.graphs`)."""

    def graph_sightings(self) -> int:
        """Calls of one key before it is captured: 1 (dense: the first call), 2 (a pack: only one that
        comes again)."""


@dataclass(frozen=True)
class RingRun:
    """Everything one ring attention call needs besides the tensors.

    schedule: the per-step blocks; ranks: the ranks this process runs (rank order);
    backend: block kernels; spec: softmax_scale / softcap / deterministic (causal and window come
    from the schedule's blocks; never sinks); transport: moves buffers between ranks; options: the
    call's :class:`~ringfa4.options.RingOptions`; sinks: ``(h,)`` sink logits of the call's q heads,
    applied once to each rank's merged result (:mod:`ringfa4.kernels.sinks`), or None.
    """

    schedule: Schedule
    ranks: tuple[int, ...]
    backend: BlockBackend
    spec: AttnSpec
    transport: Transport
    options: RingOptions = RingOptions()
    sinks: torch.Tensor | None = None

    @property
    def active_steps(self) -> int:
        """Steps up to the last one any rank has work in (later K/V is never needed)."""
        return active_steps(self.schedule)


def active_steps(schedule: Schedule) -> int:
    """Computed once per schedule object (kept on it, so it dies with it)."""
    known = schedule.__dict__.get("_active_steps")
    if known is None:
        s = schedule
        last = [t for t in range(s.num_steps) for r in range(s.world_size) if s.blocks(r, t)]
        known = max(last) + 1 if last else 1
        object.__setattr__(schedule, "_active_steps", known)
    return known


def row_dim(x: torch.Tensor) -> int:
    """Token dim: 1 for dense (b, s, h, d), 0 for packed (t, h, d)."""
    return 0 if x.dim() == 3 else 1


def with_rows(x: torch.Tensor, rows: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[row_dim(x)] = rows
    return tuple(shape)


def lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    """``(b, h, s)`` for dense q ``(b, s, h, d)``, ``(h, t)`` for packed q ``(t, h, d)``."""
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of inputs like ``x``: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rows_of(run: RingRun, rank: int) -> int:
    """Local tokens of ``rank``."""
    return run.schedule.rows(rank)


def direct_home(run: RingRun, calls: tuple, rank: int):
    """The call of ``rank``'s whole documents when it can write the final rows itself: the only
    ``home`` call among ``calls``, its rows contiguous and exactly the local rows after the
    travelling prefix, no sinks. Those rows need no merge: the call writes out (q's dtype) and lse
    straight into the results and its backward the final dq / dk / dv, one varlen call's numerics.
    None otherwise."""
    home = [c for c in calls if c.home]
    if run.sinks is not None or len(home) != 1 or not home[0].q_contiguous or not home[0].k_contiguous:
        return None
    c, travel, rows = home[0], travel_of(run, rank), rows_of(run, rank)
    if (c.pairs[0][0], c.pairs[-1][1], c.pairs[0][2], c.pairs[-1][3]) != (travel, rows, travel, rows):
        return None
    return c


def travel_of(run: RingRun, rank: int) -> int:
    """Travelling tokens of ``rank`` (a prefix of its local rows)."""
    return run.schedule.travel_rows(rank)


def cap_of(run: RingRun) -> int:
    """Travelling tokens of the largest rank (the travelling buffers' rows)."""
    return run.schedule.max_travel_rows
