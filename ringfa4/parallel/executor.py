"""The one ring loop: runs a :class:`RingSchedule` forward and backward for the ranks this process
holds (one rank: distributed; all P: simulated), with the transport injected.

Forward: K/V of each rank live in one flat double buffer; the hop for step t+1 is posted before
step t's blocks run; block outputs land in a preallocated scratch and merge into fp32 (out, lse).
Backward: per block, the backend backward with the *global* merged out and lse; dq accumulates in
fp32 locally; dK/dV accumulate in fp32 and travel with the K/V, reaching their owner after the
last active step; one cast at the end. Steps after the last one any rank needs are not run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import AttnSpec, BlockBackend
from .ring import RingSchedule
from .transport import Transport

__all__ = ["RingRun", "ring_backward", "ring_forward"]


@dataclass(frozen=True)
class RingRun:
    """Everything one ring attention call needs besides the tensors.

    schedule: the per-step blocks; ranks: the ranks this process runs (rank order);
    backend: block kernels; spec: softmax_scale / softcap / deterministic (causal and window come
    from the schedule's blocks); transport: moves buffers between ranks.
    """

    schedule: RingSchedule  # or PackedRingSchedule: blocks(rank, step), source, world_size, rows
    ranks: tuple[int, ...]
    backend: BlockBackend
    spec: AttnSpec
    transport: Transport

    @property
    def active_steps(self) -> int:
        """Steps up to the last one any rank has work in (later K/V is never needed)."""
        return active_steps(self.schedule)


def active_steps(schedule) -> int:
    """Computed once per schedule object (kept on it, so it dies with it)."""
    known = schedule.__dict__.get("_active_steps")
    if known is None:
        s = schedule
        last = [t for t in range(s.num_steps) for r in range(s.world_size) if s.blocks(r, t)]
        known = max(last) + 1 if last else 1
        object.__setattr__(schedule, "_active_steps", known)
    return known



def _row_dim(x: torch.Tensor) -> int:
    """Token dim: 1 for dense (b, s, h, d), 0 for packed (t, h, d)."""
    return 0 if x.dim() == 3 else 1


def _with_rows(x: torch.Tensor, rows: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[_row_dim(x)] = rows
    return tuple(shape)


def _lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])


class _KVBuffers:
    """Flat buffers ``[k | v]`` sized for the largest rank (packed ranks hold different counts);
    ``view(buf, rows)`` gives (k, v) of a rank with ``rows`` tokens."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cap_rows: int, dtype: torch.dtype | None = None):
        self.k_shape, self.v_shape = _with_rows(k, cap_rows), _with_rows(v, cap_rows)
        self.k_cap = math.prod(self.k_shape)
        self.numel = self.k_cap + math.prod(self.v_shape)
        self.template = (k, v)
        self.dtype = dtype or k.dtype

    def empty(self, device) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=device)

    def zeros(self, device) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=device)

    def view(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.template
        ks, vs = _with_rows(k, rows), _with_rows(v, rows)
        return buf[: math.prod(ks)].view(ks), buf[self.k_cap: self.k_cap + math.prod(vs)].view(vs)

    def filled(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        buf = self.empty(k.device)
        kb, vb = self.view(buf, k.shape[_row_dim(k)])
        kb.copy_(k)
        vb.copy_(v)
        return buf


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows(run: RingRun, rank: int, x: torch.Tensor) -> int:
    rows = getattr(run.schedule, "rows", None)
    return rows(rank) if rows is not None else x.shape[_row_dim(x)]


def _cap(run: RingRun, x: torch.Tensor) -> int:
    return getattr(run.schedule, "max_rows", x.shape[_row_dim(x)])


def ring_forward(run: RingRun, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: ``out`` like q (``(b, s, h, d)`` or packed ``(t, h, d)``) and fp32 ``lse``
    (``(b, h, s)`` or ``(h, t)``)."""
    q0 = qs[0]
    dv = vs[0].shape[-1]
    acc = _acc_dtype(q0)
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    bufs = _KVBuffers(ks[0], vs[0], _cap(run, ks[0]))
    cur = [bufs.filled(k, v) for k, v in zip(ks, vs)]
    nxt = [bufs.empty(q0.device) for _ in cur]
    outs = [torch.zeros(q.shape[:-1] + (dv,), dtype=acc, device=q.device) for q in qs]
    lses = [torch.full(_lse_shape(q), -math.inf, dtype=lse_dtype, device=q.device) for q in qs]
    scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    steps, world = run.active_steps, run.schedule.world_size
    fresh = [True] * len(qs)  # accumulator still empty: a block over all rows is copied, not merged
    for t in range(steps):
        handle = run.transport.shift(cur, nxt, 1) if t + 1 < steps else None
        for i, r in enumerate(run.ranks):
            q = qs[i]
            if q.shape not in scratch:
                scratch[q.shape] = (q.new_empty(q.shape[:-1] + (dv,)), q.new_empty(_lse_shape(q), dtype=lse_dtype))
            k_t, v_t = bufs.view(cur[i], _rows(run, run.schedule.source(r, t, world), ks[i]))
            rows = _rows(run, r, q)
            for blk in run.schedule.blocks(r, t):
                o, l = blk.forward(run.backend, q, k_t, v_t, run.spec, *scratch[q.shape])
                if fresh[i] and blk.covers(rows):
                    outs[i].copy_(o)
                    lses[i].copy_(l)
                else:
                    blk.merge(outs[i], lses[i], o, l)
                fresh[i] = False
        if handle is not None:
            run.transport.wait(handle)
            cur, nxt = nxt, cur
    return [o.to(q.dtype) for o, q in zip(outs, qs)], lses


def ring_backward(run: RingRun, douts: list[torch.Tensor], qs: list[torch.Tensor], ks: list[torch.Tensor],
                  vs: list[torch.Tensor], outs: list[torch.Tensor], lses: list[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: dq, dk, dv in the inputs' dtypes (accumulated in fp32)."""
    acc = _acc_dtype(qs[0])
    steps, world = run.active_steps, run.schedule.world_size
    bufs = _KVBuffers(ks[0], vs[0], _cap(run, ks[0]))
    gbufs = _KVBuffers(ks[0], vs[0], _cap(run, ks[0]), dtype=acc)
    kv_cur = [bufs.filled(k, v) for k, v in zip(ks, vs)]
    kv_nxt = [bufs.empty(k.device) for k in ks]
    dkv_cur = [gbufs.zeros(k.device) for k in ks]
    dkv_nxt = [gbufs.empty(k.device) for k in ks]
    dqs = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in qs]
    dkv_handle = None
    for t in range(steps):
        kv_handle = run.transport.shift(kv_cur, kv_nxt, 1) if t + 1 < steps else None
        grads, held = [], []
        for i, r in enumerate(run.ranks):
            src_rows = _rows(run, run.schedule.source(r, t, world), ks[i])
            k_t, v_t = bufs.view(kv_cur[i], src_rows)
            mine = []
            for blk in run.schedule.blocks(r, t):
                dq, dk, dv = blk.backward(run.backend, douts[i], qs[i], k_t, v_t, outs[i], lses[i], run.spec)
                blk.add_dq(dqs[i], dq)
                mine.append((blk, dk, dv))
            grads.append(mine)
            held.append(src_rows)
        if dkv_handle is not None:  # dK/dV of the K/V we hold, accumulated by the ranks before us
            run.transport.wait(dkv_handle)
            dkv_cur, dkv_nxt = dkv_nxt, dkv_cur
        for i, mine in enumerate(grads):
            dk_acc, dv_acc = gbufs.view(dkv_cur[i], held[i])
            for blk, dk, dv in mine:
                blk.add_dkv(dk_acc, dv_acc, dk, dv)
        # pass the dK/dV on with the K/V; after the last step, straight to the owner
        offset = 1 if t + 1 < steps else (world - steps + 1) % world
        dkv_handle = run.transport.shift(dkv_cur, dkv_nxt, offset) if offset else None
        if kv_handle is not None:
            run.transport.wait(kv_handle)
            kv_cur, kv_nxt = kv_nxt, kv_cur
    if dkv_handle is not None:
        run.transport.wait(dkv_handle)
        dkv_cur = dkv_nxt
    dks, dvs = [], []
    for i, r in enumerate(run.ranks):
        dk, dv = gbufs.view(dkv_cur[i], _rows(run, r, ks[i]))
        dks.append(dk.to(ks[i].dtype))
        dvs.append(dv.to(vs[i].dtype))
    return [dq.to(q.dtype) for dq, q in zip(dqs, qs)], dks, dvs
