"""``ContextParallel``: a CP group, its layout and backend, and the ring attention autograd op.

    cp = ContextParallel(group=None, layout="zigzag", backend="auto")   # distributed
    cp = ContextParallel.simulated(world_size=8, layout="zigzag")       # all ranks in one process
    x_local = cp.shard(x, dim=1); pos = cp.positions(seq_len); x = cp.unshard(x_local, dim=1)

Distributed: tensors are this rank's shard. Simulated: tensors are the full sequence (shard and
unshard are the identity, positions are 0..S-1) and ``run`` executes every rank's schedule.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..kernels import AttnSpec, get_backend
from .checks import check_local, exchange_and_check, peer_failure, post_error
from .executor import RingRun, ring_backward, ring_forward
from .layouts import Layout, make_layout
from .ring import RingSchedule
from .transport import LoopbackTransport, P2PTransport

__all__ = ["ContextParallel", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("RINGFA4_TIMEOUT_S", "300")))
"""Timeout of every collective and ring hop (env ``RINGFA4_TIMEOUT_S``, default 300 s)."""


class ContextParallel:
    """A context-parallel group: ``group`` (ProcessGroup, 1-D DeviceMesh, or None for the default
    group), ``layout`` ("zigzag" | "contiguous"), ``backend`` (block-kernel name or object),
    ``timeout`` (collectives and hops)."""

    def __init__(self, group=None, layout: str | Layout = "zigzag", backend="auto",
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT, *, _simulated: int | None = None,
                 _transport=None) -> None:
        self.timeout = timeout
        self.backend_name = backend
        if _simulated is not None:
            self.group, self.rank, self.world_size = None, None, _simulated
            self.transport = _transport or LoopbackTransport()
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
            self.transport = _transport or P2PTransport(
                self.group, self.rank, self.world_size, timeout,
                on_timeout=lambda peer, exc: peer_failure(self.rank, peer, exc))
        self.layout = make_layout(layout, self.world_size)

    @classmethod
    def simulated(cls, world_size: int, layout: str | Layout = "zigzag", backend="auto",
                  transport: LoopbackTransport | None = None) -> ContextParallel:
        """All ``world_size`` ranks in this process on one device (loopback hops)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return cls(layout=layout, backend=backend, _simulated=world_size, _transport=transport)

    @property
    def is_simulated(self) -> bool:
        return self.rank is None

    def __repr__(self) -> str:
        kind = "simulated" if self.is_simulated else f"rank {self.rank}"
        return f"ContextParallel({kind}, world_size={self.world_size}, layout={self.layout.name!r})"

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

    # -- attention -------------------------------------------------------------------------------
    def _where(self) -> str:
        return "" if self.is_simulated else f"rank {self.rank}: "

    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> None:
        """Local checks, then (distributed) the metadata all-gather: the same ValueError everywhere."""
        error = check_local(q, k, v, spec, self.layout, self._where(), local=not self.is_simulated)
        if self.is_simulated or self.world_size == 1:
            if error:
                raise ValueError(error)
            return
        exchange_and_check(self.group, self.rank, self.world_size, error, q, k, v, spec, self.layout, self.timeout)

    def run(self, q: torch.Tensor, spec: AttnSpec) -> RingRun:
        seq_len = q.shape[1] * (1 if self.is_simulated else self.world_size)
        schedule = RingSchedule(self.layout, seq_len, spec.causal, spec.window)
        ranks = tuple(range(self.world_size)) if self.is_simulated else (self.rank,)
        backend = get_backend(self.backend_name, q.device, q.dtype)
        base = spec.replace(causal=False, window=(None, None))
        return RingRun(schedule, ranks, backend, base, self.transport)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring attention of the local (or, simulated, full) q, k, v: ``(out, lse)``."""
        self.validate(q, k, v, spec)
        return _RingAttention.apply(q, k, v, self, spec)

    # per-rank views for the simulated executor
    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not self.is_simulated:
            return [x]
        return [self.layout.shard(x, 1, r).contiguous() for r in range(self.world_size)]

    def _join(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        return self.layout.unshard(parts, dim) if self.is_simulated else parts[0]

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
    def forward(ctx, q, k, v, cp: ContextParallel, spec: AttnSpec):
        run = cp.run(q, spec)
        qs, ks, vs = cp._split(q), cp._split(k), cp._split(v)
        outs, lses = cp._guard(ring_forward, run, qs, ks, vs)
        ctx.cp, ctx.run = cp, run
        ctx.save_for_backward(q, k, v)
        ctx.parts = (qs, ks, vs, outs, lses) if cp.is_simulated else None
        out, lse = cp._join(outs), cp._join(lses, dim=2)
        if not cp.is_simulated:
            ctx.parts = ([q], [k], [v], [out], [lse])
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        cp, run = ctx.cp, ctx.run
        qs, ks, vs, outs, lses = ctx.parts
        douts = cp._split(dout.contiguous())
        dqs, dks, dvs = cp._guard(ring_backward, run, douts, qs, ks, vs, outs, lses)
        ctx.parts = None
        return cp._join(dqs), cp._join(dks), cp._join(dvs), None, None
