"""Where a simulated ring step spends its time: torch.profiler over the ring forward (+ backward)
on one GPU, kernels grouped by what they do, and the GPU-busy share of the wall time (below ~1 the
host is the bottleneck).

    python benchmarks/ring_profile.py --seq 65536 --world 8 [--packed] [--out bench_results/ring_profile.json]

Groups: attention (FA4 / backend kernels), merge (the fused merge or combine), copies (memcpy,
hops, casts), accumulate (elementwise adds of dq / dk / dv), other.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

import ringfa4

GROUPS = (("attention", ("flash", "fmha", "attention", "sm90", "sm100", "cutlass_kernel_flash")),
          ("merge", ("merge", "combine", "ringmerge", "ringcombine")),
          ("copies", ("memcpy", "copy", "cast", "convert", "cat", "index")),
          ("accumulate", ("add", "elementwise", "vectorized", "fill")))


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def run(args, device):
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    S, h, hk, d = args.seq, args.heads, args.kv_heads, args.head_dim
    cp = ringfa4.ContextParallel.simulated(args.world, backend=args.backend,
                                           options=ringfa4.RingOptions.from_env())
    pack = None
    shape = (S, h, d) if args.packed else (1, S, h, d)
    kvshape = (S, hk, d) if args.packed else (1, S, hk, d)
    if args.packed:
        random.seed(0)
        lens, left = [], S
        while left > 0:
            n = min(left, random.randint(args.seq // 64, args.seq // 4))
            lens.append(n)
            left -= n
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
        pack = cp.pack(cu)
    q = torch.randn(shape, device=device, dtype=dt, generator=g)
    k, v = (torch.randn(kvshape, device=device, dtype=dt, generator=g) for _ in range(2))
    do = torch.randn(shape, device=device, dtype=dt, generator=g)

    def step():
        qq, kk, vv = (t.detach().requires_grad_(args.backward) for t in (q, k, v))
        out = ringfa4.attention(qq, kk, vv, cp=cp, causal=True, packing=pack)
        if args.backward:
            out.backward(do)

    for _ in range(2):
        step()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                                     else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.reps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.reps
    use_cuda = device.type == "cuda"
    host = _host_enqueue_ms(step) if use_cuda else None
    totals: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        t = (e.self_device_time_total if use_cuda else e.self_cpu_time_total) / args.reps / 1e3  # ms
        if t <= 0 or (use_cuda and e.device_type != torch.autograd.DeviceType.CUDA):
            continue
        grp = group_of(e.key)
        totals[grp] = totals.get(grp, 0.0) + t
        top.append((t, e.key[:90], grp, e.count // args.reps))
    top.sort(reverse=True)
    busy = sum(totals.values())
    gaps = _compute_gaps(prof, args.reps) if use_cuda else None
    return {"seq": S, "world": args.world, "packed": args.packed, "backward": args.backward, "wall_ms": wall * 1e3,
            "host_enqueue_ms": host, "compute_stream_gaps": gaps,
            "busy_ms": busy, "busy_share": busy / (wall * 1e3), "groups_ms": totals,
            "top": [{"ms": t, "name": n, "group": gname, "calls": c} for t, n, gname, c in top[:25]]}


def trace_events(prof) -> list[dict]:
    """The GPU events (kernels, copies, memsets) of a finished ``torch.profiler`` run, as its chrome
    trace lists them (``name``, ``cat``, ``ts`` / ``dur`` in us, ``args.stream``)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def stream_gaps(evs: list[dict], reps: int, min_us: float = 5.0, top: int = 5) -> dict:
    """Idle time of the compute stream (the one with the most kernel time) between its first and
    last kernel of ``reps`` profiled steps run back to back, per step: ``idle_ms`` split into gaps
    that end within 15 us of a copy ending on another stream (waiting for a hop: ``after_copy_ms``)
    and the rest (launch gaps, host waits, cross-stream waits); gaps shorter than ``min_us`` are
    counted separately (``short_ms``). ``top_gaps``: the ``top`` longest, with the events around
    them (us, the event before, the event after)."""
    by_stream: dict = {}
    for e in evs:
        by_stream.setdefault(e.get("args", {}).get("stream"), []).append(e)
    main = max((st for st in by_stream if any(e["cat"] == "kernel" for e in by_stream[st])),
               key=lambda st: sum(e["dur"] for e in by_stream[st] if e["cat"] == "kernel"))
    kern = sorted(by_stream[main], key=lambda e: e["ts"])
    copies = sorted(e["ts"] + e["dur"] for st, es in by_stream.items() if st != main for e in es
                    if e["cat"] == "gpu_memcpy")
    out = {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "after_copy_ms": 0.0, "other_ms": 0.0,
           "short_ms": 0.0, "gaps": 0, "after_copy_gaps": 0}
    end, prev, seen = kern[0]["ts"], kern[0], []
    out["span_ms"] = (max(e["ts"] + e["dur"] for e in kern) - kern[0]["ts"]) / 1e3
    for e in kern:
        gap = e["ts"] - end
        if gap > 0:
            out["idle_ms"] += gap / 1e3
            seen.append((gap, prev["name"][:70], e["name"][:70]))
            if gap < min_us:
                out["short_ms"] += gap / 1e3
            elif any(abs(c - e["ts"]) < 15.0 for c in copies):
                out["after_copy_ms"] += gap / 1e3
                out["after_copy_gaps"] += 1
            else:
                out["other_ms"] += gap / 1e3
                out["gaps"] += 1
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    out["busy_ms"] = out["span_ms"] - out["idle_ms"]
    seen.sort(key=lambda g: -g[0])
    return ({key: val / reps for key, val in out.items()} | {"steps": reps}
            | {"top_gaps": [{"us": g, "after": a, "before": b} for g, a, b in seen[:top]]})


