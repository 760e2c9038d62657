"""The q ring backward side: each rank keeps its K/V and their dK/dV accumulators; the q side of
every rank travels to the *previous* rank each step (q, dout and what the backend's backward
state derives from them: FA4's dpsum and lse * log2 e), with its fp32 dq accumulator, in q-head
groups reduce-added into in place, home after the last step. Rank r at step t holds the q side
of rank j = r + t, whose K/V-ring schedule at step t has exactly this pair (source(j, t) = r), so
the schedule's blocks are used as they are."""

from __future__ import annotations

import torch

from ..memo import ViewMemo, numbered
from . import calls
from .accum_sink import aligned_numel, grad_layout, write_dkv
from .buffers import KVBuffers
from .run import RingRun, acc_dtype, cap_of, rows_of

__all__ = ["QSide", "make_q_side", "q_side_possible"]


_ALIGN = 256  # bytes: a piece's offset in the flat buffer (every dtype's and FA4's 16-byte alignment)


class _QSideRing:
    """The travelling q sides. ``cur`` starts as each rank's own pieces (a tuple of the state's
    tensors, never received into); every receive lands in one flat byte buffer a rank whose typed
    views (:meth:`pieces`) have the own pieces' shapes and dtypes, contiguous, at 256-byte aligned
    offsets. So the first hop moves the pieces one by one and every later hop the flat buffer as
    one transfer (one copy, or one NCCL send / receive pair), as :class:`~.buffers.KVRing` does
    for K/V; a spare buffer takes the own pieces' place after the first hop. Every local rank's
    pieces have the same shapes (the q side runs only where every rank holds the same rows)."""

    def __init__(self, own: list[tuple[torch.Tensor, ...]]) -> None:
        self.layout, at = [], 0
        for p in own[0]:
            self.layout.append((at, p.numel() * p.element_size(), p.dtype, p.shape))
            at += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        device = own[0][0].device
        self.cur: list = list(own)
        self.nxt = [torch.empty(at, dtype=torch.uint8, device=device) for _ in own]
        self.spare: list | None = [torch.empty(at, dtype=torch.uint8, device=device) for _ in own]
        self.hops = 0
        self._views = ViewMemo()

    def pieces(self, x) -> tuple[torch.Tensor, ...]:
        """The pieces of ``x``: an own tuple as it is, a flat buffer as its typed views."""
        return x if isinstance(x, tuple) else self._views.get((x,), "pieces", self._typed, x)

    def _typed(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(flat.narrow(0, at, n).view(dtype).view(shape) for at, n, dtype, shape in self.layout)

    def send_recv(self) -> tuple[list, list]:
        if self.hops == 0:
            return self.cur, [self.pieces(n) for n in self.nxt]
        return self.cur, self.nxt

    def swap(self) -> None:
        old = self.cur if self.spare is None else self.spare
        self.cur, self.nxt, self.spare = self.nxt, old, None
        self.hops += 1


class QSide:
    """The q side travels (one hop back a step) with its dq accumulator in q-head groups, added into
    in place; K/V and their dK/dV accumulators stay home (a :class:`~.protocols.BackwardSide`).
    ``states``: the local ranks' AccumBackward states; ``layouts[g]``: the dK/dV layout of kv-head
    group g (``heads[g]`` its kv heads); ``inputs``: per-rank (qs, ks, vs)."""

    in_place = True

    def __init__(self, run: RingRun, states: list, layouts: list, heads: list[tuple[int, int]],
                 inputs: tuple[list, list, list]) -> None:
        qs, ks, vs = inputs
        self.run, self.states, self.layouts, self.qs, self.ks, self.vs = run, states, layouts, qs, ks, vs
        self.kv_heads, self.groups = heads, len(heads)
        self.views = ViewMemo()  # head groups and block rows of the home K/V
        # travelled blocks' replays (AccumBackward.replay) by group, home K/V class, visiting state class
        # and block: a visiting q side after a hop sits in buffers laid out alike on every rank and step
        self.replays: dict[tuple, object] = {}
        self.kv_class = numbered([(k.shape, k.stride(), k.dtype, k.data_ptr() % 16, v.shape, v.stride(),
                                    v.data_ptr() % 16) for k, v in zip(ks, vs)])
        sched = run.schedule
        world = sched.world_size
        self.step = world - 1
        q_per = qs[0].shape[2] // ks[0].shape[2]
        self.q_heads = [(a * q_per, b * q_per) for a, b in heads]
        self.ring = _QSideRing([st.travel() for st in states])
        self.dkv = _home_accumulators(layouts, ks)
        self.visitor = {}  # (rank, step) -> the rank whose q side it holds: source(visitor, step) = rank
        for r in run.ranks:
            for t in range(run.active_steps):
                j = (r + t) % world
                if sched.source(j, t, world) != r:
                    j = next(x for x in range(world) if sched.source(x, t, world) == r)
                self.visitor[(r, t)] = j

    def held(self, i: int, r: int, t: int):
        return self.ring.pieces(self.ring.cur[i]), self.visitor[(r, t)]

    def accumulators(self, i: int, zeroed: bool) -> list[torch.Tensor]:
        make = self.states[i].dq_zeros if zeroed else self.states[i].dq_empty
        return [make(*heads) for heads in self.q_heads]

    def compute(self, g: int, i: int, r: int, t: int, held, dst):
        pieces, j = held
        blocks = self.run.schedule.blocks(j, t)
        if not blocks:
            return None
        # a fresh state every step: the pieces hold another rank's q side after each hop, and a
        # backend may keep what it derived from a state's tensors (FA4 copies the lse rows of a
        # block whose rows it pads), so a state must never outlive its pieces' contents
        state = self.states[i].visiting(pieces, *self.q_heads[g], dst)
        a, b = self.kv_heads[g]
        k, v = self.ks[i], self.vs[i]
        k_g, v_g = self.views.get((k, v), ("heads", a, b), calls.kv_heads, k, v, a, b)
        rows = rows_of(self.run, r)
        cls = (g, self.kv_class[i], state.replay_class()) if t > 0 else None  # step 0: the rank's own q side
        for blk in blocks:
            kv = self.views.get((k_g, v_g), ("rows", blk.k0, blk.k1), calls.kv_rows, blk, k_g, v_g)
            dk, dv = self.layouts[g].cols(self.dkv[g][i], rows, blk.k0, blk.k1)
            replay = None if cls is None else self.replays.get((cls, blk, rows))
            if replay:
                replay(state, kv[0], kv[1], dk, dv)
                continue
            calls.accumulate(state, blk, kv, self.run.spec, dk, dv)
            if cls is not None and replay is None:
                self.replays[(cls, blk, rows)] = calls.accumulate_replay(state, blk, kv, self.run.spec, dk, dv) or False
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
            n = rows_of(self.run, r)
            if self.groups == 1:
                write_dkv(self.layouts[0], self.dkv[0][i], n, dk, dv)
            else:  # groups of equal width, in order: one pass for all where the layout can
                self.layouts[0].write_groups([grp[i] for grp in self.dkv], n, dk, dv)
            dks.append(dk)
            dvs.append(dv)
        return dks, dvs

    def results(self, local, accs: list[list[torch.Tensor]]):
        dqs = [st.dq_from([accs[g][i] for g in range(self.groups)], self.q_heads, q.dtype)
               for i, (st, q) in enumerate(zip(self.states, self.qs))]
        return (dqs, *local)


def q_side_possible(run: RingRun, qs, states: list) -> bool:
    """Dense inputs with the same rows on every rank (the q sides travel as they are), an fp32
    dK/dV wire (the q side's accumulators never round) and an AccumBackward state on every local
    rank. The same answer on every rank: the schedule is global."""
    sched = run.schedule
    even = all(sched.rows(r) == sched.max_rows for r in range(sched.world_size))
    return qs[0].dim() == 4 and even and run.options.dkv_wire_fp32 and all(st is not None for st in states)


def make_q_side(run: RingRun, states: list, qs, ks, vs) -> QSide:
    """The q side in ``dkv_groups`` kv-head groups (one where the count does not divide the kv heads)."""
    h, h_kv = qs[0].shape[2], ks[0].shape[2]
    n = run.options.dkv_groups if h_kv % run.options.dkv_groups == 0 else 1
    per, q_per = h_kv // n, h // h_kv
    heads = [(g * per, (g + 1) * per) for g in range(n)]
    cap = cap_of(run)
    layouts = []
    for a, b in heads:
        k_g, v_g = ks[0].narrow(2, a, b - a), vs[0].narrow(2, a, b - a)
        layouts.append(grad_layout(run, [states[0].heads(a * q_per, b * q_per)], k_g,
                                   KVBuffers(k_g, v_g, cap, dtype=acc_dtype(qs[0]))))
    return QSide(run, states, layouts, heads, (qs, ks, vs))


def _home_accumulators(layouts: list, ks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``[g][i]``: kv-head group g's zeroed dK/dV accumulator of local rank i, all views of one buffer
    zeroed in one launch, a rank's groups evenly spaced (each on a 256-byte boundary: one pass writes
    them out, :meth:`~ringfa4.kernels.spec.KVGradLayout.write_groups`); buffers of their own where the
    groups' layouts differ in size or dtype."""
    first = layouts[0]
    if any(lay.numel != first.numel or lay.dtype != first.dtype for lay in layouts):
        return [[torch.zeros(lay.numel, dtype=lay.dtype, device=k.device) for k in ks] for lay in layouts]
    span, G = aligned_numel(first.numel, first.dtype), len(layouts)
    flat = torch.zeros(len(ks) * G * span, dtype=first.dtype, device=ks[0].device)
    return [[flat.narrow(0, (i * G + g) * span, first.numel) for i in range(len(ks))] for g in range(G)]
