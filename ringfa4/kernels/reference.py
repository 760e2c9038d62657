"""Pure-torch block attention on any device: the ground-truth backend of the CPU paths.

Computes in float32 (float64 when the inputs are float64 or ``compute_dtype=torch.float64``),
tiling the queries so a (tile, s_k) score block per head stays small. The backward is written as
its own math from (out, lse), not as autograd of the forward, so it is exact for ring blocks given
the globally merged out and lse.

Shapes: dense ``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)`` -> ``out (b, s_q, h, d)`` in q's
dtype, ``lse (b, h, s_q)`` float32 (float64 when computing in float64). Varlen: ``(total, h, d)``
with ``lse (h, total_q)``.
"""

from __future__ import annotations

import math

import torch

from .merge import merge_planes_
from .sinks import apply_sinks_
from .spec import AttnSpec, band_mask, check_grads, materialized
from .validate import validate_block

__all__ = ["ReferenceBackend"]

_TILE_ELEMS = 1 << 24  # score elements per query tile (all heads together)


def _tiles(s_q: int, s_k: int, h: int):
    step = max(1, _TILE_ELEMS // max(1, s_k * h))
    for start in range(0, s_q, step):
        yield start, min(s_q, start + step)


def _scores(q, k, spec: AttnSpec, scale: float, q0: int, q1: int, s_q: int):
    """Scaled, soft-capped, masked scores (b, h, q1-q0, s_k) and tanh (for the softcap grad)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q[:, q0:q1], k) * scale
    t = None
    if spec.softcap:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    mask = band_mask(spec, s_q, k.shape[1], q.device, q0, q1)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return s, t, mask


def _probs(s, lse, mask):
    """exp(s - lse) with rows at lse = -inf (and masked entries) exactly 0."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    return p


class ReferenceBackend:
    """Reference block attention (see module docstring)."""

    name = "reference"

    def __init__(self, compute_dtype: torch.dtype | None = None, tile: int = 1) -> None:
        if compute_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"compute_dtype must be None, torch.float32 or torch.float64, got {compute_dtype}")
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"tile must be a positive int, got {tile!r}")
        self.compute_dtype = compute_dtype
        self.tile = tile  # no kernel tile of its own; settable so tests cut sequences as FA4 would

    def _dtype(self, q: torch.Tensor) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.float64 if q.dtype == torch.float64 else torch.float32

    # -- dense ------------------------------------------------------------------------------
    def _forward_dense(self, q, k, v, spec):
        dt = self._dtype(q)
        b, s_q, h, d = q.shape
        groups = h // k.shape[2]
        qc = q.to(dt)
        kc = k.to(dt).repeat_interleave(groups, dim=2)
        vc = v.to(dt).repeat_interleave(groups, dim=2)
        scale = spec.scale(d)
        out = torch.empty(b, s_q, h, v.shape[-1], dtype=dt, device=q.device)
        lse = torch.empty(b, h, s_q, dtype=dt, device=q.device)
        for q0, q1 in _tiles(s_q, k.shape[1], h):
            s, _, mask = _scores(qc, kc, spec, scale, q0, q1, s_q)
            m = torch.logsumexp(s, dim=-1)
            lse[:, :, q0:q1] = m
            out[:, q0:q1] = torch.einsum("bhqk,bkhd->bqhd", _probs(s, m, mask), vc)
        return out, lse

    def _backward_dense(self, dout, q, k, v, out, lse, spec):
        dt = self._dtype(q)
        b, s_q, h, d = q.shape
        h_kv = k.shape[2]
        groups = h // h_kv
        qc, doc = q.to(dt), dout.to(dt)
        kc = k.to(dt).repeat_interleave(groups, dim=2)
        vc = v.to(dt).repeat_interleave(groups, dim=2)
        lse = lse.to(dt)
        delta = (doc * out.to(dt)).sum(-1).transpose(1, 2)  # (b, h, s_q)
        scale = spec.scale(d)
        dq = torch.empty_like(qc)
        dk = torch.zeros_like(kc)
        dv = torch.zeros_like(vc)
        for q0, q1 in _tiles(s_q, k.shape[1], h):
            s, t, mask = _scores(qc, kc, spec, scale, q0, q1, s_q)
            p = _probs(s, lse[:, :, q0:q1], mask)
            do = doc[:, q0:q1]
            dv += torch.einsum("bhqk,bqhd->bkhd", p, do)
            dp = torch.einsum("bqhd,bkhd->bhqk", do, vc)
            ds = p * (dp - delta[:, :, q0:q1].unsqueeze(-1))
            if t is not None:
                ds = ds * (1.0 - t * t)
            dq[:, q0:q1] = torch.einsum("bhqk,bkhd->bqhd", ds, kc) * scale
            dk += torch.einsum("bhqk,bqhd->bkhd", ds, qc[:, q0:q1]) * scale
        if groups > 1:  # explicit sizes: a batch of 0 has no -1 to infer
            dk = dk.view(b, k.shape[1], h_kv, groups, d).sum(3)
            dv = dv.view(b, k.shape[1], h_kv, groups, v.shape[-1]).sum(3)
        return dq, dk, dv  # in the compute dtype

    # -- varlen: one dense call per document ------------------------------------------------
    @staticmethod
    def _docs(spec: AttnSpec):
        cq = spec.cu_seqlens_q.tolist()
        ck = spec.cu_seqlens_k.tolist()
        dense = spec.replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)], dense

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        validate_block(q, k, v, spec)
        if not spec.varlen:
            o, l = self._forward_dense(q, k, v, spec)
        else:
            docs, dense = self._docs(spec)
            dt = self._dtype(q)
            o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=dt, device=q.device)
            l = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=dt, device=q.device)
            for a, b, c, e in docs:
                if b > a:
                    od, ld = self._forward_dense(q[None, a:b], k[None, c:e], v[None, c:e], dense)
                    o[a:b], l[:, a:b] = od[0], ld[0]
        if spec.sinks is not None:  # in the compute dtype, before any rounding
            apply_sinks_(o, l, spec.sinks)
        o = o.to(q.dtype if out is None else out.dtype)  # an fp32 out of 16-bit inputs: not rounded
        l = l if l.dtype == torch.float64 else l.float()
        if out is not None:
            out.copy_(o)
            o = out
        if lse is not None:
            lse.copy_(l)
            l = lse
        return o, l

    def fp32_block_outputs(self, device: torch.device) -> bool:
        """Ring blocks may hand back outputs in the compute dtype (fp32 or fp64) on any device."""
        return True

    def can_forward_merge(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Dense blocks: :meth:`forward_merge` runs (in torch)."""
        return q.dim() == 4

    def forward_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                      out_acc: torch.Tensor, planes: torch.Tensor) -> torch.Tensor | None:
        """What FA4's merging forward does (:mod:`.fa4_merge`), in torch: this block's attention,
        not rounded to q's dtype, merged into ``out_acc (b, s_q, h, d)`` float32 and the running
        (M, S) ``planes (b, h, 2, s_q)`` float32 in place (:func:`.merge.merge_planes_`). Returns
        ``planes``; None (touching nothing) for varlen blocks or accumulators that are not float32."""
        if spec.varlen or q.dim() != 4 or out_acc.dtype != torch.float32 or planes.dtype != torch.float32 \
                or spec.sinks is not None:
            return None
        validate_block(q, k, v, spec)
        self._merge_into(q, k, v, spec, out_acc, planes)
        return planes

    def _merge_into(self, q, k, v, spec: AttnSpec, out_acc, planes) -> None:
        o, l = self._forward_dense(q, k, v, spec)
        merge_planes_(out_acc, planes, o, l)

    def merge_replay(self, q, k, v, spec: AttnSpec, out_acc, planes):
        """The merging block again (forward_merge itself: nothing to prepare in torch)."""
        return lambda q_, k_, v_, o_, p_: self._merge_into(q_, k_, v_, spec, o_, p_)

    def launches_taped(self, device: torch.device) -> bool:
        """torch ops only: a launch tape sees every one."""
        return True

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        validate_block(q, k, v, spec)
        if not spec.varlen:
            dq, dk, dv = self._backward_dense(dout, q, k, v, out, lse, spec)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        docs, dense = self._docs(spec)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, e in docs:
            if b > a and e > c:
                g = self._backward_dense(dout[None, a:b], q[None, a:b], k[None, c:e], v[None, c:e],
                                         out[None, a:b], lse[None, :, a:b], dense)
                dq[a:b], dk[c:e], dv[c:e] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv

    def backward_accumulate(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec,
                            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
        """:meth:`backward`'s gradients in the compute dtype, added into ``grads = (dq_acc, dk_acc,
        dv_acc)`` (float32 or float64, shaped like q / k / v, dense or varlen; views allowed; any
        may be a :class:`~.spec.Written`, then written) without rounding to the inputs' dtype
        first. Always True (the reference runs every call)."""
        validate_block(q, k, v, spec)
        grads = check_grads(grads, q, k, v, (torch.float32, torch.float64))
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        (dq_acc, dq_w), (dk_acc, dk_w), (dv_acc, dv_w) = (materialized(g, compute) for g in grads)
        if not spec.varlen:
            dq, dk, dv = self._backward_dense(dout, q, k, v, out, lse, spec)
            dq_acc += dq
            dk_acc += dk
            dv_acc += dv
        else:
            docs, dense = self._docs(spec)
            for a, b, c, e in docs:
                if b > a and e > c:
                    g = self._backward_dense(dout[None, a:b], q[None, a:b], k[None, c:e], v[None, c:e],
                                             out[None, a:b], lse[None, :, a:b], dense)
                    dq_acc[a:b] += g[0][0]
                    dk_acc[c:e] += g[1][0]
                    dv_acc[c:e] += g[2][0]
        for written, got in ((dq_w, dq_acc), (dk_w, dk_acc), (dv_w, dv_acc)):
            if written is not None:
                written.put_(got)
        return True

    def begin_backward(self, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       spec: AttnSpec) -> _ReferenceAccum | None:
        """Dense q only: block gradients stay in the compute dtype (see AccumBackward)."""
        if spec.varlen or q.dim() != 4:
            return None
        return _ReferenceAccum(self, dout, q, out, lse, spec)


class _ReferenceAccum:
    """AccumBackward of the reference backend: each block's gradients in the compute dtype."""

    def __init__(self, backend: ReferenceBackend, dout, q, out, lse, spec: AttnSpec) -> None:
        self.backend, self.dout, self.q, self.out, self.lse = backend, dout, q, out, lse
        wide = torch.float64 if q.dtype == torch.float64 else backend._dtype(q)  # fp64 inputs: fp64 (protocol)
        self.acc = torch.zeros(q.shape, dtype=wide, device=q.device)

    def add_block(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                  dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None:
        r = slice(q0, q1)
        validate_block(self.q[:, r], k, v, spec)
        dq, dk, dv = self.backend._backward_dense(self.dout[:, r], self.q[:, r], k, v, self.out[:, r],
                                                  self.lse[:, :, r], spec)
        self.acc[:, r] += dq
        dk_acc += dk
        dv_acc += dv

    def kv_layout(self, k: torch.Tensor, cap: int) -> None:
        """No layout of its own: the ring keeps dK / dV dense."""
        return None

    def replay(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, dk_acc: torch.Tensor,
               dv_acc: torch.Tensor):
        """The block again, on any state (add_block itself: the reference has no launch to prepare)."""
        return lambda state, k_, v_, dk_, dv_: state.add_block(q0, q1, k_, v_, spec, dk_, dv_)

    def replay_class(self) -> int:
        """Every state alike (:meth:`replay` runs add_block on the state it is given)."""
        return 0

    def heads(self, h0: int, h1: int) -> _ReferenceAccum:
        """The state of q heads ``[h0, h1)`` (views: dq adds into this state's accumulator)."""
        view = object.__new__(_ReferenceAccum)
        n = h1 - h0
        view.backend, view.lse, view.acc = self.backend, self.lse.narrow(1, h0, n), self.acc.narrow(2, h0, n)
        view.dout, view.q, view.out = (t.narrow(2, h0, n) for t in (self.dout, self.q, self.out))
        return view

    def dq(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.acc if dtype is None else self.acc.to(dtype)

    # the q side's travel (parallel/ring/q_side.py QSide): what a rank holding this q needs, and dq
    # accumulators of head groups that travel with it

    def travel(self) -> tuple[torch.Tensor, ...]:
        """``(dout, q, out, lse)``, contiguous: what another rank's blocks of this q need."""
        if not hasattr(self, "_travel"):
            self._travel = tuple(t.contiguous() for t in (self.dout, self.q, self.out, self.lse))
        return self._travel

    def dq_zeros(self, h0: int, h1: int) -> torch.Tensor:
        """A zeroed dq accumulator of q heads ``[h0, h1)``: ``(b, s, h1 - h0, d)`` in the compute dtype."""
        b, s, _, d = self.q.shape
        return torch.zeros(b, s, h1 - h0, d, dtype=self.acc.dtype, device=self.q.device)

    def dq_empty(self, h0: int, h1: int) -> torch.Tensor:
        b, s, _, d = self.q.shape
        return torch.empty(b, s, h1 - h0, d, dtype=self.acc.dtype, device=self.q.device)

    def visiting(self, pieces: tuple[torch.Tensor, ...], h0: int, h1: int, dq: torch.Tensor) -> _ReferenceAccum:
        """The state of q heads ``[h0, h1)`` of another rank's q side ``pieces`` (its :meth:`travel`),
        adding dq into ``dq`` (that group's accumulator)."""
        view = object.__new__(_ReferenceAccum)
        n = h1 - h0
        dout, q, out, lse = pieces
        view.backend, view.acc, view.lse = self.backend, dq, lse.narrow(1, h0, n)
        view.dout, view.q, view.out = (t.narrow(2, h0, n) for t in (dout, q, out))
        return view

    def dq_from(self, bufs: list[torch.Tensor], heads: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        """dq of this state's q in ``dtype`` from the head groups' accumulators (back home)."""
        dq = torch.empty(self.q.shape, dtype=dtype, device=self.q.device)
        for buf, (h0, h1) in zip(bufs, heads, strict=True):
            dq[:, :, h0:h1] = buf
        return dq
