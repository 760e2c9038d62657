"""Host cost of ring attention: the host microseconds one call takes to enqueue, per rank-step.

Method (the queued-sleep one): ``torch.cuda._sleep`` queues more GPU work than the call can take
on the host, then the host time of enqueueing one call behind it is read with ``perf_counter``;
the GPU is still busy with the sleep when the call returns, so the time is the host's alone. A
call whose host time reaches the queued work waited for the GPU somewhere: it is flagged
(``waited``). Median over ``--reps`` calls after warm-up. Per rank-step = the call's host time /
(P x the schedule's active steps): the simulated executor runs every rank's steps in this process.

Beside it, from the same run: the host time of a plain torch op, of upstream FA4's
``flash_attn_func`` forward and forward+backward, and of ``ringfa4.attention`` with ``cp=None``;
the kernel launches (kernels, copies, memsets the profiler sees) per rank-step; the efficiency at
the same shapes (one full-sequence call / the API call's wall time: ``ring_sim.py``'s api level,
which also splits and joins the simulated ranks' tensors) and ``of_calls_alone`` (the same ranks'
block calls alone, executor level / the API call); ``executor_us_per_rank_step``: the host time of
the ring forward / backward alone on already split shards (eager); ``inside_backward_us_per_rank_step``:
the part of a forward+backward call's host time spent inside the ring's autograd backward, which on CUDA
runs in autograd's device thread (the rest of the backward's share is the engine and the thread hand-off);
``calling_thread_us_per_rank_step``: the same forward+backward with its backward on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``), which tells the device thread's own cost apart;
``layers_us_per_rank_step``: a layer's share of ``layers`` calls chained as a model's layers are, with one
backward (``--layers``, as many as keep the launches within CUDA's queue): a training step pays autograd's
``backward()`` entry and its device-thread hand-off once, not once a layer (the baselines' "autograd alone"
rows: what that costs);
and with ``--profile`` the functions where one call's host time goes (cProfile, own and cumulative time,
top 50; ``inside_backward``: the same inside the autograd thread's ring backward; real-rank rows: their
top 25 by own time). The
median is the headline; the device's host is noisy, so the minimum is kept beside it.
Modes: ``eager`` is the defaults (since session 34 a key's calls after its second replay a launch
tape: ``RingOptions.launch_tapes``; ``tape_mib``: what the tapes keep), ``untaped`` the same with
``launch_tapes="off"`` (the executor's Python on every call). ``--graphs`` adds rows with
``RingOptions(cuda_graphs=True)`` (host time of a replay, its
efficiency, ``graph_mib``: the graphs' memory). ``--real-rank`` adds ``"path": "real-rank"`` rows (one
set per ``--metadata-check`` value): P spawned gloo ranks on this GPU, each a distributed
``ContextParallel`` with stub hops, so a rank pays what a real one pays on the host (its metadata check
over the gloo control group included, on every call or once per call key) but no NCCL
(:mod:`_real_rank`); rank 0's host time per rank-step; with ``--graphs`` also captured rows for the
stream-ordered (and ``nccl``) hops: a replay per call, watched as one wait. ``--peers stub``: rank 0
alone in this process, its peers a fake process group that agrees with every check (``"peers":
"stub"`` rows: a real rank's host path without P processes contending for one GPU and host).

    python benchmarks/host_cost.py [--tokens 4096,8192,32768] [--worlds 4,8] [--packed] [--graphs]
        [--real-rank] [--profile] [--out benchmarks/results/host_cost.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import time

import torch
from _common import calls_alone, cp_layers_step, cp_step, executor_step, full_call, interleaved_ms, median_ms, rotating

import ringfa4
from ringfa4 import RingOptions
from ringfa4.kernels import AttnSpec, get_backend, resolve
from ringfa4.parallel.ring.run import active_steps

H, HK, D = 32, 8, 128


def sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy about ``ms`` milliseconds."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 10_000_000
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return int(n * ms / start.elapsed_time(end))


def host_us(fn, cycles: int, queued_ms: float, reps: int, warm: int = 3) -> dict:
    """Median host microseconds of ``fn()`` enqueued behind ``cycles`` of queued GPU sleep;
    ``waited``: a call took as long as the queued work, so its times are not host times: it
    synchronized with the GPU, or it launched more than CUDA's launch queue holds behind the sleep
    (about a thousand launches; the packed all-gather mode's forward+backward does)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return {"us": statistics.median(times), "min_us": min(times), "waited": max(times) > 0.8e3 * queued_ms}


def launches(fn) -> int:
    """Kernels, copies and memsets one call of ``fn`` puts on the GPU (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def profile_top(fn, cycles: int, n: int = 50) -> dict:
    """cProfile of one call enqueued behind queued GPU work: the ``n`` functions with the most own
    time (``own``) and the most cumulative time (``cum``); ``inside_backward``: the same of a second
    call's ring backward (autograd's thread), profiled alone."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    torch.cuda.synchronize()
    # a second call for the backward's own profile: one profiler at a time (Python 3.12's cProfile is
    # process-wide, so the main thread's and the autograd thread's cannot both be on)
    torch.cuda._sleep(cycles)
    with InsideBackward(profile=True) as inside:
        fn()
    torch.cuda.synchronize()
    return {**_top(prof, n), "inside_backward": inside.top(n) if inside.us else None}


