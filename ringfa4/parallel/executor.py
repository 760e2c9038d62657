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

from ..kernels import AttnSpec, BlockBackend, merge_lse_
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

    schedule: RingSchedule
    ranks: tuple[int, ...]
    backend: BlockBackend
    spec: AttnSpec
    transport: Transport

    @property
    def active_steps(self) -> int:
        s = self.schedule
        last = [t for t in range(s.num_steps) for r in range(s.world_size) if s.blocks(r, t)]
        return max(last) + 1 if last else 1

    def block_spec(self, block) -> AttnSpec:
        return self.spec.replace(causal=block.causal, window=block.window)


def _pack(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    buf = torch.empty(k.numel() + v.numel(), dtype=dtype or k.dtype, device=k.device)
    buf[: k.numel()].view_as(k).copy_(k)
    buf[k.numel():].view_as(v).copy_(v)
    return buf


def _unpack(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[: k.numel()].view(k.shape), buf[k.numel():].view(v.shape)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ring_forward(run: RingRun, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: ``out (b, s_local, h, d)`` in q's dtype and fp32 ``lse (b, h, s_local)``."""
    q0 = qs[0]
    b, s, h, _ = q0.shape
    dv = vs[0].shape[-1]
    acc = _acc_dtype(q0)
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    cur = [_pack(k, v) for k, v in zip(ks, vs)]
    nxt = [torch.empty_like(c) for c in cur]
    outs = [torch.zeros(b, s, h, dv, dtype=acc, device=q0.device) for _ in qs]
    lses = [torch.full((b, h, s), -math.inf, dtype=lse_dtype, device=q0.device) for _ in qs]
    scratch_o = torch.empty(b, s, h, dv, dtype=q0.dtype, device=q0.device)
    scratch_l = torch.empty(b, h, s, dtype=lse_dtype, device=q0.device)
    steps = run.active_steps
    fresh = [True] * len(qs)  # accumulator still empty: a block over all rows is copied, not merged
    for t in range(steps):
        handle = run.transport.shift(cur, nxt, 1) if t + 1 < steps else None
        for i, r in enumerate(run.ranks):
            k_t, v_t = _unpack(cur[i], ks[i], vs[i])
            for blk in run.schedule.blocks(r, t):
                o, l = run.backend.forward(qs[i][:, blk.q0:blk.q1], k_t[:, blk.k0:blk.k1], v_t[:, blk.k0:blk.k1],
                                           run.block_spec(blk), out=scratch_o[:, blk.q0:blk.q1],
                                           lse=scratch_l[:, :, blk.q0:blk.q1])
                if fresh[i] and blk.q0 == 0 and blk.q1 == s:
                    outs[i].copy_(o)
                    lses[i].copy_(l)
                else:
                    merge_lse_(outs[i][:, blk.q0:blk.q1], lses[i][:, :, blk.q0:blk.q1], o, l)
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
    steps = run.active_steps
    world = run.schedule.world_size
    kv_cur = [_pack(k, v) for k, v in zip(ks, vs)]
    kv_nxt = [torch.empty_like(c) for c in kv_cur]
    dkv_cur = [torch.zeros(c.numel(), dtype=acc, device=c.device) for c in kv_cur]
    dkv_nxt = [torch.empty_like(c) for c in dkv_cur]
    dqs = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in qs]
    dkv_handle = None
    for t in range(steps):
        kv_handle = run.transport.shift(kv_cur, kv_nxt, 1) if t + 1 < steps else None
        grads = []
        for i, r in enumerate(run.ranks):
            k_t, v_t = _unpack(kv_cur[i], ks[i], vs[i])
            mine = []
            for blk in run.schedule.blocks(r, t):
                rows, cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
                dq, dk, dv = run.backend.backward(douts[i][:, rows], qs[i][:, rows], k_t[:, cols], v_t[:, cols],
                                                  outs[i][:, rows], lses[i][:, :, rows], run.block_spec(blk))
                dqs[i][:, rows] += dq
                mine.append((cols, dk, dv))
            grads.append(mine)
        if dkv_handle is not None:  # dK/dV of the K/V we hold, accumulated by the ranks before us
            run.transport.wait(dkv_handle)
            dkv_cur, dkv_nxt = dkv_nxt, dkv_cur
        for i, mine in enumerate(grads):
            dk_acc, dv_acc = _unpack(dkv_cur[i], ks[i], vs[i])
            for cols, dk, dv in mine:
                dk_acc[:, cols] += dk
                dv_acc[:, cols] += dv
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
    for i in range(len(qs)):
        dk, dv = _unpack(dkv_cur[i], ks[i], vs[i])
        dks.append(dk.to(ks[i].dtype))
        dvs.append(dv.to(vs[i].dtype))
    return [dq.to(q.dtype) for dq, q in zip(dqs, qs)], dks, dvs
