"""The ring forward's last pass as one CuTe DSL kernel (nvidia-cutlass-dsl), with a thin torch wrapper.

``finish_planes_cute(out_acc, m, s, lse, dtype)`` writes, for every row (one ``(b, s, h)`` vector of d
elements),

* ``out (b, s, h, d)`` bf16 / fp16 <- ``out_acc (b, s, h, d)`` float32, rounded to nearest even (as
  ``Tensor.to`` rounds), and
* ``lse (b, h, s)`` float32 <- ``M + log S`` from the merging forward's running planes ``m, s (b, h,
  s)`` float32 (:mod:`.fa4.epilogue_merge`); -inf where M is -inf.

In torch that is three launches (``log``, ``add_`` of :func:`.merge.planes_lse`, and the cast); a
ring forward runs it once per rank and call, so on short chunks it is a noticeable share of a call's
launches (issue 23). The data moved is the cast's: 4 bytes read and 2 written an element.

All five arguments may be strided views as long as the out rows' last dim has stride 1; ``m`` and
``s`` are typically ``planes[:, :, 0]`` and ``planes[:, :, 1]`` of a ``(b, h, 2, S)`` buffer. One
thread moves ``vec`` elements of one row (128-bit stores of ``out`` where the alignment allows); a
CTA holds whole rows; rows go in ``(b, h, s)`` order, s fastest, so the lse reads and writes of a CTA
are contiguous. b, s, h and every stride are runtime values: one kernel per (out dtype, d, vec,
arch), cached. Compiling needs no GPU (``compile_finish_kernel(FinishKey(..., arch="sm_100a"))``).
The launch goes on torch's current CUDA stream.
"""

import functools
from dataclasses import dataclass

import torch

from .cute_common import DTYPE_NAMES, RowGeometry, align_bytes, compile_options, cute_available, device_arch, pick_vec
from .eager import eager_boundary
from .tape import launch

__all__ = ["FinishKey", "compile_finish_kernel", "finish_planes_cute", "plan_finish"]


@dataclass(frozen=True)
class FinishKey:
    """What a compiled kernel depends on: output dtype, head dim, vector width (elements), target."""

    out_dtype: str  # "bfloat16" | "float16"
    d: int
    vec: int  # elements per thread; the out rows and their strides are multiples of it
    arch: str  # "sm_90a", "sm_100a", ...


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    class FinishPlanes(RowGeometry):
        def __init__(self, out_dtype, d: int, vec: int):
            super().__init__(d, vec)
            self.out_dtype = out_dtype

        def __str__(self) -> str:  # names the kernel (and its PTX / cubin dump files)
            return f"RingFinishPlanes_{self.out_dtype.__name__}_d{self.d}_v{self.vec}"

        @staticmethod
        def can_implement(out_dtype, d: int, vec: int) -> bool:
            return out_dtype in (cutlass.BFloat16, cutlass.Float16) and RowGeometry.fits(d, vec, out_dtype.width)

        @cute.jit
        def __call__(self, mA: cute.Tensor, mM: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor,
                     stream):
            n_rows = mA.shape[0] * mA.shape[1] * mA.shape[2]
            self.kernel(mA, mM, mS, mO, mL).launch(
                grid=[cute.ceil_div(n_rows, self.rows_per_cta), 1, 1], block=[self.num_threads, 1, 1],
                stream=stream)

        @cute.kernel
        def kernel(self, mA: cute.Tensor, mM: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            n_s, n_h = mA.shape[1], mA.shape[2]
            n_rows = mA.shape[0] * n_s * n_h
            row = bidx * self.rows_per_cta + tidx // self.tpr
            chunk = tidx % self.tpr
            if row < n_rows:
                si = row % n_s
                hi = (row // n_s) % n_h
                bi = row // (n_s * n_h)
                gA = cute.local_tile(mA[bi, si, hi, None], (self.vec,), (chunk,))
                gO = cute.local_tile(mO[bi, si, hi, None], (self.vec,), (chunk,))
                copy_acc = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                               num_bits_per_copy=min(128, self.vec * 32))
                copy_out = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype,
                                               num_bits_per_copy=min(128, self.vec * self.out_dtype.width))
                rA = cute.make_rmem_tensor_like(gA)
                rO = cute.make_rmem_tensor_like(gO)
                cute.copy(copy_acc, gA, rA)
                rO.store(rA.load().to(self.out_dtype))
                cute.copy(copy_out, rO, gO)
                if chunk == Int32(0):
                    m = mM[bi, hi, si]
                    mL[bi, hi, si] = -Float32.inf if m == -Float32.inf else m + cute.math.log(mS[bi, hi, si])

    return FinishPlanes


