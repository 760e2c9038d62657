"""FlashAttention-4 forward with a float32 output, for ring attention's per-step merges.

FA4 (flash-attn-4, pinned) writes ``out`` in q's dtype: each ring step's block output is rounded to
bf16 before the steps are merged, which costs precision. This module runs FA4's own forward kernels,
configured (not copied) so that ``out`` stays float32:

* **sm100** (Blackwell): ``FlashAttentionForwardSm100`` takes O's dtype from the O tensor
  (``self.o_dtype = mO.element_type``). It is built with ``is_split_kv=True`` and handed O as a 5-D
  ``(1, b, s_q, h, d)`` float32 view and lse as ``(1, b, h, s_q)``: one split covering every key,
  i.e. FA4's split-KV partial-output path, where fp32 sO overlaps Q's shared memory so the KV
  pipeline keeps its stages. A split with no key (a whole query tile fully masked) writes
  ``lse = -inf`` but leaves O untouched, so rows that see no key are zeroed here afterwards.
* **sm90** (Hopper): ``_Sm90Fp32Out`` subclasses ``FlashAttentionForwardSm90``: ``_check_type``
  accepts a float32 O, ``use_tma_O`` is pinned to False (no TMA store from the bf16 sO that reuses
  Q's smem), and ``epilogue`` stores the normalized fp32 accumulator straight from registers to
  global memory (row / head-dim predicated), plus the lse exactly as the base class does. No pack-GQA.

Shapes and dtypes: dense ``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)`` fp16/bf16 (h % h_kv == 0)
-> ``out (b, s_q, h, d)`` float32, ``lse (b, h, s_q)`` float32 (natural log). Causal is bottom-right
aligned, windows are ``(left, right)`` (None or -1 = unbounded), softcap 0 = off; rows that see no key get
``out = 0``, ``lse = -inf``, as in FA4. ``out`` / ``lse`` may be preallocated strided views with
last-dim stride 1 (out: 16-byte aligned pointer and strides). Kernels compile on first use per
:class:`Fp32Key` and are cached per process. The arch is FA4's choice (``FLASH_ATTENTION_ARCH`` or
the device capability). Under ``FakeTensorMode`` (with ``FLASH_ATTENTION_ARCH`` / ``CUTE_DSL_ARCH``
set) the kernels compile without a GPU and nothing runs: see :func:`compile_only`.

The same preparation serves one call of FA4's own sm90 class, O in q's dtype (:func:`prepare_plain`,
FA4's tile config and pack-GQA default): the backend's single call (``cp=None``) launches it from a
plan instead of going through FA4's Python entry point on every call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..eager import eager_boundary
from ..spec import AttnSpec
from ..tape import launch
from .launch import plain

__all__ = ["Compiled", "ForwardPlan", "Fp32Key", "Prepared", "compile_only", "fa4_forward_fp32", "prepare_forward",
           "compile_only_plain", "prepare_plain"]

_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Fp32Key:
    """Everything a compiled forward of this module is specialized on (window sizes, the softmax scale
    and the sizes other than head_dim are runtime arguments): the fp32-output one, its merging and
    varlen variants, and FA4's own class for a single call (``plain``)."""

    arch: int  # FA4's arch number: 90, 100, ...
    dtype: torch.dtype
    head_dim: int
    qhead_per_kvhead: int
    causal: bool
    local: bool
    has_window_left: bool
    has_window_right: bool
    softcap: float | None  # compile-time constant of FA4's softcap score_mod
    tile_m: int
    tile_n: int
    q_stage: int  # sm100: 2 query tiles per CTA when s_q > tile_m
    mma_pv_is_rs: bool  # sm90 only
    intra_wg_overlap: bool  # sm90 only
    broadcast: tuple  # stride-0 dims of q, k, v (static in the compiled layouts)
    merge: bool = False  # sm90: the epilogue merges into an fp32 accumulator (kernels/fa4/epilogue_merge.py)
    varlen: bool = False  # packed q / k / v with cu_seqlens (kernels/fa4/varlen_fwd.py; sm90)
    plain: bool = False  # sm90: FA4's own class, O in q's dtype (prepare_plain: the single call)
    pack_gqa: bool = False  # plain only: FA4's default for GQA (the others take no pack-GQA)


