"""Activation checkpointing of decoder layers whose saved inputs live on the GPU, on the host, or are
rebuilt from the first layer of their group, chosen per layer from memory budgets.

A checkpointed layer keeps only its input ``(b, s, H)`` for backward: at 1M tokens and H = 4096 in
bf16 that is 8 GiB a layer, 256 GiB for 32 layers. :func:`plan_offload` places each layer's input:

- ``"gpu"``: plain checkpointing (the *last* layers: backward needs them first);
- ``"host"``: copied to pinned host memory on a side stream right after the layer's forward, and
  copied back ahead of need in backward (each unpack prefetches the next host input);
- ``"rebuild"``: not kept at all; when backward reaches the group, its inputs are recomputed from the
  group head's input (one extra no-grad forward of those layers; ``group`` layers a group, so with
  ``group = k`` only every k-th input is kept and k - 1 rebuilt inputs are on the GPU at once).

    ckpt = LayerCheckpointing(decoder_layers, gpu_budget=12 * 2**30, host_budget=96 * 2**30)
    ckpt.install()          # transformers GradientCheckpointingLayer: sets _gradient_checkpointing_func

Uses ``torch.utils.checkpoint(use_reentrant=False)`` with saved-tensor hooks around it: those hooks
see exactly the checkpoint's saved inputs. With an :class:`~ringfa4.kernels.output_cache.OutputCache`
the recompute reuses the forward's attention outputs. Layers must be dropout-free (rebuilds do not
replay RNG state), and each forward must be followed by its backward before the next forward
starts (the usual training step; layer 0's forward begins a new step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..kernels.output_cache import OutputCache, cache_phase

__all__ = ["LayerCheckpointing", "OffloadPlan", "plan_offload"]

PLACES = ("gpu", "host", "rebuild")


@dataclass(frozen=True)
class OffloadPlan:
    """Where each layer's checkpointed input lives; ``group`` layers share one kept input."""

    places: tuple[str, ...]
    group: int = 1

    def head(self, i: int) -> int:
        return i - i % self.group

    def counts(self) -> dict[str, int]:
        return {p: self.places.count(p) for p in PLACES}


