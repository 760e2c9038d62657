"""Fused LSE merge as a CuTe DSL kernel (nvidia-cutlass-dsl), with a thin torch wrapper.

``merge_lse_cute_(out_acc, lse_acc, out_blk, lse_blk)`` updates in place

* ``out_acc (b, s, h, d)`` float32 and ``lse_acc (b, h, s)`` float32 (the accumulator) with
* ``out_blk (b, s, h, d)`` bf16 / fp16 / fp32 and ``lse_blk (b, h, s)`` float32 (a block result);
  varlen ``out (t, h, d)``, ``lse (h, t)`` is viewed as b = 1.

Math, in fp32 with exp2/log2 (``L = log2(e)``)::

    m = max(lse_acc, lse_blk)       (0 instead where both are -inf)
    w_acc = 2^((lse_acc - m) L),  w_blk = 2^((lse_blk - m) L)     (0 for a side at -inf)
    out_acc = (w_acc out_acc + w_blk out_blk) / (w_acc + w_blk)   (0 where both are -inf)
    lse_acc = m + log2(w_acc + w_blk) / L                          (-inf where both are -inf)

All four arguments may be strided views (zigzag halves ``acc[:, s0:s1]``, ``lse[..., s0:s1]``) as
long as the last dim of the out tensors has stride 1. One thread moves ``vec`` elements of one row
(row = one (b, s, h) vector of d elements) with 128-bit loads / stores where the alignment allows;
a CTA holds whole rows. b, s, h and every stride are runtime values (symbolic at compile time), so
one kernel serves each (block dtype, d, vec, arch), cached. Compiling needs no GPU:
``compile_merge_kernel(MergeKey(..., arch="sm_100a"))`` builds PTX / cubin from fake tensors.
The launch goes on torch's current CUDA stream (TVM FFI environment stream).
"""

import functools
import math
from dataclasses import dataclass

import torch

from .cute_common import DTYPE_NAMES, RowGeometry, align_bytes, compile_options, cute_available, device_arch, pick_vec
from .tape import launch

__all__ = ["MergeKey", "compile_merge_kernel", "cute_merge_available", "merge_lse_cute_", "plan_merge"]

cute_merge_available = cute_available



@dataclass(frozen=True)
class MergeKey:
    """What a compiled kernel depends on: block dtype, head dim, vector width (elements), target."""

    blk_dtype: str  # "bfloat16" | "float16" | "float32"
    d: int
    vec: int  # elements per thread; the out rows and their strides are multiples of it
    arch: str  # "sm_90a", "sm_100a", ...


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    log2_e = math.log2(math.e)

    class MergeLse(RowGeometry):
        def __init__(self, blk_dtype, d: int, vec: int):
            super().__init__(d, vec)
            self.blk_dtype = blk_dtype

        def __str__(self) -> str:  # names the kernel (and its PTX / cubin dump files)
            return f"RingMergeLse_{self.blk_dtype.__name__}_d{self.d}_v{self.vec}"

        @staticmethod
        def can_implement(blk_dtype, d: int, vec: int) -> bool:
            return (blk_dtype in (cutlass.BFloat16, cutlass.Float16, Float32)
                    and RowGeometry.fits(d, vec, blk_dtype.width))

        @cute.jit
        def __call__(self, mO: cute.Tensor, mL: cute.Tensor, mOB: cute.Tensor, mLB: cute.Tensor, stream):
            n_rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
            self.kernel(mO, mL, mOB, mLB).launch(
                grid=[cute.ceil_div(n_rows, self.rows_per_cta), 1, 1], block=[self.num_threads, 1, 1],
                stream=stream)

        @cute.kernel
        def kernel(self, mO: cute.Tensor, mL: cute.Tensor, mOB: cute.Tensor, mLB: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            n_s, n_h = mO.shape[1], mO.shape[2]
            n_rows = mO.shape[0] * n_s * n_h
            row = bidx * self.rows_per_cta + tidx // self.tpr
            chunk = tidx % self.tpr
            # rows past the end (last CTA) load the last row and store nothing
            row_c = cutlass.min(row, n_rows - 1)
            # rows in (b, h, s) order, s fastest: a CTA's lse reads and writes are contiguous
            si = row_c % n_s
            hi = (row_c // n_s) % n_h
            bi = row_c // (n_s * n_h)
            la = mL[bi, hi, si]
            lb = mLB[bi, hi, si]
            gO = cute.local_tile(mO[bi, si, hi, None], (self.vec,), (chunk,))
            gOB = cute.local_tile(mOB[bi, si, hi, None], (self.vec,), (chunk,))
            acc_bits = min(128, self.vec * 32)
            blk_bits = min(128, self.vec * self.blk_dtype.width)
            copy_acc = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=acc_bits)
            copy_blk = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.blk_dtype,
                                           num_bits_per_copy=blk_bits)
            rO = cute.make_rmem_tensor_like(gO)
            rOB = cute.make_rmem_tensor_like(gOB)
            cute.copy(copy_acc, gO, rO)
            cute.copy(copy_blk, gOB, rOB)
            # every thread of a row has read lse_acc before its chunk-0 thread overwrites it
            cute.arch.barrier()
            if row < n_rows:
                m = cutlass.max(la, lb)
                empty = m == -Float32.inf
                m_safe = Float32(0.0) if empty else m
                wa = cute.math.exp2((la - m_safe) * log2_e, fastmath=True)
                wb = cute.math.exp2((lb - m_safe) * log2_e, fastmath=True)
                total = Float32(1.0) if empty else wa + wb
                inv = Float32(1.0) / total
                ca, cb = wa * inv, wb * inv
                o = rO.load() * ca + rOB.load().to(Float32) * cb
                rO.store(o)
                cute.copy(copy_acc, rO, gO)
                if chunk == Int32(0):
                    mL[bi, hi, si] = -Float32.inf if empty else m_safe + cute.math.log2(total) * math.log(2.0)

    return MergeLse


