"""The one ring loop: runs a :class:`RingSchedule` forward and backward for the ranks this process
holds (one rank: distributed; all P: simulated), with the transport injected.

Forward: K/V of each rank travel in a double buffer (step 0 reads and sends the inputs
themselves); the hop for step t+1 is posted before step t's blocks run; each block merges into
the fp32 (out, lse) inside the attention kernel (``forward_merge``), or its output lands in a
scratch and a merge kernel folds it in, or (``slots`` = n) it goes to n slots that one combine
folds into the accumulator every n blocks.
Backward: per block, the backend backward with the *global* merged out and lse; one loop over the
side :mod:`.bwd_sides` picks: K/V travel with their fp32 dK/dV (dq accumulates locally), or the
q side travels with its fp32 dq (K/V and dK/dV stay); the travelling accumulators go in head
groups that the kernels add into in place where the backend can and reach their owner after the
last active step (see :func:`ring_backward`); one cast at the end. Steps after the last one any
rank needs are not run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..kernels import AttnSpec, BlockBackend
from ..kernels.cute_combine import combine_lse_
from ..kernels.merge import planes_lse
from .ring import RingSchedule
from .ring_buffers import KVBuffers, KVRing, acc_dtype, cap_of, lse_shape, rows_of
from .transport import Transport

__all__ = ["ExactLse", "RingRun", "dkv_groups", "dkv_wire_fp32", "epilogue_merge", "fp32_grads", "fp32_partials",
           "ring_backward", "ring_forward", "ring_slots"]


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
    slots: int = 0  # 0: merge each block into the accumulator; n > 0: keep n block outputs, combine once
    fp32_partials: bool = False  # block outputs in fp32 (no rounding to q's dtype before the merge)
    dkv_wire_fp32: bool = True  # dK/dV accumulate and travel in fp32 (False: in k's dtype, half the bytes)
    fp32_grads: bool = False  # block gradients never rounded to the inputs' dtype (backend.begin_backward)
    epilogue_merge: bool = True  # blocks merge inside the attention kernel (backend.forward_merge) where offered
    dkv_groups: int = 2  # kv-head groups dK/dV travel in, added into in place where the backend can

    @property
    def active_steps(self) -> int:
        """Steps up to the last one any rank has work in (later K/V is never needed)."""
        return active_steps(self.schedule)


def fp32_partials(device: torch.device | None = None) -> bool:
    """``RINGFA4_FP32_PARTIALS``: ``1`` makes 16-bit blocks hand back fp32 outputs (FA4: our
    fp32-epilogue forward), so no rounding happens between ring steps; ``auto`` (default) does so
    except on CUDA devices newer than Hopper (the sm100 fp32 forward compiles, but has not run on a
    GPU yet); ``0`` rounds each block output to q's dtype. On the H200 at 64k, P = 8 it cost nothing
    measurable, and cut out error at P = 32 from 1.13x to 0.98x one full FA4 call's."""
    raw = os.environ.get("RINGFA4_FP32_PARTIALS", "auto")
    if raw not in ("0", "1", "auto"):
        raise ValueError(f"RINGFA4_FP32_PARTIALS must be 0, 1 or auto, got {raw!r}")
    if raw == "auto":
        return not (device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10)
    return raw == "1"


def fp32_grads(device: torch.device | None = None) -> bool:
    """``RINGFA4_FP32_GRADS``: ``1`` makes ring backwards keep every block's dq / dk / dv in fp32
    through the backend's ``begin_backward`` where it offers one for the call (FA4 on sm90 / sm100:
    its fp32 accumulators carried across steps, dK/dV in its tile layout, one pre- and postprocess
    per backward; reference: its compute dtype); with ``RINGFA4_DKV_WIRE=input`` each step's fp32
    dK/dV is added into the travelling k-dtype buffer (one rounding a hop). ``auto`` (default): the
    same, except on CUDA devices newer than Hopper (FA4's sm100 accumulating backward compiles, but
    has not run on a GPU yet). ``0``: each block's gradients come back in the inputs' dtype and are
    summed in fp32. On the H200 (64k, P = 8, MHA) both cost the same; at P = 32 dq / dk / dv went
    from 1.13 / 1.22 / 1.22x to 1.00x one full FA4 call's error."""
    raw = os.environ.get("RINGFA4_FP32_GRADS", "auto")
    if raw not in ("0", "1", "auto"):
        raise ValueError(f"RINGFA4_FP32_GRADS must be 0, 1 or auto, got {raw!r}")
    if raw == "auto":
        return not (device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10)
    return raw == "1"


