"""Backend selection by name: ``reference``, ``sdpa``, ``fa4`` or ``auto``.

``auto`` picks fa4 on sm90/sm100-class CUDA devices when flash-attn-4 is installed, else sdpa on
CUDA, else reference. ``resolve("auto", device)`` says which one that is without importing it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

import torch

from .spec import BlockBackend

__all__ = ["available_backends", "fa4_installed", "get_backend", "resolve"]

NAMES = ("reference", "sdpa", "fa4")


@functools.cache
def fa4_installed() -> bool:
    """flash-attn-4 and CuTe DSL are installed (checked without importing them)."""
    try:
        importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("cutlass") is not None


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve(name: str = "auto", device: torch.device | str | None = None) -> str:
    """The concrete backend name ``name`` stands for on ``device``."""
    if name != "auto":
        if name not in NAMES:
            raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
        return name
    device = _device(device)
    if device.type != "cuda":
        return "reference"
    major, _ = torch.cuda.get_device_capability(device)
    if major in (9, 10) and fa4_installed():
        return "fa4"
    return "sdpa"


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device``."""
    device = _device(device)
    names = ["reference"]
    if device.type == "cuda":
        names.append("sdpa")
        if torch.cuda.get_device_capability(device)[0] in (9, 10) and fa4_installed():
            names.append("fa4")
    return names


@functools.cache
def _cached(name: str, options: tuple) -> BlockBackend:
    kwargs = dict(options)
    if name == "reference":
        from .reference import ReferenceBackend
        return ReferenceBackend(**kwargs)
    if name == "sdpa":
        from .sdpa import SdpaBackend
        return SdpaBackend(**kwargs)
    from .fa4 import Fa4Backend
    return Fa4Backend(**kwargs)


def get_backend(name: str | BlockBackend = "auto", device: torch.device | str | None = None,
                **options) -> BlockBackend:
    """The backend object for ``name`` (or ``name`` itself when it already is a backend).

    ``options`` go to the backend's constructor, e.g. ``get_backend("reference",
    compute_dtype=torch.float64)``.
    """
    if not isinstance(name, str):
        if not isinstance(name, BlockBackend):
            raise ValueError(f"backend must be a name or a BlockBackend, got {type(name).__name__}")
        return name
    return _cached(resolve(name, device), tuple(sorted(options.items())))
