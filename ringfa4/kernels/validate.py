"""Input checks for one block call. Each failure is a ValueError naming the tensor and what was
expected; ``where`` (e.g. ``"rank 3: "``) prefixes messages raised on behalf of a CP rank."""

from __future__ import annotations

import weakref

import torch

from .sinks import check_sinks
from .spec import AttnSpec

__all__ = ["known_empty_segment", "validate_block", "validate_cu_seqlens", "validate_varlen"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# cu_seqlens tensors already checked, keyed by the tensor object itself (weakly: a new tensor at a
# recycled address is never mistaken for a checked one) -> {(version, total) or ("longest", version)}
_CHECKED: dict[int, dict] = {}


def _seen(cu: torch.Tensor) -> dict:
    entry = _CHECKED.get(id(cu))
    if entry is None:
        entry = _CHECKED[id(cu)] = {}
        weakref.finalize(cu, _CHECKED.pop, id(cu), None)
    return entry


def validate_cu_seqlens(cu: torch.Tensor, name: str, total: int, where: str = "") -> None:
    """int32, 1-D, starts at 0, non-decreasing, last entry == ``total``. The values are read on the
    host once per tensor version (a ring calls this per block: later calls cost no device sync)."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{where}{name} must be an int32 tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{where}{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{where}{name} must be 1-D with n_docs + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    key = (cu._version, total)
    seen = _seen(cu)
    if key in seen or ("trusted", cu._version) in seen:
        return
    host = cu.detach().cpu()
    if int(host[0]) != 0:
        raise ValueError(f"{where}{name}[0] must be 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"{where}{name} must be non-decreasing, got {host.tolist()}")
    if int(host[-1]) != total:
        raise ValueError(f"{where}{name}[-1] must equal the number of tokens {total}, got {int(host[-1])}")
    _seen(cu)[key] = None
    _seen(cu)[("empty", cu._version)] = bool((host[1:] == host[:-1]).any())


def known_empty_segment(cu: torch.Tensor) -> bool:
    """Whether ``cu`` is known (from :func:`validate_cu_seqlens`' host read of this version, no new
    sync) to hold a zero-length segment; False when unknown (e.g. trusted by :func:`mark_valid`:
    the ring never builds empty segments)."""
    return bool(_seen(cu).get(("empty", cu._version), False))


def mark_valid(cu: torch.Tensor, longest: int) -> None:
    """Record that ``cu`` (built by ringfa4 itself, valid by construction) needs no value check:
    later block calls with it cost no device-to-host sync."""
    seen = _seen(cu)
    seen[("trusted", cu._version)] = None
    seen[("longest", cu._version)] = longest


def _longest(cu: torch.Tensor) -> int:
    seen = _seen(cu)
    key = ("longest", cu._version)
    if key not in seen:
        seen[key] = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return seen[key]


def validate_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                   where: str = "") -> None:
    """Check one block's q, k, v against ``spec`` (dense ``(b, s, h, d)`` or varlen ``(t, h, d)``)."""
    rank = 4 if spec.cu_seqlens_q is None else 3  # varlen: (t, h, d)
    if not _same_kind(q, k, v, rank):
        _kind_error(q, k, v, rank, spec, where)
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[:-1] != vs[:-1]:
        raise ValueError(f"{where}v must match k's shape {tuple(ks[:-1])} except head_dim, got {tuple(vs)}")
    if qs[-1] != ks[-1]:
        raise ValueError(f"{where}k head_dim must equal q's {qs[-1]}, got {ks[-1]}")
    h, h_kv = qs[-2], ks[-2]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"{where}k heads must divide q heads {h} (GQA/MQA), got {h_kv}")
    if spec.sinks is not None:
        check_sinks(spec.sinks, q, where)
    if spec.cu_seqlens_q is not None:  # spec.varlen
        validate_varlen(spec, qs[0], ks[0], where)
    elif qs[0] != ks[0]:
        raise ValueError(f"{where}k batch must equal q's {qs[0]}, got {ks[0]}")


def _same_kind(q, k, v, rank: int) -> bool:
    """q, k, v are tensors of ``rank`` dims, one floating dtype and one device (the usual case,
    checked in one expression; :func:`_kind_error` says what is wrong otherwise)."""
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(k, T) and isinstance(v, T)):
        return False
    dtype, device = q.dtype, q.device
    return (q.dim() == rank and k.dim() == rank and v.dim() == rank and dtype in _FLOATS and k.dtype == dtype
            and v.dtype == dtype and k.device == device and v.device == device)


def _kind_error(q, k, v, rank: int, spec: AttnSpec, where: str) -> None:
    """The ValueError for q, k, v that :func:`_same_kind` refused, naming the first bad tensor."""
    layout = "(total, h, d)" if spec.varlen else "(b, s, h, d)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{where}{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{where}{name} must be a floating dtype (fp16/bf16/fp32/fp64), got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{where}{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{where}{name} must be on q's device {q.device}, got {t.device}")
    raise AssertionError("_kind_error called on tensors _same_kind accepts")  # unreachable: the checks mirror it


def validate_varlen(spec: AttnSpec, total_q: int, total_k: int, where: str = "") -> None:
    """``spec``'s cu_seqlens and max_seqlen against packed tensors of ``total_q`` / ``total_k`` rows:
    their values are read once per tensor version (ringfa4's own are trusted), so a repeated call
    costs dictionary lookups."""
    validate_cu_seqlens(spec.cu_seqlens_q, "cu_seqlens_q", total_q, where)
    validate_cu_seqlens(spec.cu_seqlens_k, "cu_seqlens_k", total_k, where)
    if spec.cu_seqlens_q.numel() != spec.cu_seqlens_k.numel():
        raise ValueError(f"{where}cu_seqlens_k must have {spec.cu_seqlens_q.numel()} entries like "
                         f"cu_seqlens_q, got {spec.cu_seqlens_k.numel()}")
    for name, cu, mx in (("max_seqlen_q", spec.cu_seqlens_q, spec.max_seqlen_q),
                         ("max_seqlen_k", spec.cu_seqlens_k, spec.max_seqlen_k)):
        longest = _longest(cu)
        if mx < longest:
            raise ValueError(f"{where}{name} must be >= the longest document {longest}, got {mx}")
