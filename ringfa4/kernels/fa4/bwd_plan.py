"""How FA4 runs its backward on each GPU generation, for :mod:`.bwd_accum`: the tiles, the fp32
accumulators' roundings, the main kernel object and the postprocess that reads the accumulators.

One :class:`BwdPlan` per (arch, head_dim), chosen as ``interface._flash_attn_bwd`` chooses:

* **sm90** (Hopper): FA4's causal ``BwdConfig`` for the head dim (tiles, MMA layouts, warp
  groups); head dim rounded to 32 (64 with ``dKV_swapAB``); kv rows rounded to ``tile_n``. MHA
  reaches the fp32 dK / dV (GQA) path only through ``qhead_per_kvhead > 1``, so the kernel is built
  with 2 and told that the kv head is the q head (:func:`_sm90_mha_class`).
* **sm100** (Blackwell): 128 x 128 tiles, 2-CTA MMA clusters for head dims >= 128, head dim rounded
  to 32, and per-configuration accumulator tile orders (``accum_tile_orders``), which the
  postprocess must be told. A 2-CTA grid rounds the kv tiles up to an even count; the extra
  tile's CTA adds exact zeros, so accumulators and block starts are rounded to ``2 * tile_n``
  (``kv_align``). The fp32 dK / dV path is chosen in ``__call__`` by ``qhead_per_kvhead > 1``; for
  MHA :func:`_sm100_mha_class` pins that choice (a property that ignores the assignment), the kv
  head is already ``head_idx // 1``. Head dims 8..128 (multiples of 8); FA4's hd256 kernel keeps
  no dQ accumulator and is not used. Compiled in CI for sm_100a; not yet run on a Blackwell GPU.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..tape import launch

__all__ = ["BwdPlan", "make_kernel", "plan", "postprocess", "preprocess", "sm90_kernel", "sm90_plan", "supported"]

_DTYPES = (torch.float16, torch.bfloat16)


def _rup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class BwdPlan:
    """FA4's backward layout for one (arch, head_dim). ``d_round``: accumulator head-dim rounding;
    ``cluster_size``: 2 for sm100's 2-CTA MMA; ``dq_post`` / ``dkv_post``: the postprocess's (tile,
    threads, atom layout, swapAB, use_2cta, cluster_size, accum_order) for dQ and for dK / dV."""

    arch: int
    head_dim: int
    tile_m: int
    tile_n: int
    d_round: int
    cluster_size: int
    dq_post: tuple
    dkv_post: tuple

    @property
    def head_dim_rounded(self) -> int:
        return _rup(self.head_dim, self.d_round)

    @property
    def kv_align(self) -> int:
        """kv rows of one accumulator rounding step: blocks start on multiples, and a block's
        accumulator covers its kv rows rounded up to one (a 2-CTA grid writes whole tile pairs)."""
        return self.tile_n * self.cluster_size


@functools.cache
def _sm90_config(head_dim: int) -> Any:
    """FA4's sm90 BwdConfig for this head_dim, its causal variant for every block of a state."""
    from flash_attn.cute import interface

    return interface._tile_size_bwd_sm90(head_dim, head_dim, True, False)


def _sm100_tiles(head_dim: int) -> tuple[int, int, bool]:
    """(tile_m, tile_n, use_2cta) as interface._flash_attn_bwd picks them (no block sparsity)."""
    return 128, 128, head_dim >= 128


