"""Block backend on torch's fused SDPA ops that return the LSE (cuDNN, flash (FA2), efficient).

Shapes and dtypes: ``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d|d_v)`` fp16/bf16 (fp32: the
efficient op only) -> ``out (b, s_q, h, d_v)`` in q's dtype, ``lse (b, h, s_q)`` float32, natural
log; a row that sees no key gets ``out = 0``, ``lse = -inf``. CUDA only. Causal is bottom-right
aligned (FA convention). Dense only: varlen, softcap, sliding windows, float64 and CPU tensors raise
:class:`SdpaUnsupported` (a NotImplementedError), so ``auto`` can fall back; bad input raises
ValueError (``validate_block``) first.

What the ops do (read on an H200, torch 2.11.0+cu130, cuDNN 9.19): cudnn returns LSE
``(b, h, s_q, 1)`` (contiguous) and is TOP-LEFT causal when s_q != s_k; flash returns ``(b, h, s_q)``
with +inf on keyless rows and is bottom-right causal; efficient returns LSE padded to
``(b, h, ceil(s_q / 32) * 32)`` and is TOP-LEFT causal.

So every call is reduced to pieces that need no alignment: causal with ``s_q > s_k`` runs the last
``s_k`` query rows as a square causal block (the first ``s_q - s_k`` rows see no key: out 0, lse
-inf, dq 0); causal with ``s_q < s_k`` runs the flash op (bottom-right) or, without it, a
non-causal block on the first ``s_k - s_q`` keys plus a square causal block on the rest, merged by
LSE. The backward of each piece takes the given (global, merged) out and lse rows, which is exact;
keyless rows get lse = +inf there so P = exp(s - lse) = 0. GQA: K/V heads are expanded with
``repeat_interleave`` and dk/dv summed back per group in float32. Preference is cuDNN, then flash,
then efficient (``SdpaBackend(ops=...)`` narrows it); a cuDNN RuntimeError (an unsupported graph)
is remembered and the next op runs instead. ``spec.deterministic`` uses the flash backward with
``torch.use_deterministic_algorithms`` switched on for the call (the ops read that global flag).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .eager import eager_boundary
from .sinks import apply_sinks_
from .spec import AttnSpec, BackendUnsupported, PlainBackend
from .validate import validate_block

__all__ = ["OPS", "SdpaBackend", "SdpaUnsupported"]

OPS = ("cudnn", "flash", "efficient")
_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_aten = torch.ops.aten
_Piece = tuple[slice, slice, bool]  # (query rows, key columns, causal); causal is square or bottom-right


class SdpaUnsupported(BackendUnsupported):
    """A call that torch's fused SDPA ops cannot run (feature, dtype, device, head dim)."""


def _check(q: torch.Tensor, spec: AttnSpec) -> bool:
    """Refuse what the fused ops cannot do; return whether the block is causal."""
    if spec.varlen:
        raise SdpaUnsupported("sdpa backend: varlen (cu_seqlens) is not supported by torch's fused SDPA "
                              "ops (dense (b, h, s, d) only); use the fa4 or reference backend")
    if spec.softcap:
        raise SdpaUnsupported(f"sdpa backend: softcap={spec.softcap} is not supported by torch's fused "
                              "SDPA ops; use the fa4 or reference backend")
    left, right = spec.window_left, spec.window_right
    if left is not None or right not in (None, 0):
        raise SdpaUnsupported(f"sdpa backend: sliding window {spec.window} is not supported by torch's "
                              "fused SDPA ops (only causal or none); use the fa4 or reference backend")
    if q.dtype not in _HALF + (torch.float32,):
        raise SdpaUnsupported(f"sdpa backend: torch's fused SDPA ops have no {q.dtype} kernels "
                              "(fp16/bf16, fp32 via the efficient op); use the reference backend")
    _check_device(q)
    return right == 0


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda":
        raise SdpaUnsupported(f"sdpa backend needs CUDA tensors (torch's fused SDPA ops with LSE are "
                              f"CUDA kernels), got device {q.device}; use the reference backend")


def _check_tensor(t: torch.Tensor, name: str, shape: tuple[int, ...], q: torch.Tensor,
                  dtype: torch.dtype | None = None) -> None:
    if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.device != q.device
            or (t.dtype != dtype if dtype is not None else t.dtype not in _FLOATS)):
        want = dtype if dtype is not None else "float"
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be {shape} {want} on {q.device}, got {got}")


def _pieces(s_q: int, s_k: int, causal: bool, bottom_right: bool) -> list[_Piece]:
    """Blocks whose mask needs no alignment convention (see module docstring)."""
    all_q, all_k = slice(0, s_q), slice(0, s_k)
    if not causal:
        return [(all_q, all_k, False)]
    if s_q >= s_k:
        return [(slice(s_q - s_k, s_q), all_k, True)]
    if bottom_right:
        return [(all_q, all_k, True)]
    cut = s_k - s_q
    return [(all_q, slice(0, cut), False), (all_q, slice(cut, s_k), True)]


