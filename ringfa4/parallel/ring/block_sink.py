"""dK/dV without an accumulating backward: the backend's per-block backward."""

from __future__ import annotations

import torch

from . import calls
from .buffers import KVBuffers
from .home_grads import HomeGrads
from .run import RingRun, acc_dtype, cap_of

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
        self.rows = HomeGrads(run, qs, ks, vs, lambda r: run.schedule.blocks(r, 0))
        # fp32 block gradients (the backend's backward_accumulate) where asked and not already exact
        self.fp32 = run.options.fp32_grads and qs[0].dtype != acc

    def accumulators(self, device, zeroed: bool) -> list[torch.Tensor]:
        return [self.bufs.zeros(device) if zeroed else self.bufs.empty(device)]

    def compute(self, g: int, i: int, blocks, k, v, rows: int, dst, travelled: bool):
        mine = []
        for blk in blocks:
            tensors = (self.douts[i], self.qs[i], k, v, self.outs[i], self.lses[i])
            if self.rows.backward(i, blk, tensors):
                continue
            home = self.rows.homes[i] if blk.home else None  # there already: added into in place
            kept = calls.backward_fp32(self.run.backend, blk, tensors, self.run.spec, self.rows.dqs[i], home) if (
                self.fp32) else None
            if kept is None:
                dq, dk, dv = calls.backward(self.run.backend, blk, tensors, self.run.spec)
                blk.add_q(self.rows.dqs[i], dq)
                kept = (dk, dv)
            if kept:
                mine.append((blk, *kept))
        return mine

    def fold(self, i: int, mine, buf: torch.Tensor, rows: int) -> None:
        dk_acc, dv_acc = self.bufs.view(buf, rows)
        for blk, dk, dv in mine:
            dst_k, dst_v = self.rows.homes[i] if blk.home else (dk_acc, dv_acc)
            blk.add_k(dst_k, dk)
            blk.add_k(dst_v, dv)

    def dq(self) -> list[torch.Tensor]:
        return self.rows.dq()

    def dkv(self, bufs: list[list[torch.Tensor]], rows: list[int]):
        got = [self.rows.dkv(i, *self.bufs.view(buf, n)) for i, (buf, n) in enumerate(zip(bufs[0], rows))]
        return [dk for dk, _ in got], [dv for _, dv in got]
