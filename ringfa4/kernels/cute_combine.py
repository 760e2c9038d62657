"""One-pass LSE combine of n partial attention results as a CuTe DSL kernel, with torch versions.

Deferred correction for ring attention: each ring step writes its block result into a slot, and
every few steps one combine folds the filled slots into the fp32 accumulator.
``combine_lse_cute_(out_acc, lse_acc, parts, lse_parts, n)`` updates in place

* ``out_acc (b, s, h, d)`` float32 and ``lse_acc (b, h, s)`` float32 (the accumulator; rows at
  lse -inf are empty) with
* the first ``n`` slots of ``parts (N, b, s, h, d)`` bf16 / fp16 / fp32 and ``lse_parts (N, b, h, s)``
  float32 (``0 <= n <= N``; ``n = 0`` does nothing). Varlen ``out (t, h, d)``, ``lse (h, t)``,
  ``parts (N, t, h, d)``, ``lse_parts (N, h, t)`` are viewed as b = 1.

Math, in fp32 with exp2/log2 (``L = log2(e)``), per row (one (b, s, h) vector of d elements)::

    m = max(lse_acc, lse_0, ..., lse_{n-1})       (0 instead where all are -inf)
    w_j = 2^((lse_j - m) L)  (0 where lse_j = -inf),  w_acc likewise
    out_acc = (w_acc out_acc + sum_j w_j part_j) / (w_acc + sum_j w_j)   (0 where all are -inf)
    lse_acc = m + log2(w_acc + sum_j w_j) / L                              (-inf where all are -inf)

A row at lse -inf (accumulator or slot) may hold garbage (NaN / inf): it is never read, so it
contributes nothing. All arguments may be strided views (zigzag halves ``acc[:, s0:s1]``,
``parts[:, :, s0:s1]``) as long as the last dim of the out tensors has stride 1. One thread moves
``vec`` elements of one row (128-bit loads / stores where the alignment allows) and reads every
part row once, ``_IN_FLIGHT`` slots' loads issued before their use; a CTA holds whole rows. b, s,
h, N, n and every stride are runtime values, so one kernel serves each (part dtype, d, vec, arch),
cached. Compiling needs no GPU: ``compile_combine_kernel(CombineKey(..., arch="sm_100a"))``. The
launch goes on torch's current CUDA stream (TVM FFI environment stream).
"""

import functools
import math
import operator
import os
import shlex
from dataclasses import dataclass

import torch

from .cute_common import DTYPE_NAMES, align_bytes, cute_available, device_arch, pick_vec

__all__ = ["CombineKey", "combine_lse_", "combine_lse_cute_", "combine_lse_torch_", "compile_combine_kernel",
           "plan_combine"]

_THREADS = 256  # threads per CTA before rounding down to whole rows
_IN_FLIGHT = 4  # slots whose loads a thread issues before it accumulates them


