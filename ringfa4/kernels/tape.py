"""Launch tapes: the device work of one call, recorded once and replayed without the Python that
issued it (``RingOptions.launch_tapes``; :mod:`ringfa4.parallel.ring.tapes` says which calls).

Recording runs the call itself under a ``TorchDispatchMode``. Every aten op that writes (in-place
ops, out= ops, copies) becomes an entry; a functional op becomes its out= form writing into the
tensor the recording produced (a cast: ``copy_`` into it; a factory that fills, ``zeros_like``,
``full`` or ``arange``: that fill of it; an op without an out= form: the op and a copy into it);
views and allocations are no entries. Device work the dispatcher does not see (compiled CuTe DSL and
Triton kernels, FA4's helpers, stream and event operations) goes through :func:`launch`, which
records it as one entry and nothing that runs inside it. A launch site that does not is caught by
:meth:`Tape.verify`.

The tensors an entry names are of three kinds:

* derived from an input by view ops seen while recording: rebuilt on each replay's inputs (same
  shape, strides and offset from the input; the caller keys a tape on the inputs' layouts and
  alignment);
* in the storage of an output: each replay allocates fresh storage and rebuilds them in it, so
  a replay's outputs are its own (an empty tensor: made new each replay);
* other memory the call allocated (its scratch): the recorder holds none of it, so the allocator
  reuses it within the call as untaped; the tape lays it out as the call used it (the address
  ranges it took, overlapping ones merged, one buffer each: about the call's peak) and every
  replay reuses that (:attr:`Tape.kept_bytes`);
* memory from before the call (a backend's tables, a schedule's metadata): kept as it is.

The stream current when recording starts is a slot too: a replay's stream operations use the
stream current at the replay. A replay issues the entries in order: the same kernels on the same
streams, without checks, plan lookups or allocations besides the outputs. Recording refuses (the
call itself completes; :attr:`Recorder.refused` says why) where a replay could not repeat it: a
host sync (``.item()``), a stream switch it did not see, an op returning no tensor.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Recorder", "Tape", "launch", "recording"]

_local = threading.local()
aten = torch.ops.aten
_ALLOC = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
          aten.new_empty_strided.default, aten.empty_like.default}
# factories that fill what they make: an in-place fill of the recording's result (their out= forms,
# where they have one, take no dtype or device, so :func:`_out_form` finds none)
_FILLS = {aten.zeros.default: 0, aten.zeros_like.default: 0, aten.new_zeros.default: 0, aten.ones.default: 1,
          aten.ones_like.default: 1, aten.new_ones.default: 1, aten.full.default: "fill_value",
          aten.full_like.default: "fill_value", aten.new_full.default: "fill_value"}
_ARANGES = {aten.arange.default: ("end",), aten.arange.start: ("start", "end"),
            aten.arange.start_step: ("start", "end", "step")}
_NOT_WORK = {aten.record_stream.default}  # the tape keeps every tensor alive: nothing to tell the allocator


def launch(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: device work torch's dispatcher does not see (a compiled kernel, a
    Triton launch, an FA4 helper, a stream or event operation). ``fn`` must read nothing but its
    arguments (tensors at most one list deep). While a tape records on this thread the call is one
    entry, and nothing inside it is recorded."""
    rec = getattr(_local, "recorder", None)
    if rec is None:
        return fn(*args, **kwargs)
    return rec.opaque(fn, args, kwargs)


def recording() -> bool:
    """A tape records on this thread."""
    return getattr(_local, "recorder", None) is not None


class _Slot:
    """A tensor rebuilt per replay: from input ``src`` (``kind`` "in") or fresh output storage
    ``src`` ("out"), at ``byte_offset`` from its start (inputs: from the input's first element),
    or a new empty tensor ("new"), with ``shape``, ``stride`` and ``dtype``; or input ``src`` itself
    ("input": a view of all of it, as laid out)."""

    __slots__ = ("kind", "src", "byte_offset", "shape", "stride", "dtype")

    def __init__(self, kind: str, src: int, byte_offset: int, shape: tuple, stride: tuple,
                 dtype: torch.dtype) -> None:
        self.kind, self.src, self.byte_offset = kind, src, byte_offset
        self.shape, self.stride, self.dtype = shape, stride, dtype


