"""What our row-wise CuTe DSL kernels (merge, finish) share on the host side: availability, the
compile target of a device, the vector width a set of row tensors allows, a kernel's row geometry
and its compile options."""

from __future__ import annotations

import functools
import shlex

import torch

__all__ = ["DTYPE_NAMES", "RowGeometry", "align_bytes", "compile_options", "cute_available", "device_arch", "pick_vec"]

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
WIDTH = {"bfloat16": 16, "float16": 16, "float32": 32}


@functools.cache
def cute_available() -> bool:
    """Whether nvidia-cutlass-dsl (and the TVM FFI that calls its kernels) imports."""
    try:
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def device_arch(index: int) -> str | None:
    """The compile target of a GPU (arch-specific "a" variants from Hopper on); None before Ampere."""
    major, minor = torch.cuda.get_device_capability(index)
    return None if major < 8 else f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def align_bytes(width: int, vec: int) -> int:
    """Alignment (bytes) a kernel assumes of a row tensor's base: one 128-bit copy at most."""
    return min(16, vec * width // 8)


def _fits(t: torch.Tensor, vec: int) -> bool:
    """Every row of ``t`` (all dims but the last are row dims) starts on a ``vec``-element boundary."""
    return all(t.stride(i) % vec == 0 for i in range(t.dim() - 1)) and t.data_ptr() % align_bytes(
        8 * t.element_size(), vec) == 0


def pick_vec(d: int, dtype_name: str, rows: tuple[torch.Tensor, ...]) -> int | None:
    """Elements per thread: the widest (one 128-bit load of a ``dtype_name`` row) that divides
    ``d`` and every row start of ``rows``; None where d is 0 or a row needs over 1024 threads."""
    if d == 0:
        return None
    vec = 128 // WIDTH[dtype_name]
    while vec > 1 and not (d % vec == 0 and all(_fits(t, vec) for t in rows)):
        vec //= 2
    return None if d // vec > 1024 else vec


class RowGeometry:
    """A row kernel's launch shape: one thread moves ``vec`` of a row's ``d`` elements (``tpr``
    threads a row), a CTA holds ``rows_per_cta`` whole rows (``num_threads``: about 256). The
    kernel classes derive from it (their ``__init__`` calls this one)."""

    THREADS = 256  # threads per CTA before rounding down to whole rows

    def __init__(self, d: int, vec: int) -> None:
        self.d, self.vec = d, vec
        self.tpr = d // vec
        self.rows_per_cta = max(1, self.THREADS // self.tpr)
        self.num_threads = self.rows_per_cta * self.tpr

    @staticmethod
    def fits(d: int, vec: int, width: int) -> bool:
        """Whether ``d`` splits into power-of-two vectors of ``vec`` elements of ``width`` bits (at most
        one 128-bit copy each), at most 1024 threads a row."""
        return vec >= 1 and d % vec == 0 and 0 < d // vec <= 1024 and vec & (vec - 1) == 0 and vec * width <= 128


def compile_options(arch: str, dump_dir: str | None) -> str:
    """``cute.compile``'s options for a TVM-FFI kernel of ``arch``; with ``dump_dir`` its PTX and
    cubin are kept there."""
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {shlex.quote(str(dump_dir))}"
    return options