@dataclass(frozen=True)
class CombineKey:
    """What a compiled kernel depends on: part dtype, head dim, vector width (elements), target."""

    part_dtype: str  # "bfloat16" | "float16" | "float32"
    d: int
    vec: int  # elements per thread; the out rows and their strides are multiples of it
    arch: str  # "sm_90a", "sm_100a", ...


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    log2_e = math.log2(math.e)
    neg_inf = -Float32.inf

    class CombineLse:
        def __init__(self, part_dtype, d: int, vec: int):
            self.part_dtype, self.d, self.vec = part_dtype, d, vec
            self.tpr = d // vec  # threads per row
            self.rows_per_cta = max(1, _THREADS // self.tpr)
            self.num_threads = self.rows_per_cta * self.tpr

        def __str__(self) -> str:  # names the kernel (and its PTX / cubin dump files)
            return f"RingCombineLse_{self.part_dtype.__name__}_d{self.d}_v{self.vec}"

        @staticmethod
        def can_implement(part_dtype, d: int, vec: int) -> bool:
            return (part_dtype in (cutlass.BFloat16, cutlass.Float16, Float32) and vec >= 1 and d % vec == 0
                    and 0 < d // vec <= 1024 and vec & (vec - 1) == 0 and vec * part_dtype.width <= 128)

        @cute.jit
        def __call__(self, mO: cute.Tensor, mL: cute.Tensor, mP: cute.Tensor, mLP: cute.Tensor, n: Int32,
                     stream):
            n_rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
            self.kernel(mO, mL, mP, mLP, n).launch(
                grid=[cute.ceil_div(n_rows, self.rows_per_cta), 1, 1], block=[self.num_threads, 1, 1],
                stream=stream)

        @cute.kernel
        def kernel(self, mO: cute.Tensor, mL: cute.Tensor, mP: cute.Tensor, mLP: cute.Tensor, n: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            n_s, n_h = mO.shape[1], mO.shape[2]
            n_rows = mO.shape[0] * n_s * n_h
            row = bidx * self.rows_per_cta + tidx // self.tpr
            chunk = tidx % self.tpr
            # rows past the end (last CTA) read the last row and store nothing
            row_c = cutlass.min(row, n_rows - 1)
            # rows in (b, h, s) order, s fastest: a CTA's lse reads and writes are contiguous
            si = row_c % n_s
            hi = (row_c // n_s) % n_h
            bi = row_c // (n_s * n_h)
            acc_bits = min(128, self.vec * 32)
            part_bits = min(128, self.vec * self.part_dtype.width)
            copy_acc = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=acc_bits)
            copy_part = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.part_dtype,
                                            num_bits_per_copy=part_bits)
            la = mL[bi, hi, si]
            gO = cute.local_tile(mO[bi, si, hi, None], (self.vec,), (chunk,))
            rO = cute.make_rmem_tensor_like(gO)
            rO.fill(0.0)
            if la > neg_inf:  # an empty accumulator row is never read (it may be garbage)
                cute.copy(copy_acc, gO, rO)
            m = la
            for j in cutlass.range(n):
                m = cutlass.max(m, mLP[j, bi, hi, si])
            empty = m == neg_inf
            m_safe = Float32(0.0) if empty else m
            w_acc = cute.math.exp2((la - m_safe) * log2_e, fastmath=True) if la > neg_inf else Float32(0.0)
            rO.store(rO.load() * w_acc)
            total = w_acc
            gP0 = cute.local_tile(mP[0, bi, si, hi, None], (self.vec,), (chunk,))
            rP = [cute.make_rmem_tensor_like(gP0) for _ in range(_IN_FLIGHT)]
            for j0 in cutlass.range(0, n, _IN_FLIGHT):
                # issue up to _IN_FLIGHT loads (skipping slots at -inf and past n), then use them
                lse = [mLP[cutlass.min(j0 + g, n - 1), bi, hi, si] for g in range(_IN_FLIGHT)]
                live, w = [], []
                for g in cutlass.range_constexpr(_IN_FLIGHT):
                    ok = j0 + g < n and lse[g] > neg_inf
                    if ok:
                        gP = cute.local_tile(mP[j0 + g, bi, si, hi, None], (self.vec,), (chunk,))
                        cute.copy(copy_part, gP, rP[g])
                    live.append(ok)
                    w.append(cute.math.exp2((lse[g] - m_safe) * log2_e, fastmath=True) if ok else Float32(0.0))
                for g in cutlass.range_constexpr(_IN_FLIGHT):
                    if live[g]:
                        rO.store(rO.load() + rP[g].load().to(Float32) * w[g])
                    total = total + w[g]
            # every thread of a row has read lse_acc before its chunk-0 thread overwrites it
            cute.arch.barrier()
            if row < n_rows:
                inv = Float32(1.0) / (Float32(1.0) if empty else total)
                rO.store(rO.load() * inv)
                cute.copy(copy_acc, rO, gO)
                if chunk == Int32(0):
                    mL[bi, hi, si] = neg_inf if empty else m_safe + cute.math.log2(total) * math.log(2.0)

    return CombineLse


def compile_combine_kernel(key: CombineKey, dump_dir: str | None = None):
    """Compile (no launch, no GPU needed) the kernel for ``key``; returns the TVM-FFI callable
    ``f(out_acc4, lse_acc3, parts5, lse_parts4, n)`` that launches on torch's current stream.
    With ``dump_dir``, PTX and cubin are kept there."""
    import cutlass
    import cutlass.cute as cute

    part = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}[key.part_dtype]
    cls = _kernel_class()
    if not cls.can_implement(part, key.d, key.vec):
        raise ValueError(f"the CuTe combine kernel cannot do {key}")
    slots, b, s, h = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def out_t(dtype, lead):
        strides = tuple(cute.sym_int64(divisibility=key.vec) for _ in lead) + (1,)
        return cute.runtime.make_fake_tensor(dtype, (*lead, key.d), strides,
                                             assumed_align=align_bytes(dtype.width, key.vec))

    def lse_t(lead):
        return cute.runtime.make_fake_tensor(cutlass.Float32, lead, tuple(cute.sym_int64() for _ in lead),
                                             assumed_align=4)

    options = f"--enable-tvm-ffi --gpu-arch {key.arch}"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {shlex.quote(str(dump_dir))}"
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(cls(part, key.d, key.vec), out_t(cutlass.Float32, (b, s, h)), lse_t((b, h, s)),
                        out_t(part, (slots, b, s, h)), lse_t((slots, b, h, s)), cutlass.Int32(1), stream,
                        options=options)


_compiled = functools.cache(compile_combine_kernel)


def _check(out_acc, lse_acc, parts, lse_parts, n) -> int:
    """Raise ValueError on mismatched shapes or a bad n; returns n as an int."""
    if out_acc.dim() not in (3, 4):
        raise ValueError(f"out_acc must be (b, s, h, d) or varlen (t, h, d), got shape {tuple(out_acc.shape)}")
    if parts.dim() != out_acc.dim() + 1 or parts.shape[1:] != out_acc.shape:
        raise ValueError(f"parts must be (N, *out_acc.shape) = (N, {tuple(out_acc.shape)}), got "
                         f"{tuple(parts.shape)}")
    expected = tuple(out_acc.shape[:-3]) + (out_acc.shape[-2], out_acc.shape[-3])
    if tuple(lse_acc.shape) != expected:
        raise ValueError(f"lse_acc must have shape {expected} (…, h, s), got {tuple(lse_acc.shape)}")
    if tuple(lse_parts.shape) != (parts.shape[0], *expected):
        raise ValueError(f"lse_parts must have shape {(parts.shape[0], *expected)} (N, …, h, s), got "
                         f"{tuple(lse_parts.shape)}")
    try:
        n = operator.index(n)
    except TypeError:
        raise ValueError(f"n must be an int, got {type(n).__name__}") from None
    if not 0 <= n <= parts.shape[0]:
        raise ValueError(f"n must be in 0..N = 0..{parts.shape[0]}, got {n}")
    return n


def _as4(out_acc, lse_acc, parts, lse_parts):
    """Varlen tensors as b = 1: (b, s, h, d), (b, h, s), (N, b, s, h, d), (N, b, h, s)."""
    if out_acc.dim() == 4:
        return out_acc, lse_acc, parts, lse_parts
    return out_acc.unsqueeze(0), lse_acc.unsqueeze(0), parts.unsqueeze(1), lse_parts.unsqueeze(1)



def plan_combine(out_acc, lse_acc, parts, lse_parts, arch: str) -> CombineKey | None:
    """The kernel for these tensors (any device), or None where the kernel cannot do them.
    Raises ValueError on mismatched shapes."""
    _check(out_acc, lse_acc, parts, lse_parts, 0)
    if any(t.dtype != torch.float32 for t in (out_acc, lse_acc, lse_parts)):
        return None
    if parts.dtype not in DTYPE_NAMES or out_acc.stride(-1) != 1 or parts.stride(-1) != 1:
        return None
    o, l, p, _ = _as4(out_acc, lse_acc, parts, lse_parts)
    if any(st == 0 and size > 1 for t in (o, l) for st, size in zip(t.stride(), t.shape)):
        return None  # overlapping writes
    part, d = DTYPE_NAMES[parts.dtype], o.shape[-1]
    vec = pick_vec(d, part, (o, p))
    if vec is None:
        return None
    return CombineKey(part, d, vec, arch)


def combine_lse_cute_(out_acc: torch.Tensor, lse_acc: torch.Tensor, parts: torch.Tensor, lse_parts: torch.Tensor,
                      n: int) -> bool:
    """Fused in-place combine of the first ``n`` slots of ``(parts, lse_parts)`` into ``(out_acc,
    lse_acc)`` (see the module docstring). Returns False, doing nothing, where the kernel does not
    apply (not CUDA, no nvidia-cutlass-dsl, an accumulator not fp32, a last dim not contiguous, ...);
    raises ValueError on mismatched shapes or n outside 0..N."""
    n = _check(out_acc, lse_acc, parts, lse_parts, n)
    tensors = (out_acc, lse_acc, parts, lse_parts)
    if not all(t.is_cuda and t.device == out_acc.device for t in tensors) or not cute_available():
        return False
    arch = device_arch(out_acc.device.index or 0)
    key = None if arch is None else plan_combine(*tensors, arch=arch)
    if key is None:
        return False
    o, l, p, lp = _as4(*tensors)
    if n == 0 or o.shape[0] * o.shape[1] * o.shape[2] == 0:
        return True
    with torch.cuda.device(out_acc.device):
        _compiled(key)(o, l, p, lp, n)
    return True


def _to_rows(w: torch.Tensor) -> torch.Tensor:
    """lse layout (..., h, s) -> out layout (..., s, h, 1)."""
    return w.transpose(-1, -2).unsqueeze(-1)


def combine_lse_torch_(out_acc: torch.Tensor, lse_acc: torch.Tensor, parts: torch.Tensor, lse_parts: torch.Tensor,
                       n: int) -> None:
    """The torch version of :func:`combine_lse_` (any device, fp32 or fp64; the fallback of the
    kernel and its test oracle). Rows at lse -inf are selected away, never multiplied by 0."""
    n = _check(out_acc, lse_acc, parts, lse_parts, n)
    if not out_acc.dtype.is_floating_point or out_acc.dtype in (torch.float16, torch.bfloat16):
        raise ValueError(f"out_acc must be float32 or float64 (an accumulator), got {out_acc.dtype}")
    if n == 0:
        return
    dt = out_acc.dtype
    la, lp = lse_acc, lse_parts[:n].to(lse_acc.dtype)
    m = torch.maximum(la, lp.amax(0))
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    live_acc, live = la > -math.inf, lp > -math.inf
    w_acc = torch.where(live_acc, torch.exp(la - m_safe), torch.zeros_like(la))
    w = torch.where(live, torch.exp(lp - m_safe), torch.zeros_like(lp))
    total = w_acc + w.sum(0)
    den = torch.where(total == 0, torch.ones_like(total), total)
    zero = out_acc.new_zeros(())
    out = torch.where(_to_rows(live_acc), out_acc, zero) * _to_rows(w_acc / den).to(dt)
    for j in range(n):
        out += torch.where(_to_rows(live[j]), parts[j].to(dt), zero) * _to_rows(w[j] / den).to(dt)
    out_acc.copy_(out)
    lse_acc.copy_(torch.where(total == 0, torch.full_like(m_safe, -math.inf), m_safe + torch.log(den)))


def combine_lse_(out_acc: torch.Tensor, lse_acc: torch.Tensor, parts: torch.Tensor, lse_parts: torch.Tensor,
                 n: int) -> None:
    """Combine the first ``n`` slots of ``(parts, lse_parts)`` into ``(out_acc, lse_acc)`` in place:
    the CuTe kernel on CUDA where it applies, else :func:`combine_lse_torch_`.
    ``RINGFA4_MERGE=triton|torch`` (the merge's switch) keeps to torch."""
    n = _check(out_acc, lse_acc, parts, lse_parts, n)
    if out_acc.is_cuda and os.environ.get("RINGFA4_MERGE", "auto") in ("auto", "cute") and combine_lse_cute_(
            out_acc, lse_acc, parts, lse_parts, n):
        return
    combine_lse_torch_(out_acc, lse_acc, parts, lse_parts, n)
