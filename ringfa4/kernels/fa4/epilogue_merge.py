"""A ring step's FA4 forward that merges its block straight into the ring's fp32 accumulator.

The ring forward otherwise writes each block's output (fp32, :mod:`.fp32_forward`) to a scratch and a
separate merge kernel reads it back with the accumulator: per element 4 bytes written and 12 read
or written again by the merge, memory-bound passes that were most of the ring's forward overhead
on the H200 (64k, P = 8: the merges ran at ~3.9 TB/s, the copy ceiling). Here the epilogue of
FA4's sm90 forward (``_Sm90Fp32Out`` of :mod:`.fp32_forward`, subclassed again) does the merge while
the normalized block output is still in registers:

    the running lse is kept as (M, S): M = the largest block lse so far, S = sum_i exp(lse_i - M),
    so lse = M + log S;  for a block (o_blk, b):  M' = max(M, b),  S' = S exp(M - M') + exp(b - M'),
    out_acc <- (S exp(M - M') / S') * out_acc + (exp(b - M') / S') * o_blk

so per element the kernel reads the accumulator once and writes it once, and nothing else runs
over the outputs or the lse. Keeping (M, S) instead of an fp32 lse rounds the lse once, when the
ring ends (``lse = M + log S``, :func:`.merge.planes_lse`), instead of once per block: the ring's lse
error is then a weighted mean of the blocks' (at P = 32 the per-block fp32 logaddexp came to 1.3x
one full call's error on the H200; a float64 running lse, one small kernel per block, to 0.6x).
Rows whose M stays -inf keep ``out_acc`` (0 for a fresh accumulator) and (M, S) = (-inf, 0).

Contract (checked on the host): ``planes (b, h, 2, s_q)`` float32 (views with last-dim stride 1,
e.g. the rows ``[q0, q1)`` of a rank's ``(b, h, 2, S)`` buffer): plane 0 is M, plane 1 is S
(start: -inf and 0). The kernel gets plane 0 as FA4's ``mLSE`` and finds plane 1 one plane stride
further, which is half of ``mLSE``'s head stride; so the planes' head stride must be exactly
twice their plane stride. ``out_acc (b, s_q, h, d)`` float32 (strided views allowed, 16-byte
aligned). :func:`.merge.merge_planes_` is the torch version (the oracle and the fallback).

The threads holding a row are one quad of one warp (FA4's sm90 MMA splits rows over warp groups):
they all read the row's (M, S), sync the warp, then the one holding column 0 writes the new pair.
sm90 only; on sm100 :func:`can_implement` is False: FA4's sm100 correction loop computes the block's
lse after its ``correction_epilogue``, which gets only 1 / row_sum, so a merge there would have to
replace that loop (FA4's code); the ring there runs the fp32 forward and :mod:`.cute_merge`.
"""

from __future__ import annotations

import functools
import math

import torch

from ..eager import eager_boundary
from ..spec import AttnSpec
from .fp32_forward import Compiled, Prepared, _sm90_class, _spec, prepare_forward
from .fp32_forward import compile_only as fp32_compile_only

__all__ = ["can_implement", "check_planes", "compile_only", "fa4_forward_merge_", "prepare_merge"]

