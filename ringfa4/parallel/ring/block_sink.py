"""dK/dV without an accumulating backward: the backend's per-block backward."""

from __future__ import annotations

import torch

from . import calls
from .buffers import KVBuffers
from .run import RingRun, acc_dtype, cap_of, direct_home, row_dim

__all__ = ["BlockGradSink"]


class BlockGradSink:
    """Each block's gradients come back in fp32 where ``RingOptions.fp32_grads`` asks and the
    backend's ``backward_accumulate`` runs (FA4's varlen backward on sm90; the reference backend),
    else in the inputs' dtype; dq adds into fp32, dK/dV into the
    travelling buffer (fp32, or k's dtype on a 16-bit wire) once the hop has arrived, or, for the
    blocks of rows that never travel (``blk.home``: a balanced pack's whole documents), into an
    fp32 accumulator that stays home. Where those whole documents form one call of exactly the
    rows after the travelling prefix (:func:`~.run.direct_home`), that call is their only one: its
    backward gives the final dq / dk / dv of those rows in the inputs' dtype (one varlen call's
    numerics), with no fp32 accumulator for them. One group, not in place (a
    :class:`~.protocols.GradSink`)."""

    groups, in_place = 1, False

    def __init__(self, run: RingRun, douts, qs, ks, vs, outs, lses) -> None:
        acc = acc_dtype(qs[0])
        self.run, self.douts, self.qs, self.outs, self.lses, self.ks, self.vs = run, douts, qs, outs, lses, ks, vs
        wire = acc if run.options.dkv_wire_fp32 else ks[0].dtype
        self.bufs = KVBuffers(ks[0], vs[0], cap_of(run), dtype=wire)
        sched = run.schedule
        self.direct = [direct_home(run, sched.blocks(r, 0), r) if sched.travel_rows(r) < sched.rows(r) else None
                       for r in run.ranks]
        self.finals: list = [None] * len(qs)  # the direct call's (dq, dk, dv) per local rank
        self.dqs = [torch.zeros(q.shape if c is None else (sched.travel_rows(r),) + tuple(q.shape[1:]), dtype=acc,
                                device=q.device) for q, c, r in zip(qs, self.direct, run.ranks)]
        # fp32 block gradients (the backend's backward_accumulate) where asked and not already exact
        self.fp32 = run.options.fp32_grads and qs[0].dtype != acc
        self.home = [(torch.zeros(k.shape, dtype=acc, device=k.device),
                      torch.zeros(v.shape, dtype=acc, device=v.device))
                     if sched.travel_rows(r) < sched.rows(r) and c is None else None
                     for k, v, r, c in zip(ks, vs, run.ranks, self.direct)]

    def zeros(self, g: int, device) -> torch.Tensor:
        return self.bufs.zeros(device)

    def empty(self, g: int, device) -> torch.Tensor:
        return self.bufs.empty(device)

    def compute(self, g: int, i: int, blocks, k, v, rows: int, dst):
        mine = []
        for blk in blocks:
            tensors = (self.douts[i], self.qs[i], k, v, self.outs[i], self.lses[i])
            if blk is self.direct[i]:
                self.finals[i] = calls.backward(self.run.backend, blk, tensors, self.run.spec)
                continue
            home = self.home[i] if blk.home else None  # there already: added into in place
            kept = calls.backward_fp32(self.run.backend, blk, tensors, self.run.spec, self.dqs[i], home) if (
                self.fp32) else None
            if kept is None:
                dq, dk, dv = calls.backward(self.run.backend, blk, tensors, self.run.spec)
                blk.add_q(self.dqs[i], dq)
                kept = (dk, dv)
            if kept:
                mine.append((blk, *kept))
        return mine

    def fold(self, i: int, mine, buf: torch.Tensor, rows: int) -> None:
        dk_acc, dv_acc = self.bufs.view(buf, rows)
        for blk, dk, dv in mine:
            dst_k, dst_v = (self.home[i][0], self.home[i][1]) if blk.home else (dk_acc, dv_acc)
            blk.add_k(dst_k, dk)
            blk.add_k(dst_v, dv)

    def dq(self) -> list[torch.Tensor]:
        return [dq.to(q.dtype) if f is None else calls.join_rows(dq, f[0], q.dtype)
                for dq, q, f in zip(self.dqs, self.qs, self.finals)]

    def dkv(self, bufs: list[list[torch.Tensor]], rows: list[int]):
        dks, dvs = [], []
        for i, (buf, n) in enumerate(zip(bufs[0], rows)):
            dk, dv = self.bufs.view(buf, n)
            if self.finals[i] is not None:
                dks.append(calls.join_rows(dk, self.finals[i][1], self.ks[i].dtype))
                dvs.append(calls.join_rows(dv, self.finals[i][2], self.vs[i].dtype))
                continue
            if self.home[i] is not None:  # the travelled prefix added to what stayed home
                self.home[i][0].narrow(row_dim(dk), 0, n).add_(dk)
                self.home[i][1].narrow(row_dim(dv), 0, n).add_(dv)
                dk, dv = self.home[i][0], self.home[i][1]
            dks.append(dk.to(self.ks[i].dtype))
            dvs.append(dv.to(self.vs[i].dtype))
        return dks, dvs
