"""Per-instance memoization for the pure schedule objects (``functools.lru_cache`` on a method
shares one cache across all instances: it evicts across packs and keeps dead ones alive)."""

from __future__ import annotations

import functools

__all__ = ["ViewMemo", "cached_method", "numbered"]

_MISSING = object()


def cached_method(fn):
    """Cache ``fn(self, *args)`` in ``self`` (hashable args); works on frozen dataclasses."""
    name = f"_cache_{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(self, *args):
        cache = self.__dict__.get(name)
        if cache is None:
            cache = {}
            object.__setattr__(self, name, cache)
        got = cache.get(args, _MISSING)
        if got is _MISSING:
            got = cache[args] = fn(self, *args)
        return got

    return wrapper


class ViewMemo:
    """Views made once per executor call: a ring step reads the same few views of the same
    buffers again and again (a rank's held K/V, its head groups, a block's rows), and making a
    view costs a microsecond or two of host time. ``get(bases, key, make, *args)`` returns
    ``make(*args)`` the first time for these base tensor objects and ``key``, the same result after.
    Results are found by the bases' ids; the memo keeps every base it saw alive, so no other object
    can take one of those ids while it lives: make one per call, never longer (it would keep that
    call's buffers). Only views: a travelling buffer's contents change every hop, so nothing that
    copies or derives values from them (a backend's backward state does) may be kept here."""

    __slots__ = ("_got", "_alive")

    def __init__(self) -> None:
        self._got: dict[tuple, object] = {}
        self._alive: list[tuple] = []

    def get(self, bases: tuple, key, make, *args):
        slot = (*map(id, bases), key)
        got = self._got.get(slot, _MISSING)
        if got is _MISSING:
            self._alive.append(bases)
            got = self._got[slot] = make(*args)
        return got


def numbered(items: list) -> list[int]:
    """Each (hashable) item as a small int, equal for equal items, in order of first sight: a key
    that hashes one int instead of shapes, strides and devices."""
    seen: dict = {}
    return [seen.setdefault(x, len(seen)) for x in items]