def _top(prof: cProfile.Profile, n: int) -> dict:
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, nc, tt, ct, _) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}:{name}", "calls": nc,
                     "own_us": tt * 1e6, "cum_us": ct * 1e6})
    return {"own": sorted(rows, key=lambda r: -r["own_us"])[:n], "cum": sorted(rows, key=lambda r: -r["cum_us"])[:n]}


class InsideBackward:
    """Host time spent inside the ring's autograd backward (``_RingAttention.backward``), which on
    CUDA runs in autograd's device thread: a main-thread cProfile sees only ``run_backward``. While
    entered, every backward call is timed (``us``: one entry a call); ``profile=True`` also
    cProfiles the calls there (:meth:`top`)."""

    def __init__(self, profile: bool = False) -> None:
        from ringfa4.parallel import context

        self.fn, self.us = context._RingAttention, []
        self.orig = self.fn.backward
        self.prof = cProfile.Profile() if profile else None

    def __enter__(self) -> InsideBackward:
        orig, us, prof = self.orig, self.us, self.prof

        def timed(ctx, *grads):
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            try:
                return orig(ctx, *grads)
            finally:
                if prof is not None:
                    prof.disable()
                us.append((time.perf_counter() - t0) * 1e6)
        self.fn.backward = staticmethod(timed)
        return self

    def __exit__(self, *exc) -> None:
        self.fn.backward = staticmethod(self.orig)

    def top(self, n: int = 50) -> dict:
        return _top(self.prof, n)


