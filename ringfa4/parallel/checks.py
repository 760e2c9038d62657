"""Validation of a CP attention call: local checks, then one small metadata all-gather so every rank
raises the same ValueError before any data moves (shapes, dtype, device type, spec, layout, the
Ulysses degree, the pack, every option, the call's sequence number). The same exchange checks the
CP plan before a subgroup is made and the cu_seqlens of ``cp.pack`` (first differing boundary
named). Failures mid-call go through the error channel (:mod:`.errors`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..kernels import AttnSpec
from ..kernels.validate import validate_block
from ..options import RingOptions
from .layouts import Layout

__all__ = ["CPGroup", "CallShape", "call_key", "check_local", "check_plan", "exchange_and_check", "gather_ints",
           "gather_text", "check_cu_seqlens"]

_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_OPTION_FIELDS = tuple(f"options.{n}" for n in RingOptions.field_names())
_DEVICES = ("cpu", "cuda", "meta", "xpu", "mps")
_FIELDS = ("call number", "q.shape", "k.shape", "v.shape", "dtype", "device type", "causal", "window", "softcap",
           "softmax_scale", "layout", "ulysses degree", "packing (cu_seqlens and mode fingerprint)") + _OPTION_FIELDS


@dataclass(frozen=True)
class CallShape:
    """What the cross-rank check compares of one call's tensors: q, k, v shapes as the whole CP
    group sees them (dense ``(b, s_local, h, d)``; packed: ``(1, total, h, d)``), q's dtype and
    device. ``dense``: the ranks' local lengths may differ (any sequence length): the check sums
    them into the sequence length and expects each rank to hold the layout's part of it."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    dense: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_total: int | None = None) -> CallShape:
        """Dense tensors as they are; packed ``(t, h, d)`` ones as ``(1, packed_total, h, d)``."""
        if packed_total is None:
            return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, True)
        return cls(*((1, packed_total) + tuple(t.shape[1:]) for t in (q, k, v)), q.dtype, q.device)


def check_local(q, k, v, spec: AttnSpec, layout: Layout, where: str, seq_len: int) -> str | None:
    """Local checks of one rank's dense inputs standing for a ``seq_len``-token sequence; the
    error message, or None."""
    try:
        validate_block(q, k, v, spec, where)  # any sequence length: the layout cuts it (unevenly if need be)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"{where}k sequence length must equal q's {q.shape[1]} under CP, got {k.shape[1]}")
    except ValueError as exc:
        return str(exc)
    return None


def _f64_bits(x: float | None) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _device_code(device: torch.device) -> int:
    return _DEVICES.index(device.type) + 1 if device.type in _DEVICES else 0


def _meta(call: int, shape: CallShape, spec: AttnSpec, layout: Layout, packing: int, options: RingOptions
          ) -> list[int]:
    w = [-1 if x is None else x for x in spec.window]
    return [call, *shape.q, *shape.k, *shape.v, _DTYPES.get(shape.dtype, 0), _device_code(shape.device),
            int(spec.causal), *w,
            _f64_bits(spec.softcap), _f64_bits(spec.softmax_scale), layout.ring_layout.chunks_per_rank,
            layout.ulysses, packing, *options.encode()]


# values of each of _FIELDS in the metadata vector
_FIELD_SIZES = (1, 4, 4, 4, 1, 1, 1, 2, 1, 1, 1, 1, 1) + (1,) * len(_OPTION_FIELDS)


def _field_slices():
    out, at = [], 0
    for name, n in zip(_FIELDS, _FIELD_SIZES, strict=True):
        out.append((name, slice(at, at + n)))
        at += n
    return out


_FIELD_SLICES = _field_slices()
_DIM1 = tuple(sl.start + 1 for name, sl in _FIELD_SLICES if name.endswith(".shape"))  # q, k, v's dim 1


def _agrees(row: list[int], first: list[int], length: int) -> bool:
    """Whether a rank's metadata ``row`` (after the error flag and epoch) is rank 0's with q, k and
    v's dim 1 equal to ``length`` (what the field by field comparison below accepts)."""
    want = first[2:]
    for i in _DIM1:
        want[i] = length
    return row[2:] == want