def epilogue_merge() -> bool:
    """``RINGFA4_EPILOGUE_MERGE``: ``1`` (default) makes fp32 ring forwards merge each block inside
    the attention kernel's epilogue where the backend offers ``forward_merge`` (FA4 on sm90:
    kernels/fa4_merge.py), so no block output is written and read back; elsewhere the blocks go
    to a scratch that a merge kernel folds in, as with ``0``. On the H200 (64k, P = 8, causal
    zigzag) the forward's overhead over FA4's calls alone went from +17.6% to +13.6%, with the same
    error at P = 8 and 32."""
    raw = os.environ.get("RINGFA4_EPILOGUE_MERGE", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"RINGFA4_EPILOGUE_MERGE must be 0 or 1, got {raw!r}")
    return raw == "1"


def dkv_wire_fp32() -> bool:
    """``RINGFA4_DKV_WIRE``: ``fp32`` (default) accumulates dK/dV in fp32 as they travel the ring;
    ``input`` keeps them in k's dtype (half the bytes on the wire, one rounding per hop: the error
    grows with P, see benchmarks/ring_precision.py)."""
    raw = os.environ.get("RINGFA4_DKV_WIRE", "fp32")
    if raw not in ("fp32", "input"):
        raise ValueError(f"RINGFA4_DKV_WIRE must be 'fp32' or 'input', got {raw!r}")
    return raw == "fp32"


def ring_slots() -> int:
    """Forward merge mode from ``RINGFA4_RING_SLOTS``: 0 (default) merges every block at once;
    n > 0 keeps n block outputs and combines them in one pass (see :class:`_SlotCombine`)."""
    raw = os.environ.get("RINGFA4_RING_SLOTS", "0")
    if not raw.isdigit():
        raise ValueError(f"RINGFA4_RING_SLOTS must be an int >= 0, got {raw!r}")
    return int(raw)


def active_steps(schedule) -> int:
    """Computed once per schedule object (kept on it, so it dies with it)."""
    known = schedule.__dict__.get("_active_steps")
    if known is None:
        s = schedule
        last = [t for t in range(s.num_steps) for r in range(s.world_size) if s.blocks(r, t)]
        known = max(last) + 1 if last else 1
        object.__setattr__(schedule, "_active_steps", known)
    return known



