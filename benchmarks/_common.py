"""Pieces the benchmark scripts share: rotating inputs and the timed step functions."""

from __future__ import annotations

import math
import statistics
import time

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


def cp_layers_step(cp, backward: bool, layers: int, causal: bool = True):
    """``layers`` calls of ``ringfa4.attention`` through ``cp`` chained as a model's layers chain them
    (each layer's queries are the previous layer's output; k, v shared), then one backward with
    ``do``: the host cost a layer pays inside a training step, where autograd's ``backward()`` entry
    and its device-thread hand-off come once a step, not once a layer as in :func:`cp_step`."""
    def run(q, k, v, do):
        if backward:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = q
        for _ in range(layers):
            out = ringfa4.attention(out, k, v, cp=cp, causal=causal)
        if backward:
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


class CudaOps:
    """What :func:`sustained_ms` does on the GPU: queue heavy work (bf16 GEMMs of 8192^3, calibrated
    once), flush L2 (zero 256 MiB, as triton's do_bench), time by CUDA events, wait."""

    def __init__(self) -> None:
        self.flush_buf = torch.empty(1 << 28, dtype=torch.int8, device="cuda")
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        for _ in range(3):
            torch.mm(self.a, self.a, out=self.c)
        start, end = self.event(), self.event()
        start.record()
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.c)
        end.record()
        end.synchronize()
        self.gemm_ms = start.elapsed_time(end) / 10

    def busy(self, ms: float) -> None:
        for _ in range(max(1, math.ceil(ms / self.gemm_ms))):
            torch.mm(self.a, self.a, out=self.c)

    def flush(self) -> None:
        self.flush_buf.zero_()

    @staticmethod
    def event():
        return torch.cuda.Event(enable_timing=True)

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return start.elapsed_time(end)

    @staticmethod
    def sync() -> None:
        torch.cuda.synchronize()


def sustained_ms(fns: dict, rounds: int = 3, reps: int = 3, preload_ms: float = 50.0, discard: int = 1,
                 ops=None, max_preload_ms: float = 1000.0) -> dict:
    """GPU times (ms) of several no-argument calls, each timed while the GPU is already under load,
    as in a training step: a batch queues heavy GEMMs for at least ``preload_ms`` and twice the
    host's time to enqueue all the calls (so the host is ahead and the clocks are the loaded ones),
    then every call back to back, each behind an L2 flush, between CUDA events; ``reps`` batches a
    round, ``rounds`` rounds after ``discard`` thrown away, the order reversed every other round and
    rotated every batch (no call always first). Timed alone after an idle GPU, a short call can run
    at a cool GPU's clocks while a long one settles lower (the ranks of a simulated ring, tens of ms,
    against one call over the whole sequence, hundreds). The host's time to enqueue each call is
    taken apart, once compiled: the median of 3 calls each started on an idle GPU (inside a batch the
    host may wait for a full launch queue, which is no host time of the call's). Returns ``{name:
    {"ms": median over rounds, "rounds": [per-round median over its batches], "host_ms": ...}}`` and
    ``"_exposed"``: the host's time for a batch over its preload where ``max_preload_ms`` capped it
    (the GPU may have waited there), else None. ``ops``: :class:`CudaOps` unless given."""
    ops = ops or CudaOps()
    names = list(fns)
    for name in names:  # compiles and lazy set-up, outside everything timed
        fns[name]()
    host = {}
    for name in names:
        times = []
        for _ in range(3):
            ops.sync()
            t = time.perf_counter()
            fns[name]()
            times.append((time.perf_counter() - t) * 1e3)
        host[name] = statistics.median(times)
    ops.sync()
    need = sum(host.values())
    load = min(max(preload_ms, 2 * need), max_preload_ms)
    out: dict = {name: {"rounds": [], "host_ms": host[name]} for name in names}
    for k in range(discard + rounds):
        per: dict = {name: [] for name in names}
        for b in range(reps):
            order = list(reversed(names)) if k % 2 else list(names)
            order = order[b % len(order):] + order[:b % len(order)]
            ops.busy(load)
            marks = []
            for name in order:
                ops.flush()
                start, end = ops.event(), ops.event()
                start.record()
                fns[name]()
                end.record()
                marks.append((name, start, end))
            ops.sync()
            for name, start, end in marks:
                per[name].append(ops.elapsed_ms(start, end))
        if k >= discard:
            for name in names:
                out[name]["rounds"].append(statistics.median(per[name]))
    for v in out.values():
        v["ms"] = statistics.median(v["rounds"])
    out["_exposed"] = need / load if need > load else None
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


def bits_against(plain, other, S: int, said_of: str, seeds: int = 3, h: int = 8, d: int = 128
                 ) -> tuple[list[list[bool]], list[str]]:
    """Group ``other`` against ``plain`` (the same ranks, another RingOptions), distributed: ``seeds``
    calls of new bf16 inputs (``S`` tokens, ``h`` heads of ``d``), forward and backward with the
    deterministic block backward. Per call whether out, lse, dq, dk, dv are bit-identical, and the
    warnings that mention ``said_of`` (a mode that fell back says so)."""
    import warnings

    same, said = [], []
    for seed in range(seeds):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, do = (torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        results = []
        for cp in (plain, other):
            ql, kl, vl = (cp.shard(t).detach().clone().requires_grad_() for t in (q, k, v))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out, lse = ringfa4.attention(ql, kl, vl, cp=cp, causal=True, return_lse=True, deterministic=True)
                out.backward(cp.shard(do).contiguous())
            said += [str(w.message) for w in caught if said_of in str(w.message)]
            results.append([out.detach(), lse, ql.grad, kl.grad, vl.grad])
        same.append([torch.equal(a, b) for a, b in zip(*results)])
    return same, said


def graphs_against_eager(eager, graphed, S: int, seeds: int = 3, h: int = 8, d: int = 128) -> dict:
    """``graphed`` (a ``RingOptions(cuda_graphs=True)`` group) against ``eager`` (:func:`bits_against`;
    the first call captures, the others replay). Returns per call whether out, lse, dq, dk, dv are
    bit-identical (``same``), the cuda_graphs warnings of calls that fell back (``fell_back``) and
    whether both keys were captured (``captured``)."""
    same, fell_back = bits_against(eager, graphed, S, "cuda_graphs", seeds, h, d)
    keys = graphed.graphs.captured if graphed.graphs is not None else {}
    captured = len(keys) == 2 and all(keys.values())
    return {"same": same, "fell_back": fell_back, "captured": captured}
