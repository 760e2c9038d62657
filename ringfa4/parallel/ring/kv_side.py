"""The classic ring backward side: K/V travel to the next rank each step; their fp32 dK/dV
accumulators travel with them (in kv-head groups, added into in place where the backend can) and
reach their owner after the last step; dq stays home."""

from __future__ import annotations

import torch

from .accum_sink import AccumGradSink, DenseGrads, HeadGroups, accum_states, grad_layout
from .block_sink import BlockGradSink
from .buffers import KVBuffers, KVRing, own_kv, travelling
from .protocols import GradSink
from .run import RingRun, acc_dtype, cap_of, travel_of

__all__ = ["KVSide", "grad_sink"]


class KVSide:
    """K/V travel (one hop forward a step), dK/dV with them through a :class:`~.protocols.GradSink`;
    dq stays home (a :class:`~.protocols.BackwardSide`)."""

    step = 1

    def __init__(self, run: RingRun, douts, qs, ks, vs, outs, lses, states: list | None = None) -> None:
        self.run, self.ks, self.vs = run, ks, vs
        self.bufs = KVBuffers(ks[0], vs[0], cap_of(run))
        self.ring = KVRing(self.bufs, *travelling(run, ks, vs))
        self.own = own_kv(run, self.bufs, self.ring, ks, vs)
        self.sink = grad_sink(run, (douts, qs, ks, vs, outs, lses), states)
        self.groups, self.in_place = self.sink.groups, self.sink.in_place

    def held(self, i: int, r: int, t: int):
        if t == 0:  # its own K/V, whole documents included; n: the rows of what travels
            return self.own[i], travel_of(self.run, r)
        n = travel_of(self.run, self.run.schedule.source(r, t, self.run.schedule.world_size))
        return self.bufs.view(self.ring.cur[i], n), n

    def accumulators(self, i: int, zeroed: bool) -> list[torch.Tensor]:
        return self.sink.accumulators(self.ks[i].device, zeroed)

    def compute(self, g: int, i: int, r: int, t: int, held, dst):
        (k, v), n = held
        return self.sink.compute(g, i, self.run.schedule.blocks(r, t), k, v, n, dst, t > 0)

    def fold(self, i: int, mine, buf: torch.Tensor, held) -> None:
        self.sink.fold(i, mine, buf, held[1])

    def local(self) -> list[torch.Tensor]:
        return self.sink.dq()  # does not need the last dK/dV hops: runs while they travel

    def results(self, local, accs: list[list[torch.Tensor]]):
        rows = [travel_of(self.run, r) for r in self.run.ranks]
        return (local, *self.sink.dkv(accs, rows))


def grad_sink(run: RingRun, tensors: tuple[list, ...], states: list | None = None) -> GradSink:
    """How this backward's block gradients reach the travelling dK/dV, chosen once. Every rank
    must choose alike (the buffers travel): the choice depends on shapes, dtypes, the options
    (compared across ranks by the metadata check), the whole schedule, and on whether the
    backend's ``begin_backward`` offers a state, which for the same inputs it decides alike
    everywhere. ``tensors``: per-rank (douts, qs, ks, vs, outs, lses); ``states``: the local
    ranks' AccumBackward states when already begun (else begun here).

    - no state (fp32 grads off, packed, or the backend has none), or rows that never travel (a
      balanced pack's whole documents): :class:`BlockGradSink`;
    - states whose own dK/dV layout every block can address, an fp32 wire and dkv_groups > 1
      dividing the kv heads: :class:`AccumGradSink` in place, in head groups (a group's hop hides
      behind the other groups' blocks; no scratch, zeroing or add pass);
    - otherwise :class:`AccumGradSink` through a per-step scratch, one group.
    """
    douts, qs, ks, vs, outs, lses = tensors
    states = accum_states(run, douts, qs, outs, lses) if states is None else states
    sched = run.schedule
    stays = any(sched.travel_rows(r) != sched.rows(r) for r in range(sched.world_size))
    if stays or any(st is None for st in states):  # rows that never travel: only the block sink keeps them
        return BlockGradSink(run, douts, qs, ks, vs, outs, lses)
    wire = acc_dtype(qs[0]) if run.options.dkv_wire_fp32 else ks[0].dtype
    gbufs = KVBuffers(ks[0], vs[0], cap_of(run), dtype=wire)
    layout = grad_layout(run, states, ks[0], gbufs)
    h, h_kv = qs[0].shape[2], ks[0].shape[2]
    n = run.options.dkv_groups
    if not isinstance(layout, DenseGrads) and run.options.dkv_wire_fp32 and 1 < n and h_kv % n == 0:
        per, q_per = h_kv // n, h // h_kv
        heads = [(g * per, (g + 1) * per) for g in range(n)]
        groups = [[st.heads(a * q_per, b * q_per) for st in states] for a, b in heads]
        cap = cap_of(run)
        layouts = [grp[0].kv_layout(ks[0].narrow(2, a, b - a), cap) for grp, (a, b) in zip(groups, heads)]
        if all(lay is not None and lay.align == layout.align for lay in layouts):
            return AccumGradSink(run, states, HeadGroups(groups, layouts, heads), True, (qs, ks, vs), wire)
    return AccumGradSink(run, states, HeadGroups([states], [layout], [(0, h_kv)]), False, (qs, ks, vs), wire)
