"""The block-attention contract shared by every backend.

A *block* is one attention call: queries ``q (b, s_q, h, d)`` against keys/values
``k, v (b, s_k, h_kv, d)`` (or, varlen, ``(total, h, d)`` with int32 ``cu_seqlens``).
Every backend returns ``(out, lse)``: ``out`` in q's dtype and layout, ``lse`` float32
``(b, h, s_q)`` (varlen ``(h, total_q)``), natural log of the scaled (and soft-capped)
scores; a row that sees no key has ``lse = -inf`` and ``out = 0``. (The reference backend
computing in float64 returns a float64 lse.)

Masking convention (FlashAttention's): with ``shift = s_k - s_q`` (per document when varlen),
query ``i`` may see key ``j`` iff ``-left <= j - i - shift <= right``, where
``(left, right) = window`` (None = unbounded) and ``causal`` forces ``right = 0``. So causal is
bottom-right aligned when ``s_q != s_k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

__all__ = ["AccumBackward", "AttnSpec", "BackendUnsupported", "BlockBackend", "KVGradLayout", "PlainBackend",
           "Written", "allowed_band", "band_mask", "check_grads", "group_stride", "materialized",
           "write_each_group"]


class BackendUnsupported(NotImplementedError):
    """A valid call this backend cannot run (dtype, device, feature); ``auto`` falls back on it.
    Malformed input is a ValueError instead, raised before any backend is tried."""


def _norm_window_side(value: int | None, side: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"window {side} must be an int or None, got {value!r}")
    if value == -1:  # FlashAttention-2 convention for "unbounded"
        return None
    if value < 0:
        raise ValueError(f"window {side} must be >= 0, None or -1 (unbounded), got {value}")
    return value


@dataclass(frozen=True)
class AttnSpec:
    """Options of one block-attention call (frozen; equality/hash ignore the cu_seqlens tensors).

    causal: mask keys after the query (bottom-right aligned).
    softmax_scale: None means ``1/sqrt(d)``.
    window: (left, right) sliding window; None = unbounded; FA2's -1 is read as None.
    softcap: 0 disables; else scores become ``softcap * tanh(scores / softcap)``.
    cu_seqlens_q / cu_seqlens_k: int32 (n_docs + 1,) for varlen inputs ``(total, h, d)``.
    max_seqlen_q / max_seqlen_k: Python ints (required with cu_seqlens).
    deterministic: ask the backward for a deterministic reduction order.
    sinks: None, or ``(h,)`` learnable sink logits (gpt-oss; :mod:`.sinks`): each row's softmax
        denominator gets ``exp(sinks[head])``; the sink has no value. The returned lse includes it.
        Not part of equality/hash (a tensor, like cu_seqlens).
    """

    causal: bool = False
    softmax_scale: float | None = None
    window: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    cu_seqlens_q: torch.Tensor | None = field(default=None, compare=False, repr=False)
    cu_seqlens_k: torch.Tensor | None = field(default=None, compare=False, repr=False)
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    deterministic: bool = False
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.window, (tuple, list)) or len(self.window) != 2:
            raise ValueError(f"window must be a (left, right) pair, got {self.window!r}")
        window = (_norm_window_side(self.window[0], "left"), _norm_window_side(self.window[1], "right"))
        object.__setattr__(self, "window", window)
        if self.softcap is None:
            object.__setattr__(self, "softcap", 0.0)
        if self.softcap < 0:
            raise ValueError(f"softcap must be >= 0, got {self.softcap}")
        if self.softmax_scale is not None and not (self.softmax_scale > 0 and math.isfinite(self.softmax_scale)):
            raise ValueError(f"softmax_scale must be a positive finite float or None, got {self.softmax_scale}")
        if (self.cu_seqlens_q is None) != (self.cu_seqlens_k is None):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen), or neither")
        if self.cu_seqlens_q is not None:
            for name in ("max_seqlen_q", "max_seqlen_k"):
                value = getattr(self, name)
                if isinstance(value, torch.Tensor) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name} must be a Python int >= 0 with cu_seqlens, got {value!r}")

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def window_right(self) -> int | None:
        """Effective right bound: 0 when causal."""
        return 0 if self.causal else self.window[1]

    @property
    def window_left(self) -> int | None:
        return self.window[0]

    @property
    def is_masked(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def scale(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def replace(self, **changes) -> AttnSpec:
        return replace(self, **changes)


def allowed_band(spec: AttnSpec, s_q: int, s_k: int) -> tuple[float, float]:
    """Allowed range ``lo <= j - i <= hi`` of key minus query index for a (s_q, s_k) block."""
    shift = s_k - s_q
    lo = -math.inf if spec.window_left is None else shift - spec.window_left
    hi = math.inf if spec.window_right is None else shift + spec.window_right
    return lo, hi


def band_mask(spec: AttnSpec, s_q: int, s_k: int, device: torch.device | str = "cpu",
              q_start: int = 0, q_stop: int | None = None) -> torch.Tensor | None:
    """Boolean mask ``(q_stop - q_start, s_k)``, True where the key is visible; None if all are."""
    if not spec.is_masked:
        return None
    q_stop = s_q if q_stop is None else q_stop
    lo, hi = allowed_band(spec, s_q, s_k)
    i = torch.arange(q_start, q_stop, device=device).unsqueeze(1)
    j = torch.arange(s_k, device=device).unsqueeze(0)
    rel = j - i
    mask = torch.ones(q_stop - q_start, s_k, dtype=torch.bool, device=device)
    if lo != -math.inf:
        mask &= rel >= lo
    if hi != math.inf:
        mask &= rel <= hi
    return mask


@dataclass(frozen=True, eq=False)
class Written:
    """A gradient the block *writes* instead of adding: its rows of ``out`` get this block's
    gradient, whatever they held. For rows one block alone contributes to (the all-gather mode:
    every query row and every key slot is in exactly one call), so the caller needs no zero fill
    and the backend no read of the destination. ``out`` is shaped like q / k / v, last-dim stride
    1, float32 (float64 for the reference backend) or, for a final gradient, the inputs' dtype
    (rounded once, from the fp32 accumulation)."""

    out: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.out.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    @property
    def device(self) -> torch.device:
        return self.out.device

    def put_(self, rows: torch.Tensor) -> None:
        """``out <- rows`` (cast to its dtype)."""
        self.out.copy_(rows)


def materialized(acc, compute: torch.dtype = torch.float32):
    """``(acc, None)`` for a tensor; ``(zeros like its rows in the compute dtype, acc)`` for a
    :class:`Written`, whose ``put_`` the caller then runs with the filled zeros (how a backend
    path that only adds takes one)."""
    if isinstance(acc, Written):
        return torch.zeros(acc.shape, dtype=compute, device=acc.device), acc
    return acc, None


def check_grads(grads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> tuple:
    """``grads = (dq_acc, dk_acc, dv_acc)`` of ``backward_accumulate``: shaped like q / k / v, of one of
    ``dtypes``, on q's device, last-dim stride 1; any may be a :class:`Written` (its ``out`` alike,
    or of the inputs' dtype); else a ValueError naming the tensor."""
    if not isinstance(grads, (tuple, list)) or len(grads) != 3:
        raise ValueError(f"grads must be a (dq_acc, dk_acc, dv_acc) tuple, got {type(grads).__name__}")
    for name, acc, like in (("dq_acc", grads[0], q), ("dk_acc", grads[1], k), ("dv_acc", grads[2], v)):
        written = isinstance(acc, Written)
        t = acc.out if written else acc
        ok = (*dtypes, like.dtype) if written else dtypes
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(like.shape) or t.dtype not in ok \
                or t.device != q.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(acc).__name__
            raise ValueError(f"{name} must be {tuple(like.shape)} of {ok} on {q.device}, got {got}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {t.stride()}")
    return grads[0], grads[1], grads[2]


