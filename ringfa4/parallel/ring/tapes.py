"""Launch tapes of the ring (``RingOptions.launch_tapes``): a call's ring forward and its
backward, hops included, recorded once per call key and replayed eagerly without the executor's
and the block plans' Python (:mod:`ringfa4.kernels.tape`).

A short chunk a rank makes the ring host-bound: a rank-step is a few kernel launches, and the
Python that decides them (the schedule, buffer views, plan lookups, hop bookkeeping) costs more
host time than the launches themselves. A tape keeps only the launches. Unlike a CUDA graph
(:mod:`.graphs`), a replay is ordinary eager work: it reads the call's own inputs (no copies in)
and writes fresh outputs (no copies out), runs where a capture cannot, and needs no memory pool.

The key is a CUDA graph's (:class:`~.graphs.RingGraphs`: the step function, the schedule by
value, ranks, spec, options, backend, transport, every input's shape, strides, dtype and device,
autocast) plus each input's alignment (data pointer modulo 128 bytes, on CUDA), which inputs
share storage, and the grad and inference modes. A key is recorded at its second call (the first
compiles, probes and fills the caches later calls read: work a tape made of it would repeat), and
at most ``pack_graphs`` packs and ``dense_graphs`` dense
schedules are kept, the least recently replayed going first.

Recording is the call itself, run under the recorder; then the tape is checked once
(:meth:`~ringfa4.kernels.tape.Tape.verify`: replayed on the same inputs with its scratch and
outputs poisoned, compared with the call's outputs; bit for bit where the call is deterministic),
which costs one more call's GPU time and a host sync per key. Only where the transport allows it
(:meth:`~ringfa4.parallel.transport.Transport.tape_self_check`: the loopback): a real rank's check
would post hops its peers do not; the same executor and kernels are checked in the simulated
executor, and on real ranks whether a rank replays or runs untaped, its hops are the same, so ranks
need not agree on it.

A tape keeps its scratch between calls (the K/V buffers, accumulators, the backward's state):
``RingOptions.launch_tape_mib`` caps what all tapes of a ``ContextParallel`` keep together (the least
recently replayed go first, and are recorded again when their key comes back); a call whose own
scratch is over the cap stays untaped.

``launch_tapes="auto"`` tapes CUDA calls whose backend says its launches are recorded
(:meth:`~ringfa4.kernels.spec.BlockBackend.launches_taped`) and whose hops are (the simulated
executor's loopback; a real rank's hops are posted and waited, watched, as entries: gloo's in the
CPU tests, NCCL's as a one-GPU run checked them: ``P2PTransport.TAPED_NCCL``), silently running the
others untaped; ``"on"`` tapes CPU calls too and says once why a call is not
taped; ``"off"`` never tapes.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ...kernels.tape import Recorder, Tape, recording
from .graphs import RingGraphs, _flat, _on
from .run import RingRun

__all__ = ["RingTapes"]


class RingTapes(RingGraphs):
    """The taped ring calls of one ``ContextParallel`` (see the module doc). ``mode``: the
    option's value ("auto" | "on"); ``max_bytes``: the most scratch all its tapes keep together."""

    def __init__(self, mode: str, max_bytes: int, pack_graphs: int = 8, pack_memory: int = 256,
                 dense_graphs: int = 8) -> None:
        super().__init__(pack_graphs, pack_memory, dense_graphs)
        self.mode, self.max_bytes = mode, max_bytes
        self.recorded = 0  # tapes made (tests, benchmarks)
        self.order: OrderedDict[tuple, None] = OrderedDict()  # kept tapes' keys, least recently replayed first

    option, instead = "launch_tapes", "untaped"

    def _say(self, reason: str) -> None:
        if self.mode == "on":  # ("auto" says nothing)
            super()._say(reason)

    def why_not(self, run: RingRun, lists: tuple[list[torch.Tensor], ...]) -> str | None:
        """Why this call is not taped, or None."""
        device = lists[0][0].device
        if device.type != "cuda" and self.mode == "auto":
            return "not a CUDA call"
        if recording() or torch.compiler.is_compiling():
            return "the call is itself being recorded or compiled"
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph capture is in progress"
        if run.sinks is not None:  # (a parameter: a later call may bring another tensor)
            return "sinks are not taped"
        blocker = run.transport.tape_blocker()
        if blocker is not None:
            return blocker
        if not run.backend.launches_taped(device):
            return f"backend {run.backend.name!r} does not record its launches on {device}"
        return None

    def layout(self, flat: list[torch.Tensor]) -> tuple:
        """A graph's input layout plus each input's alignment (on CUDA: kernels assume it; a replay reads
        the inputs where they are) and which inputs share storage (a replay rebuilds views per input)."""
        first_of: dict[int, int] = {}
        align = 128 if flat[0].device.type == "cuda" else 1
        # (a storage's start: the data pointer less the offset, without making a storage object)
        return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % align,
                      first_of.setdefault(t.data_ptr() - t.storage_offset() * t.element_size(), i))
                     for i, t in enumerate(flat))

    def call(self, fn, run: RingRun, *lists: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """``fn(run, *lists)`` (a ring forward or backward on per-rank tensor lists), replayed from
        its tape where it can be, else run (recording it at its key's sighting)."""
        reason = self.why_not(run, lists)
        if reason is not None:
            self._say(reason)
            return fn(run, *lists)
        flat = _flat(lists)
        key = self.key(fn, run, lists, flat) + (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        device = flat[0].device
        if (key not in self.captured and run.transport.tape_self_check() and device.type == "cuda"
                and torch.cuda.get_sync_debug_mode() != 0):
            return fn(run, *lists)  # recording checks the tape with a host sync: not while syncs are watched
        made: list = []
        with _on(device):
            # at the key's second call at the earliest: the first compiles, probes and fills the caches
            # that later calls read (work a tape made of it would repeat every replay)
            tape = self.entry(key, run, lambda: self._record(fn, run, lists, key, made),
                              max(2, run.schedule.graph_sightings()))
            if made:
                return made[0]
            if tape is None:
                return fn(run, *lists)
            self.order.move_to_end(key)
            return tape.replay(flat)

    def _record(self, fn, run: RingRun, lists: tuple[list[torch.Tensor], ...], key: tuple, made: list
                ) -> Tape | None:
        """Run ``fn(run, *lists)`` recording it (its outputs into ``made``); its tape once checked,
        else None (the key then runs untaped, said once)."""
        flat = _flat(lists)
        device = flat[0].device
        recorder = Recorder(device).start(flat)
        with recorder:
            outputs = fn(run, *lists)
        made.append(outputs)
        need = recorder.finish(outputs)
        if need is None:
            self._say(f"not recordable ({recorder.refused})")
            return None
        if need > self.max_bytes:  # (decided before its memory is taken: long chunks have a lot of scratch)
            self._say(f"the call keeps {need / 2**20:.0f} MiB of scratch, over launch_tape_mib")
            return None
        while self.order and self.memory_bytes() + need > self.max_bytes:  # the least recently replayed
            gone, _ = self.order.popitem(last=False)  # tapes make room (recorded again when they come back)
            self.captured.pop(gone, None)
            self.key_bytes.pop(gone, None)
        tape = recorder.tape()
        if run.transport.tape_self_check():  # (a real rank's check would post hops its peers do not)
            exact = device.type != "cuda" or run.spec.deterministic or fn.__name__.endswith("_forward")  # (no atomics)
            wrong = tape.verify(flat, outputs, exact)
            if wrong is not None:
                self._say(f"its check failed ({wrong}): a launch the tape did not record")
                return None
        self.key_bytes[key] = tape.kept_bytes
        self.order[key] = None
        self.recorded += 1
        return tape