def compile_finish_kernel(key: FinishKey, dump_dir: str | None = None):
    """Compile (no launch, no GPU needed) the kernel for ``key``; returns the TVM-FFI callable
    ``f(out_acc4, m3, s3, out4, lse3)`` that launches on torch's current stream. With ``dump_dir``,
    PTX and cubin are kept there."""
    import cutlass
    import cutlass.cute as cute

    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}.get(key.out_dtype)
    cls = _kernel_class()
    if dtype is None or not cls.can_implement(dtype, key.d, key.vec):
        raise ValueError(f"the CuTe finish kernel cannot do {key}")
    b, s, h = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def rows_t(t):
        strides = tuple(cute.sym_int64(divisibility=key.vec) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(t, (b, s, h, key.d), strides, assumed_align=align_bytes(t.width, key.vec))

    def lse_t():
        return cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, s), tuple(cute.sym_int64() for _ in range(3)),
                                             assumed_align=4)

    options = compile_options(key.arch, dump_dir)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(cls(dtype, key.d, key.vec), rows_t(cutlass.Float32), lse_t(), lse_t(), rows_t(dtype), lse_t(),
                        stream, options=options)


_compiled = functools.cache(compile_finish_kernel)


def _check(out_acc, m, s, out, lse) -> None:
    if out_acc.dim() != 4:
        raise ValueError(f"out_acc must be (b, s, h, d), got shape {tuple(out_acc.shape)}")
    if out is not None and out.shape != out_acc.shape:
        raise ValueError(f"out must have out_acc's shape {tuple(out_acc.shape)}, got {tuple(out.shape)}")
    b, n_s, h, _ = out_acc.shape
    for name, t in (("m", m), ("s", s), ("lse", lse)):
        if tuple(t.shape) != (b, h, n_s):
            raise ValueError(f"{name} must have shape {(b, h, n_s)} (b, h, s), got {tuple(t.shape)}")


def plan_finish(out_acc, m, s, out, lse, arch: str, dtype: torch.dtype | None = None) -> FinishKey | None:
    """The kernel for these tensors (any device), or None where the kernel cannot do them (dtypes,
    a last dim not contiguous, overlapping writes, rows it cannot align). ``out`` None: a new
    contiguous tensor of ``dtype``. Raises ValueError on mismatched shapes."""
    _check(out_acc, m, s, out, lse)
    dtype = out.dtype if out is not None else dtype
    if any(t.dtype != torch.float32 for t in (out_acc, m, s, lse)) or dtype not in (torch.bfloat16, torch.float16):
        return None
    rows = (out_acc,) if out is None else (out_acc, out)  # (a new contiguous tensor is aligned)
    if any(t.stride(-1) != 1 for t in rows):
        return None
    if any(st == 0 and n > 1 for t in (out, lse) if t is not None for st, n in zip(t.stride(), t.shape)):
        return None  # overlapping writes
    vec = pick_vec(out_acc.shape[-1], DTYPE_NAMES[dtype], rows)
    return None if vec is None else FinishKey(DTYPE_NAMES[dtype], out_acc.shape[-1], vec, arch)


@eager_boundary
def finish_planes_cute(out_acc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, lse: torch.Tensor,
                       dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``out_acc`` in ``dtype`` (into ``out`` when given, else a new contiguous tensor) and ``lse <- M +
    log S`` (see the module doc), one launch; returns the output. None, doing nothing and allocating
    nothing, where the kernel does not apply (not CUDA, no nvidia-cutlass-dsl, dtypes or layouts it
    does not take: the caller then runs the torch ops, which check their own shapes); ValueError on
    mismatched shapes of the CUDA tensors it would run on."""
    if out is not None and out.dtype != dtype:
        raise ValueError(f"out must be {dtype}, got {out.dtype}")
    if out_acc.device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not cute_available():
        return None
    _check(out_acc, m, s, out, lse)
    if not all(t.is_cuda and t.device == out_acc.device for t in (m, s, lse) + (() if out is None else (out,))):
        return None
    arch = device_arch(out_acc.device.index or 0)
    key = None if arch is None else plan_finish(out_acc, m, s, out, lse, arch, dtype)
    if key is None:
        return None
    target = torch.empty(out_acc.shape, dtype=dtype, device=out_acc.device) if out is None else out
    if out_acc.numel():  # (no rows: nothing to write; d = 0 has no kernel)
        with torch.cuda.device(out_acc.device):
            launch(_compiled(key), out_acc, m, s, target, lse)
    return target