def _extent(piece: _Piece) -> tuple[int, int]:
    return piece[0].stop - piece[0].start, piece[1].stop - piece[1].start


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> (b, h, s, d) view with last-dim stride 1, as the ops want."""
    return (x if x.stride(-1) == 1 else x.contiguous()).transpose(1, 2)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum expanded-head gradients (b, s, h, d) back to (b, s, h // groups, d), in float32."""
    if groups == 1:
        return dx
    return dx.unflatten(2, (dx.shape[2] // groups, groups)).sum(3, dtype=torch.float32).to(dx.dtype)


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    if not on or (torch.are_deterministic_algorithms_enabled()
                  and not torch.is_deterministic_algorithms_warn_only_enabled()):
        yield
        return
    prev = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn_only)


def _fwd_op(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One op on (b, s, h, d) inputs -> out (b, s_q, h, d_v), lse (b, h, s_q) float32."""
    qt, kt, vt = _bhsd(q), _bhsd(k), _bhsd(v)
    if op == "cudnn":
        res = _aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
        lse = res[1].reshape(res[1].shape[:3])  # (b, h, s_q, 1) -> (b, h, s_q)
    elif op == "flash":
        res = _aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
        lse = res[1]
    else:
        res = _aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, causal, scale=scale)
        lse = res[1][..., : q.shape[1]]  # padded to a multiple of 32 rows
    return res[0].transpose(1, 2), lse


def _bwd_op(op: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One op's backward on (b, s, h, d) tensors; ``lse (b, h, s_q)`` float32 without -inf."""
    dev, s_q, s_k = q.device, q.shape[1], k.shape[1]
    dot, qt, kt, vt, ot = _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out)
    if op == "cudnn":
        seed = torch.zeros((), dtype=torch.long, device=dev)  # dropout 0: never read
        stats = lse.contiguous().unsqueeze(-1)  # the forward's own (b, h, s_q, 1) layout
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, stats, seed, seed, None, None, None, s_q, s_k, 0.0, causal, scale=scale)
    elif op == "flash":
        rng = torch.zeros(2, dtype=torch.uint64, device=dev)  # dropout 0: never read
        grads = _aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse.contiguous(), None, None, s_q, s_k, 0.0, causal, rng, rng[0], scale=scale)
    else:
        padded = lse.new_full((*lse.shape[:2], -(-s_q // 32) * 32), math.inf)
        padded[..., :s_q] = lse
        seed = torch.zeros((), dtype=torch.long)
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            dot, qt, kt, vt, None, ot, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return grads[0].transpose(1, 2), grads[1].transpose(1, 2), grads[2].transpose(1, 2)


class SdpaBackend(PlainBackend):
    """Block attention on ``torch.ops.aten._scaled_dot_product_{cudnn,flash,efficient}_attention``.

    ``ops``: the ops allowed, in order of preference (default cuDNN, flash, efficient).
    """

    name = "sdpa"

    def launches_taped(self, device: torch.device) -> bool:
        """aten's attention ops only: a launch tape sees every one."""
        return True

    def __init__(self, ops: tuple[str, ...] = OPS) -> None:
        ops = tuple(ops)
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")
        self.ops = ops
        self._refused: set[tuple] = set()  # cuDNN configurations that raised

    def _usable(self, q: torch.Tensor, v: torch.Tensor, flash_only: bool) -> list[str]:
        d, d_v = q.shape[-1], v.shape[-1]
        found = []
        for op in self.ops:
            if op == "efficient":
                ok = not flash_only
            else:  # cuDNN and flash: fp16/bf16, head dims multiples of 8 up to 256
                ok = q.dtype in _HALF and d % 8 == 0 and d_v % 8 == 0 and max(d, d_v) <= 256
                ok = ok and (d == d_v if op == "flash" else not flash_only)
            if ok:
                found.append(op)
        if not found:
            why = "a deterministic backward needs the flash op (fp16/bf16, d == d_v)" if flash_only else \
                f"ops {self.ops} cannot run dtype {q.dtype} with head dims {d}/{d_v}"
            raise SdpaUnsupported(f"sdpa backend: {why}")
        return found

    def _run(self, ops: list[str], piece: _Piece, fn: Callable[..., Any], key: tuple, *args: Any) -> Any:
        """``fn(op, *args)`` with the first op that may run ``piece``; a cuDNN refusal falls through."""
        n_q, n_k = _extent(piece)
        cands = [op for op in ops if not piece[2] or n_q == n_k or op == "flash"]
        for i, op in enumerate(cands):
            if (op, *key) in self._refused and i + 1 < len(cands):
                continue
            try:
                return fn(op, *args)
            except RuntimeError as exc:
                if op != "cudnn" or i + 1 == len(cands) or isinstance(exc, torch.OutOfMemoryError):
                    raise
                self._refused.add((op, *key))
                warnings.warn(f"sdpa backend: cuDNN refused {key}, using {cands[i + 1]}: "
                              f"{str(exc).splitlines()[0][:200]}", RuntimeWarning, stacklevel=3)
        raise SdpaUnsupported(f"sdpa backend: no op in {ops} runs {key}")

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        b, s_q, h, d = q.shape
        s_k, d_v = k.shape[1], v.shape[-1]
        ops = self._usable(q, v, flash_only=False)
        kx, vx = _expand(k, h // k.shape[2]), _expand(v, h // k.shape[2])
        pieces = _pieces(s_q, s_k, causal, "flash" in ops)
        parts = [self._run(ops, piece, _fwd_op, ("fwd", q.dtype, d, d_v, *_extent(piece)),
                           q[:, piece[0]], kx[:, piece[1]], vx[:, piece[1]], piece[2], scale)
                 for piece in pieces]
        if len(parts) == 2:  # bottom-right causal split in two key ranges: merge by LSE
            (o1, l1), (o2, l2) = parts
            l = torch.logaddexp(l1, l2)
            w1, w2 = (torch.exp(x - l).transpose(1, 2).unsqueeze(-1) for x in (l1, l2))
            return (w1 * o1.float() + w2 * o2.float()).to(q.dtype), l
        rows = pieces[0][0]
        if rows.start == 0:
            return parts[0]
        # causal with s_q > s_k: the first s_q - s_k rows see no key
        o = q.new_zeros(b, s_q, h, d_v)
        o[:, rows] = parts[0][0]
        l = torch.full((b, h, s_q), -math.inf, dtype=torch.float32, device=q.device)
        l[..., rows] = parts[0][1]
        return o, l

    @eager_boundary
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)`` -> ``out (b, s_q, h, d_v)`` in q's dtype,
        ``lse (b, h, s_q)`` float32 (copied into ``out=`` / ``lse=`` when given)."""
        validate_block(q, k, v, spec)
        causal = _check(q, spec)
        b, s_q, h, d = q.shape
        s_k, d_v = k.shape[1], v.shape[-1]
        if out is not None:
            _check_tensor(out, "out", (b, s_q, h, d_v), q, out.dtype if out.dtype == torch.float32 else q.dtype)
        if lse is not None:
            _check_tensor(lse, "lse", (b, h, s_q), q, torch.float32)
        if q.numel() == 0 or s_k == 0:
            o = q.new_zeros(b, s_q, h, d_v)
            l = torch.full((b, h, s_q), -math.inf, dtype=torch.float32, device=q.device)
        else:
            o, l = self._forward(q, k, v, causal, spec.scale(d))
        if spec.sinks is not None:  # the sink column, after the kernel (in fp32: one more rounding of o)
            o, l = o.float(), l.float().contiguous()
            apply_sinks_(o, l, spec.sinks)
            o = o.to(q.dtype if out is None else out.dtype)
        if out is not None:
            out.copy_(o)
        if lse is not None:
            lse.copy_(l)
        return (out if out is not None else o.contiguous()), (lse if lse is not None else l.float().contiguous())

    @eager_boundary
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh ``dq (b, s_q, h, d)``, ``dk, dv (b, s_k, h_kv, d|d_v)`` in q's dtype of one block,
        from the merged ``out`` / ``dout (b, s_q, h, d_v)`` (any float dtype; cast to q's) and
        ``lse (b, h, s_q)`` (cast to float32; -inf rows get zero gradients)."""
        validate_block(q, k, v, spec)
        causal = _check(q, spec)
        b, s_q, h, d = q.shape
        s_k, h_kv, d_v = k.shape[1], k.shape[2], v.shape[-1]
        for name, t in (("out", out), ("dout", dout)):
            _check_tensor(t, name, (b, s_q, h, d_v), q)
        _check_tensor(lse, "lse", (b, h, s_q), q)
        if q.numel() == 0 or s_k == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        groups, scale = h // h_kv, spec.scale(d)
        out, dout = out.to(q.dtype), dout.to(q.dtype)
        lse = lse.to(torch.float32).masked_fill(lse == -math.inf, math.inf)  # keyless rows: P = 0
        ops = self._usable(q, v, flash_only=spec.deterministic)
        kx, vx = _expand(k, groups), _expand(v, groups)
        pieces = _pieces(s_q, s_k, causal, "flash" in ops)
        whole = len(pieces) == 1 and pieces[0][0].start == 0
        dq = None if whole else torch.zeros(b, s_q, h, d, dtype=torch.float32, device=q.device)
        dk = dv = None
        if len(pieces) > 1:
            dk, dv = kx.new_empty(kx.shape), vx.new_empty(vx.shape)
        with _deterministic(spec.deterministic):
            for piece in pieces:
                rows, keys, pc = piece
                g = self._run(ops, piece, _bwd_op, ("bwd", q.dtype, d, d_v, *_extent(piece)), dout[:, rows],
                              q[:, rows], kx[:, keys], vx[:, keys], out[:, rows], lse[..., rows], pc, scale)
                if whole:
                    dq = g[0]
                else:
                    dq[:, rows] += g[0]
                if len(pieces) == 1:
                    dk, dv = g[1], g[2]
                else:
                    dk[:, keys], dv[:, keys] = g[1], g[2]
        return dq.to(q.dtype).contiguous(), _fold(dk, groups).contiguous(), _fold(dv, groups).contiguous()
