"""What travels in a ring backward: the two sides the one backward loop (:func:`~.executor.ring_backward`)
can run.

- :class:`KVSide` (the classic ring): K/V travel to the next rank each step; their fp32 dK/dV
  accumulators travel with them (in kv-head groups, added into in place where the backend can)
  and reach their owner after the last step; dq stays home.
- :class:`QSide` (the q ring): each rank keeps its K/V and their dK/dV accumulators; the q side of
  every rank travels to the *previous* rank each step (q, dout and what the backend's backward
  state derives from them: FA4's dpsum and lse * log2 e), with its fp32 dq accumulator, in q-head
  groups reduce-added into in place, home after the last step. Rank r at step t holds the q side
  of rank j = r + t, whose K/V-ring schedule at step t has exactly this pair (source(j, t) = r),
  so the schedule's blocks are used as they are.

Per hop the K/V side moves K, V and fp32 dK, dV (MHA bf16: 12 bytes per kv element), the q side
q, dout and fp32 dq (8 bytes per q element, plus two floats a row): for MHA a third less, for GQA
with h / h_kv >= 2 more. ``RINGFA4_BWD_RING`` picks: ``auto`` (default) the side that moves fewer
bytes a hop (the q side needs the backend's AccumBackward with ``travel`` / ``visiting``: FA4 on
sm90 / sm100, the reference backend), ``kv`` or ``q`` (q where it can run, else kv). Every rank
chooses alike: shapes, dtypes, switches and the backend decide it.

A side offers ``groups``, ``in_place``, ``step`` (the hop offset: 1 or world - 1), ``ring``
(``cur`` / ``nxt`` pieces of the travelling data, ``swap``), ``held`` (what a rank's compute needs
of the data it holds at a step), ``zeros`` / ``empty`` (a group's travelling accumulator),
``compute`` / ``fold``, ``local`` (the results that never travel, computed while the last hops
run) and ``results`` (dq, dk, dv in the inputs' dtypes once the accumulators are home).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .grad_sinks import _accum_states, _grad_layout, _write_dkv, grad_sink
from .ring_buffers import KVBuffers, KVRing, acc_dtype, cap_of, rows_of

if TYPE_CHECKING:
    from .executor import RingRun

__all__ = ["KVSide", "QSide", "backward_side", "bwd_ring", "hop_bytes"]


def bwd_ring() -> str:
    """``RINGFA4_BWD_RING``: ``auto`` (default), ``kv`` or ``q`` (see the module doc)."""
    raw = os.environ.get("RINGFA4_BWD_RING", "auto")
    if raw not in ("auto", "kv", "q"):
        raise ValueError(f"RINGFA4_BWD_RING must be auto, kv or q, got {raw!r}")
    return raw


class KVSide:
    """K/V travel (one hop forward a step), dK/dV with them through a grad sink; dq stays home."""

    step = 1

    def __init__(self, run: RingRun, douts, qs, ks, vs, outs, lses, states: list | None = None) -> None:
        self.run, self.ks = run, ks
        self.bufs = KVBuffers(ks[0], vs[0], cap_of(run, ks[0]))
        self.ring = KVRing(run, self.bufs, ks, vs)
        self.sink = grad_sink(run, douts, qs, ks, vs, outs, lses, states)
        self.groups, self.in_place = self.sink.groups, self.sink.in_place

    def held(self, i: int, r: int, t: int):
        n = rows_of(self.run, self.run.schedule.source(r, t, self.run.schedule.world_size), self.ks[i])
        return self.bufs.view(self.ring.cur[i], n), n

    def zeros(self, g: int, i: int) -> torch.Tensor:
        return self.sink.zeros(g, self.ks[i].device)

    def empty(self, g: int, i: int) -> torch.Tensor:
        return self.sink.empty(g, self.ks[i].device)

    def compute(self, g: int, i: int, r: int, t: int, held, dst):
        (k, v), n = held
        return self.sink.compute(g, i, self.run.schedule.blocks(r, t), k, v, n, dst)

    def fold(self, i: int, mine, buf: torch.Tensor, held) -> None:
        self.sink.fold(i, mine, buf, held[1])

    def local(self) -> list[torch.Tensor]:
        return self.sink.dq()  # does not need the last dK/dV hops: runs while they travel

    def results(self, local, accs: list[list[torch.Tensor]]):
        rows = [rows_of(self.run, r, k) for r, k in zip(self.run.ranks, self.ks)]
        return (local, *self.sink.dkv(accs, rows))


class _PieceRing:
    """The travelling q sides as tuples of pieces: ``cur`` starts as each rank's own (never received
    into: a spare buffer takes their place after the first hop), ``nxt`` receives, ``swap``."""

    def __init__(self, own: list[tuple[torch.Tensor, ...]]) -> None:
        def empty(pieces):
            return tuple(torch.empty_like(p) for p in pieces)

        self.cur = own
        self.nxt = [empty(p) for p in own]
        self.spare = [empty(p) for p in own]

    def swap(self) -> None:
        old = self.cur if self.spare is None else self.spare
        self.cur, self.nxt, self.spare = self.nxt, old, None


class QSide:
    """The q side travels (one hop back a step) with its dq accumulator in q-head groups, added into
    in place; K/V and their dK/dV accumulators stay home (see the module doc). ``states``: the
    local ranks' AccumBackward states; ``layouts[g]``: the dK/dV layout of kv-head group g
    (``heads[g]`` its kv heads)."""

    in_place = True

    def __init__(self, run: RingRun, states: list, layouts: list, heads: list[tuple[int, int]], qs, ks, vs) -> None:
        self.run, self.states, self.layouts, self.qs, self.ks, self.vs = run, states, layouts, qs, ks, vs
        self.kv_heads, self.groups = heads, len(heads)
        sched = run.schedule
        world = sched.world_size
        self.step = world - 1
        q_per = qs[0].shape[2] // ks[0].shape[2]
        self.q_heads = [(a * q_per, b * q_per) for a, b in heads]
        self.ring = _PieceRing([st.travel() for st in states])
        self.dkv = [[torch.zeros(lay.numel, dtype=_layout_dtype(lay), device=k.device) for k in ks] for lay in layouts]
        self.visitor = {}  # (rank, step) -> the rank whose q side it holds: source(visitor, step) = rank
        for r in run.ranks:
            for t in range(run.active_steps):
                j = (r + t) % world
                if sched.source(j, t, world) != r:
                    j = next(x for x in range(world) if sched.source(x, t, world) == r)
                self.visitor[(r, t)] = j

    def held(self, i: int, r: int, t: int):
        return self.ring.cur[i], self.visitor[(r, t)]

    def zeros(self, g: int, i: int) -> torch.Tensor:
        return self.states[i].dq_zeros(*self.q_heads[g])

    def empty(self, g: int, i: int) -> torch.Tensor:
        return self.states[i].dq_empty(*self.q_heads[g])

    def compute(self, g: int, i: int, r: int, t: int, held, dst):
        pieces, j = held
        blocks = self.run.schedule.blocks(j, t)
        if not blocks:
            return None
        state = self.states[i].visiting(pieces, *self.q_heads[g], dst)
        a, b = self.kv_heads[g]
        k_g, v_g = self.ks[i].narrow(2, a, b - a), self.vs[i].narrow(2, a, b - a)
        rows = rows_of(self.run, r, self.ks[i])
        for blk in blocks:
            blk.accumulate(state, k_g, v_g, self.run.spec, *self.layouts[g].cols(self.dkv[g][i], rows, blk.k0, blk.k1))
        return None

    def fold(self, i: int, mine, buf: torch.Tensor, held) -> None:
        pass  # the kernels added into the travelling buffer itself

    def local(self):
        """dk, dv of the K/V this rank kept (no hop needed: runs while the last dq hops travel)."""
        dks, dvs = [], []
        for i, r in enumerate(self.run.ranks):
            k, v = self.ks[i], self.vs[i]
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # contiguous, whatever k's strides
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            n = rows_of(self.run, r, k)
            for g, (a, b) in enumerate(self.kv_heads):
                _write_dkv(self.layouts[g], self.dkv[g][i], n, dk.narrow(2, a, b - a), dv.narrow(2, a, b - a))
            dks.append(dk)
            dvs.append(dv)
        return dks, dvs

    def results(self, local, accs: list[list[torch.Tensor]]):
        dqs = [st.dq_from([accs[g][i] for g in range(self.groups)], self.q_heads, q.dtype)
               for i, (st, q) in enumerate(zip(self.states, self.qs))]
        return (dqs, *local)


def _layout_dtype(layout) -> torch.dtype:
    bufs = getattr(layout, "bufs", None)  # DenseGrads: its KVBuffers' dtype; FA4's tile layout: fp32
    return torch.float32 if bufs is None else bufs.dtype


_Q_NEEDS = ("travel", "visiting", "dq_zeros", "dq_empty", "dq_from", "heads")


def _q_capable(run: RingRun, qs, ks, states: list) -> bool:
    """Dense, every rank the same rows, an fp32 dK/dV wire setting (the q side's accumulators never
    round), AccumBackward states offering the q-side protocol."""
    return qs[0].dim() == 4 and run.dkv_wire_fp32 and getattr(run.schedule, "rows", None) is None \
        and all(st is not None and all(hasattr(st, m) for m in _Q_NEEDS) for st in states)


def _q_side(run: RingRun, states: list, qs, ks, vs) -> QSide:
    h, h_kv = qs[0].shape[2], ks[0].shape[2]
    n = run.dkv_groups if h_kv % run.dkv_groups == 0 else 1
    per, q_per = h_kv // n, h // h_kv
    heads = [(g * per, (g + 1) * per) for g in range(n)]
    cap = cap_of(run, ks[0])
    layouts = []
    for a, b in heads:
        k_g, v_g = ks[0].narrow(2, a, b - a), vs[0].narrow(2, a, b - a)
        layouts.append(_grad_layout(run, [states[0].heads(a * q_per, b * q_per)], k_g,
                                    KVBuffers(k_g, v_g, cap, dtype=acc_dtype(qs[0]))))
    return QSide(run, states, layouts, heads, qs, ks, vs)


def hop_bytes(run: RingRun, qs, ks, vs, states: list | None = None) -> dict[str, int]:
    """Bytes one hop moves per rank: ``kv`` (K, V and their dK/dV accumulators on the wire) and,
    where ``states`` can run the q side, ``q`` (its travelling pieces and fp32 dq)."""
    wire = (acc_dtype(ks[0]) if run.dkv_wire_fp32 else ks[0].dtype).itemsize
    out = {"kv": (ks[0].numel() + vs[0].numel()) * (ks[0].element_size() + wire)}
    if states is not None and _q_capable(run, qs, ks, states):
        dq = states[0].dq_empty(0, qs[0].shape[2])
        out["q"] = sum(p.numel() * p.element_size() for p in states[0].travel()) + dq.numel() * dq.element_size()
    return out


def backward_side(run: RingRun, douts, qs, ks, vs, outs, lses):
    """The side this backward runs (every rank alike; see the module doc)."""
    choice = bwd_ring()
    states = _accum_states(run, douts, qs, outs, lses)
    if choice != "kv":
        sizes = hop_bytes(run, qs, ks, vs, states)
        if "q" in sizes and (choice == "q" or sizes["q"] < sizes["kv"]):
            return _q_side(run, states, qs, ks, vs)
    return KVSide(run, douts, qs, ks, vs, outs, lses, states)
