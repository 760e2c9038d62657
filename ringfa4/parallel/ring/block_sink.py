"""dK/dV without an accumulating backward: the backend's per-block backward."""

from __future__ import annotations

import torch

from . import calls
from .buffers import KVBuffers
from .run import RingRun, acc_dtype, cap_of, row_dim

__all__ = ["BlockGradSink"]


class BlockGradSink:
    """Each block's gradients come back in fp32 where ``RingOptions.fp32_grads`` asks and the
    backend's ``backward_accumulate`` runs (FA4's varlen backward on sm90; the reference backend),
    else in the inputs' dtype; dq adds into fp32, dK/dV into the
    travelling buffer (fp32, or k's dtype on a 16-bit wire) once the hop has arrived, or, for the
    blocks of rows that never travel (``blk.home``: a balanced pack's whole documents), into an
    fp32 accumulator that stays home. One group, not in place (a :class:`~.protocols.GradSink`)."""

    groups, in_place = 1, False

    def __init__(self, run: RingRun, douts, qs, ks, vs, outs, lses) -> None:
        acc = acc_dtype(qs[0])
        self.run, self.douts, self.qs, self.outs, self.lses, self.ks, self.vs = run, douts, qs, outs, lses, ks, vs
        wire = acc if run.options.dkv_wire_fp32 else ks[0].dtype
        self.bufs = KVBuffers(ks[0], vs[0], cap_of(run), dtype=wire)
        self.dqs = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in qs]
        # fp32 block gradients (the backend's backward_accumulate) where asked and not already exact
        self.fp32 = run.options.fp32_grads and qs[0].dtype != acc
        sched = run.schedule
        self.home = [(torch.zeros(k.shape, dtype=acc, device=k.device),
                      torch.zeros(v.shape, dtype=acc, device=v.device))
                     if sched.travel_rows(r) < sched.rows(r) else None for k, v, r in zip(ks, vs, run.ranks)]

    def zeros(self, g: int, device) -> torch.Tensor:
        return self.bufs.zeros(device)

    def empty(self, g: int, device) -> torch.Tensor:
        return self.bufs.empty(device)

    def compute(self, g: int, i: int, blocks, k, v, rows: int, dst):
        mine = []
        for blk in blocks:
            tensors = (self.douts[i], self.qs[i], k, v, self.outs[i], self.lses[i])
            kept = calls.backward_fp32(self.run.backend, blk, tensors, self.run.spec, self.dqs[i]) if (
                self.fp32) else None
            if kept is None:
                dq, dk, dv = calls.backward(self.run.backend, blk, tensors, self.run.spec)
                blk.add_q(self.dqs[i], dq)
            else:
                dk, dv = kept
            mine.append((blk, dk, dv))
        return mine

    def fold(self, i: int, mine, buf: torch.Tensor, rows: int) -> None:
        dk_acc, dv_acc = self.bufs.view(buf, rows)
        for blk, dk, dv in mine:
            dst_k, dst_v = (self.home[i][0], self.home[i][1]) if blk.home else (dk_acc, dv_acc)
            blk.add_k(dst_k, dk)
            blk.add_k(dst_v, dv)

    def dq(self) -> list[torch.Tensor]:
        return [dq.to(q.dtype) for dq, q in zip(self.dqs, self.qs)]

    def dkv(self, bufs: list[list[torch.Tensor]], rows: list[int]):
        dks, dvs = [], []
        for i, (buf, n) in enumerate(zip(bufs[0], rows)):
            dk, dv = self.bufs.view(buf, n)
            if self.home[i] is not None:  # the travelled prefix added to what stayed home
                self.home[i][0].narrow(row_dim(dk), 0, n).add_(dk)
                self.home[i][1].narrow(row_dim(dv), 0, n).add_(dv)
                dk, dv = self.home[i][0], self.home[i][1]
            dks.append(dk.to(self.ks[i].dtype))
            dvs.append(dv.to(self.vs[i].dtype))
        return dks, dvs