class _Ref:
    """A tensor an entry names, as recorded (no reference to it is held unless it existed before
    the call): ``kind`` "in" (input ``where``, at ``offset`` bytes from its first element), "mem"
    (memory the call allocated: ``where`` = (data_ptr, allocation number) of its storage, at
    ``offset`` bytes into it) or "ext" (``tensor``: memory from before the call, kept as it is)."""

    __slots__ = ("kind", "where", "offset", "shape", "stride", "dtype", "tensor")

    def __init__(self, kind: str, where, offset: int, t: torch.Tensor, keep: bool = False) -> None:
        self.kind, self.where, self.offset = kind, where, offset
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.tensor = t if keep else None


_STREAM = object()  # marks the recording's current stream among an entry's arguments


class Recorder(TorchDispatchMode):
    """Records the call run inside ``with recorder:`` (see the module doc); :meth:`tape` makes the
    :class:`Tape` of it given the call's inputs and outputs.

    The recording holds no reference to the memory the call allocates, so the caching allocator
    reuses it within the call as it does untaped; the tape then lays the call's scratch out as
    the call used it (the union of the address ranges, :meth:`tape`), about the call's peak."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.entries: list[tuple] = []  # (fn, args, kwargs, results to copy into or None), tensors as _Ref
        self.refused: str | None = None
        self.inside = 0  # > 0: inside a launch() call, nothing recorded
        self.derived = WeakIdKeyDictionary()  # tensor -> its input index (views of inputs)
        self.allocs: dict[int, tuple[int, int]] = {}  # storage data_ptr -> (allocation number, nbytes)
        self.sizes: dict[tuple[int, int], int] = {}  # (data_ptr, allocation number) -> nbytes
        self.cuda = device.type == "cuda"
        self.stream = self._raw_stream() if self.cuda else None
        self.start_stream = torch.cuda.current_stream(device) if self.cuda else None

    def _raw_stream(self) -> int:
        return torch._C._cuda_getCurrentRawStream(self.device.index if self.device.index is not None
                                                 else torch.cuda.current_device())

    def start(self, inputs: Sequence[torch.Tensor]) -> Recorder:
        self.inputs = list(inputs)
        for i, t in enumerate(inputs):
            if t not in self.derived:
                self.derived[t] = i
        return self

    def __enter__(self):
        if getattr(_local, "recorder", None) is not None:
            raise RuntimeError("a launch tape is already recording on this thread")
        _local.recorder = self
        return super().__enter__()

    def __exit__(self, *exc):
        _local.recorder = None
        return super().__exit__(*exc)

    def refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why

    # -- recording ---------------------------------------------------------------------------------
    def _own(self, t: torch.Tensor) -> None:
        """``t``'s storage was allocated by the call (a new allocation at its address)."""
        if t.device.type != self.device.type or t.untyped_storage().nbytes() == 0:  # host tensors of a CUDA
            return  # call: kept as they are; empty ones: made per replay (_ref)
        s = t.untyped_storage()
        key = (s.data_ptr(), len(self.sizes))
        self.allocs[key[0]] = (key[1], s.nbytes())
        self.sizes[key] = s.nbytes()

    def _ref(self, t: torch.Tensor) -> _Ref:
        if t in self.derived:
            base = self.inputs[self.derived[t]]
            off = t.storage_offset() * t.element_size() - base.storage_offset() * base.element_size()
            return _Ref("in", self.derived[t], off, t)
        s = t.untyped_storage()
        if s.nbytes() == 0 and t.device.type == self.device.type:  # no memory: a new empty one each replay
            return _Ref("new", None, 0, t)
        got = self.allocs.get(s.data_ptr())
        if got is not None and s.nbytes() <= got[1]:
            return _Ref("mem", (s.data_ptr(), got[0]), t.storage_offset() * t.element_size(), t)
        return _Ref("ext", None, 0, t, keep=True)

    def _refs(self, x):
        """``x`` (an argument) with its tensors as :class:`_Ref` (tensors at most one list deep;
        deeper ones kept as they are, refused where they are the call's)."""
        if isinstance(x, torch.Tensor):
            return self._ref(x)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(self._ref(y) if isinstance(y, torch.Tensor) else self._deep(y) for y in x)
        return self._deep(x)

    def _deep(self, x):
        for t in _leaves(x) if isinstance(x, (list, tuple, dict)) else ():
            if isinstance(t, torch.Tensor) and self._ref(t).kind != "ext":
                self.refuse("a tensor of the call nested deeper than one list in an argument")
        return x

    def _entry(self, fn, args, kwargs, results) -> None:
        self.entries.append((fn, tuple(self._refs(a) for a in args), {k: self._refs(a) for k, a in kwargs.items()},
                             None if results is None else [self._ref(t) for t in results]))

    def opaque(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.inside += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            self.inside -= 1
        if self.inside:
            return out
        results = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        given = {a.untyped_storage().data_ptr() for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in results:
            if t not in self.derived and t.untyped_storage().data_ptr() not in given:
                self._own(t)  # made inside the call (aliases of its arguments stay what they were)
        self._entry(fn, args, kwargs, results or None)
        if fn is torch.cuda.set_stream:
            self.stream = args[0].cuda_stream
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside or func in _NOT_WORK:
            return out
        schema = func._schema
        if func in _ALLOC:
            self._own(out)
            return out
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):  # a view
            src = next((self.derived[a] for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                        and a in self.derived), None)
            if src is not None:
                for t in _leaves(out):
                    if isinstance(t, torch.Tensor):
                        self.derived[t] = src
            return out
        tensors = [t for t in _leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if self.cuda and not any(t.device.type == "cuda" for t in tensors):
            return out  # host work (index tables of a schedule): a function of the key, kept as it came out
        if self.cuda and self._raw_stream() != self.stream:
            self.refuse(f"{func} ran on a stream the tape did not see made current")
        if schema.is_mutable:
            self._entry(func, args, kwargs, None)
            return out
        results = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        if not results or len(results) != len(list(_leaves(out))):
            self.refuse(f"{func} returns a value to the host")
            return out
        for t in results:
            self._own(t)
        if func is aten._to_copy.default and len(args) == 1 and not kwargs.get("pin_memory"):
            # a cast or a device copy: copy_ into the result (the out= form takes other arguments)
            self._entry(aten.copy_.default, (out, args[0]), {"non_blocking": bool(kwargs.get("non_blocking"))}, None)
            return out
        if func in _FILLS or func in _ARANGES:
            self._fill_entry(func, args, kwargs, out)
            return out
        out_op = _out_form(func, len(results))
        if out_op is None:
            self._entry(func, args, kwargs, results)
        else:
            names = [a.name for a in out_op._schema.arguments if a.is_out]
            self._entry(out_op, args, {**kwargs, **dict(zip(names, results))}, None)
        return out

    def _fill_entry(self, func, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """A factory's entry: ``zero_`` / ``fill_`` of (``arange``: ``arange.start_out`` into) its result,
        the kernel the factory itself runs on it."""
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        if func in _ARANGES:
            bounds = {"start": 0, "step": 1} | {n: named[n] for n in _ARANGES[func] if n in named}
            self._entry(aten.arange.start_out, (bounds["start"], bounds["end"], bounds["step"]), {"out": out}, None)
        elif _FILLS[func] == 0:
            self._entry(aten.zero_.default, (out,), {}, None)
        else:
            value = named[_FILLS[func]] if isinstance(_FILLS[func], str) else _FILLS[func]
            self._entry(aten.fill_.Scalar, (out, value), {}, None)

    # -- the tape ----------------------------------------------------------------------------------
    def finish(self, outputs: Any) -> int | None:
        """After the call, with its ``outputs`` (any nesting of lists / tuples of tensors): the bytes
        of scratch a tape of it keeps (:meth:`tape` allocates them), or None (:attr:`refused` says
        why) where it cannot be replayed."""
        if self.refused is not None:
            return None
        out_leaves, self.out_spec = _flatten(outputs)
        self.fresh: dict[tuple[int, int], int] = {}  # an output's storage (data_ptr, allocation) -> index
        self.fresh_bytes: list[int] = []
        self.out_refs = [self._ref(t) for t in out_leaves]
        for r in self.out_refs:
            if r.kind == "ext":
                self.refuse("an output lives in memory the call did not allocate")
                return None
            if r.kind == "mem" and r.where not in self.fresh:
                self.fresh[r.where] = len(self.fresh_bytes)
                self.fresh_bytes.append(self.sizes[r.where])
        named = {r.where for e in self.entries for r in _leaves(e[1:]) if isinstance(r, _Ref) and r.kind == "mem"}
        self.ranges = _merged([(w[0], self.sizes[w]) for w in named if w not in self.fresh])
        return sum(b - a for a, b in self.ranges)

    def tape(self) -> Tape:
        """The tape of what was recorded (after :meth:`finish`), for calls whose inputs are laid out
        as the recording's and whose outputs are made as its were."""
        fresh, out_refs = self.fresh, self.out_refs
        arenas = _Arenas(self.ranges, self.device)
        slots: list[_Slot] = []
        slot_of: dict[tuple, int] = {}
        whole = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in self.inputs]

        def resolve(r: _Ref):
            """``r`` as (slot index, None) (rebuilt per replay) or (None, tensor) (kept)."""
            if r.kind == "ext":
                return None, r.tensor
            if r.kind == "mem" and r.where not in fresh:
                return None, arenas.view(r.where[0] + r.offset, r.shape, r.stride, r.dtype)
            key = (r.kind, r.where, r.offset, r.shape, r.stride, r.dtype)
            if key not in slot_of:
                slot_of[key] = len(slots)
                src = r.where if r.kind == "in" else fresh[r.where] if r.kind == "mem" else None
                kind = {"mem": "out"}.get(r.kind, r.kind)
                if kind == "in" and r.offset == 0 and (r.shape, r.stride, r.dtype) == whole[src]:
                    kind = "input"  # the input itself (a replay's inputs are laid out as the recording's)
                slots.append(_Slot(kind, src, r.offset, r.shape, r.stride, r.dtype))
            return slot_of[key], None

        entries = [_Entry.make(fn, args, kwargs, results, resolve, self.start_stream)
                   for fn, args, kwargs, results in self.entries]
        outs = [resolve(r)[0] for r in out_refs]
        return Tape(entries, slots, self.fresh_bytes, (outs, self.out_spec), arenas.buffers, self.device)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The address ranges ``(data_ptr, nbytes)`` as ``[start, end)`` spans, overlapping ones merged
    (memory the allocator handed out again within the call)."""
    merged: list[list[int]] = []
    for start, n in sorted(r for r in ranges if r[1] > 0):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + n)
        else:
            merged.append([start, start + n])
    return [(a, b) for a, b in merged]


class _Arenas:
    """Memory for the call's scratch as the call laid it out: one buffer per span of
    :func:`_merged`; a tensor at an address maps to the same offset in its span's buffer."""

    def __init__(self, spans: list[tuple[int, int]], device: torch.device) -> None:
        self.starts = [a for a, _ in spans]
        self.buffers = [torch.empty(b - a, dtype=torch.uint8, device=device) for a, b in spans]
        self.typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def view(self, address: int, shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
        i = bisect.bisect_right(self.starts, address) - 1
        base = self.typed.get((i, dtype))
        if base is None:
            base = self.typed[i, dtype] = torch.empty(0, dtype=dtype, device=self.buffers[i].device).set_(
                self.buffers[i].untyped_storage())
        return base.as_strided(shape, stride, (address - self.starts[i]) // dtype.itemsize)


class _Entry:
    """One recorded call: ``fn`` with its arguments, the slots patched in per replay."""

    __slots__ = ("fn", "name", "args", "kwargs", "patches", "results", "bound", "top")

    @staticmethod
    def make(fn, args, kwargs, results, resolve, start_stream) -> _Entry:
        e = _Entry()
        e.fn, e.patches = getattr(fn, "_op", fn), []  # an aten op's C++ callable (OpOverload's own call: ~1 us)
        e.name = _entry_name(fn)  # (what ran: diagnostics)
        e.args = [e._arg(a, ("a", i), resolve, start_stream) for i, a in enumerate(args)]
        e.kwargs = {k: e._arg(a, ("k", k), resolve, start_stream) for k, a in kwargs.items()}
        e.results = None if results is None else [resolve(r) for r in results]
        e.bound = functools.partial(e.fn, *e.args, **e.kwargs) if not e.patches else None
        # the common patched entry: tensors in top-level positions only
        e.top = [(key, s) for (side, key), j, s in e.patches] if all(
            side == "a" and j is None for (side, _), j, _ in e.patches) else None
        return e

    def _arg(self, a, where, resolve, start_stream):
        """``a`` with its per-replay tensors (and the recording's stream) left out (None), which
        :attr:`patches` fill in."""
        if isinstance(a, _Ref):
            s, t = resolve(a)
            if s is None:
                return t
            self.patches.append((where, None, s))
            return None
        if start_stream is not None and isinstance(a, torch.cuda.Stream) and a == start_stream:
            self.patches.append((where, None, _STREAM))
            return None
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            items = []
            for j, x in enumerate(a):
                if isinstance(x, _Ref):
                    s, t = resolve(x)
                    if s is not None:
                        self.patches.append((where, j, s))
                    items.append(t)
                else:
                    items.append(x)
            return type(a)(items)
        return a

    def run(self, views: list, stream) -> None:
        if self.bound is not None:
            out = self.bound()
        elif self.top is not None:
            args = self.args[:]
            for i, s in self.top:
                args[i] = stream if s is _STREAM else views[s]
            out = self.fn(*args, **self.kwargs)
        else:
            args, kwargs = list(self.args), dict(self.kwargs)
            copied = set()
            for (side, key), j, s in self.patches:
                value = stream if s is _STREAM else views[s]
                box = args if side == "a" else kwargs
                if j is None:
                    box[key] = value
                    continue
                if (side, key) not in copied:
                    copied.add((side, key))
                    box[key] = list(box[key])
                box[key][j] = value
            out = self.fn(*args, **kwargs)
        if self.results is not None:
            got = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
            for (s, kept), new in zip(self.results, got, strict=True):
                (kept if s is None else views[s]).copy_(new)


class Tape:
    """A recorded call (see the module doc): :meth:`replay` on new inputs laid out as the
    recording's gives that call's outputs."""

    def __init__(self, entries: list[_Entry], slots: list[_Slot], fresh_bytes: list[int], outs: tuple,
                 kept: list[torch.Tensor], device: torch.device) -> None:
        self.entries, self.slots, self.fresh_bytes, self.outs = entries, slots, fresh_bytes, outs
        self.kept, self.device = kept, device
        self.stream_seen: tuple | None = None  # (raw stream, its torch.cuda.Stream)
        # fresh storages typed per dtype once a replay: which dtypes each is seen through
        self.fresh_dtypes = [sorted({s.dtype for s in slots if s.kind == "out" and s.src == i}, key=str)
                             for i in range(len(fresh_bytes))]
        # fresh storages that one slot covers exactly, densely: made in its shape (no view to build)
        users = [[s for s in slots if s.kind == "out" and s.src == i] for i in range(len(fresh_bytes))]
        self.made_whole = [len(u) == 1 and u[0].byte_offset == 0 and _dense_bytes(u[0]) == n
                           for u, n in zip(users, fresh_bytes)]

    @property
    def kept_bytes(self) -> int:
        """Device memory the tape keeps between calls (its scratch; outputs are made per replay)."""
        return sum(b.numel() for b in self.kept)

    def __len__(self) -> int:
        return len(self.entries)

    def _views(self, inputs: Sequence[torch.Tensor], poison: bool) -> list[torch.Tensor]:
        typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        for i, (nbytes, dtypes) in enumerate(zip(self.fresh_bytes, self.fresh_dtypes)):
            if self.made_whole[i]:  # (its slot makes it below)
                continue
            if len(dtypes) == 1 and nbytes % dtypes[0].itemsize == 0:
                typed[i, dtypes[0]] = torch.empty(nbytes // dtypes[0].itemsize, dtype=dtypes[0], device=self.device)
            else:
                raw = torch.empty(_round_up(nbytes, 16), dtype=torch.uint8, device=self.device)
                for dt in dtypes:
                    typed[i, dt] = raw.view(dt)
            if poison:
                next(t for (j, _), t in typed.items() if j == i).view(torch.uint8).fill_(255)
        views, retyped = [], {}
        for s in self.slots:
            if s.kind == "new":
                views.append(torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=self.device))
                continue
            if s.kind == "out":
                if self.made_whole[s.src]:
                    t = torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=self.device)
                    if poison:  # (its bytes as uint8, as the typed storages below are poisoned)
                        torch.empty(0, dtype=torch.uint8, device=self.device).set_(t.untyped_storage()).fill_(255)
                    views.append(t)
                    continue
                base = typed[s.src, s.dtype]
                views.append(base.as_strided(s.shape, s.stride, s.byte_offset // s.dtype.itemsize))
                continue
            if s.kind == "input":
                views.append(inputs[s.src])
                continue
            x = inputs[s.src]
            start = x.storage_offset() * x.element_size() + s.byte_offset
            if s.dtype != x.dtype:  # one retyped tensor a storage and dtype, shared by its slots
                key = (x.data_ptr() - x.storage_offset() * x.element_size(), s.dtype)  # (the storage's start)
                base = retyped.get(key)
                if base is None:
                    base = retyped[key] = torch.empty(0, dtype=s.dtype, device=x.device).set_(x.untyped_storage())
                x = base
            views.append(x.as_strided(s.shape, s.stride, start // s.dtype.itemsize))
        return views

    def replay(self, inputs: Sequence[torch.Tensor], poison: bool = False) -> Any:
        """The recorded call on ``inputs`` (laid out as the recording's): its outputs, fresh.
        ``poison``: the fresh outputs start as all-ones bytes (NaN) (:meth:`verify`)."""
        views = self._views(inputs, poison)
        stream = self._current_stream() if self.device.type == "cuda" else None
        for e in self.entries:
            e.run(views, stream)
        leaves, spec = self.outs
        return _unflatten([views[s] for s in leaves], spec)

    def _current_stream(self):
        """``torch.cuda.current_stream`` of the tape's device, its Python object kept while the raw
        stream stays the same (making one costs tens of microseconds of host time)."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        raw = torch._C._cuda_getCurrentRawStream(index)
        if self.stream_seen is None or self.stream_seen[0] != raw:
            self.stream_seen = (raw, torch.cuda.current_stream(index))
        return self.stream_seen[1]

    def verify(self, inputs: Sequence[torch.Tensor], expected: Any, exact: bool) -> str | None:
        """Replay on the recording's own ``inputs`` with every kept scratch and the fresh outputs
        poisoned first (all-ones bytes), and compare with the recording's outputs ``expected``:
        a launch the tape missed leaves poison or stale values behind. ``exact``: bit for bit (the
        call is deterministic), else within 1e-2 of the largest magnitude (atomics reorder sums).
        None where they agree, else what differs. Syncs the host once."""
        for b in self.kept:
            b.fill_(255)
        got, _ = _flatten(self.replay(inputs, poison=True))
        want, _ = _flatten(expected)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if not _agree(a, b, exact):
                return f"the replay's output {i} {tuple(a.shape)} differs from the recorded call's"
        return None


def _agree(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """``a`` equals ``b`` bit for bit (``exact``), else: the same non-finite values in the same places
    and the finite ones within 1e-2 of ``b``'s largest magnitude."""
    if exact:
        return torch.equal(a, b)
    a, b = a.double(), b.double()
    fa, fb = a.isfinite(), b.isfinite()
    if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):
        return False
    if not bool(fb.any()):
        return True
    return bool((a[fa] - b[fb]).abs().max() <= 1e-2 * b[fb].abs().max() + 1e-6)


def _entry_name(fn) -> str:
    """What an entry runs, for diagnostics: an aten op's name, a compiled CuTe DSL kernel's class
    (its mangled function name up to the argument types), else the callable's qualified name."""
    if hasattr(fn, "_op"):
        return str(fn)
    mangled = getattr(fn, "function_name", None)
    if isinstance(mangled, str):
        name = mangled.removeprefix("cutlass___call___")
        for cut in ("_object_at_", "_FakeTensor", "_Tensorgmem"):
            name = name.split(cut)[0]
        return f"cute:{name}"
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _dense_bytes(s: _Slot) -> int:
    """The bytes a slot's view spans when its elements tile them without gaps or overlaps, else -1."""
    n = 1
    for size in s.shape:
        n *= size
    if n == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(s.shape, s.stride))
    dims = sorted((stride, size) for size, stride in zip(s.shape, s.stride) if size > 1)
    step = 1
    for stride, size in dims:  # each dim steps over exactly the dims inside it
        if stride != step:
            return -1
        step *= size
    return n * s.dtype.itemsize if extent == n else -1


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _leaves(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _leaves(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _leaves(item)]
    return [x]


def _flatten(x) -> tuple[list[torch.Tensor], Any]:
    """Tensors of nested lists / tuples and the structure to rebuild them."""
    if isinstance(x, torch.Tensor):
        return [x], None
    if isinstance(x, (list, tuple)):
        leaves, specs = [], []
        for item in x:
            got, spec = _flatten(item)
            leaves += got
            specs.append((len(got), spec))
        return leaves, (type(x), specs)
    raise TypeError(f"launch tapes take lists and tuples of tensors, got {type(x).__name__}")


def _unflatten(leaves: list, spec) -> Any:
    if spec is None:
        return leaves[0]
    kind, specs = spec
    out, at = [], 0
    for n, sub in specs:
        out.append(_unflatten(leaves[at:at + n], sub))
        at += n
    return kind(out)


def _out_form(func, n_results: int):
    """The out= overload of functional ``func`` taking the same arguments, names and types
    (``add.out`` of ``add.Tensor``, ``sum.IntList_out`` of ``sum.dim_IntList``), or None."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        op = getattr(packet, name)
        schema = op._schema
        outs = sum(a.is_out for a in schema.arguments)
        if outs == n_results and [(a.name, str(a.type)) for a in schema.arguments if not a.is_out] == want:
            return op
    return None
