"""Pieces the benchmark scripts share: rotating inputs and the timed step functions."""

from __future__ import annotations

import statistics

import torch

import ringfa4
from ringfa4.parallel.ring import calls, ring_backward, ring_forward


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


def cp_step(cp, backward: bool, packing=None, causal: bool = True, calling_thread: bool = False):
    """``ringfa4.attention`` through ``cp`` (forward, and backward with ``do`` when asked);
    ``calling_thread``: the backward runs on this thread (``set_multithreading_enabled(False)``)
    instead of autograd's per-device worker thread, where CUDA backwards run by default."""
    def run(q, k, v, do):
        if backward:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = ringfa4.attention(q, k, v, cp=cp, causal=causal, packing=packing)
        if backward:
            with torch.autograd.set_multithreading_enabled(not calling_thread):
                out.backward(do)
    return run


def median_ms(fn, sets, rep: int = 200) -> float:
    """Median time (ms) of ``fn`` over rotating input ``sets``, by ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return do_bench(rotating(fn, sets), warmup=10, rep=rep, return_mode="median")


def interleaved_ms(fns: dict, sets, rounds: int = 5, rep: int = 200, measure=None, discard: int = 1) -> dict:
    """Median times (ms) of several step functions timed in ``rounds`` alternating rounds (each
    round times every function once, ``rep`` ms of ``do_bench``, at least one call; odd rounds in
    reverse order, so neither always runs first), after
    ``discard`` rounds that are thrown away (the first calls of a step run colder: measured 10% on
    the H200), so a drift of the GPU's speed during the run (clocks, heat, a neighbour) moves them
    alike instead of biasing their ratio. Returns ``{name: {"ms": median over rounds, "rounds": [ms
    per round]}}``; ``ratio(out, a, b)`` gives the median over rounds of a / b.
    ``measure(fn, sets, rep)`` defaults to :func:`median_ms`."""
    measure = measure or median_ms
    out = {name: {"rounds": []} for name in fns}
    for k in range(discard + rounds):
        for name, fn in (reversed(fns.items()) if k % 2 else fns.items()):
            t = measure(fn, sets, rep)
            if k >= discard:
                out[name]["rounds"].append(t)
    for v in out.values():
        v["ms"] = statistics.median(v["rounds"])
    return out


def ratio(timed: dict, a: str, b: str) -> dict:
    """Median, min and max over the rounds of :func:`interleaved_ms` of time(a) / time(b)."""
    per = [x / y for x, y in zip(timed[a]["rounds"], timed[b]["rounds"], strict=True)]
    return {"median": statistics.median(per), "min": min(per), "max": max(per)}


def _shards(cp, cache: dict | None):
    """Per-rank views of an input set: made in the timed call (api level), or once per set (executor)."""
    def split(*ts):
        if cache is None:
            return [cp.comm.split(cp.layout, t, 1) for t in ts]
        key = tuple(t.data_ptr() for t in ts)
        if key not in cache:
            cache[key] = [cp.comm.split(cp.layout, t, 1) for t in ts]
        return cache[key]
    return split


def executor_step(cp, spec, backward):
    """What the simulated ranks run on their shards: the ring forward (and backward)."""
    split = _shards(cp, {})

    def run(q, k, v, do):
        qs, ks, vs, dos = split(q, k, v, do)
        ring = cp.run(q, spec)
        outs, lses = ring_forward(ring, qs, ks, vs)
        if backward:
            ring_backward(ring, dos, qs, ks, vs, outs, lses)
    return run


def calls_alone(cp, spec, be, backward, cache: dict | None = None):
    """The same blocks as the simulated ring, without merges or hops (outputs to one scratch)."""
    split = _shards(cp, cache)

    def run(q, k, v, do):
        qs, ks, vs, dos = split(q, k, v, do)
        ring = cp.run(q, spec)
        big = max(qs, key=lambda t: t.shape[1])  # uneven lengths: the largest rank's rows
        o_s = torch.empty_like(big)
        l_s = torch.empty(big.shape[0], big.shape[2], big.shape[1], device=q.device)
        for r in ring.ranks:
            for t in range(ring.active_steps):
                src = ring.schedule.source(r, t, ring.schedule.world_size)
                for b in ring.schedule.blocks(r, t):
                    calls.forward(be, b, qs[r], ks[src], vs[src], ring.spec, o_s, l_s)
                    if backward:
                        calls.backward(be, b, (dos[r], qs[r], ks[src], vs[src], o_s, l_s), ring.spec)
    return run


def graphs_against_eager(eager, graphed, S: int, seeds: int = 3, h: int = 8, d: int = 128) -> dict:
    """``graphed`` (a ``RingOptions(cuda_graphs=True)`` group) against ``eager`` (the same group
    eager), distributed: ``seeds`` calls of new bf16 inputs (``S`` tokens, ``h`` heads of ``d``; the
    first call captures, the others replay), forward and backward with the deterministic block
    backward. Returns per call whether out, lse, dq, dk, dv are bit-identical (``same``), the
    cuda_graphs warnings of calls that fell back (``fell_back``) and whether both keys were
    captured (``captured``)."""
    import warnings

    same, fell_back = [], []
    for seed in range(seeds):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, do = (torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        results = []
        for cp in (eager, graphed):
            ql, kl, vl = (cp.shard(t).detach().clone().requires_grad_() for t in (q, k, v))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out, lse = ringfa4.attention(ql, kl, vl, cp=cp, causal=True, return_lse=True, deterministic=True)
                out.backward(cp.shard(do).contiguous())
            fell_back += [str(w.message) for w in caught if "cuda_graphs" in str(w.message)]
            results.append([out.detach(), lse, ql.grad, kl.grad, vl.grad])
        same.append([torch.equal(a, b) for a, b in zip(*results)])
    keys = graphed.graphs.captured if graphed.graphs is not None else {}
    captured = len(keys) == 2 and all(keys.values())
    return {"same": same, "fell_back": fell_back, "captured": captured}