# Tried on the H200 and dropped (benchmarks/fa4_merge_epilogue.py, 64k ring block shapes; the code
# is in the git tags tried/fa4-tma-store and tried/fa4-persistent, docs/experiments.md; both passed
# the GPU tests, the persistent one bit for bit):
# - O through a float32 sO (over sQ and sK's first stage) and FA4's TMA store, whose atom FA4 builds
#   for a float32 O: +3.9 / +2.4 / +1.7% over FA4 (8k x 4k, 4k x 8k, 8k causal) against +2.6 / +2.4 /
#   +1.5% for these register stores, same process (fa4_merge_epilogue_tma_h200.json);
# - unmasked blocks launched persistent (FA4's StaticPersistentTileScheduler, one CTA per SM): the
#   fp32 store 0.3-1.1 points cheaper, the merging forward 7-10 points dearer
#   (fa4_merge_epilogue_persistent_h200.json).
@functools.cache
def _sm90_class() -> type:
    """``FlashAttentionForwardSm90`` with an fp32-O epilogue (flash_attn imported lazily)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from quack import layout_utils

    class _Sm90Fp32Out(FlashAttentionForwardSm90):
        # FlashAttentionForwardSm90.__call__ assigns use_tma_O = use_tma_Q; O never goes through TMA
        # here (its sO is bf16 and reuses Q's smem, too small for fp32), so the assignment is ignored.
        use_tma_O = property(lambda self: False, lambda self, value: None)

        def _check_type(self, mQ_type, mK_type, mV_type, mO_type, *rest):
            if const_expr(mO_type != Float32):
                raise TypeError(f"O must be Float32, got {mO_type}")
            super()._check_type(mQ_type, mK_type, mV_type, mQ_type, *rest)

        def thread_rows(self, tiled_mma, tidx, m_block, seqlen):
            """(thread's MMA slice, its (row, col) coordinates, thread 0's, rows left in the tile).
            Rows are compared through thread 0's coordinates (compile-time) against a per-thread
            bound, as FA4 does. Traced inline into the epilogues."""
            thr_mma = tiled_mma.get_slice(tidx)
            cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
            tOcO = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cO))  # (rows, cols) of this thread
            t0OcO = layout_utils.reshape_acc_to_mn(tiled_mma.get_slice(0).partition_C(cO))
            return thr_mma, tOcO, t0OcO, seqlen.seqlen_q - m_block * self.tile_m - tOcO[0][0]

        def row_tensor(self, thr_mma, mLSE, seqlen, m_block, head_idx, batch_idx):
            """This thread's rows of ``mLSE`` (one value a row, broadcast over the columns) and the tile's
            gmem tensor of them."""
            mLSE_cur = seqlen.offset_batch_Q(mLSE, batch_idx, dim=2)[None, head_idx]
            gLSE = cute.local_tile(mLSE_cur, (self.tile_m,), (m_block,))
            bcast = cute.append(gLSE.layout, cute.make_layout((self.tile_hdimv,), stride=(0,)))
            return layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cute.make_tensor(gLSE.iterator, bcast))), gLSE

        def o_tile(self, thr_mma, mO, seqlen, m_block, head_idx, batch_idx):
            """This thread's elements of the tile's O rows in gmem, (rows, cols)."""
            mO_cur = seqlen.offset_batch_Q(mO, batch_idx, dim=3)[None, None, head_idx]
            gO = cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))
            return layout_utils.reshape_acc_to_mn(thr_mma.partition_C(gO))

        @cute.jit
        def epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma,
                     tidx, m_block, head_idx, batch_idx):
            # acc_O is already normalized (softmax.finalize + rescale_O); lse holds the row lse.
            # Nothing goes through smem, so no barrier is needed (the CTA runs a single tile).
            assert not self.pack_gqa
            thr_mma, tOcO, t0OcO, rows_left = self.thread_rows(tiled_mma, tidx, m_block, seqlen)
            if const_expr(mLSE is not None):  # one thread per row (the one holding column 0) writes
                tOgLSE, _ = self.row_tensor(thr_mma, mLSE, seqlen, m_block, head_idx, batch_idx)
                assert cute.size(tOgLSE, mode=[0]) == cute.size(lse)
                if tOcO[0][1] == 0:
                    for m in cutlass.range_constexpr(cute.size(tOgLSE, mode=[0])):
                        if t0OcO[m, 0][0] < rows_left:
                            tOgLSE[m, 0] = lse[m]
            tOgO = self.o_tile(thr_mma, mO, seqlen, m_block, head_idx, batch_idx)
            tOrO = layout_utils.reshape_acc_to_mn(acc_O)
            for m in cutlass.range_constexpr(cute.size(tOrO, mode=[0])):
                if t0OcO[m, 0][0] < rows_left:
                    if const_expr(not self.check_hdim_v_oob):
                        cute.autovec_copy(tOrO[m, None], tOgO[m, None])
                    else:
                        for n in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
                            if tOcO[m, n][1] < mO.shape[1]:
                                tOgO[m, n] = tOrO[m, n]

    return _Sm90Fp32Out


@functools.cache
def _fa4_sm90_class() -> type:
    """FA4's own ``FlashAttentionForwardSm90`` (O in q's dtype, its TMA store): :func:`prepare_plain`."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    return FlashAttentionForwardSm90


