"""``RingOptions``: every algorithm choice of a context-parallel call, in one frozen dataclass.

    cp = ringfa4.ContextParallel(options=ringfa4.RingOptions(bwd_ring="q", timeout_s=60))

A ``ContextParallel`` holds one; the metadata check compares it whole across ranks (a rank with
other options gets the same ValueError on every rank, naming the field), and it is part of the key
of every cache that depends on it. Defaults are the measured best on the H200 (see
docs/options.md for the measurements behind each). What a backend can or cannot do on a GPU
generation (e.g. FA4's sm100 fp32-output forward has not run on a GPU yet) is a property of the
backend, not an option: an option asks for a path *where the backend offers it*.

This module is the only code of ringfa4 that reads ``RINGFA4_*`` environment variables:
:meth:`RingOptions.from_env` (for benchmarks and quick experiments) and :func:`warn_ignored_env`,
which tells a user once that a variable they set no longer steers the library.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ENV_FIELDS", "RingOptions", "warn_ignored_env"]

_BWD_RINGS = ("auto", "kv", "q")
_WIRES = ("fp32", "input")
_MERGE_KERNELS = ("auto", "cute", "triton", "torch")
_CHECKS = ("every_call", "new_shapes")
_TAPES = ("auto", "on", "off")


@dataclass(frozen=True)
class RingOptions:
    """The choices of a CP call (all ranks must agree; compared by the metadata check).

    fp32_partials: ring blocks hand back fp32 outputs (no rounding to q's dtype between steps)
        where the backend writes them (FA4 on sm90; CPU reference in its compute dtype).
    fp32_grads: ring backwards keep every block's dq / dk / dv in fp32 through the backend's
        accumulating backward where it offers one (FA4 on sm90, the reference backend).
    epilogue_merge: fp32 ring forwards merge each block inside the attention kernel's epilogue
        where the backend offers it (FA4 on sm90), instead of a block output plus a merge kernel.
    bwd_ring: what travels in the ring backward: ``"auto"`` (the side that moves fewer bytes a
        hop), ``"kv"`` (K/V with dK/dV) or ``"q"`` (the q side with dq, where the backend can).
    dkv_groups: head groups the travelling gradient accumulators move in (>= 1; 2 hides one
        group's hop behind the other's blocks where the kernels add in place).
    dkv_wire: dtype dK/dV accumulate and travel in: ``"fp32"`` or ``"input"`` (k's dtype: half
        the bytes, one rounding a hop).
    merge_kernel: the online-softmax merge: ``"auto"`` (CuTe DSL, else Triton, else torch),
        ``"cute"``, ``"triton"`` or ``"torch"``.
    timeout_s: seconds any collective or ring hop may wait (> 0).
    nvlink_domain: GPUs per NVLink domain for the (Ulysses, ring) planner; None: detected.
    cuda_graphs: capture each ring forward and backward once per call key (shapes, spec, options)
        and replay it, hops included (:mod:`ringfa4.parallel.ring.graphs`: simulated or over NCCL;
        packed documents once the same pack comes again; other calls run eagerly and say why once).
    launch_tapes: record each ring forward and backward once per call key and replay its launches
        eagerly, without the executor's Python (:mod:`ringfa4.parallel.ring.tapes`): ``"auto"``
        (CUDA calls whose backend and hops are recorded: the simulated executor; a real rank's hops
        are not yet), ``"on"`` (CPU calls too; says once why a call is not taped) or ``"off"``.
        Ignored where ``cuda_graphs`` captures the call.
    launch_tape_mib: the most scratch (MiB) the tapes of one ``ContextParallel`` keep between calls
        together (K/V buffers, accumulators, backward state; the least recently replayed go first); a
        call whose own scratch is over it runs untaped (>= 0).
    metadata_check: when the ranks of a distributed group compare a call's metadata (one small gloo
        all-gather on the control group, a few hundred us of host time): ``"every_call"`` (a bad
        input on any rank is the same ValueError on every rank before any data moves), or
        ``"new_shapes"``: only when this rank's call key (shapes, dtype, spec, layout, pack,
        options, failures since) differs from the last one the ranks agreed on, so a model's
        layers check once per batch, not once each. A rank whose input alone changed while the
        others repeat the last key still gets the same ValueError on every rank within about a
        second (through the error channel), but after the others' data started to move: on
        NCCL the communicators are then aborted (docs/options.md).
    """

    fp32_partials: bool = True
    fp32_grads: bool = True
    epilogue_merge: bool = True
    bwd_ring: str = "auto"
    dkv_groups: int = 2
    dkv_wire: str = "fp32"
    merge_kernel: str = "auto"
    timeout_s: float = 300.0
    nvlink_domain: int | None = None
    cuda_graphs: bool = False
    metadata_check: str = "every_call"
    launch_tapes: str = "auto"
    launch_tape_mib: int = 4096

    def __post_init__(self) -> None:
        for name in ("fp32_partials", "fp32_grads", "epilogue_merge", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RingOptions.{name} must be True or False, got {getattr(self, name)!r}")
        for name, allowed in (("bwd_ring", _BWD_RINGS), ("dkv_wire", _WIRES), ("merge_kernel", _MERGE_KERNELS),
                              ("metadata_check", _CHECKS), ("launch_tapes", _TAPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RingOptions.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if isinstance(self.dkv_groups, bool) or not isinstance(self.dkv_groups, int) or self.dkv_groups < 1:
            raise ValueError(f"RingOptions.dkv_groups must be an int >= 1, got {self.dkv_groups!r}")
        m = self.launch_tape_mib
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"RingOptions.launch_tape_mib must be an int >= 0, got {m!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"RingOptions.timeout_s must be a finite number of seconds > 0, got {t!r}")
        d = self.nvlink_domain
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"RingOptions.nvlink_domain must be None or an int >= 1, got {d!r}")

    def replace(self, **changes: Any) -> RingOptions:
        """A copy with ``changes`` (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @property
    def dkv_wire_fp32(self) -> bool:
        return self.dkv_wire == "fp32"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "RingOptions") -> RingOptions:
        """From a config table (e.g. the recipe's ``[cp]``): unknown keys are a ValueError naming
        them and the known fields."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: RingOptions | None = None) -> RingOptions:
        """``base`` (default: the defaults) with the ``RINGFA4_*`` variables of ``environ``
        (default ``os.environ``) applied; for benchmarks and quick experiments. Names and values:
        :data:`ENV_FIELDS`. A bad value is a ValueError naming the variable."""
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for var, (name, parse) in ENV_FIELDS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                changes[name] = parse(raw)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
        out = base or cls()
        try:
            return out.replace(**changes)
        except ValueError as exc:
            bad = next((v for v, (n, _) in ENV_FIELDS.items() if f"RingOptions.{n} " in str(exc)), None)
            raise ValueError(f"{bad}: {exc}" if bad else str(exc)) from None

    def encode(self) -> list[int]:
        """One int per field (the metadata check's vector; :meth:`decode_field` reads one back),
        computed once per options object (every distributed call encodes its options)."""
        got = self.__dict__.get("_encoded")
        if got is None:
            got = tuple(self._encode())
            object.__setattr__(self, "_encoded", got)  # (not a field: equality, hash and replace ignore it)
        return list(got)

    def _encode(self) -> list[int]:
        out = []
        for f in fields(self):
            x = getattr(self, f.name)
            if isinstance(x, bool):
                out.append(int(x))
            elif isinstance(x, str):
                out.append(_CHOICES[f.name].index(x))
            elif x is None:
                out.append(-1)
            elif isinstance(x, float):
                out.append(struct.unpack("<q", struct.pack("<d", x))[0])
            else:
                out.append(int(x))
        return out

    @classmethod
    def decode_field(cls, name: str, code: int) -> Any:
        """The value :meth:`encode` wrote as ``code`` for field ``name``."""
        default = getattr(cls(), name)
        if name in _CHOICES:
            return _CHOICES[name][code] if 0 <= code < len(_CHOICES[name]) else code
        if isinstance(default, bool):
            return bool(code)
        if name == "timeout_s":
            return struct.unpack("<d", struct.pack("<q", code))[0]
        return None if code == -1 else code

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


_CHOICES = {"bwd_ring": _BWD_RINGS, "dkv_wire": _WIRES, "merge_kernel": _MERGE_KERNELS, "metadata_check": _CHECKS,
            "launch_tapes": _TAPES}


def _flag(auto_is: bool):
    def parse(raw: str) -> bool:
        if raw in ("1", "0"):
            return raw == "1"
        if raw == "auto":
            return auto_is
        raise ValueError("must be 0, 1 or auto")
    return parse


def _count(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("must be an int >= 1")
    return int(raw)


def _size(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("must be an int >= 0")
    return int(raw)


ENV_FIELDS: dict[str, tuple[str, Any]] = {
    "RINGFA4_FP32_PARTIALS": ("fp32_partials", _flag(True)),
    "RINGFA4_FP32_GRADS": ("fp32_grads", _flag(True)),
    "RINGFA4_EPILOGUE_MERGE": ("epilogue_merge", _flag(True)),
    "RINGFA4_BWD_RING": ("bwd_ring", str),
    "RINGFA4_DKV_GROUPS": ("dkv_groups", _count),
    "RINGFA4_DKV_WIRE": ("dkv_wire", str),
    "RINGFA4_MERGE": ("merge_kernel", str),
    "RINGFA4_TIMEOUT_S": ("timeout_s", float),
    "RINGFA4_NVLINK_DOMAIN": ("nvlink_domain", _count),
    "RINGFA4_CUDA_GRAPHS": ("cuda_graphs", _flag(False)),
    "RINGFA4_METADATA_CHECK": ("metadata_check", str),
    "RINGFA4_LAUNCH_TAPES": ("launch_tapes", str),
    "RINGFA4_LAUNCH_TAPE_MIB": ("launch_tape_mib", _size),
}
"""Each ``RINGFA4_*`` variable :meth:`RingOptions.from_env` reads: the field it sets and its parser."""

_REMOVED = {
    "RINGFA4_RING_SLOTS": "removed (the slot-combine forward lost to the epilogue merge; docs/experiments.md)",
    "RINGFA4_LOOPBACK_COPY": "removed (the simulated hops use plain device copies; docs/experiments.md)",
    "RINGFA4_FA4_PERSISTENT": "removed (a tried-and-dropped patch; docs/experiments.md)",
}

_warned: set[str] = set()


def warn_ignored_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn once per variable that a ``RINGFA4_*`` variable set in the environment no longer
    steers the library, naming the RingOptions field that replaced it; returns the variables
    warned about this call."""
    env = os.environ if environ is None else environ
    said = []
    for var in sorted(v for v in env if v.startswith("RINGFA4_")):
        if var in _warned:
            continue
        _warned.add(var)
        if var in ENV_FIELDS:
            field = ENV_FIELDS[var][0]
            msg = (f"{var} is set but no longer steers ringfa4: pass RingOptions({field}=...) to "
                   f"ContextParallel(options=...) (RingOptions.from_env() reads it for experiments)")
        else:
            msg = f"{var} is set but no longer steers ringfa4: {_REMOVED.get(var, 'not a ringfa4 setting')}"
        warnings.warn(msg, UserWarning, stacklevel=3)
        said.append(var)
    return said
