"""FlashAttention-4's sm90 forward over packed (varlen) documents, with a float32 output (and FA4's own).

The same kernel class as :mod:`.fp32_forward` (``_Sm90Fp32Out``, FA4's ``FlashAttentionForwardSm90``
with an fp32 register epilogue), launched as FA4's interface launches its varlen forward: packed
``q (total_q, h, d)``, ``k, v (total_k, h_kv, d)`` and int32 ``cu_seqlens_q / cu_seqlens_k``
(``mCuSeqlensQ / mCuSeqlensK``), so FA4's own varlen machinery runs: its ``SingleTileVarlenScheduler``
walks the documents' query tiles and ``SeqlenInfoQK`` gives each tile its document's offsets and
lengths (masks per document, causal bottom-right aligned per document). The epilogue's row
predicate and gmem offsets come from that ``SeqlenInfoQK`` (``offset_batch_Q``), as in the dense
kernel. Rows that see no key get ``out = 0`` and ``lse = -inf`` (FA4's softmax finalize).

Compile key (:class:`~.fp32_forward.Fp32Key` with ``varlen=True``): nothing that changes from pack
to pack. Total lengths, ``max_seqlen_q / k`` and the number of documents are runtime values (FA4's
sm90 tiles do not depend on them; its grid is computed from the runtime total and document count),
FA4's batch-lookup hint for > 256 documents (``cu_total_m_blocks``) is never passed (the
scheduler's warp prefix sums cover any count), and the kernel is compiled once per key from
canonical tensors of fixed sizes (not from the first call's, whose one-row dims could specialize
strides), so a new pack never compiles a new kernel.

The single varlen call (``cp=None``, Ulysses' one call on packed documents) runs FA4's own class the
same way (:func:`prepare_plain_varlen`: O in q's dtype, FA4's pack-GQA default), so a replay skips
FA4's Python entry point as the dense single call does (:func:`.fp32_forward.prepare_plain`).

sm90 only: FA4's sm100 varlen forward would need its scheduler metadata and split-KV varlen
layouts; :func:`fa4_forward_fp32_varlen` raises NotImplementedError there and
:class:`~.backend.Fa4Backend` serves sm100 varlen fp32 calls by FA4's own forward, widened
(compiled-only sm100 anyway).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..spec import AttnSpec
from ..tape import launch
from .fp32_forward import (
    _CACHE,
    _DTYPES,
    Compiled,
    Fp32Key,
    Prepared,
    _check_out,
    _compile,
    _fa4_sm90_class,
    _kernel_args,
    _Launch,
    _sm90_class,
)
from .launch import plain

__all__ = ["VarlenPlan", "compile_only_varlen", "fa4_forward_fp32_varlen", "prepare_forward_varlen",
           "prepare_plain_varlen"]


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> None:
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"need packed q (total_q, h, d), k = v (total_k, h_kv, d), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not spec.varlen:
        raise ValueError("fa4_forward_fp32_varlen needs a spec with cu_seqlens_q / cu_seqlens_k")
    h, h_kv = q.shape[1], k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"h={h} must be a multiple of h_kv={h_kv}")
    for name, cu in (("cu_seqlens_q", spec.cu_seqlens_q), ("cu_seqlens_k", spec.cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(f"{name} must be 1-D int32 on {q.device}, got {tuple(cu.shape)} {cu.dtype} on {cu.device}")
    if spec.cu_seqlens_q.numel() != spec.cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_k must have {spec.cu_seqlens_q.numel()} entries like cu_seqlens_q, "
                         f"got {spec.cu_seqlens_k.numel()}")


def _canonical(key: Fp32Key, q: torch.Tensor, k: torch.Tensor) -> tuple[tuple, tuple]:
    """Fixed-size stand-ins of the call's tensors to compile from: ``(q, k, v, o, lse)`` with
    3 tiles of rows and 3 documents' cu_seqlens (contiguous: the call's strides are runtime values;
    inputs with stride-0 dims keep their own, as the key records them)."""
    h, d, h_kv = q.shape[1], q.shape[2], k.shape[1]
    rows_q, rows_k = 3 * key.tile_m, 3 * key.tile_n
    dev = q.device
    if any(any(b) for b in key.broadcast):
        qc, kc = q, k
    else:
        qc = torch.empty(rows_q, h, d, dtype=q.dtype, device=dev)
        kc = torch.empty(rows_k, h_kv, d, dtype=q.dtype, device=dev)
    rq = qc.shape[0]
    o = torch.empty(rq, h, d, dtype=q.dtype if key.plain else torch.float32, device=dev)
    lse = torch.empty(h, rq, dtype=torch.float32, device=dev)
    cu = tuple(torch.empty(4, dtype=torch.int32, device=dev) for _ in "qk")
    return (qc, kc, kc, o, lse), cu


class VarlenPlan(NamedTuple):
    """One varlen fp32 forward launch, prepared (:mod:`.launch`): the compiled kernel, the softmax
    scale and the arguments after the two cu_seqlens (which every call passes: they change per pack)."""

    compiled: Compiled
    scale: float
    rest: tuple

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 cu: tuple[torch.Tensor, torch.Tensor]) -> None:
        launch(self.compiled.fn, plain(q), plain(k), plain(v), plain(out), plain(lse), self.scale, *cu, *self.rest)

    def launch_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A :func:`prepare_plain_varlen` plan's call: ``out (total_q, h, d)`` in q's dtype and ``lse
        (h, total_q)`` float32 allocated (contiguous, as its checked call allocated them), then launched."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        self(q, k, v, out, lse, cu)
        return out, lse


def fa4_forward_fp32_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                            arch: int | None = None) -> tuple[torch.Tensor, torch.Tensor, Fp32Key | None]:
    """Packed ``q (total_q, h, d)``, ``k, v (total_k, h_kv, d)`` fp16/bf16 with ``spec``'s int32
    ``cu_seqlens_q / cu_seqlens_k`` (on q's device; ``max_seqlen_*`` are not needed) and its causal /
    window / softcap / softmax_scale -> ``(out (total_q, h, d) float32, lse (h, total_q) float32, key)``
    (key None when nothing ran). ``out`` / ``lse``: optional preallocated float32 views with last-dim
    stride 1 (out: 16-byte aligned, e.g. a row slice of a bigger buffer; lse e.g. a column slice).
    Raises NotImplementedError off sm90, ValueError / TypeError for inputs it does not take."""
    prepared = prepare_forward_varlen(q, k, v, spec, out, lse, arch)
    prepared.run()
    return prepared.tensors[3], prepared.tensors[4], prepared.key


def prepare_forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                           out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                           arch: int | None = None) -> Prepared:
    """The checked path of :func:`fa4_forward_fp32_varlen`: validation, the outputs, FA4's config,
    the compile; a call with no query or no key rows is finished here. Nothing launched yet."""
    return _prepare_varlen(q, k, v, spec, (out, lse), arch, plain=False)


def prepare_plain_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                         arch: int | None = None) -> Prepared:
    """One packed call of FA4's own sm90 forward kernel (``FlashAttentionForwardSm90`` with
    cu_seqlens, FA4's tile config and its pack-GQA default; ``out (total_q, h, d)`` in q's dtype and
    ``lse (h, total_q)`` float32, both allocated), prepared as :func:`prepare_forward_varlen`
    prepares the fp32 one: a later call of the same signature replays the launch without FA4's
    Python entry point (the single varlen call: ``cp=None`` and Ulysses on packed documents). FA4's
    entry point adds a batch-lookup hint for more than 256 documents (a speed aid computed per call);
    this plan's scheduler walks any count without it, to the same results. sm90 only
    (NotImplementedError elsewhere); raises before anything ran."""
    return _prepare_varlen(q, k, v, spec, (None, None), arch, plain=True)


def _prepare_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, outs: tuple,
                    arch: int | None, plain: bool) -> Prepared:
    """:func:`prepare_forward_varlen` (``plain`` False: our fp32-output class, into ``outs = (out,
    lse)`` or allocated) and :func:`prepare_plain_varlen` (FA4's own class, O in q's dtype)."""
    out, lse = outs
    _check_inputs(q, k, v, spec)
    total_q, h, d = q.shape
    total_k, h_kv = k.shape[0], k.shape[1]

    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import get_broadcast_dims, maybe_contiguous
    from flash_attn.cute.testing import is_fake_mode

    arch = interface._get_device_arch() if arch is None else arch
    if arch // 10 != 9:
        raise NotImplementedError(f"the {'plain' if plain else 'fp32-output'} FA4 varlen forward runs on sm90 only, "
                                  f"got sm{arch}")
    try:
        interface._validate_head_dims(d, d, arch // 10, 16 // q.element_size())
    except AssertionError as exc:
        raise ValueError(str(exc)) from exc
    if out is None:
        out = torch.empty(total_q, h, d, dtype=q.dtype if plain else torch.float32, device=q.device)
    else:
        _check_out(out, "out", (total_q, h, d), q, 16)
    if lse is None:
        lse = torch.empty(h, total_q, dtype=torch.float32, device=q.device)
    else:
        _check_out(lse, "lse", (h, total_q), q, 4)
    given = (q, k, v, spec.cu_seqlens_q, spec.cu_seqlens_k)
    if total_q == 0 or total_k == 0:
        if total_q:
            out.zero_()
            lse.fill_(-math.inf)
        return Prepared((q, k, v, out, lse), None, None, False)
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    cu = (spec.cu_seqlens_q.contiguous(), spec.cu_seqlens_k.contiguous())
    causal, local, wl, wr = interface._resolve_causal_local_window(spec.causal, spec.window_left, spec.window_right)
    pack_gqa = plain and h > h_kv  # FA4's own default (its entry point: pack_gqa = qhead_per_kvhead > 1)
    cfg = interface._get_fwd_config(  # sm90: tiles from head_dim / causal / local alone
        arch=arch, head_dim=d, head_dim_v=d, max_seqlen_q=1, max_seqlen_k=1, num_head_kv=h_kv,
        qhead_per_kvhead=h // h_kv, pack_gqa=pack_gqa, batch_size=1, causal=causal, local=local,
        window_size_left=wl, window_size_right=wr, num_splits=1, device=q.device)
    softcap = spec.softcap
    key = Fp32Key(arch=arch, dtype=q.dtype, head_dim=d, qhead_per_kvhead=h // h_kv, causal=causal, local=local,
                  has_window_left=wl is not None, has_window_right=wr is not None,
                  softcap=float(softcap) if softcap else None, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
                  q_stage=cfg.q_stage, mma_pv_is_rs=cfg.mma_pv_is_rs, intra_wg_overlap=cfg.intra_wg_overlap,
                  broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v)), varlen=True, plain=plain,
                  pack_gqa=pack_gqa)
    launch = _Launch(spec.scale(d), wl, wr, 0)
    if key not in _CACHE:
        tensors, cu_c = _canonical(key, q, k)
        _CACHE[key] = _compile(key, tensors, launch, _fa4_sm90_class if plain else _sm90_class, cu_c)
    if is_fake_mode():
        return Prepared((q, k, v, out, lse), None, key, False)
    tail = _kernel_args(arch, (), launch, (None, None))
    plan = VarlenPlan(_CACHE[key], tail[0], tuple(tail[3:]))
    return Prepared((q, k, v, out, lse), plan, key, all(a is b for a, b in zip(given, (q, k, v, *cu))), (cu,))


def fake_varlen(lengths, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, **spec_kwargs):
    """Inside a ``FakeTensorMode``: packed ``q (total_q, h, d)``, ``kv (total_k, h_kv, d)`` and the
    varlen AttnSpec (``spec_kwargs``: causal, window, softcap) of documents ``lengths = ((len_q,
    len_k), ...)``, on "cuda" (the compile-only entry points' inputs)."""
    h, h_kv = heads
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = torch.empty(tq, h, head_dim, dtype=dtype, device="cuda")
    kv = torch.empty(tk, h_kv, head_dim, dtype=dtype, device="cuda")
    cq, ck = (torch.empty(len(lengths) + 1, dtype=torch.int32, device="cuda") for _ in "qk")
    spec = AttnSpec(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(a for a, _ in lengths),
                    max_seqlen_k=max(b for _, b in lengths), **spec_kwargs)
    return q, kv, spec


def compile_only_varlen(arch: str | int = "sm_90a", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                        causal: bool = False, *, window: tuple[int | None, int | None] = (None, None),
                        softcap: float = 0.0, lengths: tuple[tuple[int, int], ...] = ((300, 200), (1, 1), (64, 500)),
                        heads: tuple[int, int] = (4, 2)) -> Compiled:
    """Compile (without running) the varlen fp32-output forward for ``arch`` on fake CUDA tensors of
    documents ``lengths = ((len_q, len_k), ...)`` and ``heads = (h, h_kv)``; returns the cache entry.
    Needs no GPU (``CUTE_DSL_ARCH=sm_90a``, ``FLASH_ATTENTION_ARCH=sm_90`` set before cutlass is
    imported; see :func:`.fp32_forward.compile_only`)."""
    from flash_attn.cute.interface import _parse_arch_str
    from torch._subclasses.fake_tensor import FakeTensorMode

    arch_num = _parse_arch_str(arch) if isinstance(arch, str) else int(arch)
    with FakeTensorMode():
        q, kv, spec = fake_varlen(lengths, heads, head_dim, dtype, causal=causal, window=tuple(window),
                                  softcap=softcap)
        _, _, key = fa4_forward_fp32_varlen(q, kv, kv, spec, arch=arch_num)
    return _CACHE[key]
