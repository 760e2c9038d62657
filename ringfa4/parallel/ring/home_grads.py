"""The gradients of a rank's rows that never travel (a balanced pack's whole documents), shared by
the backward executors that compute them (:class:`~.block_sink.BlockGradSink` for the ring,
:func:`~ringfa4.parallel.allgather.allgather_backward`).

Per local rank: where its whole documents form one call of exactly the rows after the travelling
prefix (:func:`~.run.direct_home`) that call is their only contribution, so its plain backward
gives their final dq / dk / dv in the inputs' dtype (one varlen call's numerics) and the fp32 dq
accumulator covers the travelling prefix only; else dq is accumulated over all rows and the home
rows' dK/dV in fp32 accumulators that stay home (none where every row travels)."""

from __future__ import annotations

import torch

from . import calls
from .run import RingRun, acc_dtype, direct_home, row_dim

__all__ = ["HomeGrads"]


class HomeGrads:
    """``blocks_of(rank)``: the calls whose ``home`` one is looked for. ``dqs[i]``: rank i's fp32 dq
    accumulator (zeroed), or with ``dq_once`` (every row in exactly one call, which writes it:
    the all-gather mode) an unfilled one in q's dtype; ``homes[i]``: its home rows' ``(dk, dv)``
    fp32 accumulators or None; ``direct[i]``: the direct call or None (:meth:`backward` runs it)."""

    def __init__(self, run: RingRun, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
                 blocks_of, dq_once: bool = False) -> None:
        self.run, self.qs, self.ks, self.vs = run, qs, ks, vs
        acc, sched = acc_dtype(qs[0]), run.schedule
        self.direct = [direct_home(run, blocks_of(r), r) if sched.travel_rows(r) < sched.rows(r) else None
                       for r in run.ranks]
        self.finals: list = [None] * len(qs)  # the direct call's (dq, dk, dv) per local rank
        self.whole: list = [None] * len(qs)  # per local rank, the (dk, dv) that travel_out writes into
        self.dqs = [(torch.empty if dq_once else torch.zeros)(
            q.shape if c is None else (sched.travel_rows(r),) + tuple(q.shape[1:]), dtype=q.dtype if dq_once else acc,
            device=q.device) for q, c, r in zip(qs, self.direct, run.ranks)]
        zeros = lambda x: torch.zeros(x.shape, dtype=acc, device=x.device)  # noqa: E731
        self.homes = [(zeros(k), zeros(v)) if sched.travel_rows(r) < sched.rows(r) and c is None else None
                      for k, v, r, c in zip(ks, vs, run.ranks, self.direct)]

    def backward(self, i: int, blk, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Where ``blk`` is rank i's direct call: its plain backward kept as those rows' final
        gradients (True); else False, touching nothing."""
        if blk is not self.direct[i]:
            return False
        self.finals[i] = calls.backward(self.run.backend, blk, tensors, self.run.spec)
        return True

    def dq(self) -> list[torch.Tensor]:
        """Per local rank its dq in q's dtype."""
        return [dq.to(q.dtype) if f is None else calls.join_rows(dq, f[0], q.dtype)
                for dq, q, f in zip(self.dqs, self.qs, self.finals)]

    def dkv(self, i: int, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank i's dK / dV in the inputs' dtypes from its travelling rows' summed ``dk, dv`` (the
        prefix; all rows where everything travels)."""
        final, home = self.finals[i], self.homes[i]
        if final is not None:
            return calls.join_rows(dk, final[1], self.ks[i].dtype), calls.join_rows(dv, final[2], self.vs[i].dtype)
        if home is not None:  # the travelled prefix added to what stayed home
            n = dk.shape[row_dim(dk)]
            home[0].narrow(row_dim(dk), 0, n).add_(dk)
            home[1].narrow(row_dim(dv), 0, n).add_(dv)
            dk, dv = home
        return dk.to(self.ks[i].dtype), dv.to(self.vs[i].dtype)

    def travel_out(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where rank i's travelling rows' final dK / dV go when written once (the all-gather
        mode's row sums), ``(travel rows, h_kv, d)`` each: the prefix of its home accumulators (fp32;
        no home call touches the travelling rows) where it has them, else the prefix of new tensors
        of all its rows in the inputs' dtypes (the direct home call's rows follow in
        :meth:`dkv_written`); nothing is allocated for a rank whose rows all stay home."""
        k, v, home = self.ks[i], self.vs[i], self.homes[i]
        n = self.run.schedule.travel_rows(self.run.ranks[i])
        if n == 0 and home is None:
            return k.narrow(row_dim(k), 0, 0), v.narrow(row_dim(v), 0, 0)
        if self.whole[i] is None:
            self.whole[i] = home if home is not None else (torch.empty_like(k), torch.empty_like(v))
        return tuple(x.narrow(row_dim(x), 0, n) for x in self.whole[i])

    def dkv_written(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank i's dK / dV in the inputs' dtypes once :meth:`travel_out`'s rows were written: the
        direct home call's rows copied after them, or the home accumulators cast."""
        k, v, final = self.ks[i], self.vs[i], self.finals[i]
        if self.homes[i] is not None:
            dk, dv = self.homes[i]
            return dk.to(k.dtype), dv.to(v.dtype)
        n = self.run.schedule.travel_rows(self.run.ranks[i])
        if n == 0:  # every row home: the direct call's own gradients (or a rank with no rows: zeros)
            return (final[1].to(k.dtype), final[2].to(v.dtype)) if final is not None else \
                (torch.zeros_like(k), torch.zeros_like(v))
        if self.whole[i] is None:  # an executor bug, not an input's: say it rather than return garbage
            raise RuntimeError(f"HomeGrads.dkv_written({i}) before travel_out({i}): its travelling rows were "
                               "never written")
        dk, dv = self.whole[i]
        if final is not None:
            for x, f in zip((dk, dv), final[1:]):
                x.narrow(row_dim(x), n, x.shape[row_dim(x)] - n).copy_(f)
        return dk, dv