def _make_kernel(key: Fp32Key, sm90_class: Callable[[], type]) -> Any:
    from flash_attn.cute import utils
    from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

    score_mod = utils.create_softcap_scoremod(key.softcap) if key.softcap is not None else None
    common = dict(qhead_per_kvhead=key.qhead_per_kvhead, is_causal=key.causal, is_local=key.local,
                  pack_gqa=key.pack_gqa, score_mod=score_mod)
    if key.arch // 10 == 9:
        from flash_attn.cute.interface import torch2cute_dtype_map

        cls = sm90_class()
        return cls(torch2cute_dtype_map[key.dtype], key.head_dim, key.head_dim, tile_m=key.tile_m,
                             tile_n=key.tile_n, num_stages=2, num_threads=384, Q_in_regs=False,
                             intra_wg_overlap=key.intra_wg_overlap, mma_pv_is_rs=key.mma_pv_is_rs, **common)
    return FlashAttentionForwardSm100(key.head_dim, key.head_dim, is_split_kv=True, m_block_size=key.tile_m,
                                      n_block_size=key.tile_n, q_stage=key.q_stage, is_static_persistent=False,
                                      use_2cta_instrs=False, use_clc_scheduler=False, use_s_ping_pong=False,
                                      **common)


@dataclass(frozen=True)
class _Launch:
    """A launch's runtime scalars besides the tensors: the softmax scale, FA4's window sizes (None:
    unbounded) and s_q."""

    softmax_scale: float
    window_left: int | None
    window_right: int | None
    max_seqlen_q: int


def _kernel_args(arch: int, tensors: tuple, launch: _Launch, cu: tuple = (None, None)) -> list:
    """The positional arguments after the kernel object, as FA4's interface passes them (no paged KV
    / seqused / sink / block sparsity / aux tensors / varlen scheduler hints; the env stream stays
    implicit); ``tensors`` = (q, k, v, o, lse), ``cu`` = (cu_seqlens_q, cu_seqlens_k) or Nones (dense)."""
    return [*tensors, *_kernel_tail(arch, launch, cu)]


def _kernel_tail(arch: int, launch: _Launch, cu: tuple = (None, None)) -> list:
    """The arguments of :func:`_kernel_args` after the five tensors."""
    from flash_attn.cute.utils import AuxData

    args = [launch.softmax_scale, *cu, None, None, None, launch.window_left, launch.window_right, None]
    if arch // 10 in (10, 11):
        return args + [None, None, AuxData(None, None)] + [None] * 7 + [launch.max_seqlen_q]
    return args + [None, AuxData(None, None), None, None]


class Compiled(NamedTuple):
    """A cache entry: the FA4 kernel object (after compiling, e.g. ``kernel.o_dtype`` on sm100) and
    the compiled function (``fn.__ptx__`` / ``fn.__cubin__`` with ``CUTE_DSL_KEEP=ptx,cubin``)."""

    key: Fp32Key
    kernel: Any
    fn: Any


_CACHE: dict[Fp32Key, Compiled] = {}


def _compile(key: Fp32Key, tensors: tuple, launch: _Launch, sm90_class: Callable[[], type],
             cu: tuple = (None, None)) -> Compiled:
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    kernel = _make_kernel(key, sm90_class)
    q, k, v, o, lse = tensors
    cute_tensors = (*(to_cute_tensor(t) for t in (q, k, v)), to_cute_tensor(o, assumed_align=16),
                    to_cute_tensor(lse, assumed_align=4))
    cute_cu = tuple(None if t is None else to_cute_tensor(t, assumed_align=4, leading_dim=0) for t in cu)
    args = _kernel_args(key.arch, cute_tensors, launch, cute_cu)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return Compiled(key, kernel, cute.compile(kernel, *args, stream, options="--enable-tvm-ffi"))


