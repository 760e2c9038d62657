"""FlashAttention-4's sm90 backward over packed (varlen) documents, ADDED into fp32 accumulators.

One ring block of packed documents: ``q, dout, out (total_q, h, d)``, ``k, v (total_k, h_kv, d)``,
``lse (h, total_q)`` (the globally merged out / lse) and int32 ``cu_seqlens_q / cu_seqlens_k``.
FA4's own varlen backward (``_flash_attn_bwd`` with cu_seqlens) would hand back dq / dk / dv rounded
to bf16. Here its pieces run as it runs them, configured, not copied:

* FA4's preprocess with ``cu_seqlens_q`` (``interface._bwd_preprocess``): D = rowsum(dO * O),
  lse * log2(e), the dq accumulator zeroed, all in FA4's varlen layout, *padded per document*:
  document ``i`` starts at row ``(cu_q[i] + i * tile_m) // tile_m * tile_m`` of
  ``(h, total_q_pad)`` / ``(h, total_q_pad * d_r)`` (``total_q_pad`` as FA4's interface sizes it).
* FA4's main kernel (``FlashAttentionBackwardSm90``; MHA through :mod:`.bwd_plan`'s subclass that
  takes the fp32 dK / dV path) with ``mCuSeqlensQ / mCuSeqlensK``: its ``SingleTileVarlenScheduler``
  over the documents' kv tiles and ``SeqlenInfoQK`` (per-document masks, padded offsets); dQ is
  reduce-added into the dq accumulator, dK / dV into zeroed fp32 ``(h_kv, total_k_pad * d_r)``
  accumulators in the same padded layout (``tile_n`` per document).
* Once at the end of the block, the three fp32 accumulators are added into (or, for a
  :class:`~ringfa4.kernels.spec.Written`, written to) the caller's unpadded ``dq_acc, dk_acc,
  dv_acc`` with the softmax scale on dQ / dK, each row read from the document's
  padded row in FA4's in-tile order (read from its own postprocess, see
  :func:`.bwd_accum._tile_order`): one fused pass each on CUDA (:mod:`.unpad_add_triton`), else
  an ``index_select`` and an add. A written 16-bit dq (the all-gather mode's final rows) goes
  through FA4's own varlen postprocess instead (:func:`_postprocess_written_dq`). Nothing is
  rounded below fp32 before the final write.

Compile key (:class:`~.bwd_accum.AccumKey` with ``varlen=True``): no total length, max_seqlen or
document count in it; FA4's > 256-document scheduler hint is never given to the main kernel, and
always given to the preprocess (so its key does not flip at 256 documents); the main kernel is
compiled once per key from canonical tensors. All blocks use the plan's (causal) tile config.

sm90 only, fp16 / bf16, ``d == d_v`` where :func:`~.bwd_plan.supported`, not deterministic. A
zero-length q segment crashes FA4's varlen backward: callers never pass one.
"""

from __future__ import annotations

import functools

import torch

from ..spec import AttnSpec, Written, check_grads
from ..tape import launch
from .bwd_accum import _CACHE, AccumKey, _arch, _tile_order
from .bwd_plan import make_kernel, plan, postprocess, preprocess, supported

__all__ = ["accumulate_varlen", "can_implement", "padded_rows", "tile_cumsum"]

_DTYPES = (torch.float16, torch.bfloat16)


