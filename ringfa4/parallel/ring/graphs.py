"""CUDA graphs of the ring (``RingOptions.cuda_graphs``): a call's ring forward and its backward,
hops included, captured once per call key and replayed.

The key is everything the captured work depends on: the step function (ring forward / backward),
the schedule by value (``Schedule.graph_key``: layout, sequence length and mask; for packed
documents the pack's cu_seqlens, layout and placement rule), the ranks, the block spec, the
options, the backend, the transport's communicator
(:meth:`~ringfa4.parallel.transport.Transport.graph_key`) and the shape, strides, dtype and device
of every input, and the autocast dtype (None: off). A dense key is captured at its first call (every layer
repeats it). Every pack is a new schedule, so a pack's key is captured only at its second call (the
next layer of the same batch, or the same pack in a later batch: a trainer whose loader buckets
documents into recurring packs, fixed evaluation batches); a pack used by one call only runs
eagerly at no capture cost. The graphs of at most ``pack_graphs`` packs and ``dense_graphs``
dense schedules (sequence lengths; a pack of one document placed as the dense layout places it
runs the dense ring and counts as one) are kept, the least recently replayed going first, so
lengths or packs that change every batch keep bounded memory. The capture-time call's schedule
stays alive with its graph (the graph reads its device-side cu_seqlens, and the backends' values
derived from them, which live as long as those tensors). The first call of a key runs once eagerly on a
side stream (compiles, lazy initialisations, the backends' prepared launches, a communicator's
first use), then is captured on static copies of its inputs; every call of that key (this one
included) copies its inputs into those, replays the graph and hands back copies of the outputs
(the next layer's replay reuses the graph's buffers). Hops are part of the graph: the simulated
executor's loopback copies, and on real ranks NCCL's batched sends and receives (a hop's posted from
the captured stream, NCCL's own stream joined back by its wait). All graphs of a
``ContextParallel`` share one memory pool; :meth:`RingGraphs.memory_bytes` is what the static
inputs and the captures keep allocated.

Where a call cannot be captured it runs eagerly, and the reason is said once (a UserWarning):
tensors not on CUDA, hops that run on the host (a gloo group), sinks, a capture already in
progress (the caller's own graph), or a capture that failed (the key then stays eager).
With the deterministic block backward a replay is bit-identical to the eager call; the default
accumulating backward reduces with atomics, in eager as in a replay.

Failure detection in graph mode. Before a replay everything runs as in eager: the local checks
and the metadata check (every call, or once per key with ``metadata_check="new_shapes"``), so a
bad input is refused on every rank before any data moves. On real ranks every rank captures at
the same call (the key is agreed by the check); a rank whose capture fails runs that key eagerly,
which issues the same NCCL operations in the same order as the peers' replays (best effort: a
capture that fails inside NCCL can leave the communicator unusable, and the next hop then fails,
named). During a capture
nothing is watched (a captured wait is only stream-ordered); a replay is watched as one wait of
its call (:meth:`~ringfa4.parallel.transport.Transport.after_replay`): a root cause a peer
posted, a dead peer, or ``RingOptions.timeout_s`` after the replay was queued without it
finishing ends it, named as for an eager hop, and aborts the NCCL communicator (which releases
the graph's stuck transfers); the error is raised by the rank's next ringfa4 call. The simulated
executor has no peers to wait on: its replays are not watched.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...kernels.copies import copy_all
from .run import RingRun

__all__ = ["RingGraphs"]


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # flat static inputs, in the order of the call's flattened lists
    outputs: tuple[list[torch.Tensor], ...]
    run: RingRun  # kept alive: the graph reads its schedule's device-side metadata (a pack's cu_seqlens)


def _flat(lists: tuple[list[torch.Tensor], ...]) -> list[torch.Tensor]:
    return [t for lst in lists for t in lst]


def _unflat(flat: list[torch.Tensor], lists: tuple[list[torch.Tensor], ...]) -> tuple[list[torch.Tensor], ...]:
    out, at = [], 0
    for lst in lists:
        out.append(flat[at:at + len(lst)])
        at += len(lst)
    return tuple(out)


class RingGraphs:
    """The captured ring calls of one ``ContextParallel`` (see the module doc). ``pack_graphs`` /
    ``dense_graphs``: the most packs / dense schedules (sequence lengths) whose graphs are kept
    (the least recently replayed one goes first; 0: none captured); ``pack_memory``: how many
    packs' sightings are remembered."""

    def __init__(self, pack_graphs: int = 8, pack_memory: int = 256, dense_graphs: int = 8) -> None:
        self.captured: dict[tuple, _Captured | None] = {}  # None: this key runs eagerly
        self.pool = None
        self.said: set[str] = set()
        self.key_bytes: dict[tuple, int] = {}  # per captured key: the device memory its capture took
        self.pack_graphs, self.pack_memory, self.dense_graphs = pack_graphs, pack_memory, dense_graphs
        self.sightings: OrderedDict[tuple, int] = OrderedDict()  # keys not captured yet: calls seen
        self.packs: OrderedDict[tuple, list[tuple]] = OrderedDict()  # a recurring pack's schedule key: its keys
        self.dense: OrderedDict[tuple, list[tuple]] = OrderedDict()  # a dense schedule's key: its keys

    def memory_bytes(self) -> int:
        """Device memory the kept captures took, in the sizes requested (static inputs, the graphs'
        outputs and pool allocations); an evicted schedule's share leaves it (its pool blocks stay
        reserved in the shared pool for later captures)."""
        return sum(self.key_bytes.values())

    option, instead = "cuda_graphs", "eagerly"  # what the warnings name

    def _say(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            warnings.warn(f"ringfa4: RingOptions.{self.option}: {reason}; this call runs {self.instead}",
                          UserWarning, stacklevel=4)

    def why_not(self, run: RingRun, lists: tuple[list[torch.Tensor], ...]) -> str | None:
        """Why this call cannot be captured, or None."""
        first = lists[0][0]
        if first.device.type != "cuda":
            return "needs CUDA tensors"
        blocker = run.transport.capture_blocker()
        if blocker is not None:
            return blocker
        if run.sinks is not None:
            return "sinks are not captured"
        if torch.cuda.is_current_stream_capturing():
            return "a capture is already in progress"
        return None

    def key(self, fn: Callable, run: RingRun, lists: tuple[list[torch.Tensor], ...], flat: list[torch.Tensor]
            ) -> tuple:
        """What a recorded call of ``fn`` over ``run`` on ``lists`` (``flat``: their tensors) depends on
        (see the module doc)."""
        return (fn, run.schedule.graph_key(), run.ranks, run.spec, run.options, id(run.backend),
                run.transport.graph_key(), self.layout(flat), tuple(len(lst) for lst in lists), _autocast_state())

    def layout(self, flat: list[torch.Tensor]) -> tuple:
        """The shape, strides, dtype and device of every input (a capture copies them into its own)."""
        return tuple((t.shape, t.stride(), t.dtype, t.device) for t in flat)

    def call(self, fn: Callable, run: RingRun, *lists: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """``fn(run, *lists)`` (a ring forward or backward on per-rank tensor lists), replayed from
        its graph where it can be, else eagerly."""
        reason = self.why_not(run, lists)
        if reason is not None:
            self._say(reason)
            return fn(run, *lists)
        flat = _flat(lists)
        key = self.key(fn, run, lists, flat)
        device = flat[0].device
        with _on(device):
            cap = self.entry(key, run, lambda: self._capture(fn, run, lists, key))
            if cap is None:
                return fn(run, *lists)
            copy_all(cap.inputs, flat)  # one multi-tensor copy (a dtype at most), not one a tensor
            cap.graph.replay()
            run.transport.after_replay(device)
            outputs = _flat(cap.outputs)
            copies = [torch.empty_like(o) for o in outputs]
            copy_all(copies, outputs)
            return _unflat(copies, cap.outputs)

    def entry(self, key: tuple, run: RingRun, capture: Callable[[], _Captured | None],
              wanted: int | None = None) -> _Captured | None:
        """The graph of ``key`` (a call over ``run``), captured by ``capture()`` at the key's
        ``wanted``-th call (default ``run.schedule.graph_sightings()``); None: the call runs eagerly
        (not yet, or its capture failed). Graphs are kept for at most ``pack_graphs`` packs and
        ``dense_graphs`` dense schedules (a pack of one document that runs the dense ring is one of
        those)."""
        wanted = run.schedule.graph_sightings() if wanted is None else wanted
        group = run.schedule.graph_key()
        kept, limit = (self.packs, self.pack_graphs) if run.schedule.graph_sightings() > 1 else \
            (self.dense, self.dense_graphs)
        if key in self.captured:
            if group in kept:
                kept.move_to_end(group)
            return self.captured[key]
        seen = self.sightings.pop(key, 0) + 1
        if seen < wanted:
            self.sightings[key] = seen
            while len(self.sightings) > self.pack_memory:
                self.sightings.popitem(last=False)
            return None
        if limit <= 0:
            return None
        if group not in kept and len(kept) >= limit:
            _, gone = kept.popitem(last=False)
            for k in gone:
                self.captured.pop(k, None)
                self.key_bytes.pop(k, None)
        kept.setdefault(group, []).append(key)
        kept.move_to_end(group)
        self.captured[key] = capture()
        return self.captured[key]

    def _capture(self, fn: Callable, run: RingRun, lists: tuple[list[torch.Tensor], ...],
                 key: tuple) -> _Captured | None:
        """Capture ``fn(run, *lists)`` (on static copies of ``lists``). Made outside inference mode
        (inference tensors as static buffers would refuse a later training call's copies), in the
        caller's grad mode; a failed capture leaves the caller's stream current and the pool's
        allocation ended, and the key eager."""
        grad = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            static = _unflat([t.detach().clone() for t in _flat(lists)], lists)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # once eagerly: compiles, lazy inits, prepared launches
                fn(run, *static)
            torch.cuda.current_stream().wait_stream(side)
            # counted from here: what the eager run leaves (device tensors made lazily and kept, or a
            # cache's entries it evicts) depends on earlier calls, and is not the capture's. Collected
            # first: device tensors in reference cycles (a first call can leave some: 53 MB on one H100)
            # would otherwise be freed whenever Python's gc runs, maybe inside the capture, taking their
            # bytes off its count (session 33: a recapture read 4 MB less)
            gc.collect()
            before = _requested_bytes() - sum(t.nbytes for t in _flat(static))
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph's exit ends the capture before it restores the stream, so a capture that
            # fails there would leave the capture stream current: the outer stream context restores it
            try:  # thread_local: the stream watch's thread may query earlier hops' events meanwhile
                with torch.cuda.stream(torch.cuda.current_stream()), run.transport.capturing(), \
                        torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    outputs = fn(run, *static)
            except Exception as exc:  # a step that cannot be captured (a host sync, an unsupported call)
                _end_pool_allocation(lists[0][0].device, self.pool)
                self.pool = None  # later captures in a fresh pool (a torch may leave this one marked recording)
                self._say(f"capture failed ({type(exc).__name__}: {exc})")
                return None
            self.key_bytes[key] = _requested_bytes() - before
            return _Captured(graph, _flat(static), tuple(list(o) for o in outputs), run)


def _requested_bytes() -> int:
    """Device memory the caching allocator has handed out, in the sizes asked for (a block's own size
    depends on which free block it was cut from, so ``memory_allocated`` deltas of one capture vary
    with the pool's history; measured: 160 KiB on one pack recaptured after an eviction). Taken
    around the capture alone: around the eager run before it too, one pack read 351 KiB more at its
    first capture than when recaptured, where earlier tests had run in the process."""
    return torch.cuda.memory_stats().get("requested_bytes.all.current", torch.cuda.memory_allocated())


def _autocast_state() -> torch.dtype | None:
    """CUDA autocast's dtype where it is on, else None (part of a graph's key)."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def _on(device: torch.device):
    """The CUDA device guard of ``device`` where it is not the current one (a capture's side and
    capture streams, and a replay, belong to the inputs' device), else nothing."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _end_pool_allocation(device: torch.device, pool) -> None:
    """After a failed capture: the caching allocator may still route this thread's allocations
    to the graph pool and hold back freed blocks (a capture it thinks is underway: CUDAGraph's
    capture_end raises before it ends the pool's allocation). End it; nothing if it had ended."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)  # (device index, pool id) since torch 2.8
    if end is None:
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except RuntimeError:  # "not currently recording to mempool_id": the capture had ended it
        pass
