"""``eager_boundary``: keep a host-side kernel call out of ``torch.compile`` graphs without paying
``torch.compiler.disable``'s wrapper on every eager call.

``torch.compiler.disable`` wraps the function in Dynamo's frame-callback machinery, which costs
about 20 us of host time a call on the H200 machine even when nothing is being compiled; a ring
makes one such call per block. The boundary calls the function directly when no compile is tracing
(``torch.compiler.is_compiling()`` is False) and through its disabled twin when one is (a graph
break there, as before).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["eager_boundary"]

F = TypeVar("F", bound=Callable)


def eager_boundary(fn: F) -> F:
    """``fn``, run eagerly: directly, or through ``torch.compiler.disable(fn)`` while tracing."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