def _check_out(t: torch.Tensor, name: str, shape: tuple[int, ...], q: torch.Tensor, align: int) -> None:
    from flash_attn.cute.cute_dsl_utils import validate_output_layout

    if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != q.device:
        raise ValueError(f"{name} must be {shape} float32 on {q.device}, got {tuple(t.shape)} {t.dtype} "
                         f"on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have last-dim stride 1, got strides {t.stride()}")
    try:
        validate_output_layout(t, name, align_bytes=align)
    except AssertionError as exc:
        raise ValueError(str(exc)) from exc


def _empty_rows(s_q: int, s_k: int, causal: bool, wl: int | None, wr: int | None) -> list[tuple[int, int]]:
    """Query-row ranges that see no key. FA4 aligns masks bottom-right: row i sees keys
    ``i + s_k - s_q - wl .. i + s_k - s_q + wr`` (causal: wr = 0). With windows >= 0 the left end
    never passes the last key, so only the first ``s_q - s_k - wr`` rows can be empty."""
    wr = 0 if causal else wr
    if wr is None or s_q - s_k - wr <= 0:
        return []
    return [(0, min(s_q, s_q - s_k - wr))]


@eager_boundary
def fa4_forward_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float,
                     window: tuple[int | None, int | None] = (None, None), softcap: float = 0.0,
                     out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)`` fp16/bf16 -> ``out (b, s_q, h, d)`` float32,
    ``lse (b, h, s_q)`` float32, through FA4's sm90 / sm100 forward kernels (see the module doc).
    ``out`` / ``lse``: optional preallocated (strided, last-dim stride 1) float32 outputs."""
    out, lse, _ = _forward(q, k, v, _spec(causal, softmax_scale, window, softcap), out, lse)
    return out, lse


def _spec(causal: bool, softmax_scale: float, window: tuple[int | None, int | None], softcap: float) -> AttnSpec:
    """The call's options as one frozen spec; its checks raise ValueError (window sizes >= 0, None or
    -1 = unbounded; softmax_scale > 0; softcap >= 0)."""
    return AttnSpec(causal=causal, softmax_scale=softmax_scale, window=tuple(window), softcap=softcap)


class ForwardPlan(NamedTuple):
    """One dense fp32-output (or merging) forward launch, prepared (:mod:`.launch`): the compiled
    kernel, the arguments after the five tensors, whether O / lse go in as FA4's one-split sm100
    views, and the query rows such a split leaves unwritten (zeroed after the launch)."""

    compiled: Compiled
    tail: tuple
    split: bool
    empty_rows: tuple

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                 ) -> None:
        o_k, lse_k = (out.unsqueeze(0), lse.unsqueeze(0)) if self.split else (out, lse)
        launch(self.compiled.fn, plain(q), plain(k), plain(v), plain(o_k), plain(lse_k), *self.tail)
        for lo, hi in self.empty_rows:
            out[:, lo:hi].zero_()

    def launch_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A :func:`prepare_plain` plan's call: ``out (b, s_q, h, d)`` in q's dtype and ``lse (b, h,
        s_q)`` float32 allocated (contiguous, as its checked call allocated them), then launched."""
        b, s_q, h, _ = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
        self(q, k, v, out, lse)
        return out, lse


class Prepared(NamedTuple):
    """A checked call: ``tensors`` (q, k, v, out, lse) as the kernel takes them, its ``plan`` (None:
    nothing to launch, or fake tensors), the compile ``key`` (None when nothing compiled) and
    ``replayable``: the plan runs any later call of the same signature (:func:`.launch.signature`)
    on the caller's own tensors (no copy was made of q, k or v); ``extra``: what the plan takes
    after the five tensors (varlen: the call's ``(cu_seqlens_q, cu_seqlens_k)``)."""

    tensors: tuple
    plan: Any
    key: Fp32Key | None
    replayable: bool
    extra: tuple = ()

    def run(self) -> None:
        if self.plan is not None:
            self.plan(*self.tensors, *self.extra)


def _forward(q, k, v, spec: AttnSpec, out, lse, arch: int | None = None,
             merge_class: Callable[[], type] | None = None):
    """fa4_forward_fp32 for ``spec`` (causal, softmax_scale, window, softcap), also returning the
    cache key (None when nothing ran). ``merge_class``: the sm90 kernel class whose epilogue merges
    (:mod:`.epilogue_merge` passes its own; this module never imports it): out and lse are then the
    accumulator and running-lse plane of :func:`.epilogue_merge.fa4_forward_merge_` (required)."""
    prepared = prepare_forward(q, k, v, spec, out, lse, arch, merge_class)
    prepared.run()
    return prepared.tensors[3], prepared.tensors[4], prepared.key


