"""The two kinds of CP group, with the same methods, so ``ContextParallel`` and ``Pack`` never ask
which one they hold:

- :class:`DistributedGroup`: this process is one rank of a torch.distributed group; tensors are
  its shard; ``split`` / ``join`` are one-element lists; every wait is watched by the group's
  error channel (:mod:`.errors`: a posted error, a dead or a missing rank ends it within seconds,
  named); the metadata checks run on a control group of their own (gloo), and after a failed call
  the data groups are renewed at the next check, so the group takes the next call;
- :class:`SimulatedGroup`: all ``world_size`` ranks in this process on one device; tensors are the
  full sequence (``shard`` / ``unshard`` the identity), ``split`` cuts them per rank and ``join``
  puts them back; the Ulysses all-to-all is a head split (moves nothing on one device).

``placement`` arguments are a layout (dense) or a packing (packed documents): both offer
``shard(x, dim, rank)`` and ``unshard(parts, dim)``.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..kernels.spec import AttnSpec
from .checks import CallShape, call_key, check_cu_seqlens, exchange_and_check, gather_ints
from .errors import Channel, is_peer_failure
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
        """Every rank's part of the full ``x``, contiguous, in rank order (one gather)."""
        return placement.split_all(x, dim)

    def join(self, placement, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        return placement.unshard(parts, dim)

    def guard(self, fn: Callable, *args):
        return fn(*args)

    def global_length(self, local: int) -> int:
        """The sequence length a call's tensors stand for: here they are the full sequence."""
        return local

    def total_rows(self, local: int) -> int:
        """The full sequence's rows: the tensors here are the full sequence."""
        return local

    def local_rows(self, placement, total: int) -> int:
        """Packed tokens a call's tensors hold: the whole pack."""
        return total

    def ulysses_pieces(self, placement) -> None:
        """The Ulysses group's packed pieces: not needed (the all-to-all is a head split)."""
        return None

    def agree(self, cp, error: str | None, shape: CallShape | None, spec: AttnSpec, fingerprint: int,
              cu: tuple[int, ...] | None = None) -> None:
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


# per default process group (dropped with it, so a re-initialised world never meets a destroyed one's
# groups): {rank set: the gloo group its metadata checks run on} and {rank set: [epoch, data group]}
_CONTROL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@atexit.register
def _release_groups() -> None:
    """Drop our process groups while the interpreter is whole: destroyed at interpreter teardown
    instead, a gloo group's threads end the process with SIGABRT ("terminate called without an
    active exception") after ``destroy_process_group()`` returned (issue 24)."""
    _CONTROL.clear()
    _DATA.clear()
    gc.collect()  # ContextParallel objects in reference cycles hold groups too


def _of_world(cache: weakref.WeakKeyDictionary) -> dict:
    """``cache``'s entries of the current default process group."""
    world = dist.distributed_c10d._get_default_group()
    mine = cache.get(world)
    if mine is None:
        mine = cache[world] = {}
    return mine


def new_local_group(ranks: list[int], timeout: datetime.timedelta):
    """A process group of ``ranks`` (global) that only its members create (hashed name)."""
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)


def _control_group(group, ranks: list[int], timeout: datetime.timedelta):
    """The gloo group the metadata checks of ``ranks`` run on, one per rank set, whatever the data
    group's backend: no data ever moves on it, so a failed call's leftovers never meet the next
    call's check, and its tensors live on the CPU, so a check never waits for the GPU queue (an
    all-gather on an NCCL group and its ``.tolist()`` drained the queue once per call). Under torch's
    fake process group (one process standing for every rank: tracing, memory estimates, host-cost
    benchmarks) a fake one: its collectives return at once, this rank's data as every rank's."""
    mine, key = _of_world(_CONTROL), tuple(ranks)
    if key not in mine:
        backend = "fake" if dist.get_backend(group) == "fake" else "gloo"
        mine[key] = dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
    return mine[key]


def _data_group(group, ranks: list[int], timeout: datetime.timedelta) -> list:
    """``[epoch, group]`` of ``ranks``' data: over gloo a group of our own (so a failed call never
    leaves anything on the user's group), renewed after a failed call; NCCL: ``group`` itself."""
    mine, key = _of_world(_DATA), tuple(ranks)
    if key not in mine:
        mine[key] = [0, new_local_group(ranks, timeout) if dist.get_backend(group) == "gloo" else group]
    return mine[key]