# The epilogue issues every global load (the rows' (M, S), the accumulator tile) before it computes
# or stores anything (on the H200 that saved 0.1-0.9% of the kernel's time over loading the
# accumulator row by row after the (M, S) writes).
# Tried and dropped, since each was slower on the H200 (64k ring block shapes, one process each):
# - the tile's accumulator rows and (M, S) prefetched into L2 at the tile's first kv block, or at kv
#   block 1, 2, 4 or 8 of its mainloop: -0.1 to +2.3 points over these loads
#   (docs/experiments.md);
# - the same copied into 65 KB of the shared memory FA4 leaves free, by cp.async issued at the first
#   kv block (or block 2 or 8), the epilogue reading shared memory: +1 to +3 points with 8-byte copies
#   in the MMA fragment's order (git tag tried/merge-cp-async-8b, docs/experiments.md),
#   +0.6 to +1.6 points with 16-byte copies into a swizzled row-major tile (issued at kv
#   block 2: +5 to +6; git tag tried/merge-cp-async-16b).
# Nsight Compute (benchmarks/ncu_merge_epilogue.sh, 8k x 4k; benchmarks/results/ncu/) shows where
# the merge's time goes: the epilogue waiting for these loads (long scoreboard at the first use of
# (M, S): 5.8k stall samples after the last matmul against 2.3k for the fp32 store, of ~82k). The
# cp.async copy took 2.1k of them out of the epilogue but its 36 eight-byte copies a thread cost 1.8k
# to issue in the mainloop; the 16-byte one costs 0.3k to issue and leaves 3.9k in the epilogue
# (84.3k samples in all against the hoisted kernel's 84.8k, another ncu call, at ncu's locked clocks),
# yet timed back to back it was the slower one: not resolved. Left to try: one TMA load by the
# producer warp group with an mbarrier, so the MMA warps issue nothing; its tensor map has to reach
# FA4's kernel as a parameter, which its __call__ / kernel signatures have no room for (a change
# upstream, or a subclass re-declaring both).