def prepare_forward(q, k, v, spec: AttnSpec, out, lse, arch: int | None = None,
                    merge_class: Callable[[], type] | None = None) -> Prepared:
    """The checked path of :func:`_forward`: validation, the outputs (allocated when None), FA4's
    config, the compile; a call with no rows or no keys is finished here (nothing to launch).
    Raises before anything ran."""
    variant = ("merge", merge_class) if merge_class is not None else ("fp32", _sm90_class)
    return _prepare(q, k, v, spec, (out, lse), arch, variant)


def prepare_plain(q, k, v, spec: AttnSpec, arch: int | None = None) -> Prepared:
    """One dense call of FA4's own sm90 forward kernel (``out`` in q's dtype, ``lse`` float32, both
    allocated; FA4's tile config and its pack-GQA default), prepared as :func:`prepare_forward`
    prepares the fp32 one, so a later call of the same signature replays the launch without FA4's
    Python entry point (the single call, ``cp=None``). sm90 only (NotImplementedError elsewhere:
    sm100's entry point does more than one launch); raises before anything ran."""
    return _prepare(q, k, v, spec, (None, None), arch, ("plain", _fa4_sm90_class))


def _prepare(q, k, v, spec: AttnSpec, outs: tuple, arch: int | None, variant: tuple[str, Callable[[], type]]
             ) -> Prepared:
    """:func:`prepare_forward` / :func:`prepare_plain`: ``outs = (out, lse)`` (None: allocated),
    ``variant = (kind, sm90 kernel class)`` with kind "fp32", "merge" or "plain"."""
    kind, sm90_class = variant
    merge, plain = kind == "merge", kind == "plain"
    out, lse = outs
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"need q (b, s_q, h, d), k = v (b, s_k, h_kv, d), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"h={h} must be a multiple of h_kv={h_kv}")
    wl, wr = spec.window
    softmax_scale, softcap = spec.scale(d), spec.softcap

    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import get_broadcast_dims, maybe_contiguous
    from flash_attn.cute.testing import is_fake_mode

    arch = interface._get_device_arch() if arch is None else arch
    if arch // 10 not in (9, 10, 11):
        raise NotImplementedError(f"the fp32-output FA4 forward runs on sm90 / sm100 only, got sm{arch}")
    if (merge or plain) and arch // 10 != 9:
        raise NotImplementedError(f"the {kind} FA4 forward runs on sm90 only, got sm{arch}")
    if merge and (out is None or lse is None):
        raise NotImplementedError("the merging FA4 forward runs into given out / lse")
    try:
        interface._validate_head_dims(d, d, arch // 10, 16 // q.element_size())
    except AssertionError as exc:
        raise ValueError(str(exc)) from exc
    if out is None:
        out = torch.empty(b, s_q, h, d, dtype=q.dtype if plain else torch.float32, device=q.device)
    else:
        _check_out(out, "out", (b, s_q, h, d), q, 16)
    if lse is None:
        lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    else:
        _check_out(lse, "lse", (b, h, s_q), q, 4)
    if s_q == 0 or b == 0:
        return Prepared((q, k, v, out, lse), None, None, False)
    if s_k == 0:
        if not merge:  # merging: no key, the block adds nothing to the accumulator
            out.zero_()
            lse.fill_(-math.inf)
        return Prepared((q, k, v, out, lse), None, None, False)
    given = (q, k, v)
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    causal, local, wl, wr = interface._resolve_causal_local_window(spec.causal, wl, wr)
    pack_gqa = plain and h > h_kv  # FA4's own default (its entry point: pack_gqa = qhead_per_kvhead > 1)
    cfg = interface._get_fwd_config(
        arch=arch, head_dim=d, head_dim_v=d, max_seqlen_q=s_q, max_seqlen_k=s_k, num_head_kv=h_kv,
        qhead_per_kvhead=h // h_kv, pack_gqa=pack_gqa, batch_size=b, causal=causal, local=local,
        window_size_left=wl, window_size_right=wr, num_splits=1, device=q.device)
    key = Fp32Key(arch=arch, dtype=q.dtype, head_dim=d, qhead_per_kvhead=h // h_kv, causal=causal, local=local,
                  has_window_left=wl is not None, has_window_right=wr is not None,
                  softcap=float(softcap) if softcap else None, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
                  q_stage=cfg.q_stage, mma_pv_is_rs=cfg.mma_pv_is_rs, intra_wg_overlap=cfg.intra_wg_overlap,
                  broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v)), merge=merge, plain=plain,
                  pack_gqa=pack_gqa)
    split = arch // 10 != 9  # sm100: FA4's split-KV layout with a single split
    launch = _Launch(softmax_scale, wl, wr, s_q)
    if key not in _CACHE:
        o_k, lse_k = (out.unsqueeze(0), lse.unsqueeze(0)) if split else (out, lse)
        _CACHE[key] = _compile(key, (q, k, v, o_k, lse_k), launch, sm90_class)
    if is_fake_mode():
        return Prepared((q, k, v, out, lse), None, key, False)
    # a split that owns no key leaves its O rows unwritten (its lse = -inf is written)
    empty = tuple(_empty_rows(s_q, s_k, causal, wl, wr)) if split else ()
    plan = ForwardPlan(_CACHE[key], tuple(_kernel_tail(arch, launch)), split, empty)
    return Prepared((q, k, v, out, lse), plan, key, all(a is b for a, b in zip(given, (q, k, v))))