def _compute_gaps(prof, reps: int, min_us: float = 5.0) -> dict:
    """:func:`stream_gaps` of a finished profiler run."""
    return stream_gaps(trace_events(prof), reps, min_us)


def _host_enqueue_ms(step, sleep_cycles: int = 2_000_000_000) -> dict:
    """Host time to enqueue one step while the GPU is held busy by a sleep kernel ahead of it (so
    the launch queue never drains): if it exceeds the step's GPU time, the host is the bottleneck.
    ``synced`` is True when the enqueue waited for the sleep (a host sync inside the step)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(sleep_cycles)
    end.record()
    torch.cuda.synchronize()
    sleep_ms = start.elapsed_time(end)
    times = []
    for _ in range(3):
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    host = sorted(times)[1]
    return {"ms": host, "sleep_ms": sleep_ms, "synced": host > 0.8 * sleep_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--packed", action="store_true", help="random documents of S/64..S/4 tokens")
    ap.add_argument("--forward-only", dest="backward", action="store_false")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    r = run(a, device)
    print(json.dumps({k: v for k, v in r.items() if k != "top"}))
    print(f"\nring {'packed ' if a.packed else ''}S={a.seq} P={a.world} {'fwd+bwd' if a.backward else 'fwd'}, all "
          f"ranks: wall {r['wall_ms']:.2f} ms, device busy {r['busy_ms']:.2f} ms ({100 * r['busy_share']:.0f}%)")
    if r["host_enqueue_ms"]:
        h = r["host_enqueue_ms"]
        print(f"host enqueue {h['ms']:.2f} ms (GPU held by a {h['sleep_ms']:.0f} ms sleep; "
              f"{'waited on the GPU: a host sync inside' if h['synced'] else 'no host sync'})")
    if r["compute_stream_gaps"]:
        g = r["compute_stream_gaps"]
        print(f"compute stream, per step: span {g['span_ms']:.2f} ms, idle {g['idle_ms']:.2f} ms: waiting for a "
              f"hop {g['after_copy_ms']:.2f} ms ({g['after_copy_gaps']} gaps), other gaps {g['other_ms']:.2f} ms "
              f"({g['gaps']}), gaps < 5 us {g['short_ms']:.2f} ms")
    print("| group | ms | share of busy |")
    print("|---|---|---|")
    for grp, t in sorted(r["groups_ms"].items(), key=lambda x: -x[1]):
        print(f"| {grp} | {t:.3f} | {100 * t / max(r['busy_ms'], 1e-9):.1f}% |")
    print("\n| ms | calls | group | kernel |")
    print("|---|---|---|---|")
    for row in r["top"][:15]:
        print(f"| {row['ms']:.3f} | {row['calls']} | {row['group']} | {row['name']} |")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
