"""The two kinds of CP group, with the same methods, so ``ContextParallel`` and ``Pack`` never ask
which one they hold:

- :class:`DistributedGroup`: this process is one rank of a torch.distributed group; tensors are
  its shard; ``split`` / ``join`` are one-element lists; collectives wait at most the options'
  timeout and name the peer that failed;
- :class:`SimulatedGroup`: all ``world_size`` ranks in this process on one device; tensors are the
  full sequence (``shard`` / ``unshard`` the identity), ``split`` cuts them per rank and ``join``
  puts them back; the Ulysses all-to-all is a head split (moves nothing on one device).

``placement`` arguments are a layout (dense) or a packing (packed documents): both offer
``shard(x, dim, rank)`` and ``unshard(parts, dim)``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..kernels.spec import AttnSpec
from .checks import CallShape, exchange_and_check, peer_failure, post_error
from .transport import LoopbackTransport, P2PTransport, Transport
from .ulysses import UlyssesComm, heads_to_seq, lse_heads_to_seq, seq_to_heads, split_heads

__all__ = ["DistributedGroup", "SimulatedGroup"]


class SimulatedGroup:
    """All ranks of a CP group in this process (see the module doc)."""

    is_simulated = True
    rank = None
    group = None

    def __init__(self, world_size: int, transport: Transport | None = None) -> None:
        self.world_size = world_size
        self.ranks = tuple(range(world_size))
        self.transport = transport or LoopbackTransport()

    def where(self) -> str:
        return ""

    def shard(self, placement, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def unshard(self, placement, x: torch.Tensor, dim: int, max_rows: int | None = None) -> torch.Tensor:
        return x

    def split(self, placement, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [placement.shard(x, dim, r).contiguous() for r in range(self.world_size)]

    def join(self, placement, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        return placement.unshard(parts, dim)

    def guard(self, fn: Callable, *args):
        return fn(*args)

    def global_length(self, local: int) -> int:
        """The sequence length a call's tensors stand for: here they are the full sequence."""
        return local

    def local_rows(self, placement, total: int) -> int:
        """Packed tokens a call's tensors hold: the whole pack."""
        return total

    def ulysses_pieces(self, placement) -> None:
        """The Ulysses group's packed pieces: not needed (the all-to-all is a head split)."""
        return None

    def agree(self, cp, error: str | None, shape: CallShape | None, spec: AttnSpec, fingerprint: int) -> None:
        """One process checks alone: raise its error."""
        if error:
            raise ValueError(error)

    def seq_to_heads(self, tensors: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None
                     ) -> list[list[torch.Tensor]]:
        """Per Ulysses index u of the group (all of them here): its head slice of each tensor."""
        U = self.world_size
        return [[split_heads(t, U, u, head_dim).contiguous() for t in tensors] for u in range(U)]

    def heads_to_seq(self, outs: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None) -> torch.Tensor:
        return torch.cat(outs, dim=head_dim)

    def lse_heads_to_seq(self, lses: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None
                         ) -> torch.Tensor:
        return torch.cat(lses, dim=head_dim)