def compile_only(arch: str | int, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, causal: bool = False,
                 *, window: tuple[int | None, int | None] = (None, None), softcap: float = 0.0,
                 shape: tuple[int, int, int, int, int] = (2, 384, 512, 4, 4),
                 merge_class: Callable[[], type] | None = None) -> Compiled:
    """Compile (without running) the fp32-output forward for ``arch`` ('sm_90a', 'sm_100a', 90, 100)
    on fake CUDA tensors of ``shape = (b, s_q, s_k, h, h_kv)``; returns the cache entry.
    ``merge_class``: the merging variant's kernel class (sm90: :func:`.epilogue_merge.compile_only`).

    Needs no GPU, but the process must target that arch before cutlass is first imported
    (``CUTE_DSL_ARCH=sm_90a`` / ``sm_100a``; FA4 also reads ``FLASH_ATTENTION_ARCH``), and CUDA
    must not be asked for the current device (fake CUDA tensors on a CPU-only torch).
    """
    from flash_attn.cute.interface import _parse_arch_str
    from torch._subclasses.fake_tensor import FakeTensorMode

    arch_num = _parse_arch_str(arch) if isinstance(arch, str) else int(arch)
    b, s_q, s_k, h, h_kv = shape
    merge = merge_class is not None
    with FakeTensorMode():
        q, kv = _fake_qkv(shape, head_dim, dtype)
        out = torch.empty(b, s_q, h, head_dim, dtype=torch.float32, device="cuda") if merge else None
        planes = torch.empty(b, h, 2, s_q, dtype=torch.float32, device="cuda")
        run = planes.narrow(2, 0, 1).squeeze(2) if merge else None  # narrow: [] needs CUDA on fake tensors
        spec = _spec(causal, head_dim ** -0.5, window, softcap)
        _, _, key = _forward(q, kv, kv, spec, out, run, arch_num, merge_class)
    return _CACHE[key]


def compile_only_plain(arch: str | int = "sm_90a", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                       causal: bool = False, *, window: tuple[int | None, int | None] = (None, None),
                       softcap: float = 0.0, shape: tuple[int, int, int, int, int] = (2, 384, 512, 4, 4)) -> Compiled:
    """Compile (without running) :func:`prepare_plain`'s kernel (sm90) on fake CUDA tensors; the
    arguments and set-up of :func:`compile_only`."""
    from flash_attn.cute.interface import _parse_arch_str
    from torch._subclasses.fake_tensor import FakeTensorMode

    arch_num = _parse_arch_str(arch) if isinstance(arch, str) else int(arch)
    with FakeTensorMode():
        q, kv = _fake_qkv(shape, head_dim, dtype)
        key = prepare_plain(q, kv, kv, _spec(causal, head_dim ** -0.5, window, softcap), arch_num).key
    return _CACHE[key]


def _fake_qkv(shape: tuple[int, int, int, int, int], head_dim: int, dtype: torch.dtype):
    """Inside a ``FakeTensorMode``: ``q (b, s_q, h, d)`` and ``kv (b, s_k, h_kv, d)`` on "cuda" for
    ``shape = (b, s_q, s_k, h, h_kv)``."""
    b, s_q, s_k, h, h_kv = shape
    return (torch.empty(b, s_q, h, head_dim, dtype=dtype, device="cuda"),
            torch.empty(b, s_k, h_kv, head_dim, dtype=dtype, device="cuda"))
