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
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

__all__ = ["AccumBackward", "AttnSpec", "BackendUnsupported", "BlockBackend", "allowed_band", "band_mask"]


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


@runtime_checkable
class BlockBackend(Protocol):
    """A provider of block attention that returns and consumes the LSE.

    forward(q, k, v, spec, out=None, lse=None) -> (out, lse)
        ``out``/``lse`` may be preallocated (possibly strided) views to write into.
    backward(dout, q, k, v, out, lse, spec) -> (dq, dk, dv)
        Gradients of this block given the *global* merged ``out`` and ``lse`` of the rows (exact
        for ring steps); returned in the inputs' dtype, never accumulated into anything.

    Optional, for ring backwards that keep block gradients in fp32 (see :class:`AccumBackward`):
    begin_backward(dout, q, out, lse, spec) -> AccumBackward | None

    Optional, for ring forwards that merge inside the attention kernel (fp32 accumulators):
    can_forward_merge(q, v) -> bool: whether ``forward_merge`` runs for blocks of these inputs (the
    ring then keeps its running lse as (M, S) planes); forward_merge(q, k, v, spec, out_acc,
    planes) -> planes | None: the block merged into ``out_acc`` and ``planes (b, h, 2, s_q)``
    (see ``kernels/fa4_merge.py``), None where it cannot (the ring then runs forward and a merge).
    """

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class AccumBackward(Protocol):
    """One ring backward's accumulating state over a rank's dense ``q (b, s_q, h, d)``, made by a
    backend's optional ``begin_backward(dout, q, out, lse, spec)`` (None where it cannot).

    add_block(q0, q1, k, v, spec, dk_acc, dv_acc)
        Rows ``[q0, q1)`` of q against ``k, v (b, s_k, h_kv, d)`` with the block's ``spec``
        (causal / window on the sub-block): dq adds into the state, dk / dv into the fp32 (fp64
        for fp64 inputs) accumulators ``dk_acc, dv_acc`` like k (views allowed); no block gradient
        is rounded to the inputs' dtype.
    dq(dtype=None) -> the accumulated dq ``(b, s_q, h, d)``, fp32 (fp64 for fp64 inputs), or cast to
        ``dtype``.

    Optional: heads(h0, h1) -> the state of q heads ``[h0, h1)`` only (h0, h1 multiples of h / h_kv),
    sharing this state's dq: add_block then takes q rows of those heads against k, v of their kv
    heads. The ring runs its backward in head groups with it, each group's dK / dV reduce-added by
    the kernel straight into its travelling buffer (see ``parallel/executor.py``).

    Optional: kv_layout(k, cap) -> a layout of the state's own for dK / dV of ``cap`` kv rows like
    ``k``, or None (dense). The ring then keeps its travelling dK / dV in that layout: flat buffers
    of ``layout.numel`` elements (fp32, or k's dtype on a 16-bit wire) that add elementwise;
    ``layout.cols(buf, rows, k0, k1)`` gives what add_block receives as ``dk_acc, dv_acc`` for kv
    rows ``[k0, k1)`` (k0 a multiple of ``layout.align``); ``layout.dense(buf, rows)`` gives ``(b, rows,
    h_kv, d)`` dk, dv at the end, or, where the layout offers it, ``layout.write(buf, rows, dk, dv)``
    puts them straight into dk, dv of the inputs' dtype. Every rank must be offered the same layout
    (the buffers travel between ranks).

    Optional, for the q ring backward (``parallel/bwd_sides.py``, where the q side travels and K/V
    stay): travel() -> the state's q-side tensors another rank's blocks need (contiguous; sent as
    they are); dq_zeros(h0, h1) / dq_empty(h0, h1) -> a dq accumulator of q heads ``[h0, h1)`` in
    the state's layout (it travels with the q side); visiting(pieces, h0, h1, dq) -> the state of
    heads ``[h0, h1)`` of another rank's q side ``pieces`` (its travel()), adding dq into ``dq``;
    dq_from(bufs, heads, dtype) -> this state's dq ``(b, s_q, h, d)`` in ``dtype`` from the head
    groups' accumulators once they are back home.
    """

    def add_block(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                  dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None: ...

    def dq(self, dtype: torch.dtype | None = None) -> torch.Tensor: ...
