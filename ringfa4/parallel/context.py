"""``ContextParallel``: a CP group, its layout and backend; ring, Ulysses and hybrid attention.

    cp = ContextParallel(group=None, layout="zigzag", backend="auto")   # ring over the group
    cp = ContextParallel(group, ulysses=4)                              # Ulysses 4 x ring P/4
    cp = ContextParallel.auto(num_heads=32, num_kv_heads=8)             # planner picks (U, R)
    cp = ContextParallel.simulated(world_size=8, ulysses=2)             # all ranks in one process
    x_local = cp.shard(x, dim=1); pos = cp.positions(seq_len); x = cp.unshard(x_local, dim=1)

Distributed: tensors are this rank's shard. Simulated: tensors are the full sequence (shard and
unshard are the identity, positions are 0..S-1) and every rank's work runs in this process.
Rank p of a hybrid group is (ring group g, Ulysses index u) = divmod(p, U): Ulysses inside groups
of U consecutive ranks (the NVLink domain), the ring across the R = P/U groups.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..kernels import AttnSpec, get_backend
from ..kernels.autograd import block_attention
from ..kernels.output_cache import record_output, replay_output
from ..kernels.validate import validate_block
from .allgather import AllGatherSchedule, allgather_backward, allgather_forward, prefer_allgather
from .checks import check_local, exchange_and_check, peer_failure, post_error
from .executor import (
    RingRun,
    dkv_groups,
    dkv_wire_fp32,
    epilogue_merge,
    fp32_grads,
    fp32_partials,
    ring_backward,
    ring_forward,
    ring_slots,
)
from .layouts import HybridLayout, Layout, make_layout
from .packing import HybridPacking, Packing, cu_seqlens_from_position_ids
from .planner import CPPlan, detect_nvlink_domain, plan_cp
from .ring import ring_schedule
from .transport import LoopbackTransport, P2PTransport
from .ulysses import (
    HeadSplit,
    expand_kv_heads,
    heads_to_seq,
    heads_to_seq_packed,
    lse_heads_to_seq,
    lse_heads_to_seq_packed,
    seq_to_heads,
    seq_to_heads_packed,
    split_heads,
)
from .varlen import PackedRingSchedule

__all__ = ["ContextParallel", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("RINGFA4_TIMEOUT_S", "300")))
"""Timeout of every collective and ring hop (env ``RINGFA4_TIMEOUT_S``, default 300 s)."""


class ContextParallel:
    """A context-parallel group: ``group`` (ProcessGroup, 1-D DeviceMesh, or None for the default
    group), ``layout`` of the ring ("zigzag" | "contiguous"), ``backend`` (block-kernel name or
    object), ``timeout`` (collectives and hops), ``ulysses`` degree U (P = U x R)."""

    def __init__(self, group=None, layout: str | Layout = "zigzag", backend="auto",
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT, ulysses: int = 1, *,
                 _simulated: int | None = None, _transport=None) -> None:
        self.timeout = timeout
        self.backend_name = backend
        self.plan: CPPlan | None = None
        if _simulated is not None:
            self.group, self.rank, self.world_size = None, None, _simulated
        else:
            if hasattr(group, "get_group"):  # DeviceMesh (one dimension)
                group = group.get_group()
            if not dist.is_available() or not dist.is_initialized():
                if group is not None:
                    raise ValueError("group was given but torch.distributed is not initialized")
                self.group, self.rank, self.world_size = None, 0, 1
            else:
                self.group = group if group is not None else dist.group.WORLD
                self.rank = dist.get_rank(self.group)
                self.world_size = dist.get_world_size(self.group)
        if not isinstance(ulysses, int) or ulysses < 1 or self.world_size % ulysses:
            raise ValueError(f"ulysses degree must divide the CP world size {self.world_size}, got {ulysses!r}")
        self.ulysses, self.ring_size = ulysses, self.world_size // ulysses
        self.ring_layout = make_layout(layout, self.ring_size)
        self.layout = self.ring_layout if ulysses == 1 else HybridLayout(self.world_size, self.ring_layout, ulysses)
        self.ulysses_group = None
        if ulysses == 1:
            self._ring = self
            if _simulated is None:
                self.transport = _transport or P2PTransport(
                    self.group, self.rank, self.world_size, timeout,
                    on_timeout=lambda peer, exc: peer_failure(self.rank, peer, exc))
            else:
                self.transport = _transport or LoopbackTransport()
        elif _simulated is not None:
            self._ring = ContextParallel.simulated(self.ring_size, self.ring_layout, backend, _transport)
        else:
            self.ulysses_group, ring_group = self._subgroups()
            self._ring = ContextParallel(ring_group, self.ring_layout, backend, timeout, _transport=_transport)

    def _subgroups(self):
        """(Ulysses group of my g, ring group of my u); every rank creates all, in the same order."""
        U, R = self.ulysses, self.ring_size
        ranks = [dist.get_global_rank(self.group, i) for i in range(self.world_size)]
        g, u = divmod(self.rank, U)
        mine_u = mine_r = None
        for gg in range(R):
            pg = dist.new_group(ranks[gg * U:(gg + 1) * U], timeout=self.timeout)
            mine_u = pg if gg == g else mine_u
        for uu in range(U):
            pg = dist.new_group(ranks[uu::U], timeout=self.timeout)
            mine_r = pg if uu == u else mine_r
        return mine_u, mine_r

    @classmethod
    def simulated(cls, world_size: int, layout: str | Layout = "zigzag", backend="auto",
                  transport: LoopbackTransport | None = None, ulysses: int = 1) -> ContextParallel:
        """All ``world_size`` ranks in this process on one device (loopback hops; the Ulysses
        all-to-all is a head split, which moves nothing on one device)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return cls(layout=layout, backend=backend, ulysses=ulysses, _simulated=world_size, _transport=transport)

    @classmethod
    def auto(cls, group=None, num_heads: int | None = None, num_kv_heads: int | None = None,
             nvlink_domain_size: int | None = None, backend="auto", layout: str = "zigzag",
             timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> ContextParallel:
        """(U, R) from the planner (:mod:`ringfa4.parallel.planner`): U as large as the heads and
        the NVLink domain allow, the ring for the rest. ``cp.describe()`` says what it chose."""
        if num_heads is None or num_kv_heads is None:
            raise ValueError("ContextParallel.auto needs num_heads and num_kv_heads")
        probe = cls(group, layout, backend, timeout)
        domain, source = detect_nvlink_domain(nvlink_domain_size, probe.group)
        plan = plan_cp(probe.world_size, num_heads, num_kv_heads, domain, source, layout)
        cp = probe if plan.ulysses == 1 else cls(probe.group, layout, backend, timeout, ulysses=plan.ulysses)
        cp.plan = plan
        return cp

    def describe(self) -> str:
        """The plan in words (printed by recipes)."""
        if self.plan is not None:
            return self.plan.describe()
        kind = "simulated" if self.is_simulated else "distributed"
        return (f"CP ({kind}): P={self.world_size} = Ulysses {self.ulysses} x ring {self.ring_size} "
                f"({self.ring_layout.name})")

    @property
    def is_simulated(self) -> bool:
        return self.rank is None

    def __repr__(self) -> str:
        kind = "simulated" if self.is_simulated else f"rank {self.rank}"
        return (f"ContextParallel({kind}, world_size={self.world_size}, ulysses={self.ulysses}, "
                f"layout={self.ring_layout.name!r})")

    # -- data placement --------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of the full tensor ``x`` along ``dim`` (identity when simulated)."""
        if self.is_simulated or self.world_size == 1:
            return x
        return self.layout.shard(x, dim, self.rank)

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All-gather the local parts back into global order (identity when simulated)."""
        if self.is_simulated or self.world_size == 1:
            return x_local
        parts = [torch.empty_like(x_local) for _ in range(self.world_size)]
        work = dist.all_gather(parts, x_local.contiguous(), group=self.group, async_op=True)
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise peer_failure(self.rank, None, exc, "unshard's all-gather") from exc
        return self.layout.unshard(parts, dim)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions (int64) of the local tokens of a ``seq_len``-token sequence."""
        if self.is_simulated or self.world_size == 1:
            return torch.arange(seq_len, device=device)
        return self.layout.positions(seq_len, self.rank, device)

    # -- packed documents ----------------------------------------------------------------------
    def pack(self, cu_seqlens, mode: str = "auto") -> Pack:
        """The layout applied inside every document of a packed batch: ``cu_seqlens`` are the
        batch's global int32 document boundaries (any lengths, zero allowed). ``mode``: "ring"
        (K/V hops), "allgather" (one all-gather of K/V: packs of many short documents) or "auto"
        (the rule of :mod:`ringfa4.parallel.allgather`)."""
        if mode not in ("auto", "ring", "allgather"):
            raise ValueError(f"mode must be 'auto', 'ring' or 'allgather', got {mode!r}")
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype != torch.int32:
            raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
        return Pack(self, Packing(cu_seqlens, self.ring_layout), mode)

    def pack_from_position_ids(self, position_ids: torch.Tensor, mode: str = "auto") -> Pack:
        """:meth:`pack` from HF-style position_ids that restart at 0 at every document."""
        return self.pack(cu_seqlens_from_position_ids(position_ids), mode)

    # -- attention -------------------------------------------------------------------------------
    def _where(self) -> str:
        return "" if self.is_simulated else f"rank {self.rank}: "

    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> None:
        """Local checks, then (distributed) the metadata all-gather: the same ValueError everywhere."""
        error = check_local(q, k, v, spec, self.layout, self._where(), local=not self.is_simulated)
        if error is None and self.ulysses > 1:
            try:
                HeadSplit(q.shape[2], k.shape[2], self.ulysses, self._where())
            except ValueError as exc:
                error = str(exc)
        if self.is_simulated or self.world_size == 1:
            if error:
                raise ValueError(error)
            return
        exchange_and_check(self, error, q, k, v, spec)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                  packing: Pack | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """CP attention of the local (or, simulated, full) q, k, v: ``(out, lse)``; with
        ``packing`` the tensors are packed ``(t, h, d)`` and lse is ``(h, t)``."""
        if packing is not None:
            return packing.attention(q, k, v, spec)
        self.validate(q, k, v, spec)
        if self.ulysses == 1:
            return self._ring_attention(q, k, v, spec)
        split = HeadSplit(q.shape[2], k.shape[2], self.ulysses)
        k, v = expand_kv_heads(k, split.kv_factor), expand_kv_heads(v, split.kv_factor)
        U = self.ulysses
        if self.is_simulated:  # each Ulysses index's heads, over the R-ring of the full sequence
            parts = [self._ring._ring_attention(*(split_heads(t, U, u).contiguous() for t in (q, k, v)), spec)
                     for u in range(U)]
            return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=1)
        comm = (self.ulysses_group, U, self.timeout, lambda exc: peer_failure(self.rank, None, exc, "an all-to-all"))
        qh, kh, vh = seq_to_heads([q, k, v], *comm)
        out, lse = self._ring._ring_attention(qh, kh, vh, spec)
        return heads_to_seq(out, *comm), lse_heads_to_seq(lse, *comm)

    def _ring_attention(self, q, k, v, spec):
        if self.world_size == 1:  # one backend call
            return block_attention(q, k, v, get_backend(self.backend_name, q.device, q.dtype), spec)
        return _RingAttention.apply(q, k, v, self, spec)

    def run(self, q: torch.Tensor, spec: AttnSpec, packing: Packing | None = None,
            allgather: bool = False) -> RingRun:
        if packing is not None:
            schedule = packing.schedule(AllGatherSchedule if allgather else PackedRingSchedule, spec.causal,
                                        spec.window)
        else:
            seq_len = q.shape[1] * (1 if self.is_simulated else self.world_size)
            schedule = ring_schedule(self.layout, seq_len, spec.causal, spec.window)
        ranks = tuple(range(self.world_size)) if self.is_simulated else (self.rank,)
        backend = get_backend(self.backend_name, q.device, q.dtype)
        base = spec.replace(causal=False, window=(None, None))
        return RingRun(schedule, ranks, backend, base, self.transport, ring_slots(), fp32_partials(q.device),
                       dkv_wire_fp32(), fp32_grads(q.device), epilogue_merge(), dkv_groups())

    # per-rank views for the simulated executor
    def _split(self, x: torch.Tensor, packing: Packing | None = None, dim: int | None = None) -> list[torch.Tensor]:
        if not self.is_simulated:
            return [x]
        place = self.layout if packing is None else packing
        dim = (1 if packing is None else 0) if dim is None else dim
        return [place.shard(x, dim, r).contiguous() for r in range(self.world_size)]

    def _join(self, parts: list[torch.Tensor], dim: int = 1, packing: Packing | None = None) -> torch.Tensor:
        if not self.is_simulated:
            return parts[0]
        return self.layout.unshard(parts, dim) if packing is None else packing.unshard(parts, dim)

    def _guard(self, fn, *args):
        if self.is_simulated:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as exc:
            post_error(self.rank, f"{type(exc).__name__}: {exc}")
            raise


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, spec: AttnSpec, packing: Packing | None = None,
                allgather: bool = False):
        run = cp.run(q, spec, packing, allgather)
        qs, ks, vs = (cp._split(t, packing) for t in (q, k, v))
        ctx.fns = (allgather_forward, allgather_backward) if allgather else (ring_forward, ring_backward)
        dim = 1 if packing is None else 0
        kept = replay_output()  # a checkpoint recompute with the forward's (out, lse) kept
        if kept is None:
            outs, lses = cp._guard(ctx.fns[0], run, qs, ks, vs)
            out, lse = cp._join(outs, dim, packing), cp._join(lses, dim + 1, packing)
            record_output(out, lse)
        else:
            out, lse = kept
            outs, lses = cp._split(out, packing, dim), cp._split(lse, packing, dim + 1)
        ctx.cp, ctx.run, ctx.packing = cp, run, packing
        ctx.parts = (qs, ks, vs, outs, lses) if cp.is_simulated else ([q], [k], [v], [out], [lse])
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        cp, run = ctx.cp, ctx.run
        qs, ks, vs, outs, lses = ctx.parts
        packing, dim = ctx.packing, 1 if ctx.packing is None else 0
        douts = cp._split(dout.contiguous(), packing)
        dqs, dks, dvs = cp._guard(ctx.fns[1], run, douts, qs, ks, vs, outs, lses)
        ctx.parts = None
        return (cp._join(dqs, dim, packing), cp._join(dks, dim, packing), cp._join(dvs, dim, packing),
                None, None, None, None)