def ring_forward(run: RingRun, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: ``out`` like q (``(b, s, h, d)`` or packed ``(t, h, d)``) and fp32 ``lse``
    (``(b, h, s)`` or ``(h, t)``)."""
    q0 = qs[0]
    dv = vs[0].shape[-1]
    acc = acc_dtype(q0)
    lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
    bufs = KVBuffers(ks[0], vs[0], cap_of(run, ks[0]))
    kv = KVRing(run, bufs, ks, vs)
    part = acc if run.fp32_partials else None  # block output dtype (None: q's)
    can_merge = getattr(run.backend, "can_forward_merge", None)  # merging inside the kernel (FA4 sm90)
    fused = run.epilogue_merge and run.fp32_partials and can_merge is not None and can_merge(q0, vs[0]) \
        and acc != q0.dtype and q0.dim() == 4 and not run.slots
    outs = [torch.empty(q.shape[:-1] + (dv,), dtype=acc, device=q.device) if fused  # see _EpilogueMerge
            else torch.zeros(q.shape[:-1] + (dv,), dtype=acc, device=q.device) for q in qs]
    lses = [torch.empty(lse_shape(q), dtype=lse_dtype, device=q.device) if fused  # written by finish
            else torch.full(lse_shape(q), -math.inf, dtype=lse_dtype, device=q.device) for q in qs]
    merge = (_EpilogueMerge if fused else _SlotCombine if run.slots else _StepMerge)(
        qs, outs, lses, dv, lse_dtype, run.slots, part)
    steps, world = run.active_steps, run.schedule.world_size
    for t in range(steps):
        handle = run.transport.shift(kv.cur, kv.nxt, 1) if t + 1 < steps else None
        for i, r in enumerate(run.ranks):
            k_t, v_t = bufs.view(kv.cur[i], rows_of(run, run.schedule.source(r, t, world), ks[i]))
            rows = rows_of(run, r, qs[i])
            for blk in run.schedule.blocks(r, t):
                merge.block(run, i, blk, qs[i], k_t, v_t, rows)
        if handle is not None:
            run.transport.wait(handle)
            kv.swap()
    merge.finish()
    return [o.to(q.dtype) for o, q in zip(outs, qs)], lses


class ExactLse:
    """The running log-sum-exp of each rank's blocks in float64, next to the fp32 accumulator the
    merges use for their weights. The fp32 merges round their lse once per block (at P = 32 ring
    lse error came to 1.3x one full call's on the H200, 2.1x with the CPU reference); this one is
    rounded once, when ``finish`` writes it into ``lses``. One small kernel per block."""

    def __init__(self, lses: list[torch.Tensor]) -> None:
        self.lses = lses
        self.exact = [None if l.dtype == torch.float64 else torch.full_like(l, -math.inf, dtype=torch.float64)
                      for l in lses]

    def add(self, i: int, blk, l: torch.Tensor) -> None:
        if self.exact[i] is not None:
            blk.add_lse(self.exact[i], l)

    def finish(self) -> None:
        for lse, exact in zip(self.lses, self.exact):
            if exact is not None:
                lse.copy_(exact)


class _Merge:
    """A forward merge strategy: ``block`` runs one block of a rank and folds it in; ``finish``."""

    def block(self, run: RingRun, i: int, blk, q, k, v, rows: int) -> None:
        o, l = blk.forward(run.backend, q, k, v, run.spec, *self.target(i))
        self.add(i, blk, o, l, rows)


class _StepMerge(_Merge):
    """Each block's output lands in one scratch and merges into the fp32 accumulator at once (the
    first block over all rows is copied instead)."""

    def __init__(self, qs, outs, lses, dv, lse_dtype, _slots, part_dtype) -> None:
        self.outs, self.lses, self.qs = outs, lses, qs
        self.dv, self.dtypes = dv, (lse_dtype, part_dtype)
        self.by_shape: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # simulated ranks share one
        self.fresh = [True] * len(qs)
        self.exact = ExactLse(lses)

    def target(self, i: int):
        """The block-output scratch of rank i, made at its first use."""
        q = self.qs[i]
        if q.shape not in self.by_shape:
            lse_dtype, part_dtype = self.dtypes
            self.by_shape[q.shape] = (q.new_empty(q.shape[:-1] + (self.dv,), dtype=part_dtype or q.dtype),
                                      q.new_empty(lse_shape(q), dtype=lse_dtype))
        return self.by_shape[q.shape]

    def add(self, i: int, blk, o, l, rows: int) -> None:
        if self.fresh[i] and blk.covers(rows):
            self.outs[i].copy_(o)
            self.lses[i].copy_(l)
        else:
            blk.merge(self.outs[i], self.lses[i], o, l)
        self.fresh[i] = False
        self.exact.add(i, blk, l)

    def finish(self) -> None:
        self.exact.finish()


class _EpilogueMerge(_StepMerge):
    """Each block merges into the fp32 accumulator inside the attention kernel (the backend's
    ``forward_merge``): per rank the running lse lives in ``(b, h, 2, s)`` planes (M, S), with
    lse = M + log S taken once in ``finish`` (:func:`~ringfa4.kernels.merge.merge_planes_`). A block
    the backend declines (returns None) runs into a scratch and merges into the same planes in
    torch.

    The accumulator and planes start uninitialized: a rank whose first block covers all its rows
    (every causal ring's step 0) stores that block's output and lse straight into them (M = lse,
    S = 1, which a later merge weighs as exp(lse - M'), -inf rows included), so neither is zeroed
    nor read back; otherwise they are zeroed (M = -inf, S = 0) before the first merge."""

    def __init__(self, qs, outs, lses, dv, lse_dtype, _slots, part_dtype) -> None:
        self.outs, self.lses, self.qs = outs, lses, qs
        self.dv, self.dtypes = dv, (lse_dtype, part_dtype)
        self.by_shape: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # declined blocks' scratch
        self.planes = [torch.empty(q.shape[0], q.shape[2], 2, q.shape[1], dtype=torch.float32, device=q.device)
                       for q in qs]
        self.fresh = [True] * len(qs)

    def _start(self, i: int) -> None:
        """Rank i's accumulator zeroed and its planes at (M, S) = (-inf, 0)."""
        self.outs[i].zero_()
        self.planes[i][:, :, 0] = -math.inf
        self.planes[i][:, :, 1] = 0.0
        self.fresh[i] = False

    def block(self, run: RingRun, i: int, blk, q, k, v, rows: int) -> None:
        if self.fresh[i] and blk.covers(rows):
            m = self.planes[i][:, :, 0]
            blk.place(self.outs[i], m, *blk.forward(run.backend, q, k, v, run.spec, self.outs[i], m))
            self.planes[i][:, :, 1] = 1.0
            self.fresh[i] = False
            return
        if self.fresh[i]:
            self._start(i)
        if blk.forward_merge(run.backend, q, k, v, run.spec, self.outs[i], self.planes[i]) is None:
            o, l = blk.forward(run.backend, q, k, v, run.spec, *self.target(i))
            blk.merge_planes(self.outs[i], self.planes[i], o, l)

    def finish(self) -> None:
        for i, (lse, planes) in enumerate(zip(self.lses, self.planes)):
            if self.fresh[i]:  # a rank without blocks: out 0, lse -inf
                self._start(i)
            planes_lse(planes, out=lse)


class _SlotCombine(_Merge):
    """Deferred correction: block outputs go to ``n`` slots (rows a slot's block did not write
    keep lse = -inf); every n blocks one combine reads the slots once and updates the
    accumulator: per block about 2 + 8/n bytes of traffic an element instead of a merge's 10."""

    def __init__(self, qs, outs, lses, dv, lse_dtype, slots: int, part_dtype) -> None:
        self.outs, self.lses, self.n = outs, lses, slots
        self.parts = [q.new_empty((slots,) + q.shape[:-1] + (dv,), dtype=part_dtype or q.dtype) for q in qs]
        self.lse_parts = [torch.full((slots,) + lse_shape(q), -math.inf, dtype=lse_dtype, device=q.device)
                          for q in qs]
        self.used = [0] * len(qs)
        self.exact = ExactLse(lses)

    def target(self, i: int):
        u = self.used[i]
        return self.parts[i][u], self.lse_parts[i][u]

    def add(self, i: int, blk, o, l, rows: int) -> None:
        u = self.used[i]
        blk.place(self.parts[i][u], self.lse_parts[i][u], o, l)
        self.exact.add(i, blk, l)
        self.used[i] = u + 1
        if self.used[i] == self.n:
            self._combine(i)

    def _combine(self, i: int) -> None:
        u = self.used[i]
        if u:
            combine_lse_(self.outs[i], self.lses[i], self.parts[i], self.lse_parts[i], u)
            self.lse_parts[i][:u].fill_(-math.inf)
            self.used[i] = 0

    def finish(self) -> None:
        for i in range(len(self.outs)):
            self._combine(i)
        self.exact.finish()


def ring_backward(run: RingRun, douts: list[torch.Tensor], qs: list[torch.Tensor], ks: list[torch.Tensor],
                  vs: list[torch.Tensor], outs: list[torch.Tensor], lses: list[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: dq, dk, dv in the inputs' dtypes (accumulated in fp32).

    One loop for both sides of :mod:`.bwd_sides`: the travelling data (K/V, or the q side) hops
    ``side.step`` ranks a step, posted before the step's blocks run; the travelling fp32
    accumulators (dK/dV, or dq) go in ``side.groups`` pieces (head groups). Where the kernels add
    into the travelling buffer itself (``side.in_place``), each group waits for its piece's hop from
    the step before, runs its blocks into it and sends it on, so one group's hop hides behind the
    other groups' blocks; otherwise a step's blocks go to a scratch (or come back per block) and
    are added after the hop arrived. After the last step the accumulators go to their owners."""
    from .bwd_sides import backward_side

    steps, world = run.active_steps, run.schedule.world_size
    side = backward_side(run, douts, qs, ks, vs, outs, lses)
    local = range(len(run.ranks))
    acc_cur = [[side.zeros(g, i) for i in local] for g in range(side.groups)]
    acc_nxt = [[side.empty(g, i) for i in local] for g in range(side.groups)]
    hops: list = [None] * side.groups
    home = -(steps - 1) * side.step % world  # after the last step: back to the owner
    for t in range(steps):
        data_hop = run.transport.shift(side.ring.cur, side.ring.nxt, side.step) if t + 1 < steps else None
        held = [side.held(i, r, t) for i, r in enumerate(run.ranks)]
        offset = side.step if t + 1 < steps else home
        for g in range(side.groups):
            if side.in_place and hops[g] is not None:  # this group's accumulators, from the ranks before us
                run.transport.wait(hops[g])
                acc_cur[g], acc_nxt[g] = acc_nxt[g], acc_cur[g]
            made = [side.compute(g, i, r, t, held[i], acc_cur[g][i] if side.in_place else None)
                    for i, r in enumerate(run.ranks)]
            if not side.in_place and hops[g] is not None:
                run.transport.wait(hops[g])
                acc_cur[g], acc_nxt[g] = acc_nxt[g], acc_cur[g]
            for i, mine in enumerate(made):
                side.fold(i, mine, acc_cur[g][i], held[i])
            hops[g] = run.transport.shift(acc_cur[g], acc_nxt[g], offset) if offset else None
        if data_hop is not None:
            run.transport.wait(data_hop)
            side.ring.swap()
    mine = side.local()  # what never travelled: runs while the last hops do
    for g, hop in enumerate(hops):
        if hop is not None:
            run.transport.wait(hop)
            acc_cur[g] = acc_nxt[g]
    return side.results(mine, acc_cur)


def dkv_groups() -> int:
    """``RINGFA4_DKV_GROUPS``: the kv-head groups the ring backward's dK/dV travel in when the
    backend's AccumBackward adds into its own layout (FA4 on sm90). With n >= 2 (default 2) each
    group's kernels reduce-add straight into the travelling buffer once that group's hop has
    arrived, so a step adds no scratch, zeroing or add pass and a group's hop hides behind the
    other groups' blocks; ``1``: one buffer, each step's blocks into a zeroed scratch added after the
    hop. Also runs as one buffer through the scratch: a count that does not divide the kv heads,
    dK/dV on a k-dtype wire, blocks off the layout's alignment (the dense layout), a backend state
    without ``heads`` / ``kv_layout``."""
    raw = os.environ.get("RINGFA4_DKV_GROUPS", "2")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"RINGFA4_DKV_GROUPS must be an int >= 1, got {raw!r}")
    return int(raw)