class DistributedGroup:
    """One rank of ``group`` (see the module doc); ``timeout`` bounds every collective."""

    is_simulated = False

    def __init__(self, group, timeout: datetime.timedelta, transport: Transport | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise ValueError("group was given but torch.distributed is not initialized")
            self.group, self.rank, self.world_size = None, 0, 1
        else:
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        self.ranks = (self.rank,)
        self.timeout = timeout
        self.transport = transport or P2PTransport(self.group, self.rank, self.world_size, timeout,
                                                   on_timeout=lambda peer, exc: peer_failure(self.rank, peer, exc))

    def where(self) -> str:
        return f"rank {self.rank}: "

    def _local(self) -> bool:
        return self.world_size > 1

    def shard(self, placement, x: torch.Tensor, dim: int) -> torch.Tensor:
        return placement.shard(x, dim, self.rank) if self._local() else x

    def unshard(self, placement, x_local: torch.Tensor, dim: int, max_rows: int | None = None) -> torch.Tensor:
        """All-gather the local parts back into global order; ``max_rows``: ranks hold different
        counts (packed), so every part is padded to it (the placement's unshard drops the pad)."""
        if not self._local():
            return x_local
        if max_rows is None:
            buf = x_local.contiguous()
        else:
            shape = list(x_local.shape)
            shape[dim] = max_rows
            buf = x_local.new_zeros(shape)
            buf.narrow(dim, 0, x_local.shape[dim]).copy_(x_local)
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        work = dist.all_gather(parts, buf, group=self.group, async_op=True)
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise peer_failure(self.rank, None, exc, "unshard's all-gather") from exc
        return placement.unshard(parts, dim)

    def split(self, placement, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [x]

    def global_length(self, local: int) -> int:
        """The sequence length a call's shards stand for."""
        return local * self.world_size

    def local_rows(self, placement, total: int) -> int:
        """Packed tokens this rank's tensors hold."""
        return placement.rows(self.rank) if self._local() else total

    def ulysses_pieces(self, placement) -> list[int]:
        """Rows of each rank of this rank's Ulysses group (``placement`` a HybridPacking)."""
        return [n for _, n in placement.pieces(self.rank // placement.ulysses)]

    def agree(self, cp, error: str | None, shape: CallShape | None, spec: AttnSpec, fingerprint: int) -> None:
        """The metadata all-gather: the same ValueError on every rank, before any data moves."""
        if not self._local():
            if error:
                raise ValueError(error)
            return
        exchange_and_check(cp, error, shape, spec, fingerprint)

    def join(self, placement, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        return parts[0]

    def guard(self, fn: Callable, *args):
        """``fn(*args)``; a failure is posted to the rendezvous store first, for the waiting peers."""
        try:
            return fn(*args)
        except Exception as exc:
            post_error(self.rank, f"{type(exc).__name__}: {exc}")
            raise

    def _all_to_all(self, flat: torch.Tensor, recv_sizes: list[int], send_sizes: list[int]) -> torch.Tensor:
        out = flat.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=self.group, async_op=True)
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise peer_failure(self.rank, None, exc, "an all-to-all") from exc
        return out

    def _comm(self, rows: int, pieces: list[int] | None) -> UlyssesComm:
        return UlyssesComm(self.world_size, self.rank, pieces or [rows] * self.world_size, self._all_to_all)

    def seq_to_heads(self, tensors: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None
                     ) -> list[list[torch.Tensor]]:
        """The all-to-all: this rank's sequence piece of every head -> the group's sequence (pieces
        in rank order; ``pieces``: their lengths, default all equal) for this rank's head slice.
        ``head_dim`` 2: dense ``(b, s, h, d)``; 1: packed ``(t, h, d)``."""
        wide = [t if head_dim == 2 else t.unsqueeze(0) for t in tensors]
        got = seq_to_heads(wide, self._comm(wide[0].shape[1], pieces))
        return [[g if head_dim == 2 else g.squeeze(0) for g in got]]

    def heads_to_seq(self, outs: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None) -> torch.Tensor:
        (x,) = outs
        wide = x if head_dim == 2 else x.unsqueeze(0)
        rows = (pieces[self.rank] if pieces else wide.shape[1] // self.world_size)
        out = heads_to_seq(wide, self._comm(rows, pieces))
        return out if head_dim == 2 else out.squeeze(0)

    def lse_heads_to_seq(self, lses: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None
                         ) -> torch.Tensor:
        """lse ``(b, h/U, s)`` (dense, ``head_dim`` 1) or ``(h/U, t)`` (packed, 0) back to this
        rank's rows of every head."""
        (lse,) = lses
        wide = lse if head_dim == 1 else lse.unsqueeze(0)
        rows = (pieces[self.rank] if pieces else wide.shape[2] // self.world_size)
        out = lse_heads_to_seq(wide, self._comm(rows, pieces))
        return out if head_dim == 1 else out.squeeze(0)