class Pack:
    """A :class:`Packing` bound to its CP group: ``shard``, ``unshard``, ``positions`` and the
    packed attention. Simulated: shard/unshard are the identity, positions restart per document."""

    def __init__(self, cp: ContextParallel, packing: Packing, mode: str = "auto") -> None:
        self.cp, self.packing, self.mode = cp, packing, mode  # packing: the ring level's
        self.placement = packing if cp.ulysses == 1 else HybridPacking(packing, cp.ulysses)

    def uses_allgather(self, num_heads: int, num_kv_heads: int) -> bool:
        """Whether attention runs in all-gather-KV mode (``mode``, or the auto rule)."""
        if self.mode != "auto":
            return self.mode == "allgather"
        return prefer_allgather(self.packing, num_heads, num_kv_heads)

    def __repr__(self) -> str:
        return f"Pack({self.packing!r})"

    @property
    def _local(self) -> bool:
        return not self.cp.is_simulated and self.cp.world_size > 1

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self.placement.shard(x, dim, self.cp.rank) if self._local else x

    def unshard(self, x_local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """All-gather the (unevenly sized) local parts back into the packed global order."""
        if not self._local:
            return x_local
        cap = self.placement.max_rows
        pad = list(x_local.shape)
        pad[dim] = cap
        buf = x_local.new_zeros(pad)
        buf.narrow(dim, 0, x_local.shape[dim]).copy_(x_local)
        parts = [torch.empty_like(buf) for _ in range(self.cp.world_size)]
        work = dist.all_gather(parts, buf, group=self.cp.group, async_op=True)
        try:
            work.wait(self.cp.timeout)
        except Exception as exc:
            raise peer_failure(self.cp.rank, None, exc, "unshard's all-gather") from exc
        return self.placement.unshard(parts, dim)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Positions inside each document (restart at 0) of the local tokens."""
        if not self._local:
            return torch.cat([torch.arange(n, device=device) for n in self.packing.doc_lengths] or
                             [torch.zeros(0, dtype=torch.long, device=device)])
        return self.placement.positions(self.cp.rank, device)

    def attention(self, q, k, v, spec: AttnSpec):
        cp = self.cp
        self.validate(q, k, v, spec)
        if cp.ulysses > 1:
            return self._hybrid(q, k, v, spec)
        return self._ring_level(q, k, v, spec, self.uses_allgather(q.shape[1], k.shape[1]), self._local)

    def _hybrid(self, q, k, v, spec):
        """Ulysses all-to-all inside the group, then the ring level's packed attention."""
        cp, U = self.cp, self.cp.ulysses
        split = HeadSplit(q.shape[1], k.shape[1], U)
        allgather = self.uses_allgather(q.shape[1], k.shape[1])
        k, v = (expand_kv_heads(t.unsqueeze(0), split.kv_factor)[0] for t in (k, v))
        ring = Pack(cp._ring, self.packing)
        if cp.is_simulated:  # each Ulysses index's heads over the R-ring of the whole pack
            parts = [ring._ring_level(*(t[:, u * (t.shape[1] // U):(u + 1) * (t.shape[1] // U)].contiguous()
                                        for t in (q, k, v)), spec, allgather, True) for u in range(U)]
            return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=0)
        g, u = divmod(cp.rank, U)
        pieces = [n for _, n in self.placement.pieces(g)]
        comm = (cp.ulysses_group, U, cp.timeout, lambda exc: peer_failure(cp.rank, None, exc, "an all-to-all"),
                pieces, u)
        qh, kh, vh = seq_to_heads_packed([q, k, v], *comm)
        out, lse = ring._ring_level(qh, kh, vh, spec, allgather, True)
        return heads_to_seq_packed(out, *comm), lse_heads_to_seq_packed(lse, *comm)

    def _ring_level(self, q, k, v, spec, allgather: bool, use_schedule: bool):
        """Packed attention of this pack's (ring-level) cp, without validation. ``use_schedule``:
        run the packing's schedule even on one rank (the tokens are a rank's part-major local
        tokens, or, simulated, the batch the simulated executor splits), so a hybrid's ring level
        computes the same blocks in both executors; else one varlen call on a lone rank."""
        cp = self.cp
        if cp.world_size == 1 and not use_schedule:  # the whole batch in global order: one varlen call
            cu, longest = self.packing.cu_seqlens(q.device), max(self.packing.doc_lengths, default=0)
            vspec = spec.replace(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            return cp._ring_attention(q, k, v, vspec)
        return _RingAttention.apply(q, k, v, cp, spec, self.packing, allgather)

    def validate(self, q, k, v, spec: AttnSpec) -> None:
        cp = self.cp
        where = cp._where()
        rows = self.packing.total if not self._local else self.placement.rows(cp.rank)
        error = None
        try:
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t.dim() != 3:
                    raise ValueError(f"{where}{name} must be packed (total, h, d) with packing, got {tuple(t.shape)}")
                if t.shape[0] != rows:
                    raise ValueError(f"{where}{name} must have this rank's {rows} packed tokens, got {t.shape[0]}")
            check_spec = spec.replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
            validate_block(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), check_spec, where)
            if cp.ulysses > 1:
                HeadSplit(q.shape[1], k.shape[1], cp.ulysses, where)
        except ValueError as exc:
            error = str(exc)
        if not self._local:
            if error:
                raise ValueError(error)
            return
        total = self.packing.total
        exchange_and_check(cp, error, *(_Shaped(t, total) for t in (q, k, v)), spec,
                           packing=hash(self.packing.cu) & ((1 << 62) - 1))


class _Shaped:
    """A tensor stand-in for the metadata exchange: global packed shape, same dtype/device."""

    def __init__(self, t: torch.Tensor, total: int) -> None:
        self.shape = (1, total) + tuple(t.shape[1:])
        self.dtype, self.device, self.is_cuda = t.dtype, t.device, t.is_cuda