def compile_merge_kernel(key: MergeKey, dump_dir: str | None = None):
    """Compile (no launch, no GPU needed) the kernel for ``key``; returns the TVM-FFI callable
    ``f(out_acc4, lse_acc3, out_blk4, lse_blk3)`` that launches on torch's current stream.
    With ``dump_dir``, PTX and cubin are kept there."""
    import cutlass
    import cutlass.cute as cute

    blk = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}[key.blk_dtype]
    cls = _kernel_class()
    if not cls.can_implement(blk, key.d, key.vec):
        raise ValueError(f"the CuTe merge kernel cannot do {key}")
    b, s, h = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def out_t(dtype):
        strides = tuple(cute.sym_int64(divisibility=key.vec) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, (b, s, h, key.d), strides,
                                             assumed_align=align_bytes(dtype.width, key.vec))

    def lse_t():
        return cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, s), tuple(cute.sym_int64() for _ in range(3)),
                                             assumed_align=4)

    options = compile_options(key.arch, dump_dir)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(cls(blk, key.d, key.vec), out_t(cutlass.Float32), lse_t(), out_t(blk), lse_t(), stream,
                        options=options)


_compiled = functools.cache(compile_merge_kernel)



def _as4(out: torch.Tensor, lse: torch.Tensor):
    return (out.unsqueeze(0), lse.unsqueeze(0)) if out.dim() == 3 else (out, lse)


def _check(out_acc, lse_acc, out_blk, lse_blk) -> None:
    if out_acc.dim() not in (3, 4):
        raise ValueError(f"out_acc must be (b, s, h, d) or varlen (t, h, d), got shape {tuple(out_acc.shape)}")
    if out_blk.shape != out_acc.shape:
        raise ValueError(f"out_blk must have out_acc's shape {tuple(out_acc.shape)}, got {tuple(out_blk.shape)}")
    expected = tuple(out_acc.shape[:-3]) + (out_acc.shape[-2], out_acc.shape[-3])
    for name, t in (("lse_acc", lse_acc), ("lse_blk", lse_blk)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (…, h, s), got {tuple(t.shape)}")




def plan_merge(out_acc, lse_acc, out_blk, lse_blk, arch: str) -> MergeKey | None:
    """The kernel for these tensors (any device), or None where the kernel cannot do them.
    Raises ValueError on mismatched shapes."""
    _check(out_acc, lse_acc, out_blk, lse_blk)
    if out_acc.dtype != torch.float32 or lse_acc.dtype != torch.float32 or lse_blk.dtype != torch.float32:
        return None
    if out_blk.dtype not in DTYPE_NAMES or out_acc.stride(-1) != 1 or out_blk.stride(-1) != 1:
        return None
    o, l = _as4(out_acc, lse_acc)
    ob = _as4(out_blk, lse_blk)[0]
    if any(st == 0 and n > 1 for t in (o, l) for st, n in zip(t.stride(), t.shape)):
        return None  # overlapping writes
    blk, d = DTYPE_NAMES[out_blk.dtype], o.shape[-1]
    vec = pick_vec(d, blk, (o, ob))
    if vec is None:
        return None
    return MergeKey(blk, d, vec, arch)


def merge_lse_cute_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor,
                    lse_blk: torch.Tensor) -> bool:
    """Fused in-place merge of ``(out_blk, lse_blk)`` into ``(out_acc, lse_acc)`` (see the module
    docstring). Returns False, doing nothing, where the kernel does not apply (not CUDA, no
    nvidia-cutlass-dsl, an accumulator not fp32, a last dim not contiguous, ...); raises
    ValueError on mismatched shapes."""
    _check(out_acc, lse_acc, out_blk, lse_blk)
    tensors = (out_acc, lse_acc, out_blk, lse_blk)
    if not all(t.is_cuda and t.device == out_acc.device for t in tensors) or not cute_available():
        return False
    arch = device_arch(out_acc.device.index or 0)
    key = None if arch is None else plan_merge(*tensors, arch=arch)
    if key is None:
        return False
    o, l = _as4(out_acc, lse_acc)
    ob, lb = _as4(out_blk, lse_blk)
    if o.shape[0] * o.shape[1] * o.shape[2] == 0:
        return True
    with torch.cuda.device(out_acc.device):
        launch(_compiled(key), o, l, ob, lb)
    return True
