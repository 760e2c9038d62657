"""FlashAttention-4's own sm90 backward for one call (dense or packed), prepared once per call signature.

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
Packed documents (a varlen spec: ``cp=None`` and Ulysses' one call on packs): ``q, out, dout
(total_q, h, d)``, ``k, v (total_k, h_kv, d)``, ``lse (h, total_q)`` and the spec's int32 cu_seqlens,
through FA4's varlen kernels as ``_flash_attn_bwd`` runs them (its scratch padded per document; FA4's
batch-lookup hint, a speed aid for over 256 documents, given to the pre- and postprocesses always, so
their compile keys do not flip with the document count, and never to the main kernel, whose
scheduler walks any count without it).
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
from ..tape import launch
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
    it is FA4's deterministic kernel (``varlen``: packed documents, FA4's varlen kernels)."""

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
    longest: tuple[int, int] = (0, 0)  # varlen: the spec's (max_seqlen_q, max_seqlen_k) (semaphore sizes)

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
        launch(kern.preprocess, out, dout, dpsum, lse, lse_log2, dq_accum, None, None, None, None, None, 1.0, None,
               None)
        if kern.post_dkv is None:  # MHA: the main kernel writes dK / dV in q's dtype
            launch(kern.main, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, *self.head, *sem, *self.tail)
        else:  # GQA: q heads of a kv head reduce-add into fp32 accumulators
            dk_accum, dv_accum = (torch.zeros(b, h_kv, s_k_r * d_r, **f32) for _ in "kv")
            launch(kern.main, q, k, v, dout, lse_log2, dpsum, dq_accum, dk_accum, dv_accum, *self.head, *sem,
                   *self.tail)
            launch(kern.post_dkv, dk_accum, dk, self.softmax_scale, None, None, None, None)
            launch(kern.post_dkv, dv_accum, dv, 1.0, None, None, None, None)
        launch(kern.post_dq, dq_accum, dq, self.softmax_scale, None, None, None, None)
        return dq, dk, dv

    def launch_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      dout: torch.Tensor, lse: torch.Tensor, cu: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`launch_new` of a packed call (``cu = (cu_seqlens_q, cu_seqlens_k)``, contiguous
        int32): FA4's varlen scratch, padded per document as its entry point sizes it, and the same
        launches with the cu_seqlens (and the tile-cumsum hints of the pre- and postprocesses)."""
        from .varlen_bwd import padded_rows, tile_cumsum

        (total_q, h, _), (total_k, h_kv) = q.shape, k.shape[:2]
        p, d_r, n_cu = self.bwd_plan, self.bwd_plan.head_dim_rounded, cu[0].numel()
        pq, pk = padded_rows(total_q, n_cu, p.tile_m), padded_rows(total_k, n_cu, p.tile_n)
        f32 = dict(dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(h, pq * d_r, **f32)
        dpsum, lse_log2 = torch.empty(h, pq, **f32), torch.empty(h, pq, **f32)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        q, k, v, out, dout, lse = (plain(t) for t in (q, k, v, out, dout, lse))
        kern = self.kernels
        sem = self.semaphores(n_cu - 1, h, h_kv, _rup(self.longest[0], p.tile_m), _rup(self.longest[1], p.tile_n),
                              q.device)
        head = (self.head[0], *cu, *self.head[3:])
        launch(kern.preprocess, out, dout, dpsum, lse, lse_log2, dq_accum, cu[0], None, None, None, None, 1.0,
                        tile_cumsum(cu[0], p.tile_m), None)
        if kern.post_dkv is None:
            launch(kern.main, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, *head, *sem, *self.tail)
        else:
            dk_accum, dv_accum = (torch.zeros(h_kv, pk * d_r, **f32) for _ in "kv")
            launch(kern.main, q, k, v, dout, lse_log2, dpsum, dq_accum, dk_accum, dv_accum, *head, *sem, *self.tail)
            hint_k = tile_cumsum(cu[1], p.dkv_post[0])
            launch(kern.post_dkv, dk_accum, dk, self.softmax_scale, cu[1], None, None, hint_k)
            launch(kern.post_dkv, dv_accum, dv, 1.0, cu[1], None, None, hint_k)
        launch(kern.post_dq, dq_accum, dq, self.softmax_scale, cu[0], None, None, tile_cumsum(cu[0], p.dq_post[0]))
        return dq, dk, dv


class Prepared(NamedTuple):
    """A checked call: its ``plan`` (None under fake tensors: compiled, nothing to launch) and the
    compile ``key``."""

    plan: BackwardPlan | None
    key: PlainBwdKey


def _main_args(softmax_scale: float, wl: int | None, wr: int | None) -> tuple[tuple, tuple]:
    """The main kernel's arguments between its nine tensors and its three semaphores, and after
    them, as FA4's entry point passes them for a dense call (no aux tensors, block sparsity or tile
    cumsum; the stream implicit); a packed call's cu_seqlens replace the two Nones after the
    scale."""
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
    nine, for its compile; ``args``: its (head, semaphores, tail) arguments, varlen ones with the
    cu_seqlens in ``head``; varlen pre- and postprocesses take the tile-cumsum hint)."""
    import cutlass.cute as cute
    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    dtype = interface.torch2cute_dtype_map[key.dtype]
    d, d_round, gqa, var = key.head_dim, p.d_round, key.qhead_per_kvhead > 1, key.varlen
    pre = interface._compile_bwd_preprocess(dtype, d, d, p.tile_m, var, False, False, True, False, True, True,
                                            False, False, 1, 1, var, d_round)
    kernel = sm90_kernel(FlashAttentionBackwardSm90, _config(d, key.causal, key.local), key.dtype, d,
                         key.qhead_per_kvhead, (key.causal, key.local), key.softcap, key.deterministic)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    head, sem, tail = args
    head = tuple(to_cute_tensor(a, assumed_align=4) if isinstance(a, torch.Tensor) else a for a in head)
    main = cute.compile(kernel, *(to_cute_tensor(t) for t in tensors), *head, *(_semaphore_arg(t) for t in sem),
                        *tail, stream, options="--enable-tvm-ffi")

    def post(kind: str) -> Any:
        tile, threads, atom, swap, use2, cluster, order = p.dq_post if kind == "dq" else p.dkv_post
        return interface._compile_bwd_postprocess(dtype, d, tile, threads, atom, swap, var, False, use2, cluster,
                                                  key.arch, var, None, d_round, order)

    return _Kernels(pre, main, post("dq"), post("dkv") if gqa else None)


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
            lse: torch.Tensor, spec: AttnSpec) -> tuple[int, int, int, int, int, int]:
    """``(b, s_q, s_k, h, h_kv, d)`` of a dense call, or of a packed one ``(documents, max_seqlen_q,
    max_seqlen_k, h, h_kv, d)``; ValueError for shapes the prepared backward does not take."""
    lead = 1 if spec.varlen else 2
    if q.dim() != lead + 2 or k.shape != v.shape or k.dim() != q.dim() or k.shape[:lead - 1] != q.shape[:lead - 1] \
            or k.shape[-1] != q.shape[-1]:
        want = ("q (total_q, h, d), k = v (total_k, h_kv, d)" if spec.varlen
                else "q (b, s_q, h, d), k = v (b, s_k, h_kv, d)")
        raise ValueError(f"need {want}, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, d, h_kv = q.shape[-2], q.shape[-1], k.shape[-2]
    lse_shape = (h, q.shape[0]) if spec.varlen else (q.shape[0], h, q.shape[1])
    if out.shape != q.shape or dout.shape != q.shape or tuple(lse.shape) != lse_shape:
        raise ValueError(f"need out, dout {tuple(q.shape)} and lse {lse_shape}, got {tuple(out.shape)}, "
                         f"{tuple(dout.shape)}, {tuple(lse.shape)}")
    if h_kv == 0 or h % h_kv != 0 or q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"need h={h} a multiple of h_kv={h_kv} and rows on both sides")
    if spec.varlen:
        return spec.cu_seqlens_q.numel() - 1, spec.max_seqlen_q, spec.max_seqlen_k, h, h_kv, d
    return q.shape[0], q.shape[1], k.shape[1], h, h_kv, d