def _describe(name: str, vals: list[int]):
    if name.endswith("shape"):
        return tuple(vals)
    if name == "device type":
        return _DEVICES[vals[0] - 1] if 0 < vals[0] <= len(_DEVICES) else "unknown"
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

    comm: Any
    rank: int
    world_size: int
    layout: Layout
    options: RingOptions


def call_key(cp: CPGroup, shape: CallShape, spec: AttnSpec, packing: int, epoch: int) -> tuple[int, ...]:
    """What :func:`exchange_and_check` compares of this rank's call, without the call number, and
    the rank's ``epoch`` (grows with every failed call): equal keys on consecutive calls mean the
    ranks agreed on it already (``RingOptions(metadata_check="new_shapes")`` skips the exchange)."""
    return (epoch, *_meta(0, shape, spec, cp.layout, packing, cp.options))


def gather_ints(comm, call: int, values: list[int], what: str) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank) through one all-gather on
    ``comm``'s control group, watched by its error channel: ``rows[r]`` is rank r's."""
    group, world = comm.control, comm.world_size  # a gloo group: CPU tensors, off the GPU queue
    mine = torch.tensor(values, dtype=torch.int64)
    every = torch.empty(world * len(values), dtype=torch.int64)
    work = dist.all_gather_into_tensor(every, mine, group=group, async_op=True)
    comm.channel.wait(work, call, what, gloo=True)
    return every.view(world, len(values)).tolist()


_TEXT_BYTES = 2048


def gather_text(comm, call: int, text: str) -> list[str]:
    """Every rank's ``text`` (utf-8, cut to 2 KiB) through one fixed-size all-gather."""
    raw = list(text.encode()[:_TEXT_BYTES])
    rows = gather_ints(comm, call, [len(raw)] + raw + [0] * (_TEXT_BYTES - len(raw)), "the error-text all-gather")
    return [bytes(row[1:1 + row[0]]).decode(errors="replace") for row in rows]


def _agree_on_errors(comm, call: int, error: str | None, failed: list[int]) -> None:
    """Raise the first failing rank's message (the same ValueError on every rank)."""
    if failed:
        first = failed[0]
        message = gather_text(comm, call, error or "")[first]
        raise ValueError(message if message.startswith(f"rank {first}") else f"rank {first}: {message}")


def exchange_and_check(cp: CPGroup, error: str | None, shape: CallShape, spec: AttnSpec, packing: int = 0,
                       epoch: int = 0, announce: bool = False) -> int:
    """All-gather a fixed-size metadata vector (an error flag, this rank's ``epoch`` and the call's
    shapes, spec, layout, pack and every field of ``cp.options``) over the control group; raise
    the same ValueError on every rank if any rank failed its local checks or the ranks disagree.
    Returns the largest epoch of any rank (the group renews its data groups when it grew), also
    when it raises (``cp.comm.agreed_epoch``). ``announce``: say so in the error channel first
    (:meth:`.errors.Channel.announce_check`: peers that skip the check see it from their waits)."""
    comm = cp.comm
    call = comm.channel.next_call()
    if announce:
        comm.channel.announce_check(call)
    n = sum(_FIELD_SIZES)
    meta = [1 if error else 0, epoch] + ([0] * n if error else _meta(call, shape, spec, cp.layout, packing,
                                                                      cp.options))
    rows = gather_ints(comm, call, meta, "the metadata all-gather")
    comm.agreed_epoch = max(r[1] for r in rows)
    _agree_on_errors(comm, call, error, [r for r in range(cp.world_size) if rows[r][0]])
    calls = [r[2] for r in rows]
    if len(set(calls)) > 1:  # a rank skipped a call: resynchronise the numbers, then say so
        comm.channel.resync(max(calls))
    comm.agreed_seq_len = None
    lengths = [r[4] for r in rows]  # each rank's q.shape[1] (after the error flag, epoch, call number, b)
    if shape is not None and shape.dense:  # any length: each rank must hold the layout's part of their sum
        comm.agreed_seq_len = sum(lengths)
        lengths = cp.layout.all_rows(comm.agreed_seq_len)
    if all(_agrees(rows[r], rows[0], lengths[r]) for r in range(cp.world_size)):
        return comm.agreed_epoch  # the usual case, one list compare a rank; else name the first difference:
    for name, sl in _FIELD_SLICES:
        for r in range(0 if name.endswith(".shape") else 1, cp.world_size):  # rank 0's own length too
            ref = list(rows[0][2:][sl])
            if name.endswith(".shape"):  # a dense rank's own length as the layout gives it
                ref[1] = lengths[r]
            if rows[r][2:][sl] != ref:
                got, want = _describe(name, rows[r][2:][sl]), _describe(name, ref)
                why = ": a rank skipped or repeated a call" if name == "call number" else ""
                if name.endswith(".shape") and comm.agreed_seq_len is not None and got[1] != want[1]:
                    why = (f"; dim 1: rank {r}'s part of the {comm.agreed_seq_len}-token sequence the ranks' "
                           "lengths sum to (cp.shard gives each rank its part)")
                raise ValueError(f"rank {r}: {name} is {got}, expected {want} as on rank 0 (all CP ranks must agree)"
                                 + why)
    return comm.agreed_epoch