class DistributedGroup:
    """One rank of ``group`` (see the module doc); ``timeout`` bounds every wait. ``channel``: the
    parent CP group's error channel (a hybrid's Ulysses and ring sub-groups share it); ``cp_ranks``:
    the CP-group rank of each rank of ``group``."""

    is_simulated = False

    def __init__(self, group, timeout: datetime.timedelta, transport: Transport | None = None,
                 channel: Channel | None = None, cp_ranks: list[int] | None = None) -> None:
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
        self.global_ranks = ([dist.get_global_rank(self.group, i) for i in range(self.world_size)]
                             if self.group is not None else [0])
        self.cp_ranks = cp_ranks or list(range(self.world_size))
        top = channel is None and self.group is not None
        self.channel = channel if not top else Channel(self.group, self.rank, self.world_size,
                                                       timeout.total_seconds())
        self.control = _control_group(self.group, self.global_ranks, timeout) if top and self._local() else None
        self.agreed_epoch = 0
        self.agreed_seq_len: int | None = None  # the last check's sum of dense local lengths
        self.agreed_key: tuple[int, ...] | None = None  # this rank's key of the last check that passed
        self.data = _data_group(self.group, self.global_ranks, timeout) if top and self._local() else None
        self.epoch = self.data[0] if self.data else 0
        self.on_new_epoch: Callable[[], None] | None = None  # renews a hybrid's sub-groups (ContextParallel)
        self._calls: dict[int, int] = {}  # id(run) -> the call its forward belonged to (its backward's too)
        data = self.data[1] if self.data else self.group
        self.transport = transport or P2PTransport(data, self.rank, self.world_size, timeout, self.channel,
                                                   self.cp_ranks)

    def where(self) -> str:
        return f"rank {self.rank}: "

    def _local(self) -> bool:
        return self.world_size > 1

    def rebind(self, group) -> None:
        """Move this rank's data onto ``group`` (a renewed group of the same ranks)."""
        if self.data is None:  # a hybrid's sub-group: its own group is its data group
            self.group = group
        self.transport.group = group

    def _renew(self) -> None:
        """After a failed call (some rank's epoch grew): fresh data groups on every rank, at the
        same point of the same check; the old ones keep what a failed call left on them."""
        if self.data is None:
            return
        if self.agreed_epoch > self.data[0] and dist.get_backend(self.data[1]) == "gloo":
            self.data[:] = [self.agreed_epoch, new_local_group(self.global_ranks, self.timeout)]
        self.channel.want_epoch = max(self.channel.want_epoch, self.data[0])
        if self.epoch < self.data[0]:
            self.epoch = self.data[0]
            if self.on_new_epoch is not None:
                self.on_new_epoch()
            self.rebind(self.data[1])

    def _failed(self, exc: BaseException, call: int) -> None:
        """This rank leaves a call by ``exc``: post it if it is a root cause; renew data groups."""
        if self.channel is None:
            return
        self.channel.want_epoch += 1
        if not is_peer_failure(exc):
            self.channel.post(call, f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc),
                              type(exc).__name__)

    def _guarded(self, call: int, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as exc:
            found = self.channel.streams.take_failure() if self.channel is not None else None
            if found is not None:  # the watch's verdict, not what the aborted communicator raised
                self._failed(found, call)
                raise found from exc
            self._failed(exc, call)
            raise

    def shard(self, placement, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of ``x``. A bad ``x`` (a local ValueError) is posted under the next
        call's key first, so the peers' next check raises the same ValueError within seconds."""
        if not self._local():
            return x
        try:
            return placement.shard(x, dim, self.rank)
        except ValueError as exc:
            message = f"rank {self.rank}: {exc}"
            if self.channel is not None:
                self.channel.post(self.channel.call + 1, message, "ValueError")
            raise ValueError(message) from None

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
        call = self.channel.next_call()
        work = dist.all_gather(parts, buf, group=self.transport.group, async_op=True)
        self._guarded(call, self.channel.wait, work, call, "unshard's all-gather", None, None, self.transport.group)
        return placement.unshard(parts, dim)

    def split(self, placement, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [x]

    def global_length(self, local: int) -> int:
        """The sequence length a call's shards stand for: the last metadata check's sum of the
        ranks' lengths (any length), else ``local`` x the world (a group of one: ``local``)."""
        if self._local() and self.agreed_seq_len is not None:
            return self.agreed_seq_len
        return local * self.world_size

    def total_rows(self, local: int) -> int:
        """The sum over ranks of ``local`` (one small all-gather)."""
        if not self._local():
            return local
        call = self.channel.next_call()
        return sum(r[0] for r in gather_ints(self, call, [local], "a length all-gather"))

    def local_rows(self, placement, total: int) -> int:
        """Packed tokens this rank's tensors hold."""
        return placement.rows(self.rank) if self._local() else total

    def ulysses_pieces(self, placement) -> list[int]:
        """Rows of each rank of this rank's Ulysses group (``placement`` a HybridPacking)."""
        return [n for _, n in placement.pieces(self.rank // placement.ulysses)]

    def agree(self, cp, error: str | None, shape: CallShape | None, spec: AttnSpec, fingerprint: int,
              cu: tuple[int, ...] | None = None) -> None:
        """The metadata all-gather: the same ValueError on every rank, before any data moves
        (``cu``: the pack's cu_seqlens, compared boundary by boundary when the fingerprints
        differ); renews the data groups first when a rank failed a call since the last check.
        With ``RingOptions(metadata_check="new_shapes")`` a call whose key (:func:`.checks.call_key`)
        equals the last agreed one skips it: the call number moves on as the check would move it
        (every rank skips alike), and a failure the stream watch found since is raised there; a
        rank whose key is new announces its check and exchanges once every rank has
        (:meth:`.errors.Channel.announce_check`; peers that skipped it post the mismatch); a rank
        whose local checks failed posts its ValueError and raises it without the exchange, so
        every rank raises the same ValueError within about a second."""
        if not self._local():
            if error:
                raise ValueError(error)
            return
        new_shapes = cp.options.metadata_check == "new_shapes"
        once = new_shapes and error is None and shape is not None
        if once and call_key(cp, shape, spec, fingerprint, self.channel.want_epoch) == self.agreed_key:
            self.channel.next_call()
            return
        self.agreed_key = None
        if new_shapes and error:  # peers that repeat the agreed key skip the exchange: post it instead,
            call = self.channel.next_call()  # so they raise it from their waits (a ValueError stays one), and
            self.channel.post(call, error, "ValueError")  # peers in the exchange see it there, within seconds
            found = self.channel.posted(call)  # the first post wins: several bad ranks raise the same one
            raise self.channel.peer_error(call, "the metadata check", found) if found else ValueError(error)
        try:
            exchange_and_check(cp, error, shape, spec, fingerprint, self.channel.want_epoch, announce=once)
        except ValueError as exc:
            self._renew()
            if cu is not None and "packing (cu_seqlens and mode fingerprint)" in str(exc):
                check_cu_seqlens(self, list(cu), None)
            raise
        self._renew()
        if once:  # (after the renewal, which may move want_epoch: the next call's key is compared to this)
            self.agreed_key = call_key(cp, shape, spec, fingerprint, self.channel.want_epoch)

    def check_pack(self, cu: list[int] | None, error: str | None) -> None:
        """``cp.pack``'s cu_seqlens against every rank's (see :func:`.checks.check_cu_seqlens`)."""
        if not self._local():
            if error:
                raise ValueError(error)
            return
        check_cu_seqlens(self, cu, error)

    def join(self, placement, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        return parts[0]

    def guard(self, fn: Callable, *args):
        """``fn(run, ...)`` (a ring forward or backward); a failure is posted to the error
        channel under the run's call first (a backward uses its forward's call), for the peers."""
        if self.channel is None:
            return fn(*args)
        run = args[0]
        call = self._calls.get(id(run))
        if call is None:
            call = self._calls[id(run)] = self.channel.call
            weakref.finalize(run, self._calls.pop, id(run), None)
        self.transport.call = call
        return self._guarded(call, fn, *args)

    def _all_to_all(self, call: int, flat: torch.Tensor, recv_sizes: list[int], send_sizes: list[int]
                    ) -> torch.Tensor:
        out = flat.new_empty(sum(recv_sizes))
        work = self._guarded(call, dist.all_to_all_single, out, flat, recv_sizes, send_sizes, self.group, True)
        self._guarded(call, self.channel.wait, work, call, "the Ulysses all-to-all", None, None, self.group)
        return out

    def _comm(self, rows: int, pieces: list[int] | None) -> UlyssesComm:
        call = self.channel.call
        return UlyssesComm(self.world_size, self.rank, pieces or [rows] * self.world_size,
                           lambda *a: self._all_to_all(call, *a))

    def seq_to_heads(self, tensors: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None
                     ) -> list[list[torch.Tensor]]:
        """The all-to-all: this rank's sequence piece of every head -> the group's sequence (pieces
        in rank order; ``pieces``: their lengths, default all equal) for this rank's head slice.
        ``head_dim`` 2: dense ``(b, s, h, d)``; 1: packed ``(t, h, d)``."""
        wide = [t if head_dim == 2 else t.unsqueeze(0) for t in tensors]
        got = self._guarded(self.channel.call, seq_to_heads, wide, self._comm(wide[0].shape[1], pieces))
        return [[g if head_dim == 2 else g.squeeze(0) for g in got]]

    def heads_to_seq(self, outs: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None) -> torch.Tensor:
        (x,) = outs
        wide = x if head_dim == 2 else x.unsqueeze(0)
        rows = (pieces[self.rank] if pieces else wide.shape[1] // self.world_size)
        out = self._guarded(self.channel.call, heads_to_seq, wide, self._comm(rows, pieces))
        return out if head_dim == 2 else out.squeeze(0)

    def lse_heads_to_seq(self, lses: list[torch.Tensor], head_dim: int, pieces: list[int] | None = None
                         ) -> torch.Tensor:
        """lse ``(b, h/U, s)`` (dense, ``head_dim`` 1) or ``(h/U, t)`` (packed, 0) back to this
        rank's rows of every head."""
        (lse,) = lses
        wide = lse if head_dim == 1 else lse.unsqueeze(0)
        rows = (pieces[self.rank] if pieces else wide.shape[2] // self.world_size)
        out = self._guarded(self.channel.call, lse_heads_to_seq, wide, self._comm(rows, pieces))
        return out if head_dim == 1 else out.squeeze(0)
