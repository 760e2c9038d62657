"""FlashAttention-4's own sm90 backward for one dense call, prepared once per call signature.

``interface._flash_attn_bwd`` runs three to five launches (preprocess: D = rowsum(dO * O), lse *
log2(e), the fp32 dQ accumulator zeroed; the main kernel; the dQ postprocess, and for GQA the dK and
dV postprocesses of fp32 accumulators) behind several hundred microseconds of Python: its config
lookup, three compile keys, validation and allocations on every call. The backend's single call
(``cp=None``, and Ulysses' one call after its all-to-all) runs the same backward every layer of every
step with the same shapes. Here its checked path builds a :class:`BackwardPlan` once: FA4's
``BwdConfig`` for the call's (head dim, causal, local), FA4's own ``FlashAttentionBackwardSm90``
class built as its entry point builds it, and FA4's preprocess / postprocess kernels, all compiled
once per :class:`PlainBwdKey` (through FA4's own compile helpers) and launched directly; later
calls of the same signature allocate the outputs and scratch and launch.

Shapes and dtypes: ``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)``, ``out, dout (b, s_q, h, d)``
fp16 / bf16 (one dtype), ``lse (b, h, s_q)`` float32 natural log -> ``dq, dk, dv`` like q, k, v.
Causal is bottom-right aligned, windows ``(left, right)`` (None = unbounded), softcap as FA4's
score mod. sm90 only, ``d == d_v``, inputs of last-dim stride 1 (views such as a head group's or
a row range's, which FA4's entry point also passes on as they are; what it would copy first is not
prepared).
The results are FA4's: the same kernels with the same configuration and arguments. dQ and GQA's
dK / dV are reduced with fp32 atomics, so, as FA4's own, they may differ between runs in the last
bits; a deterministic spec runs FA4's deterministic kernel instead, its reductions ordered through
int32 semaphores that are zeroed for every call as FA4's entry point zeroes them (bit-identical
from run to run).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..spec import AttnSpec
from .bwd_accum import AccumKey
from .bwd_plan import BwdPlan, _rup, sm90_kernel, sm90_plan
from .launch import plain

__all__ = ["BackwardPlan", "PlainBwdKey", "prepare_backward"]

_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PlainBwdKey(AccumKey):
    """What the kernels of one plan are specialized on: :class:`~.bwd_accum.AccumKey`'s fields (window
    sizes, the softmax scale and every size but the head dim are runtime arguments), for FA4's own
    main-kernel class under its config for the call's mask (never equal to an AccumKey), and whether
    it is FA4's deterministic kernel."""

    deterministic: bool = False


class _Kernels(NamedTuple):
    """A cache entry: the compiled preprocess, main kernel, dQ postprocess and (GQA) dK / dV one."""

    preprocess: Any
    main: Any
    post_dq: Any
    post_dkv: Any | None


_CACHE: dict[PlainBwdKey, _Kernels] = {}


@functools.cache
def _config(head_dim: int, causal: bool, local: bool) -> Any:
    """FA4's sm90 ``BwdConfig`` for this call, as its entry point picks it."""
    from flash_attn.cute import interface

    return interface._tile_size_bwd_sm90(head_dim, head_dim, causal, local)