def can_implement(arch: int, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> bool:
    """Whether :func:`accumulate_varlen` runs for this arch (FA4 number) and shape: sm90 only."""
    return arch // 10 == 9 and supported(arch, dtype, head_dim, head_dim_v)


def padded_rows(total: int, n_cu: int, tile: int) -> int:
    """Rows of FA4's per-document padded varlen accumulators (its interface's sizing):
    ``total`` packed rows, ``n_cu`` cu_seqlens entries (documents + 1)."""
    return (total + n_cu * tile - 1) // tile * tile


def _check(dout, q, k, v, out, lse, spec: AttnSpec) -> None:
    if q.dtype not in _DTYPES or q.dim() != 3 or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must be packed (total, h, d) fp16/bf16, got {tuple(q.shape)} {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if k.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2] or q.shape[1] % max(k.shape[1], 1) \
            or k.shape[1] == 0:
        raise ValueError(f"k = v must be (total_k, h_kv | {q.shape[1]}, {q.shape[2]}), got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not spec.varlen or spec.deterministic:
        raise ValueError("accumulate_varlen needs a varlen, non-deterministic spec")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    for name, t, shape in (("out", out, q.shape), ("dout", dout, q.shape), ("lse", lse, (q.shape[1], q.shape[0]))):
        if tuple(t.shape) != tuple(shape) or t.dtype not in floats or t.device != q.device:
            raise ValueError(f"{name} must be {tuple(shape)} float on {q.device}, got {tuple(t.shape)} {t.dtype} "
                             f"on {t.device}")


def _gather_index(cu: torch.Tensor, total: int, tile: int, order: torch.Tensor, d: int, d_r: int) -> torch.Tensor:
    """Flat offsets ``(total * d,)`` int64 into a padded FA4 accumulator row ``(pad * d_r,)`` of each
    packed (row, column < d): the row's padded row ``p`` (:func:`_padded_rows_of`), inside a tile FA4's
    ``order`` (``(tile * d,)``) holds."""
    p = _padded_rows_of(cu, total, tile)
    inner = order.view(tile, d).index_select(0, p % tile)  # (total, d)
    return ((p // tile) * (tile * d_r)).unsqueeze(1).add(inner).flatten()


def _of_cu(cu: torch.Tensor, what: tuple, make):
    """``make()``, computed once per cu_seqlens tensor, version and ``what`` (a pack's blocks pass
    the same tensors on every layer). The result is kept on the tensor itself, so it lives exactly
    as long as the cu_seqlens: packs that change every batch keep nothing, and a CUDA graph that
    keeps its pack's cu_seqlens alive keeps what it reads of these too. Made on the stream current
    at its first use (the ring's compute stream, as later)."""
    cache = cu.__dict__.setdefault("_ringfa4_of_cu", {})
    key = (cu._version, what)
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


def tile_cumsum(cu: torch.Tensor, tile: int) -> torch.Tensor:
    """FA4's tile cumsum of ``cu`` (``(documents + 1,)`` int32: tiles of ``tile`` rows before each
    document), its varlen schedulers' batch-lookup hint; once per cu_seqlens version."""
    from flash_attn.cute import interface

    return _of_cu(cu, ("tile cumsum", tile),
                  lambda: launch(interface._compute_tile_cumsum, cu_seqlens=cu, tile_size=tile)[0])


def _padded_rows_of(cu: torch.Tensor, total: int, tile: int) -> torch.Tensor:
    """``(total,)`` int64: the padded row of each packed row, document ``i`` starting at padded row
    ``(cu[i] + i * tile) // tile * tile`` (once per cu_seqlens version: eleven small kernels a call)."""
    def make() -> torch.Tensor:
        rows = torch.arange(total, device=cu.device)
        cu64 = cu.long()
        doc = torch.searchsorted(cu64, rows, right=True) - 1  # empty documents are skipped by right=True
        starts = cu64[:-1]
        shift = (starts + torch.arange(starts.numel(), device=cu.device) * tile) // tile * tile - starts
        return rows + shift[doc]
    return _of_cu(cu, ("padded rows", total, tile), make)


def _padded_rows_i32(cu: torch.Tensor, total: int, tile: int) -> torch.Tensor:
    """:func:`_padded_rows_of` as int32 (what the unpad kernel reads), once per cu_seqlens version."""
    return _of_cu(cu, ("padded rows i32", total, tile), lambda: _padded_rows_of(cu, total, tile).int())


@functools.cache
def _int32(order: torch.Tensor) -> torch.Tensor:
    """A tile order (one per plan and kind, cached for the process by :func:`.bwd_accum._tile_order`)
    as int32, made once."""
    return order.int()


def _add_rows_(acc, accum: torch.Tensor, cu: torch.Tensor, tile: int, order: torch.Tensor, d_r: int,
               scale: float) -> None:
    """``acc (total, heads, d) += scale *`` the rows of FA4's padded accumulator ``(heads, pad *
    d_r)`` (documents at ``cu``'s offsets, FA4's in-tile ``order``); a
    :class:`~ringfa4.kernels.spec.Written` ``acc`` gets them written instead (in its dtype). One
    fused Triton pass on CUDA (:mod:`.unpad_add_triton`), else a gather through the flat index
    and an add (or a copy)."""
    from .unpad_add_triton import unpad_add_triton_

    store = isinstance(acc, Written)
    dst = acc.out if store else acc
    total, d = dst.shape[0], dst.shape[2]
    if dst.is_cuda and unpad_add_triton_(dst, accum, _padded_rows_i32(cu, total, tile), _int32(order), tile, d_r, scale,
                                         store):
        return
    heads = accum.shape[0]
    rows = accum.index_select(1, _gather_index(cu, total, tile, order, d, d_r)).view(heads, total, d)
    if store:
        dst.copy_(rows.permute(1, 0, 2).mul(scale))
    else:
        dst.add_(rows.permute(1, 0, 2), alpha=scale)


def _postprocess_written_dq(p, dq_acc, dq_accum: torch.Tensor, cu: torch.Tensor, scale: float, fake: bool) -> bool:
    """A :class:`~ringfa4.kernels.spec.Written` dq of q's 16-bit dtype, contiguous (a call's rows of
    the final dq), written by FA4's own varlen postprocess (:func:`.bwd_plan.postprocess`): the
    same bits as the unpad kernel's store form in half its time (H200, 8k rows, 32 heads, d = 128:
    57 against 116 us). False, doing nothing, for anything else (the unpad kernel takes it)."""
    if not isinstance(dq_acc, Written) or dq_acc.out.dtype not in _DTYPES or not dq_acc.out.is_contiguous():
        return False
    postprocess(p, "dq", dq_accum, dq_acc.out, scale, fake_mode=fake, cu_seqlens=cu,
                cu_total_blocks=tile_cumsum(cu, p.dq_post[0]))
    return True


def _canonical(key: AccumKey, tensors: list, cu: tuple, tm: int, tn: int, d_r: int) -> tuple[list, tuple]:
    """Fixed-size stand-ins to compile from (3 tiles of rows, 3 documents), or the call's own tensors
    when q / k / v / dout have stride-0 dims (the key records those)."""
    if any(any(b) for b in key.broadcast):
        return tensors, cu
    q, k = tensors[0], tensors[1]
    h, d, h_kv, dev = q.shape[1], q.shape[2], k.shape[1], q.device
    rq, rk = 3 * tm, 3 * tn
    pq, pk = padded_rows(rq, 4, tm), padded_rows(rk, 4, tn)
    f32 = dict(dtype=torch.float32, device=dev)
    qc = torch.empty(rq, h, d, dtype=q.dtype, device=dev)
    kc = torch.empty(rk, h_kv, d, dtype=q.dtype, device=dev)
    stats = torch.empty(h, pq, **f32)
    dkv = torch.empty(h_kv, pk * d_r, **f32)
    return [qc, kc, kc, qc, stats, stats, torch.empty(h, pq * d_r, **f32), dkv, dkv], \
        tuple(torch.empty(4, dtype=torch.int32, device=dev) for _ in "qk")


def _args(tensors: list, cu: tuple, scale: float, wl, wr) -> list:
    """The main kernel's arguments after the kernel object, as ``_flash_attn_bwd`` passes them for
    varlen (no seqused, semaphores, aux tensors, block sparsity or scheduler hint)."""
    from flash_attn.cute.utils import AuxData

    return [*tensors, scale, *cu, None, None, wl, wr, None, None, None, AuxData(None, None), None, None]


def _compile(key: AccumKey, tensors: list, cu: tuple, scale: float, wl, wr):
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = _args([to_cute_tensor(t) for t in tensors], tuple(to_cute_tensor(t, assumed_align=4) for t in cu),
                 scale, wl, wr)
    return cute.compile(make_kernel(plan(key.arch, key.head_dim), key), *args, stream, options="--enable-tvm-ffi")


def accumulate_varlen(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, spec: AttnSpec, grads: tuple) -> AccumKey | None:
    """One packed block's gradients added into ``grads = (dq_acc (total_q, h, d), dk_acc, dv_acc
    (total_k, h_kv, d))`` float32 (views with last-dim stride 1; any may be a
    :class:`~ringfa4.kernels.spec.Written`), from the merged ``out`` / ``dout``
    (like q; fp32 ones are cast to q's dtype, as FA4's preprocess requires) and ``lse (h, total_q)``
    float32, with ``spec``'s cu_seqlens / causal / window / softcap / softmax_scale. Every check runs
    before anything is written (a ValueError leaves the accumulators untouched). Returns the main
    kernel's cache key (None when nothing ran)."""
    _check(dout, q, k, v, out, lse, spec)
    dq_acc, dk_acc, dv_acc = check_grads(grads, q, k, v)
    total_q, h, d = q.shape
    total_k, h_kv = k.shape[0], k.shape[1]
    arch = _arch()
    if not can_implement(arch, q.dtype, d, v.shape[-1]):
        raise ValueError(f"fa4.varlen_bwd cannot run sm{arch} {q.dtype} head_dim={d} (see can_implement)")
    wl, wr = spec.window_left, spec.window_right
    if total_q == 0 or total_k == 0:
        for g in (dq_acc, dk_acc, dv_acc):
            if isinstance(g, Written):  # no block: a written gradient is zero
                g.out.zero_()
        return None
    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import get_broadcast_dims, maybe_contiguous
    from flash_attn.cute.testing import is_fake_mode

    fake = is_fake_mode()
    p = plan(arch, d)
    tm, tn, d_r = p.tile_m, p.tile_n, p.head_dim_rounded
    cu = (spec.cu_seqlens_q.contiguous(), spec.cu_seqlens_k.contiguous())
    n_cu = cu[0].numel()
    pq, pk = padded_rows(total_q, n_cu, tm), padded_rows(total_k, n_cu, tn)
    q, k, v, out, dout = (maybe_contiguous(t) for t in (q, k, v, out.to(q.dtype), dout.to(q.dtype)))
    lse = lse.float().contiguous()
    f32 = dict(dtype=torch.float32, device=q.device)
    dq_accum, dpsum, lse_log2 = torch.empty(h, pq * d_r, **f32), torch.empty(h, pq, **f32), torch.empty(h, pq, **f32)
    dk_accum, dv_accum = torch.zeros(h_kv, pk * d_r, **f32), torch.zeros(h_kv, pk * d_r, **f32)
    preprocess(p, out, dout, (dpsum, lse_log2, dq_accum), lse, fake_mode=fake, cu_seqlens=cu[0],
               cu_total_blocks=tile_cumsum(cu[0], tm))
    causal, local, wl, wr = interface._resolve_causal_local_window(spec.causal, wl, wr)
    softcap = float(spec.softcap) if spec.softcap else None
    key = AccumKey(arch=arch, dtype=q.dtype, head_dim=d, qhead_per_kvhead=h // h_kv, causal=causal, local=local,
                   has_window_left=wl is not None, has_window_right=wr is not None, softcap=softcap,
                   broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v, dout)), single_q_block=False,
                   single_k_block=False, varlen=True)
    tensors = [q, k, v, dout, lse_log2, dpsum, dq_accum, dk_accum, dv_accum]
    scale = spec.scale(d)
    if key not in _CACHE:
        _CACHE[key] = _compile(key, *_canonical(key, tensors, cu, tm, tn, d_r), scale, wl, wr)
    if fake:
        return key
    launch(_CACHE[key], *_args([t.detach() for t in tensors], cu, scale, wl, wr))
    if not _postprocess_written_dq(p, dq_acc, dq_accum, cu[0], scale, fake):
        _add_rows_(dq_acc, dq_accum, cu[0], tm, _tile_order(arch, q.dtype, d, "dq", q.device), d_r, scale)
    order_k = _tile_order(arch, q.dtype, d, "dkv", q.device)
    _add_rows_(dk_acc, dk_accum, cu[1], tn, order_k, d_r, scale)
    _add_rows_(dv_acc, dv_accum, cu[1], tn, order_k, d_r, 1.0)
    return key


def compile_only_varlen(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, *, heads: tuple[int, int] = (4, 2),
                        lengths: tuple[tuple[int, int], ...] = ((300, 200), (1, 1), (64, 500)),
                        **spec_kwargs) -> AccumKey:
    """Compile (without running) :func:`accumulate_varlen` on fake CUDA tensors of documents
    ``lengths = ((len_q, len_k), ...)``, ``heads = (h, h_kv)`` and AttnSpec ``spec_kwargs`` (causal,
    window, softcap); returns the key. Needs ``CUTE_DSL_ARCH=sm_90a`` and ``FLASH_ATTENTION_ARCH=sm_90``
    set before cutlass is imported, no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .varlen_fwd import fake_varlen

    with FakeTensorMode():
        q, kv, spec = fake_varlen(lengths, heads, head_dim, dtype, **spec_kwargs)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device="cuda")
        grads = (torch.empty(q.shape, dtype=torch.float32, device="cuda"),
                 *(torch.empty(kv.shape, dtype=torch.float32, device="cuda") for _ in "kv"))
        return accumulate_varlen(q, q, kv, kv, q, lse, spec, grads)
