"""Validation of a CP attention call: local checks, then one small metadata all-gather so every rank
raises the same ValueError before any data moves. Failures mid-call are posted to the rendezvous
store so peers waiting on a hop can say which rank failed and why."""

from __future__ import annotations

import datetime
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..kernels import AttnSpec
from ..kernels.validate import validate_block
from ..options import RingOptions
from .layouts import Layout

__all__ = ["CPGroup", "CallShape", "check_local", "exchange_and_check", "peer_failure", "post_error"]

_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_OPTION_FIELDS = tuple(f"options.{n}" for n in RingOptions.field_names())
_FIELDS = ("q.shape", "k.shape", "v.shape", "dtype", "causal", "window", "softcap", "softmax_scale", "layout",
           "ulysses degree", "packing (cu_seqlens fingerprint)") + _OPTION_FIELDS
_ERROR_KEY = "ringfa4/error"


@dataclass(frozen=True)
class CallShape:
    """What the cross-rank check compares of one call's tensors: q, k, v shapes as the whole CP
    group sees them (dense ``(b, s_local, h, d)``; packed: ``(1, total, h, d)``), q's dtype and
    device."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_total: int | None = None) -> CallShape:
        """Dense tensors as they are; packed ``(t, h, d)`` ones as ``(1, packed_total, h, d)``."""
        if packed_total is None:
            return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device)
        return cls(*((1, packed_total) + tuple(t.shape[1:]) for t in (q, k, v)), q.dtype, q.device)


def check_local(q, k, v, spec: AttnSpec, layout: Layout, where: str, seq_len: int) -> str | None:
    """Local checks of one rank's dense inputs standing for a ``seq_len``-token sequence; the
    error message, or None."""
    try:
        validate_block(q, k, v, spec, where)
        what = (f"q sequence length (local {q.shape[1]} x {layout.world_size} ranks)" if seq_len != q.shape[1]
                else "q sequence length")
        layout.check_seq_len(seq_len, what, where)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"{where}k sequence length must equal q's {q.shape[1]} under CP, got {k.shape[1]}")
    except ValueError as exc:
        return str(exc)
    return None


def _f64_bits(x: float | None) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _meta(shape: CallShape, spec: AttnSpec, layout: Layout, packing: int, options: RingOptions) -> list[int]:
    w = [-1 if x is None else x for x in spec.window]
    return [*shape.q, *shape.k, *shape.v, _DTYPES.get(shape.dtype, 0), int(spec.causal), *w,
            _f64_bits(spec.softcap), _f64_bits(spec.softmax_scale), layout.ring_layout.chunks_per_rank,
            layout.ulysses, packing, *options.encode()]


# values of each of _FIELDS in the metadata vector
_FIELD_SIZES = (4, 4, 4, 1, 1, 2, 1, 1, 1, 1, 1) + (1,) * len(_OPTION_FIELDS)


def _field_slices():
    out, at = [], 0
    for name, n in zip(_FIELDS, _FIELD_SIZES, strict=True):
        out.append((name, slice(at, at + n)))
        at += n
    return out


def _describe(name: str, vals: list[int]):
    if name.endswith("shape"):
        return tuple(vals)
    if name == "dtype":
        return {c: d for d, c in _DTYPES.items()}.get(vals[0], "unsupported")
    if name == "window":
        return tuple(None if x == -1 else x for x in vals)
    if name in ("softcap", "softmax_scale"):
        return None if vals[0] == -1 else struct.unpack("<d", struct.pack("<q", vals[0]))[0]
    if name == "causal":
        return bool(vals[0])
    if name.startswith("options."):
        return RingOptions.decode_field(name.removeprefix("options."), vals[0])
    return {1: "contiguous", 2: "zigzag"}.get(vals[0], vals[0]) if name == "layout" else vals[0]


class CPGroup(Protocol):
    """What the check needs of a context-parallel group (``ContextParallel`` has it)."""

    group: Any
    rank: int
    world_size: int
    layout: Layout
    timeout: datetime.timedelta
    options: RingOptions


def exchange_and_check(cp: CPGroup, error: str | None, shape: CallShape, spec: AttnSpec, packing: int = 0) -> None:
    """All-gather a fixed-size metadata vector (and an error flag) over ``cp.group``; raise the same
    ValueError on every rank if any rank failed its local checks or the ranks disagree (shapes,
    spec, layout, pack, and every field of ``cp.options``; each collective waits at most
    ``cp.timeout``)."""
    group, rank, world, layout, timeout = cp.group, cp.rank, cp.world_size, cp.layout, cp.timeout
    n = 1 + sum(_FIELD_SIZES)
    payload = None if error else _meta(shape, spec, layout, packing, cp.options)
    meta = [1 if error else 0] + ([0] * (n - 1) if error else payload)
    use_cuda = dist.get_backend(group) == "nccl"
    device = shape.device if (use_cuda and shape.device.type == "cuda") else (
        torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"))
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    every = torch.empty(world * n, dtype=torch.int64, device=device)
    gather = dist.all_gather_into_tensor
    work = gather(every, mine, group=group, async_op=True)
    try:
        work.wait(timeout)
    except Exception as exc:
        raise peer_failure(rank, None, exc, "the metadata all-gather") from exc
    rows = every.view(world, n).tolist()
    failed = [r for r in range(world) if rows[r][0]]
    if failed:
        first = failed[0]
        message = _gather_text(group, world, error or "", device, timeout)[first]
        raise ValueError(message if message.startswith(f"rank {first}") else f"rank {first}: {message}")
    for name, sl in _field_slices():
        ref = rows[0][1:][sl]
        for r in range(1, world):
            if rows[r][1:][sl] != ref:
                raise ValueError(f"rank {r}: {name} is {_describe(name, rows[r][1:][sl])}, expected "
                                 f"{_describe(name, ref)} as on rank 0 (all CP ranks must agree)")


_TEXT_BYTES = 2048


def _gather_text(group, world: int, text: str, device, timeout: datetime.timedelta) -> list[str]:
    """Every rank's ``text`` (utf-8, cut to 2 KiB) through one fixed-size all-gather."""
    raw = text.encode()[:_TEXT_BYTES]
    mine = torch.zeros(_TEXT_BYTES + 4, dtype=torch.uint8)
    mine[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    mine[4:4 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    mine = mine.to(device)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    gather = dist.all_gather_into_tensor
    gather(every, mine, group=group, async_op=True).wait(timeout)
    out = []
    for row in every.view(world, -1).cpu().tolist():
        n = int.from_bytes(bytes(row[:4]), "little")
        out.append(bytes(row[4:4 + n]).decode(errors="replace"))
    return out


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group / no store
        return None


def post_error(rank: int, message: str) -> None:
    """Leave this rank's failure in the rendezvous store for peers that wait on it."""
    store = _store()
    if store is not None:
        try:
            store.set(_ERROR_KEY, f"rank {rank}: {message}")
        except Exception:  # best effort only: never mask the original error
            pass


def peer_failure(rank: int, peer: int | None, exc: BaseException, what: str = "a ring hop") -> RuntimeError:
    """The error a waiting rank raises: the first failure posted to the store, else the peer."""
    store = _store()
    posted = None
    if store is not None:
        try:
            if store.check([_ERROR_KEY]):
                posted = store.get(_ERROR_KEY).decode()
        except Exception:
            posted = None
    if posted:
        return RuntimeError(f"rank {rank}: {what} failed because {posted}")
    who = "a peer" if peer is None else f"peer rank {peer}"
    return RuntimeError(f"rank {rank}: {what} failed or timed out waiting on {who}: {exc}")