def plan_offload(num_layers: int, layer_bytes: int, gpu_budget: float | None, host_budget: float | None,
                 group: int | None = None) -> OffloadPlan:
    """Place ``num_layers`` checkpointed inputs of ``layer_bytes`` each within ``gpu_budget`` and
    ``host_budget`` bytes (None = unlimited). The last layers stay on the GPU, earlier ones go to
    the host; when both together cannot hold every input, layers are grouped (the smallest ``k``
    such that ceil(L/k) kept inputs plus k - 1 rebuilt ones fit; or the given ``group``)."""
    L = num_layers
    g_fit = L if gpu_budget is None else int(gpu_budget // max(layer_bytes, 1))
    h_fit = L if host_budget is None else int(host_budget // max(layer_bytes, 1))
    ks = [group] if group else range(1, L + 1)
    for k in ks:
        heads = list(range(0, L, k))
        g_heads = g_fit - (k - 1)  # room for a group's rebuilt inputs during its backward
        if g_heads < 0 or len(heads) > g_heads + h_fit:
            continue
        on_gpu = set(heads[len(heads) - min(g_heads, len(heads)):])
        places = tuple(("gpu" if i in on_gpu else "host") if i % k == 0 else "rebuild" for i in range(L))
        return OffloadPlan(places, k)
    raise ValueError(f"checkpointed inputs do not fit: {L} layers x {layer_bytes / 2**30:.2f} GiB with "
                     f"gpu_budget {_gib(gpu_budget)} and host_budget {_gib(host_budget)}"
                     + (f" at group={group}" if group else " at any group size"))


def _gib(x) -> str:
    return "unlimited" if x is None else f"{x / 2**30:.2f} GiB"


class _PinnedPool:
    """Pinned host buffers reused across steps, keyed by (shape, dtype)."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.used: set[tuple] = set()
        self.nbytes = 0

    def get(self, like: torch.Tensor) -> torch.Tensor:
        bucket = self.free.get((tuple(like.shape), like.dtype))
        if bucket:
            return bucket.pop()
        self.nbytes += like.numel() * like.element_size()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)

    def put(self, t: torch.Tensor) -> None:
        key = (tuple(t.shape), t.dtype)
        self.free.setdefault(key, []).append(t)
        self.used.add(key)

    def trim(self) -> None:
        """Free the buffers of shapes the last step did not use (packed lengths vary)."""
        for key in [k for k in self.free if k not in self.used]:
            self.nbytes -= sum(t.numel() * t.element_size() for t in self.free.pop(key))
        self.used = set()


class _Raw:
    """A saved tensor that is not the layer input (torch <= 2.11 saves a 0-element dummy too)."""

    __slots__ = ("t",)

    def __init__(self, t) -> None:
        self.t = t


def _only_input(x: torch.Tensor, pack, unpack):
    """Hooks that apply ``pack`` / ``unpack`` to the layer input ``x`` only. They keep no reference
    to ``x``: autograd holds the hooks as long as the saved tensor, which would pin ``x`` on the GPU."""
    ptr, numel = x.data_ptr(), x.numel()

    def pack_input(t):
        same = numel > 0 and t.numel() == numel and t.data_ptr() == ptr
        return pack(t) if same else _Raw(t)

    def unpack_input(h):
        return h.t if isinstance(h, _Raw) else unpack(h)
    return pack_input, unpack_input


class _Held:
    """A saved input: on the GPU (``gpu``), or on the host with its copy events."""

    __slots__ = ("gpu", "host", "device", "ready")

    def __init__(self, gpu=None, host=None, device=None, ready=None) -> None:
        self.gpu, self.host, self.device, self.ready = gpu, host, device, ready


class LayerCheckpointing:
    """Checkpoint ``layers`` (callables taking the hidden states first) per an :class:`OffloadPlan`
    made at the first forward from the input size and the budgets (bytes; None = unlimited), or
    given as ``plan``. ``cache`` (an OutputCache, or True for a new one) keeps attention outputs
    for the recompute. Counters: ``peak_host_bytes``, ``rebuilds``."""

    def __init__(self, layers, gpu_budget: float | None = None, host_budget: float | None = None,
                 group: int | None = None, plan: OffloadPlan | None = None, cache: OutputCache | bool = False):
        self.layers = list(layers)
        self.budgets = (gpu_budget, host_budget, group)
        if plan is not None and len(plan.places) != len(self.layers):
            raise ValueError(f"plan places {len(plan.places)} layers, got {len(self.layers)} layers")
        self.plan, self._fixed, self._bytes = plan, plan, 0
        self.cache = OutputCache() if cache is True else (cache or None)
        self.pool = _PinnedPool()
        self._stream = None
        self._host: list[tuple[int, _Held]] = []  # host-held inputs of this step, in forward order
        self._heads: dict[int, _Held] = {}         # kept input of each group head
        self._fns: dict[int, object] = {}          # layer forward functions, for rebuilds
        self._rebuilt: dict[int, torch.Tensor] = {}
        self.rebuilds = 0

    # -- wiring ------------------------------------------------------------------------------------
    def install(self) -> LayerCheckpointing:
        """Make every layer (a transformers GradientCheckpointingLayer) checkpoint through this."""
        for i, layer in enumerate(self.layers):
            if not hasattr(layer, "_gradient_checkpointing_func"):
                raise ValueError(f"{type(layer).__name__} is not a transformers GradientCheckpointingLayer")
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = self.layer_fn(i)
        return self

    def layer_fn(self, i: int):
        """The ``checkpoint(fn, *args)`` replacement for layer ``i``."""
        def run(fn, *args):
            return self(i, fn, *args)
        return run

    @property
    def peak_host_bytes(self) -> int:
        """Pinned host bytes the pool holds: after a step, that step's peak (the next step's
        start frees buffers of shapes it no longer uses)."""
        return self.pool.nbytes

    # -- the checkpoint of one layer ---------------------------------------------------------------
    def __call__(self, i: int, fn, *args):
        if not args and isinstance(fn, functools.partial) and "hidden_states" in fn.keywords:
            kw = dict(fn.keywords)  # hidden states passed by keyword: make them the checkpointed input
            args = (kw.pop("hidden_states"),)
            fn = functools.partial(fn.func, *fn.args, **kw)
        x = args[0]
        plan = self._plan_for(x)
        if i == 0:  # a new step: whatever the last one left unused goes back to the pool
            for _, held in self._host:
                if held.host is not None:
                    self.pool.put(held.host)
            self._host.clear()
            self._heads.clear()
            self._rebuilt.clear()
            self._fns.clear()
            self.pool.trim()
        place, head = plan.places[i], plan.head(i)
        if plan.group > 1:  # rebuilds call the layer again
            if sum(isinstance(a, torch.Tensor) for a in args) > 1:
                raise ValueError("grouped checkpointing rebuilds a layer from its hidden states alone; this layer "
                                 f"takes {len(args)} positional tensors")
            self._fns[i] = fn
        calls = {"n": 0}
        cache = self.cache if torch.is_grad_enabled() else None  # no backward, no recompute to serve

        def body(*a):  # first call: the forward (record outputs); later: the recompute (take them)
            phase = "record" if calls["n"] == 0 else "take"
            calls["n"] += 1
            with cache_phase(cache, i, phase):
                return fn(*a)

        hooks = {"gpu": self._gpu_hooks(i), "host": self._host_hooks(i), "rebuild": self._rebuild_hooks(i, head)}[place]
        if plan.group > 1 and i == head:
            hooks = self._head_hooks(i, place)
        with torch.autograd.graph.saved_tensors_hooks(*_only_input(x, *hooks)):
            return checkpoint(body, *args, use_reentrant=False)

    def _plan_for(self, x: torch.Tensor) -> OffloadPlan:
        nbytes = x.numel() * x.element_size()
        if self._fixed is None and nbytes != self._bytes:  # planned per input size
            self.plan = plan_offload(len(self.layers), nbytes, *self.budgets)
        self._bytes = nbytes
        return self.plan

    # -- host copies -------------------------------------------------------------------------------
    def _copy_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, x: torch.Tensor) -> _Held:
        host = self.pool.get(x)
        stream = self._copy_stream(x.device)
        if stream is None:
            host.copy_(x)
            return _Held(host=host, device=x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
        x.record_stream(stream)  # x's memory is not reused before the copy has read it
        return _Held(host=host, device=x.device)

    def _fetch(self, held: _Held) -> None:
        """Start the copy back to the device (idempotent)."""
        if held.gpu is not None or held.host is None:
            return
        stream = self._copy_stream(held.device)
        if stream is None:
            held.gpu = held.host.clone()
            return
        stream.wait_stream(torch.cuda.current_stream(held.device))
        with torch.cuda.stream(stream):
            held.gpu = held.host.to(held.device, non_blocking=True)
            held.ready = torch.cuda.Event()
            held.ready.record(stream)

    def _take(self, held: _Held) -> torch.Tensor:
        """The device tensor of ``held`` (waiting for its copy), its host buffer back in the pool."""
        self._fetch(held)
        x = held.gpu
        if held.ready is not None:
            torch.cuda.current_stream(held.device).wait_event(held.ready)
            x.record_stream(torch.cuda.current_stream(held.device))
            self.pool.put(held.host)  # later copies into it queue behind this one on the copy stream
        elif held.host is not None:
            self.pool.put(held.host)
        held.host, held.ready = None, None
        self._host = [(j, h) for j, h in self._host if h is not held]  # autograd's holder keeps it now
        return x

    def _prefetch_before(self, i: int) -> None:
        """Start copying back the nearest earlier host input if backward needs it next (within one
        group of layers), not sooner: it would sit on the GPU through the layers in between."""
        earlier = [(j, h) for j, h in self._host if j < i]
        if earlier and earlier[-1][0] >= i - self.plan.group:
            self._fetch(earlier[-1][1])

    def _gpu_hooks(self, i: int):
        def unpack(x):  # kept as is; backward reaching it starts the copy of the next host input
            self._prefetch_before(i)
            return x
        return (lambda x: x), unpack

    def _host_hooks(self, i: int):
        def pack(x):
            held = self._to_host(x)
            self._host.append((i, held))
            return held

        def unpack(held):
            x = self._take(held)
            self._prefetch_before(i)
            return x
        return pack, unpack

    # -- groups ------------------------------------------------------------------------------------
    def _head_hooks(self, i: int, place: str):
        def pack(x):
            held = self._to_host(x) if place == "host" else _Held(gpu=x)
            if place == "host":
                self._host.append((i, held))
            self._heads[i] = held
            return held

        def unpack(held):  # may run more than once for one saved input: idempotent
            x = self._take(held) if held.host is not None else held.gpu
            held.gpu = x
            self._heads.pop(i, None)  # the group's rebuild came first; autograd's holder keeps it now
            for j in range(i, i + self.plan.group):
                self._fns.pop(j, None)
            self._prefetch_before(i)
            return x
        return pack, unpack

    def _rebuild_hooks(self, i: int, head: int):
        def pack(x):
            return _Held()  # nothing kept: rebuilt from the head's input when backward gets here

        def unpack(held):  # idempotent: a second unpack of the same input reuses the first
            if held.gpu is None:
                if i not in self._rebuilt:
                    self._rebuild_group(head, i)
                held.gpu = self._rebuilt.pop(i)
            return held.gpu
        return pack, unpack

    def _rebuild_group(self, head: int, upto: int) -> None:
        """Recompute (no grad) the inputs of layers head+1 .. upto from the head's kept input."""
        held = self._heads[head]
        x = self._take(held) if held.host is not None else held.gpu
        held.gpu = x  # the head's own unpack reuses it
        with torch.no_grad():
            for j in range(head, upto):
                layer = self.layers[j]
                unshard = getattr(layer, "unshard", None)  # an FSDP2 unit: gather its parameters
                if unshard is not None:
                    unshard()
                with cache_phase(self.cache, j, "peek"):
                    out = self._fns[j](x)
                if unshard is not None:
                    layer.reshard()
                x = out[0] if isinstance(out, tuple) else out
                self._rebuilt[j + 1] = x
                self.rebuilds += 1

    def describe(self) -> str:
        if self.plan is None:
            return "layer checkpointing: not planned yet (first forward)"
        c = self.plan.counts()
        size = self._bytes / 2**30
        return (f"layer checkpointing: {len(self.layers)} layers, input {size:.2f} GiB each: {c['gpu']} on GPU, "
                f"{c['host']} on host, {c['rebuild']} rebuilt (group {self.plan.group})"
                + (", attention outputs cached" if self.cache is not None else ""))

