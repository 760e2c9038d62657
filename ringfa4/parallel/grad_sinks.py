"""Where a ring backward's block gradients go (the executor's gradient strategies, chosen once
per backward by :func:`grad_sink`):

- :class:`BlockGradSink`: the backend's per-block backward; gradients in the inputs' dtype, dq
  summed in fp32, dK/dV added into the travelling buffer after its hop arrived;
- :class:`AccumGradSink`: the backend's AccumBackward (fp32 block gradients), into the backend's
  own dK/dV layout or :class:`DenseGrads`; in place (kv-head groups whose kernels add straight
  into the travelling buffer) or through a per-step scratch.

A sink offers ``groups``, ``in_place``, ``zeros`` / ``empty`` (a group's travelling buffer),
``compute`` (a rank's blocks of a step), ``fold`` (what compute returned into the arrived buffer),
``dq`` and ``dkv`` (the results in the inputs' dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .ring_buffers import KVBuffers, acc_dtype, cap_of

if TYPE_CHECKING:
    from .executor import RingRun

__all__ = ["AccumGradSink", "BlockGradSink", "DenseGrads", "HeadGroups", "grad_sink"]


class BlockGradSink:
    """dK/dV without an AccumBackward: each block's gradients come back in the inputs' dtype; dq
    adds into fp32, dK/dV into the travelling buffer (fp32, or k's dtype on a 16-bit wire) once
    the hop has arrived. One group, not in place."""

    groups, in_place = 1, False

    def __init__(self, run: RingRun, douts, qs, ks, vs, outs, lses) -> None:
        acc = acc_dtype(qs[0])
        self.run, self.douts, self.qs, self.outs, self.lses, self.ks, self.vs = run, douts, qs, outs, lses, ks, vs
        self.bufs = KVBuffers(ks[0], vs[0], cap_of(run, ks[0]), dtype=acc if run.dkv_wire_fp32 else ks[0].dtype)
        self.dqs = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in qs]

    def zeros(self, g: int, device) -> torch.Tensor:
        return self.bufs.zeros(device)

    def empty(self, g: int, device) -> torch.Tensor:
        return self.bufs.empty(device)

    def compute(self, g: int, i: int, blocks, k, v, rows: int, dst):
        mine = []
        for blk in blocks:
            dq, dk, dv = blk.backward(self.run.backend, self.douts[i], self.qs[i], k, v, self.outs[i], self.lses[i],
                                      self.run.spec)
            blk.add_dq(self.dqs[i], dq)
            mine.append((blk, dk, dv))
        return mine

    def fold(self, i: int, mine, buf: torch.Tensor, rows: int) -> None:
        dk_acc, dv_acc = self.bufs.view(buf, rows)
        for blk, dk, dv in mine:
            blk.add_dkv(dk_acc, dv_acc, dk, dv)

    def dq(self) -> list[torch.Tensor]:
        return [dq.to(q.dtype) for dq, q in zip(self.dqs, self.qs)]

    def dkv(self, bufs: list[list[torch.Tensor]], rows: list[int]):
        dks, dvs = [], []
        for i, (buf, n) in enumerate(zip(bufs[0], rows)):
            dk, dv = self.bufs.view(buf, n)
            dks.append(dk.to(self.ks[i].dtype))
            dvs.append(dv.to(self.vs[i].dtype))
        return dks, dvs


@dataclass(frozen=True)
class HeadGroups:
    """The kv-head groups dK/dV travel in: ``heads[g]`` = group g's ``(start, stop)`` kv heads,
    ``layouts[g]`` its accumulator layout, ``states[g]`` the per-rank AccumBackward states of its
    q heads."""

    states: list[list]
    layouts: list
    heads: list[tuple[int, int]]


class AccumGradSink:
    """dK/dV through the backend's AccumBackward states (block gradients never rounded), in the
    kv-head ``groups`` (:class:`HeadGroups`); ``full``: the per-rank states over all heads;
    ``inputs``: the per-rank (qs, ks, vs). In place: blocks add straight into the travelling buffer;
    else into a zeroed fp32 scratch that is added to the buffer after the hop."""

    def __init__(self, run: RingRun, full: list, groups: HeadGroups, in_place: bool, inputs: tuple[list, list, list],
                 dtype: torch.dtype) -> None:
        self.run, self.full, self.in_place, self.dtype = run, full, in_place, dtype
        self.states, self.layouts, self.heads = groups.states, groups.layouts, groups.heads
        self.groups = len(groups.layouts)
        self.qs, self.ks, self.vs = inputs
        acc = acc_dtype(self.qs[0])
        self.scratch = None if in_place else [torch.empty(self.layouts[0].numel, dtype=acc, device=k.device)
                                              for k in self.ks]

    def zeros(self, g: int, device) -> torch.Tensor:
        return torch.zeros(self.layouts[g].numel, dtype=self.dtype, device=device)

    def empty(self, g: int, device) -> torch.Tensor:
        return torch.empty(self.layouts[g].numel, dtype=self.dtype, device=device)

    def compute(self, g: int, i: int, blocks, k, v, rows: int, dst):
        if not blocks:
            return None
        target = dst if self.in_place else self.scratch[i].zero_()
        a, b = self.heads[g]
        k_g, v_g = k.narrow(2, a, b - a), v.narrow(2, a, b - a)
        for blk in blocks:
            blk.accumulate(self.states[g][i], k_g, v_g, self.run.spec, *self.layouts[g].cols(target, rows, blk.k0,
                                                                                               blk.k1))
        return None if self.in_place else target

    def fold(self, i: int, mine, buf: torch.Tensor, rows: int) -> None:
        if mine is not None:
            buf += mine  # same layout, same held rows: one elementwise add (rounded to a k-dtype wire)

    def dq(self) -> list[torch.Tensor]:
        return [st.dq(q.dtype) for st, q in zip(self.full, self.qs)]

    def dkv(self, bufs: list[list[torch.Tensor]], rows: list[int]):
        dks, dvs = [], []
        for i, n in enumerate(rows):
            k, v = self.ks[i], self.vs[i]
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # contiguous, whatever k's strides
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            for g, (a, b) in enumerate(self.heads):
                _write_dkv(self.layouts[g], bufs[g][i], n, dk.narrow(2, a, b - a), dv.narrow(2, a, b - a))
            dks.append(dk)
            dvs.append(dv)
        return dks, dvs


def _write_dkv(layout, buf: torch.Tensor, rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """A layout's finished dK/dV into ``dk, dv`` (the inputs' dtype): its ``write`` where offered."""
    write = getattr(layout, "write", None)
    if write is not None:
        write(buf, rows, dk, dv)
        return
    dk_f, dv_f = layout.dense(buf, rows)
    dk.copy_(dk_f)
    dv.copy_(dv_f)


class DenseGrads:
    """dK/dV as dense ``(b, rows, h_kv, d)`` views of :class:`KVBuffers` (the executor's own layout;
    the backend's ``kv_layout`` may offer its native one instead, see AccumBackward)."""

    align = 1

    def __init__(self, bufs: KVBuffers) -> None:
        self.bufs, self.numel = bufs, bufs.numel

    def cols(self, buf: torch.Tensor, rows: int, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        dk, dv = self.bufs.view(buf, rows)
        return dk[:, k0:k1], dv[:, k0:k1]

    def dense(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bufs.view(buf, rows)


def grad_sink(run: RingRun, douts, qs, ks, vs, outs, lses, states: list | None = None):
    """How this backward's block gradients reach the travelling dK/dV. Every rank must choose alike
    (the buffers travel): the choice depends on shapes, dtypes, the switches (compared across
    ranks by the metadata check) and the whole schedule, and on whether the backend's
    ``begin_backward`` offers a state, which for the same inputs it decides alike everywhere.
    ``states``: the local ranks' AccumBackward states when already begun (else begun here)."""
    states = _accum_states(run, douts, qs, outs, lses) if states is None else states
    if any(st is None for st in states):
        return BlockGradSink(run, douts, qs, ks, vs, outs, lses)
    wire = acc_dtype(qs[0]) if run.dkv_wire_fp32 else ks[0].dtype
    gbufs = KVBuffers(ks[0], vs[0], cap_of(run, ks[0]), dtype=wire)
    layout = _grad_layout(run, states, ks[0], gbufs)
    h, h_kv = qs[0].shape[2], ks[0].shape[2]
    n = run.dkv_groups
    if not isinstance(layout, DenseGrads) and run.dkv_wire_fp32 and 1 < n and h_kv % n == 0 \
            and all(hasattr(st, "heads") for st in states):
        per, q_per = h_kv // n, h // h_kv
        heads = [(g * per, (g + 1) * per) for g in range(n)]
        groups = [[st.heads(a * q_per, b * q_per) for st in states] for a, b in heads]
        cap = cap_of(run, ks[0])
        layouts = [grp[0].kv_layout(ks[0].narrow(2, a, b - a), cap) for grp, (a, b) in zip(groups, heads)]
        if all(lay is not None and lay.align == layout.align for lay in layouts):
            return AccumGradSink(run, states, HeadGroups(groups, layouts, heads), True, (qs, ks, vs), wire)
    return AccumGradSink(run, states, HeadGroups([states], [layout], [(0, h_kv)]), False, (qs, ks, vs), wire)


def _grad_layout(run: RingRun, states: list, k: torch.Tensor, gbufs: KVBuffers):
    """The backend's own dK/dV layout when every local state offers one and every block of the
    schedule, on every rank (the buffers travel: all ranks must choose alike), starts at a kv row it
    can address; else the dense layout."""
    dense = DenseGrads(gbufs)
    offer = getattr(states[0], "kv_layout", None)
    if offer is None or any(st is None for st in states):
        return dense
    layout = offer(k, cap_of(run, k))
    if layout is None:
        return dense
    sched = run.schedule
    aligned = all(b.k0 % layout.align == 0 for t in range(run.active_steps) for r in range(sched.world_size)
                  for b in sched.blocks(r, t))
    return layout if aligned else dense


def _accum_states(run: RingRun, douts, qs, outs, lses) -> list:
    """Per local rank, the backend's AccumBackward state when ``run.fp32_grads`` asks for one and
    the backend offers it for these inputs (dense), else None."""
    begin = getattr(run.backend, "begin_backward", None)
    if not run.fp32_grads or begin is None or qs[0].dim() != 4:
        return [None] * len(qs)
    return [begin(do, q, o, lse, run.spec) for do, q, o, lse in zip(douts, qs, outs, lses)]
