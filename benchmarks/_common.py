"""Pieces the benchmark scripts share: rotating inputs and the timed step functions."""

from __future__ import annotations

import ringfa4


def rotating(fn, sets):
    """A no-argument callable that runs ``fn(*inputs)`` on the next input set each call (so timing
    loops don't measure the L2 cache)."""
    state = {"i": 0}

    def call():
        fn(*sets[state["i"] % len(sets)])
        state["i"] += 1
    return call


def full_call(backend, spec, backward: bool):
    """One block-backend call on the whole sequence (forward, and backward when asked)."""
    def run(q, k, v, do):
        o, l = backend.forward(q, k, v, spec)
        if backward:
            backend.backward(do, q, k, v, o, l, spec)
    return run


def cp_step(cp, backward: bool, packing=None, causal: bool = True):
    """``ringfa4.attention`` through ``cp`` (forward, and backward with ``do`` when asked)."""
    def run(q, k, v, do):
        if backward:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = ringfa4.attention(q, k, v, cp=cp, causal=causal, packing=packing)
        if backward:
            out.backward(do)
    return run


def median_ms(fn, sets, rep: int = 200) -> float:
    """Median time (ms) of ``fn`` over rotating input ``sets``, by ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return do_bench(rotating(fn, sets), warmup=10, rep=rep, return_mode="median")