def _dense_inputs(S: int, n_sets: int = 2):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [[torch.randn(1, S, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (H, HK, HK, H)]
            for _ in range(n_sets)]


def baselines(cycles: int, queued_ms: float, reps: int) -> list[dict]:
    """Host time of a plain torch op, upstream FA4's own entry points and ringfa4 ``cp=None``
    (4k tokens, h = 32 / kv 8, d = 128, causal)."""
    sets = _dense_inputs(4096)
    q, k, v, do = sets[0]
    rows = [{"what": "torch add", **host_us(lambda: q.add(1.0), cycles, queued_ms, reps)}]
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as exc:
        print(f"(upstream FA4 not importable: {exc})")
        flash_attn_func = None
    for backward in (False, True):
        name = "fwd+bwd" if backward else "fwd"
        if flash_attn_func is not None:
            def fa4(backward=backward):
                qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
                out = flash_attn_func(qq, kk, vv, causal=True)
                out = out[0] if isinstance(out, tuple) else out
                if backward:
                    out.backward(do)
            rows.append({"what": f"FA4 flash_attn_func {name}", **host_us(fa4, cycles, queued_ms, reps)})
        rows.append({"what": f"ringfa4 cp=None {name}",
                     **host_us(rotating(cp_step(None, backward), sets), cycles, queued_ms, reps)})
    rows += _autograd_floor(sets[0], cycles, queued_ms, reps)
    rows += _backward_alone(sets, cycles, queued_ms, reps)
    rows += _varlen_alone(sets, cycles, queued_ms, reps)
    return rows


class _NoKernels(torch.autograd.Function):
    """An attention-shaped autograd op that launches nothing: what autograd alone costs a call."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.kv = (k, v)  # (their shapes and dtypes: the gradients made like them)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        k, v = ctx.kv
        return torch.empty_like(dout), torch.empty_like(k), torch.empty_like(v)


def _autograd_floor(tensors: list, cycles: int, queued_ms: float, reps: int) -> list[dict]:
    """The host time of autograd itself on CUDA tensors: a forward+backward of :class:`_NoKernels`
    (no kernel, fresh gradients), its backward on autograd's device thread (the default) and on the
    calling thread. Every ring call pays it once, so at P ranks x s steps it is this / (P s) a
    rank-step."""
    q, k, v, do = tensors

    def floor(calling_thread: bool) -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = _NoKernels.apply(qq, kk, vv)
        with torch.autograd.set_multithreading_enabled(not calling_thread):
            out.backward(do)
    return [{"what": "autograd alone fwd+bwd (a no-kernel op), device thread",
             **host_us(lambda: floor(False), cycles, queued_ms, reps)},
            {"what": "autograd alone fwd+bwd (a no-kernel op), calling thread",
             **host_us(lambda: floor(True), cycles, queued_ms, reps)}]


def _backward_alone(sets: list, cycles: int, queued_ms: float, reps: int) -> list[dict]:
    """The backward by itself, without autograd: FA4's ``_flash_attn_bwd`` and the backend's
    ``backward`` (sm90: FA4's kernels from a prepared plan) on the same forward's out / lse."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return []
    be, spec = get_backend("fa4"), AttnSpec(causal=True)
    args = [(q, k, v, *be.forward(q, k, v, spec), do) for q, k, v, do in sets]
    fa4 = rotating(lambda q, k, v, o, lse, do: interface._flash_attn_bwd(q, k, v, o, do, lse, causal=True), args)
    ours = rotating(lambda q, k, v, o, lse, do: be.backward(do, q, k, v, o, lse, spec), args)
    return [{"what": "FA4 _flash_attn_bwd alone", **host_us(fa4, cycles, queued_ms, reps)},
            {"what": "ringfa4 Fa4Backend.backward alone", **host_us(ours, cycles, queued_ms, reps)}]


def _varlen_alone(sets: list, cycles: int, queued_ms: float, reps: int) -> list[dict]:
    """One packed call (the 4k tokens as four 1k documents: what ``cp=None`` and Ulysses run on packs),
    forward and backward each alone: FA4's ``flash_attn_varlen_func`` / ``_flash_attn_bwd`` with
    cu_seqlens against the backend's (sm90: FA4's kernels from prepared plans)."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return []
    cu = torch.tensor([0, 1024, 2048, 3072, 4096], dtype=torch.int32, device="cuda")
    be = get_backend("fa4")
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024, causal=True)
    packed = [[t[0] for t in ts] for ts in sets]  # (4096, heads, d) each
    fa4_fwd = rotating(lambda q, k, v, do: interface.flash_attn_varlen_func(q, k, v, return_lse=True, **kw), packed)
    ours_fwd = rotating(lambda q, k, v, do: be.forward(q, k, v, spec), packed)
    args = [(q, k, v, *be.forward(q, k, v, spec), do) for q, k, v, do in packed]
    fa4_bwd = rotating(lambda q, k, v, o, lse, do: interface._flash_attn_bwd(q, k, v, o, do, lse, **kw), args)
    ours_bwd = rotating(lambda q, k, v, o, lse, do: be.backward(do, q, k, v, o, lse, spec), args)
    return [{"what": f"{what} (varlen, 4 documents)", **host_us(fn, cycles, queued_ms, reps)}
            for what, fn in (("FA4 flash_attn_varlen_func fwd", fa4_fwd), ("ringfa4 Fa4Backend.forward", ours_fwd),
                             ("FA4 _flash_attn_bwd alone", fa4_bwd), ("ringfa4 Fa4Backend.backward alone", ours_bwd))]


def _pack_lengths(total: int, seed: int = 0) -> list[int]:
    import random

    rnd, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rnd.randint(1024, 16384), total - sum(out)))
    return out


def bench_dense(P: int, tokens: int, be, args, cycles: int) -> list[dict]:
    """Rows of one dense shape: per pass and mode (eager; graphs with ``--graphs``) the API call's
    host time, launches, and its GPU time against one full-sequence call and the block calls alone."""
    S = tokens * P
    sets = _dense_inputs(S)
    spec = AttnSpec(causal=True)
    base = RingOptions.from_env()  # gpu.sh's variants (RINGFA4_*); graphs / tapes per mode
    # eager: the defaults (launch tapes since session 34); untaped: launch_tapes="off" (a parent's library
    # without the field: eager only)
    tapes = "launch_tapes" in RingOptions.field_names()
    modes = ("eager",) + (("untaped",) if tapes else ()) + (("graphs",) if args.graphs else ())
    mode_options = {"eager": base, "untaped": base.replace(launch_tapes="off") if tapes else base,
                    "graphs": base.replace(cuda_graphs=True)}
    cps = {m: ringfa4.ContextParallel.simulated(P, backend=be, options=mode_options[m]) for m in modes}
    steps = active_steps(cps["eager"].run(sets[0][0], spec).schedule)
    rank_steps = P * steps
    rows = []
    nan = {"ms": float("nan")}
    for backward in (False, True):
        t_full = float("nan") if args.host_only else median_ms(full_call(be, spec, backward), sets, 100)
        execu = host_us(rotating(executor_step(cps["eager"], spec, backward), sets), cycles, args.queued_ms, args.reps)
        fns = {m: cp_step(cps[m], backward) for m in modes}
        fns["calls"] = calls_alone(cps["eager"], spec, be, backward, {})
        timed = {m: nan for m in fns} if args.host_only else interleaved_ms(fns, sets, rounds=3, rep=100)
        for mode in modes:
            api = rotating(fns[mode], sets)
            with InsideBackward() as inside:
                host = host_us(api, cycles, args.queued_ms, args.reps)
            ring_ms = timed[mode]["ms"]
            row = {"path": "simulated", "mode": mode, "pass": "fwd+bwd" if backward else "fwd", "P": P,
                   "tokens_per_rank": tokens,
                   "layout": "dense", "rank_steps": rank_steps, "us_per_rank_step": host["us"] / rank_steps,
                   "min_us_per_rank_step": host["min_us"] / rank_steps, "waited": host["waited"],
                   "launches_per_rank_step": launches(api) / rank_steps,
                   "efficiency": t_full / ring_ms, "of_calls_alone": timed["calls"]["ms"] / ring_ms,
                   "ring_ms": ring_ms, "calls_ms": timed["calls"]["ms"], "full_ms": t_full,
                   "graph_mib": cps[mode].graph_memory() / 2**20,
                   "tape_mib": cps[mode].tape_memory() / 2**20 if hasattr(cps[mode], "tape_memory") else 0.0}
            if mode == "eager":
                row["executor_us_per_rank_step"] = execu["us"] / rank_steps
                if backward:  # the same call with its backward on this thread, not autograd's device thread
                    calling = host_us(rotating(cp_step(cps[mode], True, calling_thread=True), sets), cycles,
                                      args.queued_ms, args.reps)
                    row["calling_thread_us_per_rank_step"] = calling["us"] / rank_steps
                    row["calling_thread_min_us_per_rank_step"] = calling["min_us"] / rank_steps
                # a layer's share of a chain of calls with one backward (a model's step), as many layers as
                # keep the chain's launches within CUDA's launch queue (about a thousand) behind the sleep
                layers = min(args.layers, int(900 // max(row["launches_per_rank_step"] * rank_steps, 1)))
                if layers > 1:
                    chain = host_us(rotating(cp_layers_step(cps[mode], backward, layers), sets), cycles,
                                    args.queued_ms, args.reps)
                    row["layers"] = layers
                    row["layers_us_per_rank_step"] = chain["us"] / (layers * rank_steps)
                    row["layers_min_us_per_rank_step"] = chain["min_us"] / (layers * rank_steps)
                    row["layers_waited"] = chain["waited"]
            if backward and inside.us:  # of the host time: inside the ring's backward (autograd's thread)
                row["inside_backward_us_per_rank_step"] = statistics.median(inside.us) / rank_steps
            if args.profile:
                row["profile"] = profile_top(api, cycles)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    return rows


def bench_packed(P: int, total: int, be, args, cycles: int) -> list[dict]:
    lengths = _pack_lengths(total)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [[torch.randn(total, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (H, HK, HK, H)]
            for _ in range(2)]
    cp = ringfa4.ContextParallel.simulated(P, backend=be, options=RingOptions.from_env())
    pack = cp.pack(cu)
    gathered = pack.uses_allgather(H, HK)
    sched = cp.run(sets[0][0], AttnSpec(causal=True), pack.packing, gathered).schedule
    steps = 1 if gathered else active_steps(sched)  # the all-gather mode: one gathered step a rank
    rows = []
    for backward in (False, True):
        api = rotating(cp_step(cp, backward, pack), sets)
        host = host_us(api, cycles, args.queued_ms, args.reps)
        rank_steps = P * steps
        row = {"path": "simulated", "mode": "eager", "pass": "fwd+bwd" if backward else "fwd", "P": P,
               "tokens_per_rank": total // P,
               "layout": f"packed {len(lengths)} docs 1k-16k ({'allgather' if gathered else 'ring'})",
               "rank_steps": rank_steps,
               "us_per_rank_step": host["us"] / rank_steps, "min_us_per_rank_step": host["min_us"] / rank_steps,
               "waited": host["waited"],
               "launches_per_rank_step": launches(api) / rank_steps}
        if args.profile:
            row["profile"] = profile_top(api, cycles)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    return rows


def main() -> None:
    global HK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,8192,32768", help="tokens per rank (dense)")
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--packed", action="store_true", help="also one packed mix (64k tokens of 1k-16k documents)")
    ap.add_argument("--profile", action="store_true", help="cProfile one call of each row")
    ap.add_argument("--graphs", action="store_true", help="also RingOptions(cuda_graphs=True) rows")
    ap.add_argument("--no-baselines", action="store_true", help="skip the torch / FA4 / cp=None baselines")
    ap.add_argument("--real-rank", action="store_true",
                    help="also the real-rank path: P spawned gloo ranks on this GPU, stub hops (_real_rank.py)")
    ap.add_argument("--host-only", action="store_true", help="skip the GPU timings (efficiency, of calls alone)")
    ap.add_argument("--hops", default="loopback,stream-ordered,blocking",
                    help="real-rank hop waits (_real_rank.py): loopback, stream-ordered (NCCL's path), blocking; "
                         "nccl: real NCCL hops, one GPU a rank; nccl-self (--peers stub): NCCL hops to the rank itself")
    ap.add_argument("--peers", default="spawned",
                    help="real-rank peers (_real_rank.py), comma-separated: spawned (P processes sharing this GPU), "
                         "stub (rank 0 alone, a fake process group: no contention, no network)")
    ap.add_argument("--no-simulated", action="store_true", help="only the real-rank rows (with --real-rank)")
    ap.add_argument("--no-dense", action="store_true", help="no simulated dense rows (with --packed / --real-rank)")
    ap.add_argument("--metadata-check", default="every_call,new_shapes",
                    help="real-rank RingOptions.metadata_check values (every_call: the check on every call; "
                         "new_shapes: once per call key)")
    ap.add_argument("--kv-heads", type=int, default=HK,
                    help="kv heads of the dense and packed rows (32: MHA, where the backward runs the q ring)")
    ap.add_argument("--layers", type=int, default=4,
                    help="eager rows also time a chain of up to this many calls with one backward (a model's "
                         "layers; fewer where the launches would overfill CUDA's queue): layers_us_per_rank_step, "
                         "a layer's share (1: off)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--queued-ms", type=float, default=400.0, help="GPU sleep queued before each timed call")
    ap.add_argument("--out", default="bench_results/host_cost.json")
    args = ap.parse_args()
    HK = args.kv_heads
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    cycles = sleep_cycles(args.queued_ms)
    out = {"device": torch.cuda.get_device_name(), "heads": H, "kv_heads": HK, "head_dim": D, "backend": be.name,
           "queued_ms": args.queued_ms, "rows": [],
           "baselines": [] if args.no_baselines else baselines(cycles, args.queued_ms, args.reps)}
    for b in out["baselines"]:
        print(json.dumps(b), flush=True)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for P in (int(p) for p in args.worlds.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            if args.no_simulated or args.no_dense:
                break
            out["rows"] += bench_dense(P, tokens, be, args, cycles)
            save()
            torch.cuda.empty_cache()
        if args.packed and not args.no_simulated:
            out["rows"] += bench_packed(P, 65536, be, args, cycles)
            save()
        if args.real_rank:
            from _real_rank import STUB_PEER_HOPS, real_rank_rows

            for peers, tokens, hops, check, graphs in itertools.product(
                    args.peers.split(","), (int(t) for t in args.tokens.split(",")), args.hops.split(","),
                    args.metadata_check.split(","), (False, True) if args.graphs else (False,)):
                if graphs and hops not in ("stream-ordered", "nccl", "nccl-self"):  # captured hops: GPU-side waits only
                    continue
                if peers == "stub" and hops not in STUB_PEER_HOPS:
                    continue
                rows = real_rank_rows(P, tokens, (H, HK, D), reps=args.reps, cycles=cycles, hops=hops,
                                      options={"metadata_check": check, "cuda_graphs": graphs}, peers=peers,
                                      profile=args.profile)
                for r in rows:
                    print(json.dumps(r), flush=True)
                out["rows"] += rows
                save()
    print(f"\nhost cost on {out['device']} ({be.name}, h={H}/{HK}, d={D}, bf16, causal, simulated, queued "
          f"{args.queued_ms:.0f} ms)")
    print("| baseline | host us (median) | min |\n|---|---|---|")
    for b in out["baselines"]:
        print(f"| {b['what']} | {b['us']:.0f} | {b['min_us']:.0f} |")
    print("\n(real-rank rows: rank 0's host time, stub hops; its peers P spawned gloo ranks on this GPU, or stubbed "
          "by a fake process group)")
    print("\n| layout | mode | P | tokens/rank | pass | us/rank-step (median) | min | executor us/rank-step | "
          "launches/rank-step | efficiency | of calls alone | waited |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r.get('path', 'simulated')} {r.get('peers', '')} {r.get('hops', '')} {r.get('metadata_check', '')} "
              f"{r['layout']} | "
              f"{r['mode']} | {r['P']} | "
              f"{r['tokens_per_rank']} | "
              f"{r['pass']} | "
              f"{r['us_per_rank_step']:.0f} | "
              f"{r['min_us_per_rank_step']:.0f} | "
              f"{r.get('executor_us_per_rank_step', float('nan')):.0f} | "
              f"{r.get('launches_per_rank_step', float('nan')):.1f} | "
              f"{r.get('efficiency', float('nan')):.3f} | {r.get('of_calls_alone', float('nan')):.3f} | "
              f"{r.get('waited', '-')} |")
    for r in out["rows"]:
        if r.get("path") == "real-rank" and "profile" in r:
            print(f"\nprofile (own): real rank, {r['peers']} peers, {r['hops']} hops, {r['metadata_check']}, "
                  f"{r['mode']}, P={r['P']} {r['pass']}")
            for p in r["profile"][:12]:
                print(f"  {p['own_us']:9.0f} us own {p['cum_us']:9.0f} cum {p['calls']:6d}x {p['function']}")
    if args.profile and out["rows"]:
        for r in [r for r in out["rows"] if r.get("path") != "real-rank"][:2]:
            for key in ("own", "cum"):
                print(f"\nprofile ({key}): {r['layout']} P={r['P']} {r['tokens_per_rank']} tokens/rank {r['pass']}")
                for p in r["profile"][key]:
                    print(f"  {p['own_us']:9.0f} us own {p['cum_us']:9.0f} cum {p['calls']:6d}x {p['function']}")


if __name__ == "__main__":
    main()
