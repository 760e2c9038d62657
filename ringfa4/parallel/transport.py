"""How K/V and dK/dV buffers move between ring neighbours.

``shift(send, recv, offset)`` posts, for every rank ``r`` this process runs, a transfer of
``send[i]`` to rank ``r + offset`` and of rank ``r - offset``'s buffer into ``recv[i]`` (each a
tensor, or a tuple of tensors sent as pieces: piece j of a send lands in piece j of the receive,
same sizes on every rank); ``wait``
makes the compute stream (or the CPU) wait for it. On CUDA the transfer first waits for what the
compute stream queued so far, so producers are done and earlier readers of ``recv`` have finished:
NCCL's hops are posted from the compute stream (NCCL's own stream waits for it), the loopback's
copies run on a communication stream forked from it. A hop is one post and one wait (two launch-tape
entries). ``move_start`` (the all-gather mode's exchange: any number of
row ranges sent straight from where they are to where their receiver computes with them, each rank
sending every other rank just the rows it needs) posts and ``finish`` waits, so the all-gather mode
computes one group of documents while the next group's K/V arrive.

- :class:`P2PTransport`: one NCCL batch of sends and receives (as ``batch_isend_irecv``) or one byte
  ``all_to_all_single`` a hop (gloo), every wait watched by the CP group's error channel.
- :class:`LoopbackTransport`: all P ranks in one process: device-to-device copies on the
  communication stream, forked and joined by events (the simulated executor). ``poison`` fills receive
  buffers with NaN first and ``delay_cycles`` sleeps on the communication stream before copying,
  so a missing wait shows up as a wrong result.

Stream and event operations go through :func:`ringfa4.kernels.tape.launch` (a launch tape
records them; :mod:`.ring.tapes` asks :meth:`Transport.tape_blocker` whether a transport's hops
can be taped). CUDA graphs (:mod:`.ring.graphs`) ask a transport whether its hops can be captured
(:meth:`Transport.capture_blocker`), what identifies its communicator in a graph's key
(:meth:`Transport.graph_key`), capture under :meth:`Transport.capturing` (a wait is then only
stream-ordered: the stream watch never sees a captured work) and hand it every replay
(:meth:`Transport.after_replay`: a P2P transport watches the replay as one wait of the call).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..kernels.copies import one_dtype
from ..kernels.tape import launch

__all__ = ["LoopbackTransport", "Moves", "P2PTransport", "Pending", "Transport"]


def _poison_(buf: torch.Tensor) -> None:
    """A receive buffer filled with what no hop writes: NaN for floats, every bit set for integers (a
    byte buffer whose typed views hold floats, e.g. the q side's one-buffer hop, then reads NaN in
    each of them: all-ones is a NaN in fp16, bf16 and fp32)."""
    buf.fill_(math.nan if buf.is_floating_point() else -1 if buf.dtype.is_signed else torch.iinfo(buf.dtype).max)


def _pieces(x) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _first(bufs: list) -> torch.Tensor:
    return _pieces(bufs[0])[0]


def _fork(stream: torch.cuda.Stream, other: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """``stream`` waits for what ``other`` has queued so far, through ``event`` (a wait takes the
    event's latest record, so a tape's replays reuse the event its recording made; ``wait_stream``
    made a new one every call: tens of microseconds of host time a hop)."""
    event.record(other)
    stream.wait_event(event)


def _copies_on(stream: torch.cuda.Stream, compute: torch.cuda.Stream, fork: torch.cuda.Event,
               done: torch.cuda.Event, dsts: list[torch.Tensor], srcs: list[torch.Tensor], runs: tuple[int, ...],
               delay_cycles: int = 0) -> None:
    """A loopback hop or exchange as one post: on ``stream``, after what ``compute`` queued so far
    (through ``fork``), ``dsts[i] <- srcs[i]`` in runs of ``runs[j]`` pairs (one copy, or one
    multi-tensor copy, a run: a receiving rank's pieces), then ``done`` recorded there; ``compute``
    is current again after. One launch-tape entry, as a real rank's post is one NCCL batch
    (``delay_cycles``: a sleep first on ``stream``, the tests' late hop)."""
    _fork(stream, compute, fork)
    torch.cuda.set_stream(stream)
    try:
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        at = 0
        for n in runs:
            if n == 1:
                dsts[at].copy_(srcs[at], non_blocking=True)
            else:
                torch._foreach_copy_(dsts[at:at + n], srcs[at:at + n], non_blocking=True)
            at += n
        done.record(stream)
    finally:
        torch.cuda.set_stream(compute)


def _wait_event(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    stream.wait_event(event)


def _record(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    event.record(stream)


class _Replayed:
    """A CUDA graph replay as a work the error channel can watch: ``wait()`` is a no-op (the
    replay ran on the current stream), ``wait(timeout)`` holds the host until it is done (a
    transport without an error channel), polling its end event, and raises TimeoutError past
    ``timeout``; ``is_completed()`` asks its end event."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            return True
        deadline, pause = time.monotonic() + timeout.total_seconds(), 1e-4
        while not self.event.query():  # polled, so a stuck replay ends at the timeout as a stuck hop does
            if time.monotonic() >= deadline:
                raise TimeoutError(f"a CUDA graph replay of the ring call did not finish within {timeout}")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class _Posted:
    """The works one post made (a hop, an exchange): filled by the post, read by its wait. A launch
    tape records the two as entries sharing one of these, so a replay waits for the works its own
    post made."""

    __slots__ = ("works",)

    def __init__(self, works=()) -> None:
        self.works = list(works)


class _Handle:
    def __init__(self, works=None, event=None, device: torch.device | None = None):
        self.works = works if isinstance(works, _Posted) else _Posted(works or [])
        self.event = event
        self.device = device


class Pending:
    """Transfers in flight (:meth:`Transport.move_start`): the receive tensors are valid on the
    compute stream after :meth:`Transport.finish`; ``unstage`` (gloo) copies the received bytes
    into them there."""

    def __init__(self, works=(), what: str = "", event=None, device: torch.device | None = None,
                 unstage=None) -> None:
        self.works = works if isinstance(works, _Posted) else _Posted(works)
        self.what, self.event, self.device, self.unstage = what, event, device, unstage


Moves = list[list[tuple[int, torch.Tensor]]]  # per local rank: (peer rank, tensor), in order


def _matched(sends: Moves, recvs: Moves, ranks: list[int]) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(dst, src, receive, send)`` of local ranks ``ranks`` (list index i is rank ``ranks[i]``),
    receiver by receiver: the k-th send of ``a`` to ``b`` fills the k-th receive of ``b`` from ``a``."""
    queued: dict[tuple[int, int], list[torch.Tensor]] = {}  # (src, dst): its sends, in order
    for src, out in zip(ranks, sends):
        for dst, x in out:
            queued.setdefault((src, dst), []).append(x)
    taken: dict[tuple[int, int], int] = {}
    pairs = []
    for dst, got in zip(ranks, recvs):
        for src, t in got:
            k = taken.get((src, dst), 0)
            taken[(src, dst)] = k + 1
            pairs.append((dst, src, t, queued[(src, dst)][k]))
    return pairs


def _launches(pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> list[tuple[list, list]]:
    """The copies of :func:`_matched`'s pairs as a real rank launches them, one multi-tensor copy
    each: per receiving rank, what it receives from others (its NCCL batch) and its moves to itself
    (its local copies); never one launch for several ranks (so the simulated executor issues the
    launches a real rank does)."""
    batches: dict[tuple[int, bool], tuple[list, list]] = {}
    for dst, src, recv, send in pairs:
        dsts, srcs = batches.setdefault((dst, src == dst), ([], []))
        dsts.append(recv)
        srcs.append(send)
    return list(batches.values())


class Transport:
    """Base: stream bookkeeping shared by both transports."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._current: dict[int, tuple[int, torch.cuda.Stream]] = {}
        self.in_capture = False  # a CUDA graph is being captured through this transport (capturing())

    # -- CUDA graphs (ring/graphs.py) ------------------------------------------------------------
    def capture_blocker(self) -> str | None:
        """Why a ring call over this transport cannot be captured in a CUDA graph, or None."""
        return "this transport does not say that its hops can be captured"

    def graph_key(self) -> tuple:
        """What a captured call depends on of this transport (its communicator): part of the key."""
        return ()

    def tape_blocker(self) -> str | None:
        """Why a ring call over this transport cannot be recorded in a launch tape
        (:mod:`.ring.tapes`), or None."""
        return "this transport does not say that its hops can be taped"

    def tape_self_check(self) -> bool:
        """Whether a new tape may be checked by replaying it once (:meth:`~ringfa4.kernels.tape.Tape.verify`):
        only where its hops pair with nobody else's (a real rank's extra hops would need every peer
        to replay too)."""
        return False

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While a ring call is captured: waits are stream-ordered only (nothing is watched)."""
        self.in_capture = True
        try:
            yield
        finally:
            self.in_capture = False

    def after_replay(self, device: torch.device) -> None:
        """Called after each replay of a call captured through this transport (on the replay's
        stream)."""

    def comm_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        """``torch.cuda.current_stream(device)``, its Python object kept while the raw stream stays
        the same (making one costs tens of microseconds of host time; a ring asks every hop)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        raw = torch._C._cuda_getCurrentRawStream(index)
        known = self._current.get(index)
        if known is None or known[0] != raw:
            known = self._current[index] = (raw, torch.cuda.current_stream(index))
        return known[1]

    def on_stream(self, stream: torch.cuda.Stream, device: torch.device, post) -> None:
        """``post()`` with ``stream`` current, after it waited for the compute stream (so producers
        are done and earlier readers of the receive buffers have finished); the compute stream is
        current again after."""
        compute = self.current_stream(device)
        launch(_fork, stream, compute, torch.cuda.Event())
        launch(torch.cuda.set_stream, stream)
        try:
            post()
        finally:
            launch(torch.cuda.set_stream, compute)

    def post_copies(self, device: torch.device, runs: list[tuple], delay_cycles: int = 0) -> torch.cuda.Event:
        """``runs`` (per receiving rank: its destination and source pieces) copied on the communication
        stream in one launched post (:func:`_copies_on`); the event recorded after them."""
        done = torch.cuda.Event()
        launch(_copies_on, self.comm_stream(device), self.current_stream(device), torch.cuda.Event(), done,
               [d for dsts, _ in runs for d in dsts], [t for _, srcs in runs for t in srcs],
               tuple(len(dsts) for dsts, _ in runs), delay_cycles)
        return done

    def shift(self, send: list[torch.Tensor], recv: list[torch.Tensor], offset: int) -> _Handle:
        raise NotImplementedError

    def wait(self, handle: _Handle) -> None:
        raise NotImplementedError

    def move_start(self, sends: Moves, recvs: Moves, what: str = "an exchange") -> Pending:
        """Tensors moved between ranks, posted, not waited for (the compute stream may queue other
        work before :meth:`finish`). Per local rank ``i``: ``sends[i]`` lists ``(dst, tensor)`` and
        ``recvs[i]`` ``(src, tensor)`` (a rank may name itself); between two ranks the k-th send
        fills the k-th receive, of the same dtype and size (the schedule computes both sides).
        Sends are read where they are (views: no staging copy over NCCL or the loopback);
        receives are written in place. ``what`` names it in errors."""
        raise NotImplementedError

    def finish(self, pending: Pending) -> None:
        """The compute stream (or the CPU) made to wait for the moves; their receives are then valid."""
        if pending.event is not None:
            launch(_wait_event, self.current_stream(pending.device), pending.event)
        if pending.unstage is not None:
            pending.unstage()
            pending.unstage = None


class LoopbackTransport(Transport):
    """All ranks in this process: ``recv[(i + offset) % P] <- send[i]``."""

    def __init__(self, poison: bool = False, delay_cycles: int = 0) -> None:
        super().__init__()
        self.poison = poison
        self.delay_cycles = delay_cycles

    def capture_blocker(self) -> str | None:
        """Device-to-device copies on the communication stream: always capturable."""
        return None

    def tape_blocker(self) -> str | None:
        """Copies and stream operations: always taped."""
        return None

    def tape_self_check(self) -> bool:
        """Every rank is in this process: a check's replay moves its own buffers only."""
        return True

    def shift(self, send, recv, offset):
        n = len(send)
        device = _first(send).device
        stream = self.comm_stream(device)
        if self.poison:
            for r in recv:
                for piece in _pieces(r):
                    _poison_(piece)
        # per receiving rank its pieces (a multi-piece hop is one NCCL batch on a real rank: one
        # multi-tensor copy here, as move_start's)
        per_rank = []
        for i in range(n):
            dsts, srcs = _pieces(recv[(i + offset) % n]), _pieces(send[i])
            if len(dsts) != len(srcs):
                raise ValueError(f"a hop sends {len(srcs)} pieces into {len(dsts)}")
            per_rank.append(one_dtype(dsts, srcs) if len(srcs) > 1 else (dsts, srcs))
        if stream is None:
            for dsts, srcs in per_rank:
                torch._foreach_copy_(dsts, srcs)
            return _Handle()
        done = self.post_copies(device, per_rank, self.delay_cycles)
        return _Handle(event=done, device=device)

    def wait(self, handle):
        if handle.event is not None:
            launch(_wait_event, self.current_stream(handle.device), handle.event)

    def move_start(self, sends, recvs, what="an exchange"):
        """Every rank local (list index = rank): each receive copied from its matching send on the
        communication stream, a multi-tensor copy per receiving rank of what it gets from others
        and one of its moves to itself (:func:`_launches`: a real rank's NCCL batch and local copies)."""
        pairs = _matched(sends, recvs, list(range(len(recvs))))
        if not pairs:
            return Pending()
        device = pairs[0][2].device
        stream = self.comm_stream(device)
        launches = _launches(pairs)
        if stream is None:
            for dsts, srcs in launches:
                torch._foreach_copy_(dsts, srcs)
            return Pending()
        if self.poison:
            for _, _, dst, _ in pairs:
                _poison_(dst)
        event = self.post_copies(device, launches, self.delay_cycles)  # a copy launch a rank and kind, as the ranks'
        for _, _, dst, src in pairs:  # kept from the allocator until the communication stream is past them
            dst.record_stream(stream)
            src.record_stream(stream)
        return Pending(event=event, device=device)


class P2PTransport(Transport):
    """One rank of a process group; ring peers are ``rank +- offset`` within ``group``.

    ``channel`` (:class:`~ringfa4.parallel.errors.Channel`) watches every wait: a posted error, a
    dead peer or a missing rank ends it within seconds, named (over NCCL the waits are
    stream-ordered: the host never blocks on a hop, and the failure is raised at a later wait);
    ``cp_ranks``: the CP-group rank of each rank of ``group`` (for the messages). Over gloo a hop
    is one ``all_to_all_single`` of bytes (a collective can be waited on in slices; a gloo
    send/receive whose wait times out closes the group), so a waiting rank can watch the channel;
    over NCCL it is one batch of sends and receives (:meth:`_nccl_batch`) posted from the compute
    stream (a hop; an exchange's batch and its local copies run on the communication stream)."""

    def __init__(self, group, rank: int, world_size: int, timeout: datetime.timedelta, channel=None,
                 cp_ranks: list[int] | None = None) -> None:
        super().__init__()
        self.group, self.rank, self.world_size, self.timeout = group, rank, world_size, timeout
        self.channel = channel
        self.cp_ranks = cp_ranks or list(range(world_size))
        self.call = 0  # the sequence number the hops belong to (set by the CP group per call)
        self.gloo = group is not None and dist.get_backend(group) == "gloo"
        self._warm = False  # NCCL communicator made (move_start)

    def _peer(self, group_rank: int) -> int:
        """The rank of :attr:`group` that a hop to ``group_rank`` goes to: itself (a stand-in
        transport may send elsewhere)."""
        return group_rank

    def _nccl_batch(self, sends: list, to: list, recvs: list, frm: list) -> list:
        """``sends[i]`` to group rank ``to[i]`` and ``recvs[i]`` from ``frm[i]``: one NCCL batch (a
        coalesced group of sends and receives, posted in this order), as ``batch_isend_irecv`` posts
        it, less its Python a call (its op objects, the ranks translated to global and back, the
        checks; tensors: contiguous, on this rank's GPU)."""
        pg = self.group if self.group is not None else dist.group.WORLD
        device = (sends or recvs)[0].device
        pg._start_coalescing(device)
        try:
            for t, d in zip(sends, to, strict=True):
                pg.send([t], self._peer(d), 0)
            for t, f in zip(recvs, frm, strict=True):
                pg.recv([t], self._peer(f), 0)
        except BaseException:
            with contextlib.suppress(Exception):  # (the coalescing state ended; the first error is raised)
                pg._end_coalescing(device)
            raise
        return [pg._end_coalescing(device)]

    def capture_blocker(self) -> str | None:
        """NCCL hops are captured (a batch of sends and receives, NCCL's stream joined back by the waits); gloo
        hops run on the host."""
        if self.gloo:
            return "a gloo group's hops run on the host (NCCL hops are captured)"
        return None

    def graph_key(self) -> tuple:
        """The communicator (a renewed group is a new key; the group itself, not its id, which a
        later group could reuse) and this rank's place in it."""
        return (self.group, self.rank, self.world_size)

    # NCCL hops in tapes: built as gloo's (whose real-rank tapes the CPU tests check); on since
    # tests/test_nccl_self_gpu.py passed (one H100, session 41: NCCL's send/receive to self, replays bit
    # for bit with eager); gpu.sh nccl's tapes_check repeats it over two GPUs. False: NCCL ranks untaped
    TAPED_NCCL = True

    def tape_blocker(self) -> str | None:
        """A hop's post and its watched wait are tape entries (:meth:`_post_p2p`, :meth:`_wait_posted`:
        a replay posts and waits as eager does, through the error channel); over NCCL while
        ``TAPED_NCCL`` (on)."""
        if self.gloo or self.TAPED_NCCL:
            return None
        return "a real rank's NCCL hops are not taped (P2PTransport.TAPED_NCCL is off)"

    def after_replay(self, device: torch.device) -> None:
        """A replay holds every hop of the call: it is watched as one wait of the call (a posted
        root cause, a dead peer or the timeout ends it, named, and aborts the communicator, as
        for an eager hop), through an event recorded after it on the current stream."""
        event = torch.cuda.Event()
        event.record(self.current_stream(device))
        self._wait(_Replayed(event), "a CUDA graph replay of the ring call", None)

    def _wait(self, work, what: str, peers: list[int] | None) -> None:
        if self.in_capture:  # captured: ordered on the stream only (after_replay watches the replay)
            work.wait()
            return
        if self.channel is None:
            work.wait(self.timeout)
            return
        cp_peers = None if peers is None else [self.cp_ranks[p] for p in peers]
        self.channel.wait(work, self.call, what, cp_peers, group=self.group)

    def shift(self, send, recv, offset):
        (s,), (r,) = send, recv
        to = (self.rank + offset) % self.world_size
        frm = (self.rank - offset) % self.world_size
        posted = _Posted()
        if self.gloo:
            flat = torch.cat([p.reshape(-1).view(torch.uint8) for p in _pieces(s)])
            out = torch.empty_like(flat)
            send_sizes, recv_sizes = [0] * self.world_size, [0] * self.world_size
            send_sizes[to] += flat.numel()
            recv_sizes[frm] += flat.numel()
            launch(self._post_a2a, posted, out, flat, recv_sizes, send_sizes)
            return _Handle(works=posted, event=(frm, to, out, _pieces(r)))
        # posted from the current (compute) stream, no stream of ours: NCCL's own stream waits for what the
        # compute stream queued so far (producers done, earlier readers of the receive buffers finished), as
        # a fork to a communication stream would, and the wait orders the compute stream after NCCL's
        # (a capture joins NCCL's stream back through it). Two tape entries a hop: this post and its wait.
        launch(self._post_p2p, posted, list(_pieces(s)), list(_pieces(r)), to, frm)
        return _Handle(works=posted, event=(frm, to, None, None))

    def _post_p2p(self, posted: _Posted, sends: list, recvs: list, to: int, frm: int) -> None:
        """Piece j of ``sends`` to rank ``to``, of ``recvs`` from ``frm``: one NCCL batch."""
        posted.works = self._nccl_batch(sends, [to] * len(sends), recvs, [frm] * len(recvs))

    def _post_a2a(self, posted: _Posted, out: torch.Tensor, flat: torch.Tensor, recv_sizes: list,
                  send_sizes: list) -> None:
        posted.works = [dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=self.group, async_op=True)]

    def _post_pairs(self, posted: _Posted, sends: list, to: list, recvs: list, frm: list) -> None:
        """``sends[i]`` to rank ``to[i]``, ``recvs[i]`` from ``frm[i]``: one NCCL batch (none if empty)."""
        posted.works = self._nccl_batch(sends, to, recvs, frm) if sends or recvs else []

    def _wait_posted(self, posted: _Posted, what: str, peers: list[int] | None) -> None:
        """Every work of ``posted`` waited (watched by the error channel, under the current call)."""
        for work in posted.works:
            self._wait(work, what, peers)

    def wait(self, handle):
        frm, to, staged, pieces = handle.event
        launch(self._wait_posted, handle.works, "a ring hop", sorted({frm, to}))
        if staged is not None:  # gloo: the bytes into the receive pieces
            at = 0
            for piece in pieces:
                n = piece.numel() * piece.element_size()
                piece.copy_(staged[at:at + n].clone().view(piece.dtype).view(piece.shape))
                at += n

    def move_start(self, sends, recvs, what="an exchange"):
        """Over NCCL, one batch of every send and receive on the communication stream
        (NCCL matches a pair's operations in order), a rank's moves to itself copied there; over
        gloo, one ``all_to_all_single`` of bytes (the sends staged in rank order, the receives
        unstaged at :meth:`finish`)."""
        (out,), (got,) = sends, recvs
        me = self.rank
        if self.gloo:
            return self._move_gloo(out, got, what)
        if not self._warm:  # NCCL: the group's communicator made by all ranks together (every rank calls
            # move_start alike), before a batch that some ranks take no part in
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=self.group)
            self._warm = True
        local = [(d, s) for _, _, d, s in _matched([out], [[(s, t) for s, t in got if s == me]], [me])]
        sent = [(dst, t.contiguous()) for dst, t in out if dst != me]
        taken = [(src, t) for src, t in got if src != me]
        if not sent and not taken and not local:
            return Pending(what=what)
        device = (out or got)[0][1].device
        stream, posted = self.comm_stream(device), _Posted()

        def post():  # the NCCL batch first: its stream waits only for what this stream queued before it, so
            if sent or taken:  # the local copies queued after run beside the transfers (disjoint receive slots)
                launch(self._post_pairs, posted, [t for _, t in sent], [d for d, _ in sent], [t for _, t in taken],
                       [f for f, _ in taken])
            if local:  # one multi-tensor copy, as the loopback's per rank
                torch._foreach_copy_([d for d, _ in local], [s for _, s in local], non_blocking=True)
        if stream is None:
            post()
            return Pending(posted, what)
        event = torch.cuda.Event()

        def post_then_mark():
            post()
            launch(_record, event, stream)
        self.on_stream(stream, device, post_then_mark)
        for dst, src in local:
            dst.record_stream(stream)
            src.record_stream(stream)
        return Pending(posted, what, event=event, device=device)

    def _move_gloo(self, out, got, what: str) -> Pending:
        def to_bytes(t):
            return t.contiguous().reshape(-1).view(torch.uint8)
        by_dst = [[t for d, t in out if d == j] for j in range(self.world_size)]
        send = [to_bytes(t) for ts in by_dst for t in ts]
        device = (out or got)[0][1].device if out or got else None
        flat = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8, device=device)
        sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in by_dst]
        recv_sizes = [sum(t.numel() * t.element_size() for s, t in got if s == j) for j in range(self.world_size)]
        staged = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=flat.device)
        posted = _Posted()
        launch(self._post_a2a, posted, staged, flat, recv_sizes, sizes)
        order = sorted(range(len(got)), key=lambda i: got[i][0])  # stable: each source's receives in order

        def unstage():
            at = 0
            for i in order:
                t = got[i][1]
                n = t.numel() * t.element_size()
                t.copy_(staged[at:at + n].clone().view(t.dtype).view(t.shape))
                at += n
        return Pending(posted, what, unstage=unstage)

    def finish(self, pending):
        """Each collective's wait watched by the error channel (a dead or failed rank ends it, named);
        NCCL's waits are stream-ordered once the work is done."""
        launch(self._wait_posted, pending.works, pending.what, None)
        pending.works = _Posted()
        super().finish(pending)