def supported(arch: int, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> bool:
    """Whether a plan exists: fp16 / bf16, d == d_v, d % 8 == 0, and the arch's head-dim range."""
    if dtype not in _DTYPES or head_dim != head_dim_v or head_dim % 8 != 0 or head_dim < 8:
        return False
    if arch // 10 == 9:
        if head_dim > 256:
            return False
        cfg = _sm90_config(head_dim)
        d_round = 64 if cfg.dKV_swapAB else 32
        kernel_round = 64 if cfg.dKV_swapAB else 16  # FlashAttentionBackwardSm90.tile_hdim
        return _rup(head_dim, kernel_round) == _rup(head_dim, d_round) and cfg.num_wg == 2
    if arch // 10 in (10, 11):
        return head_dim <= 128
    return False


@functools.cache
def plan(arch: int, head_dim: int) -> BwdPlan:
    """The plan for ``arch`` (FA4's number: 90, 100, ...) and ``head_dim`` (see :func:`supported`)."""
    if arch // 10 == 9:
        return sm90_plan(arch, head_dim, _sm90_config(head_dim))
    if arch // 10 in (10, 11):
        from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

        tm, tn, use2 = _sm100_tiles(head_dim)
        cluster = 2 if use2 else 1
        dq_order, dkv_order = FlashAttentionBackwardSm100.accum_tile_orders(use2, tn)
        return BwdPlan(arch, head_dim, tm, tn, 32, cluster, (tm, 128, 1, False, use2, 1, dq_order),
                       (tn, 128, 1, False, False, cluster, dkv_order))
    raise ValueError(f"no FA4 backward plan for sm{arch}")


def sm90_plan(arch: int, head_dim: int, cfg: Any) -> BwdPlan:
    """The sm90 plan of FA4's ``BwdConfig`` ``cfg`` (:func:`plan` passes the causal one)."""
    threads_dq = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
    return BwdPlan(arch, head_dim, cfg.m_block_size, cfg.n_block_size, 64 if cfg.dKV_swapAB else 32, 1,
                   (cfg.m_block_size, threads_dq, cfg.AtomLayoutMdQ, cfg.dQ_swapAB, False, 1, None),
                   (cfg.n_block_size, cfg.num_wg * 128, cfg.AtomLayoutNdKV, cfg.dKV_swapAB, False, 1, None))


@functools.cache
def _sm90_mha_class() -> type:
    """FlashAttentionBackwardSm90 on its GQA (fp32 dK/dV accumulator) path with one q head per kv
    head: built with qhead_per_kvhead=2, while the kernel's kv-head divisor is 1."""
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    def kv_head_is_q_head(method):
        sig = inspect.signature(method)

        def wrapper(self, *args, **kwargs):
            bound = sig.bind(self, *args, **kwargs)
            bound.arguments["qhead_per_kvhead_divmod"] = 1  # head_idx // 1 at trace time
            return method(*bound.args, **bound.kwargs)

        return functools.wraps(method)(wrapper)

    class _Sm90MhaAccum(FlashAttentionBackwardSm90):
        load = kv_head_is_q_head(FlashAttentionBackwardSm90.load)
        epilogue_dKV = kv_head_is_q_head(FlashAttentionBackwardSm90.epilogue_dKV)

    return _Sm90MhaAccum


@functools.cache
def _sm100_mha_class() -> type:
    """FlashAttentionBackwardSm100 with its fp32 dK / dV accumulator path also for MHA:
    ``__call__`` assigns ``dKV_postprocess = qhead_per_kvhead > 1``; here the attribute is a
    property that stays True and ignores the assignment."""
    from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

    class _Sm100MhaAccum(FlashAttentionBackwardSm100):
        dKV_postprocess = property(lambda self: True, lambda self, value: None)

    return _Sm100MhaAccum


def _softcap_mods(softcap: float | None) -> dict:
    """The score-mod keyword arguments of FA4's backward classes (softcap as FA4's entry point maps it)."""
    from flash_attn.cute import utils

    return dict(score_mod=utils.create_softcap_scoremod(softcap) if softcap else None,
                score_mod_bwd=utils.create_softcap_scoremod_bwd(softcap) if softcap else None, mask_mod=None,
                has_aux_tensors=False, q_subtile_factor=2)


def sm90_kernel(cls: type, cfg: Any, dtype: torch.dtype, head_dim: int, qhead_per_kvhead: int, mask: tuple,
                softcap: float | None, deterministic: bool = False) -> Any:
    """An sm90 backward kernel object of ``cls`` (FA4's ``FlashAttentionBackwardSm90`` or a subclass)
    under FA4's ``BwdConfig`` ``cfg``, as ``interface._flash_attn_bwd`` builds it: ``mask = (causal,
    local)``, ``d == d_v``; ``deterministic``: FA4's semaphore-ordered reductions of dQ (and GQA's
    dK / dV)."""
    from flash_attn.cute.interface import torch2cute_dtype_map

    causal, local = mask
    return cls(torch2cute_dtype_map[dtype], head_dim, head_dim, qhead_per_kvhead, causal, is_local=local,
               deterministic=deterministic, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q,
               dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB,
               dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
               AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
               num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, dQ_single_wg=cfg.dQ_single_wg,
               **_softcap_mods(softcap))


def make_kernel(p: BwdPlan, key: Any) -> Any:
    """The FA4 main-kernel object for an :class:`~.bwd_accum.AccumKey` under plan ``p``."""
    if p.arch // 10 == 9:
        from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

        cls = FlashAttentionBackwardSm90 if key.qhead_per_kvhead > 1 else _sm90_mha_class()
        return sm90_kernel(cls, _sm90_config(key.head_dim), key.dtype, key.head_dim, max(2, key.qhead_per_kvhead),
                           (key.causal, key.local), key.softcap)
    from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

    cls = FlashAttentionBackwardSm100 if key.qhead_per_kvhead > 1 else _sm100_mha_class()
    return cls(key.head_dim, key.head_dim, is_causal=key.causal, is_local=key.local,
               qhead_per_kvhead=key.qhead_per_kvhead, tile_m=p.tile_m, tile_n=p.tile_n,
               cluster_size=p.cluster_size, use_2cta_instrs=p.cluster_size == 2, deterministic=False, spt=False,
               kv_subtile_factor=1, **_softcap_mods(key.softcap))


_COMPILED: dict[tuple, Any] = {}  # ("pre" | "post", FA4's compile key) -> its compiled kernel


def _compiled(which: str, key: tuple) -> Any:
    """FA4's compiled pre- or postprocess for its own compile ``key``, from FA4's jit cache (compiled
    there as FA4's entry points compile it), kept here so a call costs one dict lookup."""
    got = _COMPILED.get((which, key))
    if got is None:
        from flash_attn.cute import interface

        helper, build = ((interface._bwd_preprocess, interface._compile_bwd_preprocess) if which == "pre" else
                         (interface._bwd_postprocess_convert, interface._compile_bwd_postprocess))
        if key not in helper.compile_cache:
            helper.compile_cache[key] = build(*key)
        got = _COMPILED[which, key] = helper.compile_cache[key]
    return got


def preprocess(p: BwdPlan, out: torch.Tensor, dout: torch.Tensor, rows: tuple, lse: torch.Tensor, *,
               fake_mode: bool, cu_seqlens: torch.Tensor | None = None,
               cu_total_blocks: torch.Tensor | None = None) -> None:
    """FA4's preprocess (``interface._bwd_preprocess``'s kernel, launched directly): ``rows = (dpsum,
    lse_log2, dq_accum)`` fp32 <- rowsum(dO * O), ``lse`` in log2 units, zeros. Dense: ``out`` / ``dout``
    ``(b, s, h, d)`` 16-bit, ``lse (b, h, s)``, rows ``(b, h, s_r)`` and ``(b, h, s_r * d_r)``; varlen:
    ``(total, h, d)``, ``(h, total)``, rows padded per document, with int32 ``cu_seqlens`` and FA4's
    tile cumsum ``cu_total_blocks`` at the plan's ``tile_m`` (required: FA4's own would make it)."""
    from flash_attn.cute import interface

    if cu_seqlens is not None and cu_total_blocks is None:
        raise ValueError("preprocess: a varlen call needs cu_total_blocks (FA4's tile cumsum at tile_m)")
    dpsum, lse_log2, dq_accum = rows
    d = out.shape[-1]
    key = (interface.torch2cute_dtype_map[out.dtype], d, d, p.tile_m, cu_seqlens is not None, False, False, True,
           False, True, True, False, False, 1, 1, cu_total_blocks is not None, p.d_round, False)
    kernel = _compiled("pre", key)
    if not fake_mode:
        launch(kernel, out, dout, dpsum, lse, lse_log2, dq_accum, cu_seqlens, None, None, None, None, 1.0,
               cu_total_blocks, None)


def postprocess(p: BwdPlan, kind: str, accum: torch.Tensor, out: torch.Tensor, scale: float, *,
                fake_mode: bool, cu_seqlens: torch.Tensor | None = None,
                cu_total_blocks: torch.Tensor | None = None) -> None:
    """FA4's postprocess (``interface._bwd_postprocess_convert``'s kernel, launched directly): ``out (b,
    rows, heads, d)`` 16-bit <- ``scale *`` the FA4-layout fp32 accumulator ``(b, heads, rows_r * d_r)``;
    ``kind`` "dq" (dQ) or "dkv" (dK / dV). Varlen: ``out (total, heads, d)`` and ``accum (heads,
    total_pad * d_r)`` with int32 ``cu_seqlens`` (documents padded as FA4's varlen backward pads them)
    and, always given so its compile key never flips with the document count, FA4's tile cumsum
    ``cu_total_blocks`` at the plan's postprocess tile (required)."""
    from flash_attn.cute import interface

    if cu_seqlens is not None and cu_total_blocks is None:
        raise ValueError("postprocess: a varlen call needs cu_total_blocks (FA4's tile cumsum)")
    tile, threads, atom, swap, use2, cluster, order = p.dq_post if kind == "dq" else p.dkv_post
    key = (interface.torch2cute_dtype_map[out.dtype], out.shape[-1], tile, threads, atom, swap,
           cu_seqlens is not None, False, use2, cluster, p.arch, cu_total_blocks is not None, None, p.d_round, order)
    kernel = _compiled("post", key)
    if not fake_mode:
        launch(kernel, accum, out, scale, cu_seqlens, None, None, cu_total_blocks)