def _compile_inputs(call: tuple, shapes: tuple, p: BwdPlan, varlen: bool) -> tuple[tuple, tuple]:
    """The main kernel's nine tensors to compile from and the cu_seqlens, for ``call = (q, k, v,
    dout)`` (varlen: fixed-size stand-ins of 3 tiles of rows and 3 documents, as the call's sizes
    are runtime values; dense: scratch of the call's sizes around its own tensors)."""
    q, k, v, dout = call
    b, s_q, s_k, h, h_kv, _ = shapes
    f32, d_r, gqa = dict(dtype=torch.float32, device=q.device), p.head_dim_rounded, h > h_kv
    if not varlen:
        s_q_r, s_k_r = _rup(s_q, p.tile_m), _rup(s_k, p.tile_n)
        rows = torch.empty(b, h, s_q_r, **f32)
        kv = (torch.empty(b, h_kv, s_k_r * d_r, **f32),) * 2 if gqa else (k, v)
        return (q, k, v, dout, rows, rows, torch.empty(b, h, s_q_r * d_r, **f32), *kv), (None, None)
    from .varlen_bwd import padded_rows

    if any(any(dims) for dims in _broadcast(*call)):
        raise ValueError("the prepared FA4 varlen backward takes no stride-0 dims")
    rq, rk = 3 * p.tile_m, 3 * p.tile_n
    pq, pk = padded_rows(rq, 4, p.tile_m), padded_rows(rk, 4, p.tile_n)
    qc = torch.empty(rq, h, q.shape[-1], dtype=q.dtype, device=q.device)
    kc = torch.empty(rk, h_kv, q.shape[-1], dtype=q.dtype, device=q.device)
    rows = torch.empty(h, pq, **f32)
    kv = (torch.empty(h_kv, pk * d_r, **f32),) * 2 if gqa else (kc, kc)
    cu = tuple(torch.empty(4, dtype=torch.int32, device=q.device) for _ in "qk")
    return (qc, kc, kc, qc, rows, rows, torch.empty(h, pq * d_r, **f32), *kv), cu


