"""``ContextParallel``: a CP group, its layout, backend and options; ring, Ulysses and hybrid
attention.

    cp = ContextParallel(group=None, layout="zigzag", backend="auto")   # ring over the group
    cp = ContextParallel(group, ulysses=4)                              # Ulysses 4 x ring P/4
    cp = ContextParallel.auto(num_heads=32, num_kv_heads=8)             # planner picks (U, R)
    cp = ContextParallel.simulated(world_size=8, ulysses=2)             # all ranks in one process
    cp = ContextParallel(options=RingOptions(bwd_ring="q", timeout_s=60))
    x_local = cp.shard(x, dim=1); pos = cp.positions(seq_len); x = cp.unshard(x_local, dim=1)

Distributed: tensors are this rank's shard. Simulated: tensors are the full sequence (shard and
unshard are the identity, positions are 0..S-1) and every rank's work runs in this process; the
difference lives in the group object (:mod:`.groups`), never in a branch here.
Rank p of a hybrid group is (ring group g, Ulysses index u) = divmod(p, U): Ulysses inside groups
of U consecutive ranks (the NVLink domain), the ring across the R = P/U groups.
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..kernels import AttnSpec, get_backend
from ..kernels.autograd import block_attention
from ..kernels.host_copy import to_device
from ..kernels.output_cache import record_output, replay_output
from ..kernels.registry import backend_tile
from ..kernels.sinks import sink_grad
from ..kernels.validate import validate_block
from ..options import RingOptions, warn_ignored_env
from .allgather import AllGatherSchedule, allgather_backward, allgather_forward, prefer_allgather
from .checks import CallShape, check_local, check_plan
from .groups import DistributedGroup, SimulatedGroup, new_local_group
from .layouts import HybridLayout, Layout, make_layout
from .memo import cached_method
from .packing import HybridPacking, Packing, cu_seqlens_from_position_ids
from .planner import detect_nvlink_domain, plan_cp
from .ring import RingGraphs, RingRun, RingTapes, ring_backward, ring_forward, ring_schedule
from .transport import LoopbackTransport
from .ulysses import HeadSplit, expand_kv_heads
from .varlen import PackedRingSchedule

__all__ = ["PACK_MODES", "ContextParallel", "Pack"]

PACK_MODES = ("auto", "balanced", "ring", "allgather")


class ContextParallel:
    """A context-parallel group: ``group`` (ProcessGroup, 1-D DeviceMesh, or None for the default
    group), ``layout`` of the ring ("zigzag" | "contiguous"), ``backend`` (block-kernel name or
    object), ``ulysses`` degree U (P = U x R), ``options`` (:class:`~ringfa4.options.RingOptions`:
    every algorithm choice and the timeout; compared across ranks by every call's check).
    ``timeout``: forwards to ``options.timeout_s``."""

    def __init__(self, group=None, layout: str | Layout = "zigzag", backend="auto", ulysses: int = 1, *,
                 options: RingOptions | None = None, timeout: datetime.timedelta | None = None,
                 _simulated: int | None = None, _transport=None, _parent: tuple | None = None) -> None:
        options = RingOptions() if options is None else options
        if not isinstance(options, RingOptions):
            raise ValueError(f"options must be a RingOptions, got {type(options).__name__}")
        if timeout is not None:
            options = options.replace(timeout_s=timeout.total_seconds())
        warn_ignored_env()
        self.options, self.backend_name, self.plan = options, backend, None
        self.graphs = RingGraphs() if options.cuda_graphs else None  # captured ring calls (ring/graphs.py)
        self.tapes = (RingTapes(options.launch_tapes, options.launch_tape_mib << 20)  # recorded launches
                      if options.launch_tapes != "off" and not options.cuda_graphs else None)  # (ring/tapes.py)
        if _simulated is not None:
            self.comm = SimulatedGroup(_simulated, _transport)
        else:
            if isinstance(group, DeviceMesh):
                group = group.get_group()
            self.comm = DistributedGroup(group, self.timeout, _transport, *(_parent or (None, None)))
        self.group, self.rank, self.world_size = self.comm.group, self.comm.rank, self.comm.world_size
        error, code = None, 0
        try:
            if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or self.world_size % ulysses:
                raise ValueError(f"ulysses degree must divide the CP world size {self.world_size}, got {ulysses!r}")
            self.ulysses, self.ring_size = ulysses, self.world_size // ulysses
            self.ring_layout = make_layout(layout, self.ring_size, backend_tile(backend))
            code = self.ring_layout.chunks_per_rank
        except ValueError as exc:
            error = f"{self.comm.where()}{exc}"
        if _simulated is None and _parent is None and self.world_size > 1:  # before any subgroup exists
            check_plan(self.comm, self.world_size, ulysses if type(ulysses) is int else -1, code, options, error)
        if error:
            raise ValueError(error)
        self.layout = self.ring_layout if ulysses == 1 else HybridLayout(self.world_size, self.ring_layout, ulysses)
        self.transport = self.comm.transport
        self.ulysses_comm = None
        if ulysses == 1:
            self._ring = self
        elif _simulated is not None:
            self._ring = ContextParallel(layout=self.ring_layout, backend=backend, options=options,
                                         _simulated=self.ring_size, _transport=_transport)
            self.ulysses_comm = SimulatedGroup(ulysses)
        else:
            U, (g, u) = ulysses, divmod(self.rank, ulysses)
            ulysses_group, ring_group = self._subgroups()
            self._ring = ContextParallel(ring_group, self.ring_layout, backend, options=options, _transport=_transport,
                                         _parent=(self.comm.channel, [gg * U + u for gg in range(self.ring_size)]))
            self.ulysses_comm = DistributedGroup(ulysses_group, self.timeout, None, self.comm.channel,
                                                 [g * U + uu for uu in range(U)])

            def renew() -> None:  # after a failed call: fresh Ulysses and ring groups (the old keep its leftovers)
                ulysses_new, ring_new = self._subgroups()
                self.ulysses_comm.rebind(ulysses_new)
                self._ring.comm.rebind(ring_new)

            self.comm.on_new_epoch = renew

    def graph_memory(self) -> int:
        """Bytes of device memory this group's CUDA graphs keep (``RingOptions.cuda_graphs``; 0 without)."""
        return sum(g.memory_bytes() for g in {id(x): x for x in (self.graphs, self._ring.graphs) if x}.values())

    def graphed(self, fn):
        """``fn(run, *per-rank lists)`` (a ring forward or backward), replayed from a CUDA graph
        where ``RingOptions.cuda_graphs`` asks and the call can be captured (:mod:`.ring.graphs`),
        else from a launch tape where ``RingOptions.launch_tapes`` allows (:mod:`.ring.tapes`)."""
        if self.graphs is not None:
            return functools.partial(self.graphs.call, fn)
        if self.tapes is not None:
            return functools.partial(self.tapes.call, fn)
        return fn

    def tape_memory(self) -> int:
        """Bytes of device memory this group's launch tapes keep between calls (their scratch;
        ``RingOptions.launch_tapes``)."""
        return sum(t.memory_bytes() for t in {id(x): x for x in (self.tapes, self._ring.tapes) if x}.values())

    @property
    def timeout(self) -> datetime.timedelta:
        """Of every collective and ring hop: ``options.timeout_s``."""
        return datetime.timedelta(seconds=self.options.timeout_s)

    def _subgroups(self):
        """(Ulysses group of my g, ring group of my u), created by their members only (so CP groups
        of several dp replicas never have to create each other's groups: a ``dist.new_group``
        over one CP group's ranks would hang them); after a failed call, fresh ones the same way."""
        U = self.ulysses
        ranks = [dist.get_global_rank(self.group, i) for i in range(self.world_size)]
        g, u = divmod(self.rank, U)
        return new_local_group(ranks[g * U:(g + 1) * U], self.timeout), new_local_group(ranks[u::U], self.timeout)

    @classmethod
    def simulated(cls, world_size: int, layout: str | Layout = "zigzag", backend="auto",
                  transport: LoopbackTransport | None = None, ulysses: int = 1,
                  options: RingOptions | None = None) -> ContextParallel:
        """All ``world_size`` ranks in this process on one device (loopback hops; the Ulysses
        all-to-all is a head split, which moves nothing on one device)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return cls(layout=layout, backend=backend, ulysses=ulysses, options=options, _simulated=world_size,
                   _transport=transport)

    @classmethod
    def auto(cls, group=None, num_heads: int | None = None, num_kv_heads: int | None = None,
             nvlink_domain_size: int | None = None, backend="auto", layout: str = "zigzag",
             options: RingOptions | None = None, packed: bool = False) -> ContextParallel:
        """(U, R) from the planner (:mod:`ringfa4.parallel.planner`): U as large as the heads and
        the NVLink domain (``nvlink_domain_size``, else ``options.nvlink_domain``, else detected)
        allow, the ring for the rest; ``packed=True`` (batches of packed documents): the ring
        alone. ``cp.describe()`` says what it chose."""
        if num_heads is None or num_kv_heads is None:
            raise ValueError("ContextParallel.auto needs num_heads and num_kv_heads")
        probe = cls(group, layout, backend, options=options)
        given = nvlink_domain_size if nvlink_domain_size is not None else probe.options.nvlink_domain
        domain, source = detect_nvlink_domain(given, probe.group)
        plan = plan_cp(probe.world_size, num_heads, num_kv_heads, domain, source, layout, packed)
        cp = probe if plan.ulysses == 1 else cls(probe.group, layout, backend, plan.ulysses, options=probe.options)
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
        return self.comm.is_simulated

    def __repr__(self) -> str:
        kind = "simulated" if self.is_simulated else f"rank {self.rank}"
        return (f"ContextParallel({kind}, world_size={self.world_size}, ulysses={self.ulysses}, "
                f"layout={self.ring_layout.name!r}, options={self.options})")

    # -- data placement --------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of the full tensor ``x`` along ``dim`` (identity when simulated)."""
        return self.comm.shard(self.layout, x, dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All-gather the local parts back into global order (identity when simulated); any length:
        the ranks' parts may differ by the layout's uneven last chunk."""
        seq_len = self.comm.total_rows(x_local.shape[dim])
        cap = self.layout.max_rows(seq_len)
        return self.comm.unshard(_SeqPlacement(self.layout, seq_len), x_local, dim,
                                 None if cap == x_local.shape[dim] and seq_len == cap * self.world_size else cap)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions (int64) of the local tokens of a ``seq_len``-token sequence."""
        return self.comm.shard(self.layout, torch.arange(seq_len, device=device), 0)

    # -- packed documents ----------------------------------------------------------------------
    def pack(self, cu_seqlens, mode: str = "auto") -> Pack:
        """The placement of a packed batch's documents: ``cu_seqlens`` are the batch's global
        int32 document boundaries (any lengths, zero allowed). ``mode``:

        - "balanced": the cost-balanced placement (:mod:`ringfa4.parallel.dispatch`): short
          documents whole on one rank, long ones in tile-aligned pieces on the ranks they need;
          only the split documents' K/V move, through ring hops or the all-gather mode's exchange
          (each rank receives just the pieces its rows see) by the rule of
          :func:`~ringfa4.parallel.allgather.prefer_allgather` applied to the split documents;
        - "auto" (default): "balanced" (the solver itself falls back to splitting every document
          where that balances best, which is the per-document placement), except where the
          balanced placement leaves a rank without tokens and the layout inside every document
          gives every rank some (tiny packs: fewer tokens than the tile-aligned pieces can
          spread; a model's layers cannot run a zero-length shard): then that layout;
        - "ring" / "allgather": the layout inside every document, every token's K/V moving by ring
          hops / the exchange (kept for comparison and for the layout's own chunking).
        ``pack.describe()`` prints the placement and the balance reached."""
        error, packing = None, None
        try:
            if mode not in PACK_MODES:
                raise ValueError(f"mode must be one of {', '.join(map(repr, PACK_MODES))}, got {mode!r}")
            if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype != torch.int32:
                raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
            packing = Packing(cu_seqlens, self.ring_layout, balanced=mode in ("auto", "balanced"))
            if mode == "auto" and _leaves_a_rank_empty(packing):
                spread = Packing(packing.cu, self.ring_layout)
                packing = packing if _leaves_a_rank_empty(spread) else spread
        except ValueError as exc:
            error = f"{self.comm.where()}{exc}"
        if not self.is_simulated:  # every rank's cu_seqlens compared: the same ValueError everywhere
            self.comm.check_pack(None if packing is None else list(packing.cu), error)
        elif error:
            raise ValueError(error)
        return Pack(self, packing, mode)

    def pack_from_position_ids(self, position_ids: torch.Tensor, mode: str = "auto") -> Pack:
        """:meth:`pack` from HF-style position_ids that restart at 0 at every document."""
        return self.pack(cu_seqlens_from_position_ids(position_ids), mode)

    # -- attention -------------------------------------------------------------------------------
    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                 pack: Pack | None = None) -> None:
        """Local checks of one call (dense, or packed with ``pack``), then (distributed) the
        metadata all-gather: the same ValueError everywhere before any data moves."""
        where = self.comm.where()
        if pack is None:
            shape, fingerprint = CallShape.of(q, k, v), 0
            error = check_local(q, k, v, spec, self.layout, where, self.comm.global_length(q.shape[1]))
        else:
            shape, fingerprint = CallShape.of(q, k, v, pack.packing.total), pack.fingerprint
            error = pack.check_local(q, k, v, spec, where)
        if error is None and self.ulysses > 1:
            try:
                HeadSplit(q.shape[-2], k.shape[-2], self.ulysses, where)
            except ValueError as exc:
                error = str(exc)
        self.comm.agree(self, error, shape, spec, fingerprint, None if pack is None else pack.packing.cu)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                  packing: Pack | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """CP attention of the local (or, simulated, full) q, k, v: ``(out, lse)``; with
        ``packing`` the tensors are packed ``(t, h, d)`` and lse is ``(h, t)``."""
        if packing is not None:
            return packing.attention(q, k, v, spec)
        self.validate(q, k, v, spec)
        seq_len = self.comm.global_length(q.shape[1])  # distributed: the check's sum of the ranks' lengths
        if self.ulysses == 1:
            return self._ring_attention(q, k, v, spec, seq_len)
        split = HeadSplit(q.shape[2], k.shape[2], self.ulysses)
        k, v = expand_kv_heads(k, split.kv_factor), expand_kv_heads(v, split.kv_factor)
        pieces = self.comm.ulysses_pieces(_SeqPlacement(self.layout, seq_len))  # uneven lengths: unequal pieces
        views = self.ulysses_comm.seq_to_heads([q, k, v], 2, pieces)  # per local Ulysses index: its heads
        specs = _head_specs(spec, self.ulysses_comm.ranks, self.ulysses)
        parts = [self._ring._ring_attention(*t, s, seq_len) for t, s in zip(views, specs)]
        return (self.ulysses_comm.heads_to_seq([p[0] for p in parts], 2, pieces),
                self.ulysses_comm.lse_heads_to_seq([p[1] for p in parts], 1, pieces))

    def _ring_attention(self, q, k, v, spec, seq_len: int | None = None):
        if self.world_size == 1:  # one backend call
            return block_attention(q, k, v, get_backend(self.backend_name, q.device, q.dtype), spec)
        return _RingAttention.apply(q, k, v, self, spec, None, False, spec.sinks, seq_len)

    def run(self, q: torch.Tensor, spec: AttnSpec, packing: Packing | None = None,
            allgather: bool = False, seq_len: int | None = None) -> RingRun:
        """The :class:`~ringfa4.parallel.ring.RingRun` of one call (dense of ``seq_len`` tokens,
        default the group's length for q, or over ``packing``)."""
        if packing is not None:
            schedule = packing.schedule(AllGatherSchedule if allgather else PackedRingSchedule, spec.causal,
                                        spec.window)
        else:
            seq_len = self.comm.global_length(q.shape[1]) if seq_len is None else seq_len
            schedule = ring_schedule(self.layout, seq_len, spec.causal, spec.window)
        backend = get_backend(self.backend_name, q.device, q.dtype)
        if spec.sinks is None and not spec.varlen:  # (tensor-free: one value a spec, equal keys the same object)
            base = _block_spec(spec)
        else:
            base = spec.replace(causal=False, window=(None, None), sinks=None)
        sinks = None if spec.sinks is None else spec.sinks.detach()
        return RingRun(schedule, self.comm.ranks, backend, base, self.transport, self.options, sinks)


class _RingAttention(torch.autograd.Function):
    """One ring (or all-gather) call over ``cp``'s group: every local rank's tensors split out,
    run, joined back; autograd flows to the (local or, simulated, full) inputs and to ``sinks``
    (``spec.sinks``: applied once to each rank's merged result; each rank's ``d sinks`` covers its
    own rows)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, spec: AttnSpec, packing: Packing | None = None,
                allgather: bool = False, sinks: torch.Tensor | None = None, seq_len: int | None = None):
        run = cp.run(q, spec, packing, allgather, seq_len)
        place, dim = (cp.layout, 1) if packing is None else (packing, 0)
        qs, ks, vs = (cp.comm.split(place, t, dim) for t in (q, k, v))
        ctx.fns = (allgather_forward, allgather_backward) if allgather else (ring_forward, ring_backward)
        kept = replay_output()  # a checkpoint recompute with the forward's (out, lse) kept
        if kept is None:
            outs, lses = cp.comm.guard(cp.graphed(ctx.fns[0]), run, qs, ks, vs)
            out, lse = cp.comm.join(place, outs, dim), cp.comm.join(place, lses, dim + 1)
            record_output(out, lse)
        else:
            out, lse = kept
            outs, lses = cp.comm.split(place, out, dim), cp.comm.split(place, lse, dim + 1)
        ctx.cp, ctx.run, ctx.place, ctx.dim = cp, run, place, dim
        ctx.parts = (qs, ks, vs, outs, lses)
        ctx.sink_io = None if sinks is None else (out, lse, sinks)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros made for lse's gradient (a fill launch a call)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        cp, run, place, dim = ctx.cp, ctx.run, ctx.place, ctx.dim
        qs, ks, vs, outs, lses = ctx.parts
        if dout is None:  # out took no part in the loss: zeros keep every rank's collectives in step
            dout = torch.zeros_like(cp.comm.join(place, outs, dim))
        douts = cp.comm.split(place, dout.contiguous(), dim)
        dqs, dks, dvs = cp.comm.guard(cp.graphed(ctx.fns[1]), run, douts, qs, ks, vs, outs, lses)
        ctx.parts = None
        dsinks = None
        if ctx.sink_io is not None and ctx.needs_input_grad[7]:
            dsinks = sink_grad(dout, *ctx.sink_io)  # this rank's rows (simulated: all of them)
        ctx.sink_io = None
        return (cp.comm.join(place, dqs, dim), cp.comm.join(place, dks, dim), cp.comm.join(place, dvs, dim),
                None, None, None, None, dsinks, None)


@functools.lru_cache(maxsize=64)
def _block_spec(spec: AttnSpec) -> AttnSpec:
    """A tensor-free ``spec`` without its mask (the schedule's blocks carry their own), made once: a
    run's spec is then the same object every call, which its tape's key compares by identity."""
    return spec.replace(causal=False, window=(None, None), sinks=None)


def _leaves_a_rank_empty(packing: Packing) -> bool:
    """Whether some rank holds no token of a pack that has at least one token a rank."""
    P = packing.world_size
    return packing.total >= P and any(packing.rows(r) == 0 for r in range(P))


class Pack:
    """A :class:`Packing` bound to its CP group: ``shard``, ``unshard``, ``positions`` and the
    packed attention. Simulated: shard/unshard are the identity, positions restart per document."""

    def __init__(self, cp: ContextParallel, packing: Packing, mode: str = "auto") -> None:
        self.cp, self.packing, self.mode = cp, packing, mode  # packing: the ring level's
        self.placement = packing if cp.ulysses == 1 else HybridPacking(packing, cp.ulysses)

    def uses_allgather(self, num_heads: int, num_kv_heads: int) -> bool:
        """Whether the travelling K/V move by the all-gather mode (``mode``, or the rule for balanced)."""
        if self.mode in ("ring", "allgather"):
            return self.mode == "allgather"
        return prefer_allgather(self.packing, num_heads, num_kv_heads)

    def describe(self, num_kv_heads: int | None = None, head_dim: int | None = None) -> str:
        """The placement, the balance reached and the bytes a hop moves (see :meth:`Packing.describe`)."""
        return self.packing.describe(num_kv_heads, head_dim)

    def __repr__(self) -> str:
        return f"Pack({self.packing!r})"

    @property
    def fingerprint(self) -> int:
        """A 62-bit fingerprint of the pack's cu_seqlens and mode (the cross-rank check compares it)."""
        return hash((self.packing.cu, PACK_MODES.index(self.mode))) & ((1 << 62) - 1)

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self.cp.comm.shard(self.placement, x, dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """All-gather the (unevenly sized) local parts back into the packed global order."""
        return self.cp.comm.unshard(self.placement, x_local, dim, max_rows=self.placement.max_rows)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Positions inside each document (restart at 0) of the local tokens."""
        full = to_device(torch.cat([torch.arange(n) for n in self.packing.doc_lengths] or
                                   [torch.zeros(0, dtype=torch.long)]), device)
        return self.shard(full, 0)

    def attention(self, q, k, v, spec: AttnSpec):
        self.cp.validate(q, k, v, spec, pack=self)
        allgather = self.uses_allgather(q.shape[1], k.shape[1])
        if self.cp.ulysses > 1:
            return self._hybrid(q, k, v, spec, allgather)
        return self._ring_level(q, k, v, spec, allgather, False)

    def _hybrid(self, q, k, v, spec, allgather: bool):
        """Ulysses all-to-all inside the group, then the ring level's packed attention."""
        cp = self.cp
        split = HeadSplit(q.shape[1], k.shape[1], cp.ulysses)
        k, v = (expand_kv_heads(t.unsqueeze(0), split.kv_factor)[0] for t in (k, v))
        ring = Pack(cp._ring, self.packing)
        pieces = cp.comm.ulysses_pieces(self.placement)
        views = cp.ulysses_comm.seq_to_heads([q, k, v], 1, pieces)
        specs = _head_specs(spec, cp.ulysses_comm.ranks, cp.ulysses)
        parts = [ring._ring_level(*t, s, allgather, True) for t, s in zip(views, specs)]
        return (cp.ulysses_comm.heads_to_seq([p[0] for p in parts], 1, pieces),
                cp.ulysses_comm.lse_heads_to_seq([p[1] for p in parts], 0, pieces))

    def _ring_level(self, q, k, v, spec, allgather: bool, use_schedule: bool):
        """Packed attention of this pack's (ring-level) cp, without validation. ``use_schedule``:
        run the packing's schedule even on one rank (the tokens are a rank's part-major local
        tokens, or, simulated, the batch the simulated executor splits), so a hybrid's ring level
        computes the same blocks in both executors; else one varlen call on a lone rank."""
        cp = self.cp
        if not use_schedule and self.is_one_dense_sequence():  # the dense ring's kernels and schedule
            out, lse = cp._ring_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), spec, self.packing.total)
            return out[0], lse[0]
        if cp.world_size == 1 and not use_schedule:  # the whole batch in global order: one varlen call
            cu, longest = self.packing.cu_seqlens(q.device), max(self.packing.doc_lengths, default=0)
            vspec = spec.replace(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            return cp._ring_attention(q, k, v, vspec)
        return _RingAttention.apply(q, k, v, cp, spec, self.packing, allgather, spec.sinks)

    @cached_method
    def is_one_dense_sequence(self) -> bool:
        """Whether this pack is one document placed exactly as the dense layout places a sequence of
        its length (the balanced placement of a long document usually is): its attention then runs
        the dense ring (fp32 epilogue merges, the accumulating backward's in-place head groups)."""
        packing, cp = self.packing, self.cp
        if cp.world_size == 1 or cp.ulysses != 1 or sum(1 for n in packing.doc_lengths if n) != 1:
            return False
        return all([(s.start, s.length) for s in packing.segments(r)] ==
                   [(a, n) for a, n in cp.layout.segments(packing.total, r) if n] for r in range(cp.world_size))

    def check_local(self, q, k, v, spec: AttnSpec, where: str) -> str | None:
        """This rank's packed tensors against the pack: the error message, or None."""
        rows = self.cp.comm.local_rows(self.placement, self.packing.total)
        try:
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t.dim() != 3:
                    raise ValueError(f"{where}{name} must be packed (total, h, d) with packing, got {tuple(t.shape)}")
                if t.shape[0] != rows:
                    raise ValueError(f"{where}{name} must have this rank's {rows} packed tokens, got {t.shape[0]}")
            check_spec = spec.replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
            validate_block(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), check_spec, where)
        except ValueError as exc:
            return str(exc)
        return None


def _head_specs(spec: AttnSpec, indices: tuple[int, ...], degree: int) -> list[AttnSpec]:
    """Per local Ulysses index, ``spec`` with the sinks of that index's q heads (the all-to-all
    gives index u the u-th of ``degree`` equal head slices)."""
    if spec.sinks is None:
        return [spec] * len(indices)
    per = spec.sinks.shape[0] // degree
    return [spec.replace(sinks=spec.sinks[u * per:(u + 1) * per]) for u in indices]


class _SeqPlacement:
    """A dense layout bound to one sequence length: what the groups' unshard and Ulysses pieces
    need of a placement (``unshard(parts, dim)`` of padded parts, ``pieces(g)``, ``ulysses``)."""

    def __init__(self, layout: Layout, seq_len: int) -> None:
        self.layout, self.seq_len, self.ulysses = layout, seq_len, layout.ulysses

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        return self.layout.shard(x, dim, rank)

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        return self.layout.unshard(parts, dim, self.seq_len)

    def pieces(self, g: int) -> list[tuple[int, int]]:
        return self.layout.pieces(self.seq_len, g)
