"""The ring forward: K/V of each rank travel in a double buffer (step 0 reads and sends the
inputs themselves); the hop for step t+1 is posted before step t's blocks run; each block merges
into the fp32 (out, lse) inside the attention kernel (the backend's ``forward_merge``: FA4 on
sm90), or its output lands in a scratch and a merge kernel folds it in."""

from __future__ import annotations

import math

import torch

from ...kernels.cute_finish import finish_planes_cute
from ...kernels.merge import planes_lse
from ...kernels.sinks import apply_sinks_
from ..memo import ViewMemo, numbered
from . import calls
from .buffers import KVBuffers, KVRing, own_kv, travelling
from .run import RingRun, acc_dtype, cap_of, direct_home, lse_shape, row_dim, rows_of, travel_of, with_rows

__all__ = ["EpilogueMerge", "ExactLse", "StepMerge", "forward_merge_strategy", "ring_forward"]


def ring_forward(run: RingRun, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: ``out`` like q (``(b, s, h, d)`` or packed ``(t, h, d)``) and fp32 ``lse``
    (``(b, h, s)`` or ``(h, t)``)."""
    bufs = KVBuffers(ks[0], vs[0], cap_of(run))
    kv = KVRing(bufs, *travelling(run, ks, vs))
    own = own_kv(run, bufs, kv, ks, vs)
    merge = forward_merge_strategy(run, qs, vs[0])
    steps, world = run.active_steps, run.schedule.world_size
    for t in range(steps):
        handle = run.transport.shift(*kv.send_recv(), 1) if t + 1 < steps else None
        for i, r in enumerate(run.ranks):
            # step 0: the rank's own K/V, whole documents included; later: what travelled here
            k_t, v_t = own[i] if t == 0 else bufs.view(kv.cur[i], travel_of(run, run.schedule.source(r, t, world)))
            rows = rows_of(run, r)
            for blk in run.schedule.blocks(r, t):
                merge.block(i, blk, qs[i], k_t, v_t, rows, t > 0)
        if handle is not None:
            run.transport.wait(handle)
            kv.swap()
    merge.finish(run.sinks)
    return merge.results(), merge.lses


def forward_merge_strategy(run: RingRun, qs: list[torch.Tensor], v: torch.Tensor) -> StepMerge:
    """How this forward folds its blocks in, decided once: inside the kernel's epilogue where the
    options ask for fp32 partials and the epilogue merge and the backend offers both for these
    (dense, 16-bit) inputs; else a block output (fp32 where the backend writes it) and a merge."""
    q0, dv = qs[0], v.shape[-1]
    acc = acc_dtype(q0)
    fp32_parts = run.options.fp32_partials and run.backend.fp32_block_outputs(q0.device)
    fused = (run.options.epilogue_merge and fp32_parts and acc != q0.dtype and q0.dim() == 4
             and run.backend.can_forward_merge(q0, v))
    return (EpilogueMerge if fused else StepMerge)(run, qs, dv, acc if fp32_parts else None)


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
            calls.add_lse(blk, self.exact[i], l)

    def finish(self, upto: list[int | None] | None = None) -> None:
        """``upto[i]``: copy only the first rows of rank i (the rest were written exactly)."""
        for i, (lse, exact) in enumerate(zip(self.lses, self.exact)):
            n = None if upto is None else upto[i]
            if exact is not None:
                (lse if n is None else lse[..., :n]).copy_(exact if n is None else exact[..., :n])


class StepMerge:
    """Each block's output lands in one scratch (``part_dtype``: fp32 partials, or None for q's
    dtype) and merges into the fp32 accumulator at once (the first block over all rows is copied
    instead). ``outs`` / ``lses``: the per-rank accumulators; :meth:`results` the outputs.

    A rank whose whole documents form one call after its travelling prefix
    (:func:`~.run.direct_home`) keeps an accumulator of the prefix only: that call writes its rows
    of the final output (q's dtype) and of the lse itself."""

    def __init__(self, run: RingRun, qs: list[torch.Tensor], dv: int, part_dtype: torch.dtype | None) -> None:
        self.run, self.qs, self.dv, self.part_dtype = run, qs, dv, part_dtype
        acc = acc_dtype(qs[0])
        self.lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
        self.direct = [direct_home(run, run.schedule.blocks(r, 0), r) for r in run.ranks]
        self.acc_rows = [travel_of(run, r) if d is not None else rows_of(run, r)
                         for d, r in zip(self.direct, run.ranks)]
        self.finals = [None if d is None else q.new_empty(q.shape[:-1] + (dv,)) for d, q in zip(self.direct, qs)]
        self.outs = [torch.zeros(with_rows(q, n)[:-1] + (dv,), dtype=acc, device=q.device)
                     for q, n in zip(qs, self.acc_rows)]
        self.lses = [torch.full(lse_shape(q), -math.inf, dtype=self.lse_dtype, device=q.device) for q in qs]
        self.by_shape: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # simulated ranks share one
        self.fresh = [True] * len(qs)
        self.exact = ExactLse(self.lses)

    def target(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block-output scratch of rank i, made at its first use."""
        q = self.qs[i]
        if q.shape not in self.by_shape:
            self.by_shape[q.shape] = (q.new_empty(q.shape[:-1] + (self.dv,), dtype=self.part_dtype or q.dtype),
                                      q.new_empty(lse_shape(q), dtype=self.lse_dtype))
        return self.by_shape[q.shape]

    def block(self, i: int, blk, q, k, v, rows: int, travelled: bool) -> None:
        """Rank i's ``blk`` against the held ``k, v``; ``travelled``: they came by a hop (in the
        ring's own buffers)."""
        run = self.run
        if blk is self.direct[i]:  # the whole documents: their lse rows and final out rows, no merge
            o, _ = calls.forward(run.backend, blk, q, k, v, run.spec, self.finals[i], self.lses[i])
            blk.put_q(self.finals[i], o)  # (a no-op where the backend wrote there: q's dtype, one call)
            return
        o, l = calls.forward(run.backend, blk, q, k, v, run.spec, *self.target(i))
        if self.fresh[i] and blk.covers(self.acc_rows[i]):
            blk.put_q(self.outs[i], o)
            blk.put_lse(self.lses[i], l)
        else:
            calls.merge(blk, self.outs[i], self.lses[i], o, l, run.options.merge_kernel)
        self.fresh[i] = False
        self.exact.add(i, blk, l)

    def finish(self, sinks: torch.Tensor | None) -> None:
        """The merged lse into ``lses``, then ``sinks (h,)`` (or None) applied once to the fp32
        result."""
        self.exact.finish([None if d is None else n for d, n in zip(self.direct, self.acc_rows)])
        _apply_sinks(self.outs, self.lses, sinks)

    def results(self) -> list[torch.Tensor]:
        """Per rank the output in q's dtype."""
        out = []
        for acc, final, q in zip(self.outs, self.finals, self.qs):
            if final is None:
                out.append(acc.to(q.dtype))
            else:
                final.narrow(row_dim(q), 0, acc.shape[row_dim(q)]).copy_(acc)
                out.append(final)
        return out


class EpilogueMerge(StepMerge):
    """Each block merges into the fp32 accumulator inside the attention kernel (the backend's
    ``forward_merge``): per rank the running lse lives in ``(b, h, 2, s)`` planes (M, S), with
    lse = M + log S taken once in ``finish`` (:func:`~ringfa4.kernels.merge.merge_planes_`). A block
    the backend declines (returns None) runs into a scratch and merges into the same planes in
    torch.

    The accumulator and planes start uninitialized: a rank whose first block covers all its rows
    (every causal ring's step 0) stores that block's output and lse straight into them (M = lse,
    S = 1, which a later merge weighs as exp(lse - M'), -inf rows included), so neither is zeroed
    nor read back; otherwise they are zeroed (M = -inf, S = 0) before the first merge."""

    def __init__(self, run: RingRun, qs: list[torch.Tensor], dv: int, part_dtype: torch.dtype | None) -> None:
        self.run, self.qs, self.dv, self.part_dtype = run, qs, dv, part_dtype
        self.lse_dtype = torch.float32
        self.outs = [torch.empty(q.shape[:-1] + (dv,), dtype=torch.float32, device=q.device) for q in qs]
        self.lses = [torch.empty(lse_shape(q), dtype=torch.float32, device=q.device) for q in qs]  # by finish
        self.direct = self.finals = [None] * len(qs)  # dense: no whole documents
        self.by_shape = {}  # declined blocks' scratch
        self.planes = [torch.empty(q.shape[0], q.shape[2], 2, q.shape[1], dtype=torch.float32, device=q.device)
                       for q in qs]
        self.fresh = [True] * len(qs)
        self.finished: list[torch.Tensor | None] = [None] * len(qs)  # outputs the finish kernel wrote
        self.rows_by_range: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self.kv_views = ViewMemo()  # the blocks' kv rows of each held (k, v)
        # travelled blocks' replays (BlockBackend.merge_replay) by q class, block and held rows: K/V that
        # came by a hop sit in buffers laid out alike on every rank and step, and each rank's accumulator
        # and planes alike, so such a block's arguments match the first one's (its checked call); False:
        # none. Not while torch.compile traces (the backend's call is the graph break there).
        self.replays: dict[tuple, object] | None = None if torch.compiler.is_compiling() else {}
        self.q_class = numbered([(q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16) for q in qs])

    def _rows(self, i: int, blk) -> tuple[torch.Tensor, ...]:
        """Rank i's views for ``blk``'s query rows (:func:`.calls.merge_rows`), made once per row range."""
        key = (i, blk.q0, blk.q1)
        got = self.rows_by_range.get(key)
        if got is None:
            got = self.rows_by_range[key] = calls.merge_rows(blk, self.qs[i], self.outs[i], self.planes[i])
        return got

    def _start(self, i: int) -> None:
        """Rank i's accumulator zeroed and its planes at (M, S) = (-inf, 0)."""
        self.outs[i].zero_()
        self.planes[i][:, :, 0] = -math.inf
        self.planes[i][:, :, 1] = 0.0
        self.fresh[i] = False

    def block(self, i: int, blk, q, k, v, rows: int, travelled: bool) -> None:
        run = self.run
        if self.fresh[i] and blk.covers(rows):
            m = self.planes[i][:, :, 0]
            o, l = calls.forward(run.backend, blk, q, k, v, run.spec, self.outs[i], m)
            blk.put_q(self.outs[i], o)
            blk.put_lse(m, l)
            self.planes[i][:, :, 1] = 1.0
            self.fresh[i] = False
            return
        if self.fresh[i]:
            self._start(i)
        kv = self.kv_views.get((k, v), (blk.k0, blk.k1), calls.kv_rows, blk, k, v)
        rows_i = self._rows(i, blk)
        key = (self.q_class[i], blk, k.shape[1]) if travelled and self.replays is not None else None
        replay = None if key is None else self.replays.get(key)
        if replay:
            replay(rows_i[0], kv[0], kv[1], rows_i[1], rows_i[2])
            return
        if calls.forward_merge(run.backend, blk, rows_i, kv, run.spec) is None:
            o, l = calls.forward(run.backend, blk, q, k, v, run.spec, *self.target(i))
            calls.merge_planes(blk, self.outs[i], self.planes[i], o, l)
            if key is not None:
                self.replays[key] = False
        elif key is not None and replay is None:
            self.replays[key] = calls.merge_replay(run.backend, blk, rows_i, kv, run.spec) or False

    def finish(self, sinks: torch.Tensor | None) -> None:
        """Per rank lse = M + log S into ``lses``; without sinks the output in q's dtype in the same
        launch (:func:`~ringfa4.kernels.cute_finish.finish_planes_cute`, where it applies), which
        :meth:`results` then returns; with ``sinks (h,)`` they are applied to the fp32 result first."""
        for i, (lse, planes) in enumerate(zip(self.lses, self.planes)):
            if self.fresh[i]:  # a rank without blocks: out 0, lse -inf
                self._start(i)
            if sinks is None:
                self.finished[i] = finish_planes_cute(self.outs[i], planes[:, :, 0], planes[:, :, 1], lse,
                                                      self.qs[i].dtype)
                if self.finished[i] is not None:
                    continue
            planes_lse(planes, out=lse)
        _apply_sinks(self.outs, self.lses, sinks)

    def results(self) -> list[torch.Tensor]:
        return [acc.to(q.dtype) if done is None else done for acc, done, q in zip(self.outs, self.finished, self.qs)]


def _apply_sinks(outs: list[torch.Tensor], lses: list[torch.Tensor], sinks: torch.Tensor | None) -> None:
    """``sinks (h,)`` applied once to each rank's merged fp32 ``(out, lse)`` in place (None: nothing)."""
    if sinks is not None:
        for o, l in zip(outs, lses):
            apply_sinks_(o, l, sinks)