class BackwardPlan(NamedTuple):
    """One prepared backward: the compiled kernels, the plan's tiles and roundings, the softmax scale,
    the main kernel's arguments between its nine tensors and its semaphores (``head``) and after
    them (``tail``), and whether the kernel is deterministic (it then takes zeroed semaphores)."""

    kernels: _Kernels
    bwd_plan: BwdPlan
    softmax_scale: float
    head: tuple
    tail: tuple
    deterministic: bool = False

    def semaphores(self, b: int, h: int, h_kv: int, s_q_r: int, s_k_r: int, device: torch.device) -> tuple:
        """``(dQ, dK, dV)`` int32 semaphores, zeroed, as FA4's entry point allocates them for sm90
        (cluster size 1): dQ ``(b, h, s_q_r / tile_m, 1)``, for GQA dK / dV ``(b, h_kv, s_k_r /
        tile_n, 2)``; Nones where the kernel takes none (not deterministic; dK / dV of MHA)."""
        if not self.deterministic:
            return None, None, None
        p, i32 = self.bwd_plan, dict(dtype=torch.int32, device=device)
        dq = torch.zeros(b, h, s_q_r // p.tile_m, 1, **i32)
        if h == h_kv:
            return dq, None, None
        return (dq, *(torch.zeros(b, h_kv, s_k_r // p.tile_n, 2, **i32) for _ in "kv"))

    def launch_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   dout: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dq, dk, dv`` (allocated like q, k, v) of a call of the plan's signature: FA4's scratch
        allocated as its entry point allocates it, then the three to five launches."""
        b, s_q, h, _ = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        p, d_r = self.bwd_plan, self.bwd_plan.head_dim_rounded
        s_q_r, s_k_r = _rup(s_q, p.tile_m), _rup(s_k, p.tile_n)
        f32 = dict(dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(b, h, s_q_r * d_r, **f32)
        dpsum, lse_log2 = torch.empty(b, h, s_q_r, **f32), torch.empty(b, h, s_q_r, **f32)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        q, k, v, out, dout, lse = (plain(t) for t in (q, k, v, out, dout, lse))
        kern, sem = self.kernels, self.semaphores(b, h, h_kv, s_q_r, s_k_r, q.device)
        kern.preprocess(out, dout, dpsum, lse, lse_log2, dq_accum, None, None, None, None, None, 1.0, None, None)
        if kern.post_dkv is None:  # MHA: the main kernel writes dK / dV in q's dtype
            kern.main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, *self.head, *sem, *self.tail)
        else:  # GQA: q heads of a kv head reduce-add into fp32 accumulators
            dk_accum, dv_accum = (torch.zeros(b, h_kv, s_k_r * d_r, **f32) for _ in "kv")
            kern.main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_accum, dv_accum, *self.head, *sem, *self.tail)
            kern.post_dkv(dk_accum, dk, self.softmax_scale, None, None, None, None)
            kern.post_dkv(dv_accum, dv, 1.0, None, None, None, None)
        kern.post_dq(dq_accum, dq, self.softmax_scale, None, None, None, None)
        return dq, dk, dv


class Prepared(NamedTuple):
    """A checked call: its ``plan`` (None under fake tensors: compiled, nothing to launch) and the
    compile ``key``."""

    plan: BackwardPlan | None
    key: PlainBwdKey


def _main_args(softmax_scale: float, wl: int | None, wr: int | None) -> tuple[tuple, tuple]:
    """The main kernel's arguments between its nine tensors and its three semaphores, and after
    them, as FA4's entry point passes them for a dense call (no varlen, aux tensors, block sparsity
    or tile cumsum; the stream implicit)."""
    from flash_attn.cute.utils import AuxData

    return (softmax_scale, None, None, None, None, wl, wr), (AuxData(None, None), None, None)


def _semaphore_arg(t: torch.Tensor | None) -> Any:
    """A semaphore for the main kernel's compile, converted as FA4's entry point converts it."""
    from flash_attn.cute import utils

    if t is None:
        return None
    return utils.convert_from_dlpack_leading_static(t.detach(), leading_dim=3, alignment=4,
                                                    stride_order=t.dim_order())


def _compile(key: PlainBwdKey, p: BwdPlan, tensors: tuple, args: tuple) -> _Kernels:
    """FA4's preprocess, main kernel and postprocess(es) for ``key`` (``tensors``: the main kernel's
    nine, for its compile; ``args``: its (head, semaphores, tail) arguments)."""
    import cutlass.cute as cute
    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    dtype = interface.torch2cute_dtype_map[key.dtype]
    d, d_round, gqa = key.head_dim, p.d_round, key.qhead_per_kvhead > 1
    pre = interface._compile_bwd_preprocess(dtype, d, d, p.tile_m, False, False, False, True, False, True, True,
                                            False, False, 1, 1, False, d_round)
    kernel = sm90_kernel(FlashAttentionBackwardSm90, _config(d, key.causal, key.local), key.dtype, d,
                         key.qhead_per_kvhead, (key.causal, key.local), key.softcap, key.deterministic)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    head, sem, tail = args
    main = cute.compile(kernel, *(to_cute_tensor(t) for t in tensors), *head, *(_semaphore_arg(t) for t in sem),
                        *tail, stream, options="--enable-tvm-ffi")

    def post(kind: str) -> Any:
        tile, threads, atom, swap, use2, cluster, order = p.dq_post if kind == "dq" else p.dkv_post
        return interface._compile_bwd_postprocess(dtype, d, tile, threads, atom, swap, False, False, use2, cluster,
                                                  key.arch, False, None, d_round, order)

    return _Kernels(pre, main, post("dq"), post("dkv") if gqa else None)


def prepare_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, spec: AttnSpec, arch: int | None = None) -> Prepared:
    """The checked path: shapes, dtypes, layout and FA4's config; the kernels compiled once per
    :class:`PlainBwdKey`. Raises (before anything ran) NotImplementedError off sm90 or for varlen
    or sink specs, ValueError / TypeError for inputs it does not take (last-dim stride not 1,
    ``d != d_v``, empty, head dims FA4 lacks): the caller then runs FA4's entry point."""
    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import get_broadcast_dims
    from flash_attn.cute.testing import is_fake_mode

    arch = interface._get_device_arch() if arch is None else arch
    if arch // 10 != 9:
        raise NotImplementedError(f"the prepared FA4 backward runs on sm90 only, got sm{arch}")
    if spec.varlen or spec.sinks is not None:
        raise NotImplementedError("the prepared FA4 backward is dense, without sinks")
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k, v, out, dout)) or lse.dtype != torch.float32:
        raise TypeError(f"q, k, v, out, dout must share one dtype of fp16/bf16 and lse be float32, got "
                        f"{[t.dtype for t in (q, k, v, out, dout, lse)]}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"need q (b, s_q, h, d), k = v (b, s_k, h_kv, d), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if out.shape != q.shape or dout.shape != q.shape or tuple(lse.shape) != (b, h, s_q):
        raise ValueError(f"need out, dout {tuple(q.shape)} and lse {(b, h, s_q)}, got {tuple(out.shape)}, "
                         f"{tuple(dout.shape)}, {tuple(lse.shape)}")
    if h_kv == 0 or h % h_kv != 0 or q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"need h={h} a multiple of h_kv={h_kv} and rows on both sides")
    if any(t.stride(-1) != 1 for t in (q, k, v, out, dout, lse)):
        raise ValueError("the prepared FA4 backward takes inputs of last-dim stride 1 (contiguous rows)")
    try:
        interface._validate_head_dims(d, d, arch // 10, 16 // q.element_size())
    except AssertionError as exc:
        raise ValueError(str(exc)) from exc
    wl, wr = spec.window_left, spec.window_right
    causal, local, wl, wr = interface._resolve_causal_local_window(spec.causal, wl, wr)
    cfg = _config(d, causal, local)
    p = sm90_plan(arch, d, cfg)
    key = PlainBwdKey(arch=arch, dtype=q.dtype, head_dim=d, qhead_per_kvhead=h // h_kv, causal=causal, local=local,
                      has_window_left=wl is not None, has_window_right=wr is not None,
                      softcap=float(spec.softcap) if spec.softcap else None,
                      broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v, dout)),
                      single_q_block=_rup(s_q, p.tile_m) == p.tile_m, single_k_block=_rup(s_k, p.tile_n) == p.tile_n,
                      deterministic=bool(spec.deterministic))
    scale = spec.scale(d)
    head, tail = _main_args(scale, wl, wr)
    if key not in _CACHE:
        f32 = dict(dtype=torch.float32, device=q.device)
        d_r, s_q_r, s_k_r = p.head_dim_rounded, _rup(s_q, p.tile_m), _rup(s_k, p.tile_n)
        rows = torch.empty(b, h, s_q_r, **f32)
        kv = (torch.empty(b, h_kv, s_k_r * d_r, **f32),) * 2 if h > h_kv else (k, v)
        tensors = (q, k, v, dout, rows, rows, torch.empty(b, h, s_q_r * d_r, **f32), *kv)
        plan = BackwardPlan(None, p, scale, head, tail, key.deterministic)
        _CACHE[key] = _compile(key, p, tensors, (head, plan.semaphores(b, h, h_kv, s_q_r, s_k_r, q.device), tail))
    if is_fake_mode():
        return Prepared(None, key)
    return Prepared(BackwardPlan(_CACHE[key], p, scale, head, tail, key.deterministic), key)

