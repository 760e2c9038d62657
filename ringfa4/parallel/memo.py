"""Per-instance memoization for the pure schedule objects (``functools.lru_cache`` on a method
shares one cache across all instances: it evicts across packs and keeps dead ones alive)."""

from __future__ import annotations

import functools

__all__ = ["cached_method"]


def cached_method(fn):
    """Cache ``fn(self, *args)`` in ``self`` (hashable args); works on frozen dataclasses."""
    name = f"_cache_{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(self, *args):
        cache = self.__dict__.get(name)
        if cache is None:
            cache = {}
            object.__setattr__(self, name, cache)
        if args not in cache:
            cache[args] = fn(self, *args)
        return cache[args]

    return wrapper
