"""dK/dV through the backend's accumulating backward (block gradients never rounded): the sink,
the dense gradient layout, and the helpers the q side shares with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.spec import write_each_group
from ..memo import ViewMemo
from . import calls
from .buffers import KVBuffers
from .run import RingRun, acc_dtype, cap_of

__all__ = ["AccumGradSink", "DenseGrads", "HeadGroups", "accum_states", "aligned_numel", "grad_layout",
           "write_dkv"]


@dataclass(frozen=True)
class HeadGroups:
    """The kv-head groups dK/dV travel in: ``heads[g]`` = group g's ``(start, stop)`` kv heads,
    ``layouts[g]`` its accumulator layout, ``states[g]`` the per-rank AccumBackward states of its
    q heads."""

    states: list[list]
    layouts: list
    heads: list[tuple[int, int]]


class AccumGradSink:
    """dK/dV through the backend's AccumBackward states, in the kv-head ``groups``
    (:class:`HeadGroups`); ``full``: the per-rank states over all heads; ``inputs``: the per-rank
    (qs, ks, vs). In place: blocks add straight into the travelling buffer; else into a zeroed
    fp32 scratch that is added to the buffer after the hop (a :class:`~.protocols.GradSink`)."""

    def __init__(self, run: RingRun, full: list, groups: HeadGroups, in_place: bool, inputs: tuple[list, list, list],
                 dtype: torch.dtype) -> None:
        self.run, self.full, self.in_place, self.dtype = run, full, in_place, dtype
        self.states, self.layouts, self.heads = groups.states, groups.layouts, groups.heads
        self.groups = len(groups.layouts)
        self.qs, self.ks, self.vs = inputs
        self.views = ViewMemo()  # head groups and block rows of the held K/V
        # travelled blocks' replays (AccumBackward.replay) by group, state class, block and held rows: the
        # buffers K/V and dK/dV travel in are laid out alike on every rank and step, so such a block's
        # arguments have the signature and alignment of the first one's (its checked call); False: none
        self.replays: dict[tuple, object] = {}
        self.classes: dict[tuple[int, int], object] = {}
        acc = acc_dtype(self.qs[0])
        self.scratch = None if in_place else [torch.empty(self.layouts[0].numel, dtype=acc, device=k.device)
                                              for k in self.ks]

    def accumulators(self, device, zeroed: bool) -> list[torch.Tensor]:
        """The groups' accumulators as views of one buffer (zeroed in one launch), each starting on
        a 256-byte boundary."""
        starts = [0]
        for lay in self.layouts:
            starts.append(starts[-1] + aligned_numel(lay.numel, self.dtype))
        flat = (torch.zeros if zeroed else torch.empty)(starts[-1], dtype=self.dtype, device=device)
        return [flat.narrow(0, a, lay.numel) for a, lay in zip(starts, self.layouts)]

    def compute(self, g: int, i: int, blocks, k, v, rows: int, dst, travelled: bool):
        if not blocks:
            return None
        target = dst if self.in_place else self.scratch[i].zero_()
        a, b = self.heads[g]
        k_g, v_g = self.views.get((k, v), ("heads", a, b), calls.kv_heads, k, v, a, b)
        state = self.states[g][i]
        for blk in blocks:
            kv = self.views.get((k_g, v_g), ("rows", blk.k0, blk.k1), calls.kv_rows, blk, k_g, v_g)
            dk, dv = self.layouts[g].cols(target, rows, blk.k0, blk.k1)
            if not travelled:  # step 0: the inputs' own K/V, laid out as the caller made them
                calls.accumulate(state, blk, kv, self.run.spec, dk, dv)
                continue
            key = (g, self._class(g, i), blk, rows)
            replay = self.replays.get(key)
            if replay:
                replay(state, kv[0], kv[1], dk, dv)
                continue
            calls.accumulate(state, blk, kv, self.run.spec, dk, dv)
            if replay is None:
                self.replays[key] = calls.accumulate_replay(state, blk, kv, self.run.spec, dk, dv) or False
        return None if self.in_place else target

    def _class(self, g: int, i: int):
        """State (g, i)'s replay class, asked once."""
        got = self.classes.get((g, i))
        if got is None:
            got = self.classes[(g, i)] = self.states[g][i].replay_class()
        return got

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
            if self.groups == 1:
                write_dkv(self.layouts[0], bufs[0][i], n, dk, dv)
            else:  # groups of equal width, in order: one pass for all where the layout can
                self.layouts[0].write_groups([grp[i] for grp in bufs], n, dk, dv)
            dks.append(dk)
            dvs.append(dv)
        return dks, dvs


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """``numel`` elements of ``dtype`` rounded up to a whole number of 256-byte blocks, in elements: the
    distance between accumulators cut from one buffer, each starting on a 256-byte boundary."""
    return -(-numel * dtype.itemsize // 256) * 256 // dtype.itemsize


def write_dkv(layout, buf: torch.Tensor, rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """A layout's finished dK/dV into ``dk, dv`` (the inputs' dtype)."""
    layout.write(buf, rows, dk, dv)


class DenseGrads:
    """dK/dV as dense ``(b, rows, h_kv, d)`` views of :class:`KVBuffers` (the executor's own layout;
    the backend's AccumBackward may offer its native one instead: ``kv_layout``). A
    :class:`~ringfa4.kernels.spec.KVGradLayout`."""

    align = 1

    def __init__(self, bufs: KVBuffers) -> None:
        self.bufs, self.numel, self.dtype = bufs, bufs.numel, bufs.dtype

    def cols(self, buf: torch.Tensor, rows: int, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        dk, dv = self.bufs.view(buf, rows)
        return dk[:, k0:k1], dv[:, k0:k1]

    def write(self, buf: torch.Tensor, rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        dk_f, dv_f = self.bufs.view(buf, rows)
        dk.copy_(dk_f)
        dv.copy_(dv_f)

    def write_groups(self, bufs: list[torch.Tensor], rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        write_each_group(self, bufs, rows, dk, dv)


def grad_layout(run: RingRun, states: list, k: torch.Tensor, gbufs: KVBuffers):
    """The backend's own dK/dV layout when every local state offers one and every block of the
    schedule, on every rank (the buffers travel: all ranks must choose alike), starts at a kv row it
    can address; else the dense layout."""
    dense = DenseGrads(gbufs)
    if any(st is None for st in states):
        return dense
    layout = states[0].kv_layout(k, cap_of(run))
    if layout is None:
        return dense
    sched = run.schedule
    aligned = all(b.k0 % layout.align == 0 for t in range(run.active_steps) for r in range(sched.world_size)
                  for b in sched.blocks(r, t))
    return layout if aligned else dense


def accum_states(run: RingRun, douts, qs, outs, lses) -> list:
    """Per local rank, the backend's AccumBackward state when the options ask for fp32 block
    gradients and the backend offers it for these inputs (dense), else None."""
    if not run.options.fp32_grads or qs[0].dim() != 4:
        return [None] * len(qs)
    return [run.backend.begin_backward(do, q, o, lse, run.spec) for do, q, o, lse in zip(douts, qs, outs, lses)]