def _broadcast(*tensors: torch.Tensor) -> tuple:
    """FA4's stride-0 dims of each tensor (static in a compiled layout)."""
    from flash_attn.cute.cute_dsl_utils import get_broadcast_dims

    return tuple(get_broadcast_dims(t) for t in tensors)


def prepare_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, spec: AttnSpec, arch: int | None = None) -> Prepared:
    """The checked path: shapes, dtypes, layout and FA4's config; the kernels compiled once per
    :class:`PlainBwdKey`. Raises (before anything ran) NotImplementedError off sm90 or for sink
    specs, ValueError / TypeError for inputs it does not take (last-dim stride not 1, ``d != d_v``,
    empty, head dims FA4 lacks): the caller then runs FA4's entry point."""
    from flash_attn.cute import interface
    from flash_attn.cute.testing import is_fake_mode

    arch = interface._get_device_arch() if arch is None else arch
    if arch // 10 != 9:
        raise NotImplementedError(f"the prepared FA4 backward runs on sm90 only, got sm{arch}")
    if spec.sinks is not None:
        raise NotImplementedError("the prepared FA4 backward takes no sinks")
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k, v, out, dout)) or lse.dtype != torch.float32:
        raise TypeError(f"q, k, v, out, dout must share one dtype of fp16/bf16 and lse be float32, got "
                        f"{[t.dtype for t in (q, k, v, out, dout, lse)]}")
    shapes = _shapes(q, k, v, out, dout, lse, spec)
    b, s_q, s_k, h, h_kv, d = shapes
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
    single = not spec.varlen  # FA4's key: one-tile dims (dense only; packed sizes are runtime values)
    key = PlainBwdKey(arch=arch, dtype=q.dtype, head_dim=d, qhead_per_kvhead=h // h_kv, causal=causal, local=local,
                      has_window_left=wl is not None, has_window_right=wr is not None,
                      softcap=float(spec.softcap) if spec.softcap else None, broadcast=_broadcast(q, k, v, dout),
                      single_q_block=single and _rup(s_q, p.tile_m) == p.tile_m,
                      single_k_block=single and _rup(s_k, p.tile_n) == p.tile_n,
                      deterministic=bool(spec.deterministic), varlen=spec.varlen)
    scale = spec.scale(d)
    head, tail = _main_args(scale, wl, wr)
    plan = BackwardPlan(None, p, scale, head, tail, key.deterministic, (s_q, s_k))
    if key not in _CACHE:
        tensors, cu = _compile_inputs((q, k, v, dout), shapes, p, spec.varlen)
        rows_q, rows_k = (3 * p.tile_m, 3 * p.tile_n) if spec.varlen else (_rup(s_q, p.tile_m), _rup(s_k, p.tile_n))
        sem = plan.semaphores(3 if spec.varlen else b, h, h_kv, rows_q, rows_k, q.device)
        _CACHE[key] = _compile(key, p, tensors, ((head[0], *cu, *head[3:]), sem, tail))
    if is_fake_mode():
        return Prepared(None, key)
    return Prepared(plan._replace(kernels=_CACHE[key]), key)