_PLAN_FIELDS = ("CP world size", "ulysses degree", "layout") + _OPTION_FIELDS


def check_plan(comm, world: int, ulysses: int, layout_code: int, options: RingOptions, error: str | None) -> None:
    """Before any subgroup is made: every rank's (world size, Ulysses degree, layout, options) and
    local construction error; the same ValueError on every rank when one failed or they differ."""
    call = comm.channel.next_call()
    rows = gather_ints(comm, call, [1 if error else 0, world, ulysses, layout_code, *options.encode()],
                       "the CP plan all-gather")
    _agree_on_errors(comm, call, error, [r for r in range(comm.world_size) if rows[r][0]])
    for i, name in enumerate(_PLAN_FIELDS):
        ref = rows[0][1 + i]
        for r in range(1, comm.world_size):
            if rows[r][1 + i] != ref:
                got, want = rows[r][1 + i], ref
                if name.startswith("options."):
                    got, want = (RingOptions.decode_field(name.removeprefix("options."), x) for x in (got, want))
                elif name == "layout":
                    got, want = (_describe("layout", [x]) for x in (got, want))
                raise ValueError(f"rank {r}: {name} is {got}, expected {want} as on rank 0 (all CP ranks must agree; "
                                 f"checked before any subgroup is created)")


def check_cu_seqlens(comm, cu: list[int] | None, error: str | None) -> None:
    """``cp.pack``'s cu_seqlens on every rank: the same ValueError everywhere when one rank's are
    malformed (naming it) or they differ (naming the first differing boundary)."""
    call = comm.channel.next_call()
    n = -1 if cu is None else len(cu)
    rows = gather_ints(comm, call, [1 if error else 0, n], "the cu_seqlens all-gather")
    _agree_on_errors(comm, call, error, [r for r in range(comm.world_size) if rows[r][0]])
    sizes = [r[1] for r in rows]
    longest = max(sizes)
    every = gather_ints(comm, call, list(cu) + [-1] * (longest - len(cu)), "the cu_seqlens all-gather")
    for r in range(1, comm.world_size):
        if every[r] != every[0]:
            i = next(j for j in range(longest) if every[r][j] != every[0][j])
            got, want = every[r][i], every[0][i]
            raise ValueError(f"rank {r}: cu_seqlens[{i}] is {'missing' if got == -1 else got}, expected "
                             f"{'missing' if want == -1 else want} as on rank 0 (cu_seqlens has {sizes[r]} entries "
                             f"there, {sizes[0]} on rank 0; all CP ranks must pack the same batch)")