@runtime_checkable
class BlockBackend(Protocol):
    """A provider of block attention that returns and consumes the LSE. Every method is required
    (:class:`PlainBackend` gives a backend without the ring extras their "not offered" answers).

    forward(q, k, v, spec, out=None, lse=None) -> (out, lse)
        ``out``/``lse`` may be preallocated (possibly strided) views to write into; an fp32 ``out``
        for 16-bit inputs asks for the unrounded block output (where ``fp32_block_outputs``).
    backward(dout, q, k, v, out, lse, spec) -> (dq, dk, dv)
        Gradients of this block given the *global* merged ``out`` and ``lse`` of the rows (exact
        for ring steps); returned in the inputs' dtype, never accumulated into anything.
    backward_accumulate(dout, q, k, v, out, lse, spec, grads) -> bool
        The same block gradients ADDED into ``grads = (dq_acc, dk_acc, dv_acc)``: float32
        accumulators shaped like q / k / v (dense ``(b, s, h, d)`` or varlen ``(total, h, d)``;
        views with last-dim stride 1, e.g. row slices of a bigger buffer; any may be a
        :class:`Written`, whose rows the block writes instead; float64 also taken by the reference
        backend), never rounded to the inputs' dtype on the way. Returns True, or
        False touching nothing where it cannot (the caller then uses ``backward``). Malformed
        accumulators are a ValueError naming the tensor.
    fp32_block_outputs(device) -> bool
        Whether ring blocks on ``device`` may ask ``forward`` for fp32 outputs (a property of the
        backend and the GPU generation, e.g. FA4's fp32 forward has not run on sm100).
    begin_backward(dout, q, out, lse, spec) -> AccumBackward | None
        The accumulating state of a ring backward that keeps block gradients in fp32 (see
        :class:`AccumBackward`); None where it cannot.
    can_forward_merge(q, v) -> bool
        Whether ``forward_merge`` runs for blocks of these inputs (the ring then keeps its running
        lse as (M, S) planes).
    forward_merge(q, k, v, spec, out_acc, planes) -> planes | None
        The block merged into ``out_acc`` and ``planes (b, h, 2, s_q)`` (see
        ``kernels/fa4/epilogue_merge.py``), None where it cannot (the ring then runs forward and a
        merge).
    merge_replay(q, k, v, spec, out_acc, planes) -> callable | None
        After a ``forward_merge`` with these arguments that ran: ``fn(q, k, v, out_acc, planes)``
        repeating it without its checks on tensors of the same shapes, strides, dtypes and
        alignment (the ring's later steps: the same rows of buffers laid out alike); None where
        ``forward_merge`` itself is as cheap.
    launches_taped(device) -> bool
        Whether every launch the backend makes on ``device`` goes through torch's dispatcher or
        :func:`ringfa4.kernels.tape.launch`, so a launch tape records a ring call over it whole
        (:mod:`ringfa4.kernels.tape`).
    """

    name: str
    tile: int  # the kernels' token tile: uneven sequences are cut into multiples of it (FA4: 128)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def backward_accumulate(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec,
                            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool: ...

    def fp32_block_outputs(self, device: torch.device) -> bool: ...

    def begin_backward(self, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       spec: AttnSpec) -> AccumBackward | None: ...

    def can_forward_merge(self, q: torch.Tensor, v: torch.Tensor) -> bool: ...

    def forward_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                      out_acc: torch.Tensor, planes: torch.Tensor) -> torch.Tensor | None: ...

    def merge_replay(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                     out_acc: torch.Tensor, planes: torch.Tensor) -> Callable[..., None] | None: ...

    def launches_taped(self, device: torch.device) -> bool: ...


