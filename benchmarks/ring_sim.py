"""Compute-side CP efficiency of the ring on one GPU (simulated executor).

efficiency = time(one full-sequence call) / (P x time of one rank's ring work); the simulated
executor runs all P ranks back to back, so P x (one rank) is its total time. Also timed in the
same run: the same ranks' block calls alone (no merge, no hops), so the overhead of everything
that is not the block kernel is ``ring / calls - 1``. Ring and calls are timed in alternating
rounds (``--rounds``, after one discarded warm round); the overhead is the median over rounds of
their ratio, with its range.

Two levels: ``api`` times ``ringfa4.attention`` on the full tensors (the simulated executor also
shards the inputs and unshards the outputs and gradients, which a real rank never does per call);
``executor`` times what each rank runs, the ring forward / backward on already-sharded inputs,
against the block calls on the same shards.

``--hops none`` (attribution only: results are wrong) keeps the hops' stream waits and events
but copies nothing, so ``ring - calls`` splits into the simulated hops' share and the rest.

    python benchmarks/ring_sim.py [--quick | --seqs 65536,66536] [--level both] [--hops copy]
        [--out bench_results/ring_sim.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
from _common import calls_alone, cp_step, executor_step, full_call, interleaved_ms, median_ms, ratio

import ringfa4
from ringfa4 import RingOptions
from ringfa4.kernels import AttnSpec, get_backend, resolve
from ringfa4.parallel import LoopbackTransport


class _NoCopyHops(LoopbackTransport):
    """Loopback hops with their stream waits and events, copying into each receive buffer only the
    first time it is seen (in the warm-up: the caching allocator hands the ring the same buffers
    every call), so the timed calls move nothing while every block still reads real values, not
    uninitialized memory. Timing attribution only: ranks compute on stale K/V and dK/dV."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, int]] = set()

    def shift(self, send, recv, offset):
        n = len(send)
        pieces = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
        device = pieces(send[0])[0].device
        stream = self.comm_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for i in range(n):
                for dst, src in zip(pieces(recv[(i + offset) % n]), pieces(send[i])):
                    if (dst.data_ptr(), dst.numel()) not in self.seen:
                        self.seen.add((dst.data_ptr(), dst.numel()))
                        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, handle):
        torch.cuda.current_stream().wait_event(handle)


def _inputs(S, h, d, n_sets):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [[torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
            for _ in range(n_sets)]


def _save(args, rows) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "heads": args.heads, "head_dim": args.head_dim,
                   "layout": "zigzag", "options": _options(), "rows": rows}, f, indent=1)


def _options() -> dict:
    """The RingOptions this run used: the defaults with any RINGFA4_* variables applied."""
    return dataclasses.asdict(RingOptions.from_env())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64k only")
    ap.add_argument("--seqs", default="", help="comma-separated sequence lengths (any length: e.g. 65536,66536)")
    ap.add_argument("--worlds", default="4,8", help="comma-separated P values")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--passes", choices=("both", "fwd", "fwd+bwd"), default="both")
    ap.add_argument("--out", default="bench_results/ring_sim.json")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--level", choices=("both", "api", "executor"), default="both")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of ring and calls-alone timing")
    ap.add_argument("--hops", choices=("copy", "none"), default="copy",
                    help="none: hops copy nothing (timing attribution only, wrong results)")
    args = ap.parse_args()
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else [65536] if args.quick else [65536, 262144]
    rows = []
    for S in seqs:
        sets = _inputs(S, args.heads, args.head_dim, 2 if S > 100_000 else 3)
        rep = 60 if S > 100_000 else 200
        for causal in {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]:
            spec = AttnSpec(causal=causal)
            for backward in {"both": (False, True), "fwd": (False,), "fwd+bwd": (True,)}[args.passes]:
                t_full = median_ms(full_call(be, spec, backward), sets, rep)
                for P in (int(p) for p in args.worlds.split(",")):
                    cp = ringfa4.ContextParallel.simulated(
                        P, layout="zigzag", backend=be, transport=_NoCopyHops() if args.hops == "none" else None,
                        options=RingOptions.from_env())
                    for level in {"both": ("api", "executor"), "api": ("api",), "executor": ("executor",)}[args.level]:
                        if level == "api":
                            fns = {"ring": cp_step(cp, backward, causal=causal),
                                   "calls": calls_alone(cp, spec, be, backward)}
                        else:
                            fns = {"ring": executor_step(cp, spec, backward),
                                   "calls": calls_alone(cp, spec, be, backward, {})}
                        timed = interleaved_ms(fns, sets, args.rounds, rep)
                        t_ring, t_calls = timed["ring"]["ms"], timed["calls"]["ms"]
                        over = ratio(timed, "ring", "calls")
                        row = {"S": S, "P": P, "causal": causal, "pass": "fwd+bwd" if backward else "fwd",
                               "level": level, "full_ms": t_full, "ring_ms_per_rank": t_ring / P,
                               "calls_ms_per_rank": t_calls / P, "efficiency": t_full / t_ring,
                               "calls_efficiency": t_full / t_calls, "overhead": over["median"] - 1,
                               "overhead_range": [over["min"] - 1, over["max"] - 1], "rounds": args.rounds,
                               "ring_ms_rounds": timed["ring"]["rounds"], "calls_ms_rounds": timed["calls"]["rounds"],
                               "backend": be.name, "hops": args.hops}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        _save(args, rows)  # after every row: a run cut short keeps what it measured
                        torch.cuda.empty_cache()
        del sets
        torch.cuda.empty_cache()
    print(f"\nring, simulated on one {torch.cuda.get_device_name()} ({be.name} blocks, h={args.heads}, "
          f"d={args.head_dim}, bf16, zigzag, hops: {args.hops})")
    print("| S | P | causal | pass | level | full ms | ring ms/rank | calls ms/rank | efficiency | calls alone "
          "| overhead (range over rounds) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["overhead_range"]
        print(f"| {r['S'] // 1024}k | {r['P']} | {'yes' if r['causal'] else 'no'} | {r['pass']} | {r['level']} | "
              f"{r['full_ms']:.2f} | "
              f"{r['ring_ms_per_rank']:.3f} | {r['calls_ms_per_rank']:.3f} | {r['efficiency']:.3f} | "
              f"{r['calls_efficiency']:.3f} | {100 * r['overhead']:+.1f}% ({100 * lo:+.1f} to {100 * hi:+.1f}) |")


if __name__ == "__main__":
    main()