@functools.cache
def _sm90_merge_class() -> type:
    """``_Sm90Fp32Out`` whose epilogue merges into (out_acc, plane 0) instead of storing."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr
    from quack import layout_utils

    log2_e = math.log2(math.e)

    class _Sm90MergeOut(_sm90_class()):
        @cute.jit
        def epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma,
                     tidx, m_block, head_idx, batch_idx):
            # acc_O: this block's normalized output; lse: its row lse (natural log). Every store is
            # straight from registers to global memory (no smem, no barrier), as in the base class.
            assert not self.pack_gqa
            thr_mma, tOcO, t0OcO, rows_left = self.thread_rows(tiled_mma, tidx, m_block, seqlen)
            # plane 0 (the running max M) is mLSE; plane 1 (the running sum S) lies half a head
            # stride further
            tOgRun, gRun = self.row_tensor(thr_mma, mLSE, seqlen, m_block, head_idx, batch_idx)
            bcast = cute.append(gRun.layout, cute.make_layout((self.tile_hdimv,), stride=(0,)))
            gSum = cute.make_tensor(gRun.iterator + mLSE.stride[1] // 2, bcast)
            tOgSum = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(gSum))
            assert cute.size(tOgRun, mode=[0]) == cute.size(lse)
            tOgO = self.o_tile(thr_mma, mO, seqlen, m_block, head_idx, batch_idx)
            tOrO = layout_utils.reshape_acc_to_mn(acc_O)
            run_m = cute.make_rmem_tensor_like(lse, Float32)
            run_s = cute.make_rmem_tensor_like(lse, Float32)
            prev = cute.make_rmem_tensor_like(tOrO, Float32)
            # every load first (the rows' (M, S) and accumulator elements), so their latencies
            # overlap: the stores below may alias them, so nothing after a store would be hoisted
            for m in cutlass.range_constexpr(cute.size(lse)):
                run_m[m] = -Float32.inf
                run_s[m] = Float32(0.0)
                if t0OcO[m, 0][0] < rows_left:
                    run_m[m] = Float32(tOgRun[m, 0])
                    run_s[m] = Float32(tOgSum[m, 0])
                    if const_expr(not self.check_hdim_v_oob):
                        cute.autovec_copy(tOgO[m, None], prev[m, None])
            w_acc = cute.make_rmem_tensor_like(lse, Float32)
            w_blk = cute.make_rmem_tensor_like(lse, Float32)
            new_m = cute.make_rmem_tensor_like(lse, Float32)
            new_s = cute.make_rmem_tensor_like(lse, Float32)
            for m in cutlass.range_constexpr(cute.size(lse)):
                w_acc[m] = Float32(1.0)  # a row whose M stays -inf keeps out_acc
                w_blk[m] = Float32(0.0)
                new_m[m] = -Float32.inf
                new_s[m] = Float32(0.0)
                top = cute.arch.fmax(run_m[m], lse[m])
                if top != -Float32.inf:  # rows past the end have run_m = lse = -inf
                    s_acc = run_s[m] * cute.math.exp2((run_m[m] - top) * log2_e)
                    e_blk = cute.math.exp2((lse[m] - top) * log2_e)
                    total = s_acc + e_blk  # >= 1: the larger side's own term is exp(0)
                    inv = Float32(1.0) / total
                    w_acc[m] = s_acc * inv
                    w_blk[m] = e_blk * inv
                    new_m[m] = top
                    new_s[m] = total
            # every thread of a row (one quad of one warp) has read (M, S) before one writes them
            cute.arch.sync_warp()
            if tOcO[0][1] == 0:
                for m in cutlass.range_constexpr(cute.size(lse)):
                    if t0OcO[m, 0][0] < rows_left:
                        if new_m[m] != -Float32.inf:
                            tOgRun[m, 0] = new_m[m]
                            tOgSum[m, 0] = new_s[m]
            for m in cutlass.range_constexpr(cute.size(tOrO, mode=[0])):
                if t0OcO[m, 0][0] < rows_left:
                    if const_expr(not self.check_hdim_v_oob):
                        for n in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
                            prev[m, n] = w_acc[m] * prev[m, n] + w_blk[m] * tOrO[m, n]
                        cute.autovec_copy(prev[m, None], tOgO[m, None])
                    else:
                        for n in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
                            if tOcO[m, n][1] < mO.shape[1]:
                                tOgO[m, n] = w_acc[m] * tOgO[m, n] + w_blk[m] * tOrO[m, n]

    return _Sm90MergeOut


def can_implement(arch: int) -> bool:
    """Whether the merging forward runs for this arch (FA4's number: 90, 100...)."""
    return arch // 10 == 9


def check_planes(planes: torch.Tensor, q: torch.Tensor) -> None:
    """ValueError unless ``planes`` is a ``(b, h, 2, s_q)`` float32 view as the module doc asks."""
    b, s_q, h, _ = q.shape
    if tuple(planes.shape) != (b, h, 2, s_q) or planes.dtype != torch.float32 or planes.device != q.device:
        raise ValueError(f"lse planes must be ({b}, {h}, 2, {s_q}) float32 on {q.device}, got "
                         f"{tuple(planes.shape)} {planes.dtype} on {planes.device}")
    if planes.stride(-1) != 1 or planes.stride(1) != 2 * planes.stride(2):
        raise ValueError(f"lse planes need last-dim stride 1 and a head stride twice the plane stride (a view of "
                         f"a (b, h, 2, S) buffer), got strides {planes.stride()}")


@eager_boundary
def fa4_forward_merge_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_acc: torch.Tensor,
                       planes: torch.Tensor, *, causal: bool, softmax_scale: float,
                       window: tuple[int | None, int | None] = (None, None), softcap: float = 0.0) -> torch.Tensor:
    """Attention of ``q (b, s_q, h, d)`` over ``k, v (b, s_k, h_kv, d)`` (fp16 / bf16; masks as in
    :func:`.fp32_forward.fa4_forward_fp32`) merged into ``out_acc (b, s_q, h, d)`` float32 and the
    running ``planes (b, h, 2, s_q)`` float32 (M, S) in place (see the module doc). Returns
    ``planes``."""
    prepare_merge(q, k, v, out_acc, planes, _spec(causal, softmax_scale, window, softcap)).run()
    return planes  # a block that ran nothing (no rows, or no keys) adds nothing


def prepare_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_acc: torch.Tensor, planes: torch.Tensor,
                  spec: AttnSpec) -> Prepared:
    """The checked path of :func:`fa4_forward_merge_` for ``spec`` (causal, softmax_scale, window,
    softcap): its launch prepared (:class:`~.fp32_forward.Prepared`; the plan takes the M plane,
    ``planes.select(2, 0)``, as its lse), nothing run yet."""
    check_planes(planes, q)
    return prepare_forward(q, k, v, spec, out_acc, planes.select(2, 0), merge_class=_sm90_merge_class)


def compile_only(arch: str | int, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, causal: bool = False,
                 **kwargs) -> Compiled:
    """Compile (without running) the merging forward for ``arch`` (sm90) on fake CUDA tensors; the
    arguments of :func:`.fp32_forward.compile_only`."""
    return fp32_compile_only(arch, dtype, head_dim, causal, merge_class=_sm90_merge_class, **kwargs)