class PlainBackend:
    """Base of a backend with only ``forward`` / ``backward``: the ring extras' "not offered"
    answers (fp32 block outputs allowed: ``forward`` copies into a given fp32 ``out``; no tile)."""

    tile = 1

    def fp32_block_outputs(self, device: torch.device) -> bool:
        return True

    def backward_accumulate(self, dout, q, k, v, out, lse, spec: AttnSpec, grads) -> bool:
        return False

    def begin_backward(self, dout, q, out, lse, spec: AttnSpec) -> None:
        return None

    def can_forward_merge(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        return False

    def forward_merge(self, q, k, v, spec: AttnSpec, out_acc, planes) -> None:
        return None

    def merge_replay(self, q, k, v, spec: AttnSpec, out_acc, planes) -> None:
        return None

    def launches_taped(self, device: torch.device) -> bool:
        """Unknown for a subclass's own kernels: False (the torch-only backends say True)."""
        return False


class KVGradLayout(Protocol):
    """How a ring keeps its travelling dK / dV: flat buffers of ``numel`` elements of ``dtype``
    that add elementwise; ``cols(buf, rows, k0, k1)`` gives what ``add_block`` receives as
    ``dk_acc, dv_acc`` for kv rows ``[k0, k1)`` (k0 a multiple of ``align``);
    ``write(buf, rows, dk, dv)`` puts the finished ``(b, rows, h_kv, d)`` dk, dv into ``dk, dv``
    (the inputs' dtype); ``write_groups(bufs, rows, dk, dv)`` does it for ``G = len(bufs)`` kv-head
    groups of this layout's width, in order, into ``dk, dv (b, rows, G * h_kv, d)`` (contiguous):
    one pass for all groups where it can (:func:`group_stride`), else :func:`write_each_group`.
    Every rank must be offered the same layout (the buffers travel)."""

    numel: int
    align: int
    dtype: torch.dtype

    def cols(self, buf: torch.Tensor, rows: int, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write(self, buf: torch.Tensor, rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None: ...

    def write_groups(self, bufs: list[torch.Tensor], rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None: ...


def write_each_group(layout: KVGradLayout, bufs: list[torch.Tensor], rows: int, dk: torch.Tensor,
                     dv: torch.Tensor) -> None:
    """``layout.write`` of each head group ``g`` (``bufs[g]``) into its kv heads of ``dk, dv (b, rows,
    G * h_g, d)`` (the groups of equal width ``h_g``, in order)."""
    width = dk.shape[2] // len(bufs)
    for g, buf in enumerate(bufs):
        layout.write(buf, rows, dk.narrow(2, g * width, width), dv.narrow(2, g * width, width))


def group_stride(bufs: list[torch.Tensor], numel: int) -> int | None:
    """The distance in elements between consecutive head groups' buffers ``bufs`` (each ``numel``
    contiguous elements, one dtype) where they are evenly spaced, non-overlapping views of one
    allocation in order (a ring's groups' accumulators, cut from one buffer: one strided view over
    them all addresses every group); else None (also for one group)."""
    first = bufs[0]
    if len(bufs) < 2:
        return None
    item, base = first.element_size(), first.untyped_storage().data_ptr()
    step, rest = divmod(bufs[1].data_ptr() - first.data_ptr(), item)
    if rest or step < numel:
        return None
    for g, buf in enumerate(bufs):
        if (buf.dtype != first.dtype or buf.numel() != numel or not buf.is_contiguous()
                or buf.data_ptr() != first.data_ptr() + g * step * item
                or (g and buf.untyped_storage().data_ptr() != base)):
            return None
    return step


class AccumBackward(Protocol):
    """One ring backward's accumulating state over a rank's dense ``q (b, s_q, h, d)``, made by a
    backend's ``begin_backward(dout, q, out, lse, spec)`` (None where it cannot). Every method is
    required.

    add_block(q0, q1, k, v, spec, dk_acc, dv_acc)
        Rows ``[q0, q1)`` of q against ``k, v (b, s_k, h_kv, d)`` with the block's ``spec``
        (causal / window on the sub-block): dq adds into the state, dk / dv into the fp32 (fp64
        for fp64 inputs) accumulators ``dk_acc, dv_acc`` like k (views allowed); no block gradient
        is rounded to the inputs' dtype.
    dq(dtype=None) -> the accumulated dq ``(b, s_q, h, d)``, fp32 (fp64 for fp64 inputs), or cast to
        ``dtype``.
    heads(h0, h1) -> the state of q heads ``[h0, h1)`` only (h0, h1 multiples of h / h_kv), sharing
        this state's dq: add_block then takes q rows of those heads against k, v of their kv heads
        (the ring's head groups, each group's dK / dV reduce-added by the kernel straight into its
        travelling buffer).
    kv_layout(k, cap) -> a :class:`KVGradLayout` of the state's own for dK / dV of ``cap`` kv rows
        like ``k``, or None (the ring keeps them dense).
    replay(q0, q1, k, v, spec, dk_acc, dv_acc) -> after an add_block with these arguments, a
        callable ``fn(state, k, v, dk_acc, dv_acc)`` that repeats it, without its checks, for any
        state of this backward whose ``replay_class()`` equals this one's and tensors of the same
        shapes, strides, dtypes and alignment (the ring's later steps: the same rows of buffers
        laid out alike); None where add_block itself is as cheap.
    replay_class() -> a hashable, equal for states whose blocks one replay runs.
    For the q ring backward (``parallel/ring/q_side.py``, where the q side travels and K/V stay):
    travel() -> the state's q-side tensors another rank's blocks need (contiguous; sent as they
    are); dq_zeros(h0, h1) / dq_empty(h0, h1) -> a dq accumulator of q heads ``[h0, h1)`` in the
    state's layout (it travels with the q side); visiting(pieces, h0, h1, dq) -> the state of heads
    ``[h0, h1)`` of another rank's q side ``pieces`` (its travel()), adding dq into ``dq``; valid
    while ``pieces`` hold that q side (the state may keep what it derives from them: FA4 copies the
    lse rows of blocks whose rows it pads), so the ring makes one per step;
    dq_from(bufs, heads, dtype) -> this state's dq ``(b, s_q, h, d)`` in ``dtype`` from the head
    groups' accumulators once they are back home.
    """

    def add_block(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                  dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None: ...

    def dq(self, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def heads(self, h0: int, h1: int) -> AccumBackward: ...

    def kv_layout(self, k: torch.Tensor, cap: int) -> KVGradLayout | None: ...

    def replay(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, dk_acc: torch.Tensor,
               dv_acc: torch.Tensor) -> Callable[..., None] | None: ...

    def replay_class(self) -> Hashable: ...

    def travel(self) -> tuple[torch.Tensor, ...]: ...

    def dq_zeros(self, h0: int, h1: int) -> torch.Tensor: ...

    def dq_empty(self, h0: int, h1: int) -> torch.Tensor: ...

    def visiting(self, pieces: tuple[torch.Tensor, ...], h0: int, h1: int, dq: torch.Tensor) -> AccumBackward: ...

    def dq_from(self, bufs: list[torch.Tensor], heads: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor: ...
