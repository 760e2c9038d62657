"""Packed documents under CP on one GPU: each simulated rank timed alone, against one FA4 varlen call.

For every mix of documents and P, and each ``cp.pack`` mode (``balanced``: the default placement;
``ring`` / ``allgather``: every document cut 2P ways), every rank's own forward (and backward) on
its shards is timed separately, the executor level: ``ring_forward`` / ``allgather_forward`` of a
:class:`RingRun` of that one rank (a pack of one document placed as the dense layout places it: the
dense ring, as ``ringfa4.attention`` runs it, travel ``dense``), whose hops copy its travelling
buffers (the bytes a real rank receives; their contents are its own, stale: timing only) and whose
exchange writes the bytes the rank receives. efficiency = t(one
``flash_attn_varlen_func``-equivalent FA4 call over the whole pack) / (P x the slowest rank's
time), so an unbalanced placement cannot score well. The one call and every rank are timed by
``_common.sustained_ms``: in batches that first queue heavy GEMMs (at least 50 ms, and twice the
host's time to enqueue the batch: the host is ahead and the GPU's clocks are those of a loaded GPU,
as in a training step), then run every call back to back, each behind an L2 flush, between CUDA
events; ``--rep`` batches a round, ``--rounds`` rounds after one discarded, the order rotated every
batch and reversed every other round; each time is the median over the rounds (a drift of the GPU's
speed moves them alike). Timed alone after an idle GPU (session 22's first method), a rank's call
of tens of ms may run at a cool GPU's clocks while the one call over the pack (hundreds of ms)
settles lower, which would favour the ranks (suspected: one 64k document read 1.004 that way against
``ring_sim.py``'s 0.873, whose ring calls run 220 ms back to back, and the full calls agreed). Each
call's host enqueue time is kept beside its GPU time (``rank_host_ms``; ``efficiency_host_bound``
takes max(GPU, host) a call).
``efficiency_by_round`` keeps each round's.
Also: each rank's time beside its tokens, causal pairs (exact, and in whole tiles: what its kernels
compute), key rows and segments (``rank_ms``, ``rank_tokens``, ``rank_pairs``, ``rank_tile_pairs``,
``rank_key_rows``, ``rank_key_tiles``, ``rank_segments``; ``tile_balance``), and their least-squares fit
over the balanced rows (``rank_cost_fit``, :func:`fit_rank_cost`: what the placement's cost model
should weigh, and how much of the time pairs alone explain);
max / mean tokens and causal FLOPs per rank, rows and MiB of K/V a rank sends per hop (ring), the
key rows the split documents' holders need (what the exchange moves) and the pieces, and the
solver's time for 1,000 documents, all whole and with one split (CPU, median of 7).

Mixes: uniform 1k-16k documents at 64k and 256k tokens, many short ones (512-4k) at 128k, a long
tail (log-uniform 128-64k) at 256k, and one 64k document. h = 32 / kv 8, d = 128, bf16, causal.

    python benchmarks/varlen_sim.py [--mixes uniform_64k,...] [--worlds 4,8] [--modes balanced,ring,allgather]
        (balanced/ring, balanced/allgather: the placement with its travel forced; unrefined: balanced
        without the solver's step 5)
        [--profile [all]] [--out benchmarks/results/varlen_sim.json]

``--profile`` adds, per row, torch.profiler over the slowest rank's step under load (:func:`_profile`):
GPU span ms, kernel ms by group (attention, merge, copies, accumulate, other: ring_profile.py's groups),
the compute stream's idle gaps (the longest with the kernels around them), the busy share (kernel
time / wall; well under 1 means the host or launch gaps bound the rank) and the top kernels;
``--profile all`` also every rank's GPU ms by kernel kind (``rank_kernels_ms``: FA4's forward, backward
main, pre- and postprocess kernels, the others by group), to see where ranks of equal work differ.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import statistics
import time

import torch
from _common import CudaOps, rotating, sustained_ms

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, resolve
from ringfa4.parallel import LoopbackTransport, dispatch
from ringfa4.parallel.allgather import allgather_backward, allgather_forward
from ringfa4.parallel.dispatch import balance_documents
from ringfa4.parallel.ring import ring_backward, ring_forward
from ringfa4.parallel.transport import Pending

H, HK, D = 32, 8, 128
MIXES = {  # name: (tokens, document length sampler)
    "uniform_64k": (65536, lambda r: r.randint(1024, 16384)),
    "uniform_256k": (262144, lambda r: r.randint(1024, 16384)),
    "short_128k": (131072, lambda r: r.randint(512, 4096)),
    "tail_256k": (262144, lambda r: int(2 ** r.uniform(7, 16))),
    "one_64k": (65536, lambda r: 65536),
}


def mix_lengths(name: str, seed: int = 0) -> list[int]:
    tokens, draw = MIXES[name]
    rnd, out = random.Random(seed), []
    while sum(out) < tokens:
        out.append(min(draw(rnd), tokens - sum(out)))
    return out


class _OneRank(LoopbackTransport):
    """The transport of one simulated rank run alone: a hop copies its own buffer (the bytes a
    real rank receives); the all-gather mode's moves write every receive of the rank, copied from
    a scratch of random values (stale contents: timing only). ``exchange``: ``"serial"`` copies in
    the rank's own stream order (the exchange's time all counted in the rank's); ``"overlapped"``
    on the communication stream, waited for at ``finish`` as the loopback and NCCL transports do
    (the rank's home calls run meanwhile; the dense ring's hops are always simulated so)."""

    def __init__(self, world_size: int, exchange: str = "serial") -> None:
        super().__init__()
        if exchange not in ("serial", "overlapped"):
            raise ValueError(f"exchange must be 'serial' or 'overlapped', got {exchange!r}")
        self.world_size, self.exchange = world_size, exchange
        self.scratch: dict[torch.dtype, torch.Tensor] = {}

    def move_start(self, sends, recvs, what="an exchange"):
        dsts = [t for _, t in recvs[0]]
        srcs = []
        for t in dsts:
            src = self.scratch.get(t.dtype)
            if src is None or src.numel() < t.numel():
                src = self.scratch[t.dtype] = torch.randn(max(t.numel(), 1 << 24), device=t.device).to(t.dtype)
            srcs.append(src[:t.numel()].view(t.shape))
        if not dsts:
            return Pending()
        stream = self.comm_stream(dsts[0].device) if self.exchange == "overlapped" else None
        if stream is None:
            torch._foreach_copy_(dsts, srcs)  # as the loopback transport: one multi-tensor copy
            return Pending()
        event = self.post_copies(dsts[0].device, [(dsts, srcs)])  # one launched post, as the loopback's
        for t in dsts:  # kept from the allocator until the communication stream is past them
            t.record_stream(stream)
        return Pending(event=event, device=dsts[0].device)


EXPOSED: list = []  # rows whose host time for a batch outlasted the GPU load queued before it (host / load)


def _rank_step(run, fwd, bwd, backward: bool):
    def step(q, k, v, do):
        outs, lses = fwd(run, [q], [k], [v])
        if backward:
            bwd(run, [do], [q], [k], [v], outs, lses)
    return step


def _solver_ms(one_split: bool = False) -> float:
    """The solver's time for 1,000 documents of 100-4000 tokens at P = 8 (all stay whole), or 999 of
    them beside one of 2M tokens (``one_split``: it must be cut, so the fill candidate is built too);
    CPU, median of 7."""
    rnd = random.Random(1)
    lengths = tuple(rnd.randint(100, 4000) for _ in range(999 if one_split else 1000)) + \
        ((2_000_000,) if one_split else ())
    times = []
    for _ in range(7):
        t = time.perf_counter()
        balance_documents(lengths, 8, 128)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _ratio(xs) -> float:
    return max(xs) * len(xs) / sum(xs) if sum(xs) else 1.0


def _profile(step, shards, reps: int = 5, ops=None) -> dict:
    """torch.profiler over ``reps`` steps of one rank run back to back under load (after 2 warm
    ones): GEMMs queued before the profiler starts (``ops.busy``; at least 60 ms and three times the
    steps' untraced time) keep the host ahead and the clocks loaded, as :func:`~_common.sustained_ms`
    times them, and are not traced. Per step: ``span_ms`` (the compute stream's first to last
    kernel), GPU ms by kernel group, ``busy_share`` (kernel time / span; under 1: the GPU waited,
    ``gaps`` says where: :func:`ring_profile.stream_gaps`) and the 8 longest kernels (ms, calls)."""
    from ring_profile import group_of, stream_gaps, trace_events

    ops = ops or CudaOps()
    call = rotating(step, shards)
    for _ in range(2):
        call()
    ops.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    ops.sync()
    steps_ms = (time.perf_counter() - t0) * 1e3  # at least the host's time for them
    ops.busy(max(60.0, 3 * steps_ms))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(1000)  # a marker: events up to its end (the GEMMs, if traced) are not the steps'
        for _ in range(reps):
            call()
        ops.sync()
    evs = trace_events(prof)
    marks = [e["ts"] + e["dur"] for e in evs if "spin_kernel" in e["name"]]
    evs = [e for e in evs if e["ts"] >= max(marks)] if marks else evs
    groups, by_name = {}, {}
    for e in evs:
        groups[group_of(e["name"])] = groups.get(group_of(e["name"]), 0.0) + e["dur"] / 1e3 / reps
        ms, n = by_name.get(e["name"][:80], (0.0, 0))
        by_name[e["name"][:80]] = (ms + e["dur"] / 1e3 / reps, n + 1)
    top = sorted(({"ms": ms, "name": name, "calls": n / reps} for name, (ms, n) in by_name.items()),
                 key=lambda x: -x["ms"])
    gaps = stream_gaps(evs, reps)
    busy = sum(groups.values())
    return {"span_ms": gaps["span_ms"], "busy_ms": busy, "busy_share": busy / gaps["span_ms"], "groups_ms": groups,
            "gaps": gaps, "top": top[:8], "top_all": top}


def _kernel_kinds(prof: dict) -> dict:
    """A rank's :func:`_profile` as GPU ms a step: FA4's forward, backward main, pre- and
    postprocess kernels, the rest by group, and the span."""
    from ring_profile import group_of

    kinds = {"span": prof["span_ms"]}
    for k in prof["top_all"]:
        name = k["name"]
        kind = ("fa4_fwd" if "_fwd" in name else "fa4_bwd_pre" if "bwd_preprocess" in name else "fa4_bwd_post"
                if "bwd_postprocess" in name else "fa4_bwd" if "_bwd" in name else group_of(name))
        kinds[kind] = kinds.get(kind, 0.0) + k["ms"]
    return kinds


def _shard(packing, dense: bool, t: torch.Tensor, r: int) -> torch.Tensor:
    """Rank ``r``'s rows of packed ``t``; ``(1, rows, ...)`` for the dense ring."""
    x = packing.shard(t, 0, r)
    return x.unsqueeze(0) if dense else x


def key_rows(packing) -> int:
    """The placement's spread: over ranks and the split documents they hold pieces of, the keys each
    needs (up to the end of its last piece of the document)."""
    return sum(sum(packing.piece_ends(r).values()) for r in range(packing.world_size))


def key_tiles(packing, rank: int) -> int:
    """The key tiles ``rank``'s calls run, summed over its segments: a piece's keys up to its end
    (causal; its document's earlier keys included), a whole document's own, in tiles of the layout's
    tile (each such tile's dK/dV is written, unpadded, returned and summed once per segment that sees it)."""
    t = packing.layout.tile
    return sum(-(-((s.pos + s.length) if s.travels else s.length) // t) for s in packing.segments(rank))


def pieces(packing) -> int:
    """Travelling segments (pieces of split documents) over all ranks."""
    return sum(1 for r in range(packing.world_size) for s in packing.segments(r) if s.travels)


@contextlib.contextmanager
def without_step5():
    """The solver without its last step (``dispatch.refine_boundaries``: the placement the whole-piece
    steps leave): mode ``unrefined``, to measure what step 5 buys in the same run."""
    refine = dispatch.refine_boundaries
    dispatch.refine_boundaries = lambda placement, *args, **kwargs: placement
    try:
        yield
    finally:
        dispatch.refine_boundaries = refine


def travel_kind(dense: bool, allgather: bool) -> str:
    return "dense" if dense else "allgather" if allgather else "ring"


def bench_mix(name: str, worlds, modes, be, rep: int, profile: str | None = None, rounds: int = 3,
              exchange: str = "serial") -> list[dict]:
    lengths = mix_lengths(name)
    total = sum(lengths)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [[torch.randn(total, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (H, HK, HK, H)]
            for _ in range(2)]
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                    max_seqlen_k=max(lengths))

    def one_call(backward):
        def run(q, k, v, do):
            o, l = be.forward(q, k, v, spec)
            if backward:
                be.backward(do, q, k, v, o, l, spec)
        return run

    rows = []
    for P in worlds:
        cp = ringfa4.ContextParallel.simulated(P, backend=be, options=ringfa4.RingOptions.from_env())
        for mode in modes:
            pack_mode, _, forced = mode.partition("/")  # "balanced/ring": the placement, its K/V forced to travel so
            with without_step5() if pack_mode == "unrefined" else contextlib.nullcontext():
                pack = cp.pack(cu, "balanced" if pack_mode == "unrefined" else pack_mode)
            packing = pack.packing
            allgather = forced == "allgather" if forced else pack.uses_allgather(H, HK)
            dense = pack.is_one_dense_sequence()  # the API runs it on the dense ring: so is it timed
            fwd, bwd = (allgather_forward, allgather_backward) if allgather and not dense else (ring_forward,
                                                                                             ring_backward)
            base = (cp.run(sets[0][0].unsqueeze(0), AttnSpec(causal=True), seq_len=total) if dense else
                    cp.run(sets[0][0], AttnSpec(causal=True), packing, allgather))
            shard = functools.partial(_shard, packing, dense)
            toks = [packing.rows(r) for r in range(P)]
            flops = [packing.work(r) for r in range(P)]
            tiles = [packing.tile_work(r) for r in range(P)]
            travel = packing.max_travel_rows
            keys = key_rows(packing)
            for backward in (False, True):
                fns = {"full": rotating(one_call(backward), sets)}
                for r in range(P):
                    run = dataclasses.replace(base, ranks=(r,), transport=_OneRank(P, exchange))
                    fns[r] = rotating(_rank_step(run, fwd, bwd, backward), [[shard(t, r) for t in s] for s in sets])
                timed = sustained_ms(fns, rounds=rounds, reps=rep)
                if timed["_exposed"] is not None:
                    EXPOSED.append(timed["_exposed"])
                per_rank = [timed[r]["ms"] for r in range(P)]
                host_rank = [timed[r]["host_ms"] for r in range(P)]
                full_ms = timed["full"]["ms"]
                per_round = [timed["full"]["rounds"][k] / (P * max(timed[r]["rounds"][k] for r in range(P)))
                             for k in range(rounds)]
                slowest = max(per_rank)
                prof, rank_profiles = None, None
                if profile:  # the slowest rank; with "all", every rank's kernels (where equal work differs)
                    slow = per_rank.index(slowest)
                    for r in (range(P) if profile == "all" else [slow]):
                        run = dataclasses.replace(base, ranks=(r,), transport=_OneRank(P, exchange))
                        got = _profile(_rank_step(run, fwd, bwd, backward), [[shard(t, r) for t in s] for s in sets])
                        if profile == "all":
                            rank_profiles = (rank_profiles or []) + [_kernel_kinds(got)]
                        if r == slow:
                            prof = {k: v for k, v in got.items() if k != "top_all"}
                rows.append({
                    "mix": name, "P": P, "mode": mode, "travel": travel_kind(dense, allgather),
                    "pass": "fwd+bwd" if backward else "fwd", "docs": len(lengths),
                    "split_docs": len(packing.split_docs()), "full_ms": full_ms, "rank_ms": per_rank,
                    "rank_host_ms": host_rank, "full_host_ms": timed["full"]["host_ms"],
                    "rank_tokens": toks, "rank_pairs": flops,  # per-rank features beside rank_ms: the cost
                    "rank_key_rows": [sum(packing.piece_ends(r).values()) for r in range(P)],  # model's fit
                    "rank_segments": [len(packing.segments(r)) for r in range(P)],
                    "rank_key_tiles": [key_tiles(packing, r) for r in range(P)],
                    "rank_tile_pairs": tiles, "tile_balance": _ratio(tiles),
                    "slowest_rank_ms": slowest, "mean_rank_ms": statistics.mean(per_rank),
                    "efficiency": full_ms / (P * slowest),  # GPU time under load, the host ahead (as in training)
                    "efficiency_host_bound": max(full_ms, timed["full"]["host_ms"]) / (
                        P * max(max(g, h) for g, h in zip(per_rank, host_rank, strict=True))),
                    "efficiency_by_round": per_round, "flops_balance": _ratio(flops),
                    "token_balance": _ratio(toks), "rows_per_hop": travel, "key_rows": keys, "pieces": pieces(packing),
                    "mib_per_hop": 2 * travel * HK * D * 2 / 2**20} | ({"profile": prof} if prof else {})
                    | ({"rank_kernels_ms": rank_profiles} if rank_profiles else {}))
                print(json.dumps(rows[-1]), flush=True)
    del sets
    torch.cuda.empty_cache()
    return rows


COST_FEATURES = ("rank_tile_pairs", "rank_key_rows", "rank_key_tiles", "rank_tokens", "rank_segments")


def fit_rank_cost(rows: list[dict], mode: str = "balanced") -> list[dict]:
    """Least squares of each rank's time on its features (:data:`COST_FEATURES` and a constant),
    over the ``mode`` rows of every mix and P, one fit a pass: what the placement's cost model
    should weigh. Per pass: ``us_per`` (us per unit of each feature, and ``const``), ``r2`` of the
    fit, ``r2_pairs`` / ``r2_tile_pairs`` of exact pairs / whole-tile pairs and a constant alone (the
    solver's candidates / its last step), ``ranks`` fitted."""
    out = []
    for pass_ in sorted({r["pass"] for r in rows if r["mode"] == mode}):
        sel = [r for r in rows if r["mode"] == mode and r["pass"] == pass_
               and all(f in r for f in COST_FEATURES + ("rank_pairs",))]
        y = torch.tensor([ms * 1e3 for r in sel for ms in r["rank_ms"]], dtype=torch.float64)
        cols = [torch.tensor([float(x) for r in sel for x in r[f]], dtype=torch.float64) for f in COST_FEATURES]
        pairs = torch.tensor([float(x) for r in sel for x in r["rank_pairs"]], dtype=torch.float64)
        if len(y) <= len(cols) + 1:
            continue
        r2 = {}
        for name, use in (("all", cols), ("pairs", [pairs]), ("tile_pairs", cols[:1])):
            X = torch.stack(use + [torch.ones_like(y)], dim=1)
            scale = X.abs().amax(dim=0).clamp_min(1.0)  # features of 1e9 beside a constant: solve scaled
            coef = torch.linalg.lstsq(X / scale, y.unsqueeze(1)).solution.squeeze(1) / scale
            resid = y - X @ coef
            r2[name] = 1.0 - float(resid.square().sum() / (y - y.mean()).square().sum().clamp_min(1e-30))
            if name == "all":
                us_per = dict(zip(COST_FEATURES + ("const",), coef.tolist(), strict=True))
        out.append({"pass": pass_, "mode": mode, "ranks": len(y), "us_per": us_per, "r2": r2["all"],
                    "r2_pairs": r2["pairs"], "r2_tile_pairs": r2["tile_pairs"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--modes", default="balanced,ring,allgather",
                    help="cp.pack modes; MODE/ring or MODE/allgather forces how the split documents' K/V travel; "
                         "unrefined: balanced without the solver's step 5 (refine_boundaries)")
    ap.add_argument("--rep", type=int, default=3, help="batches a round (each times every call once)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (after one discarded)")
    ap.add_argument("--profile", nargs="?", const="slowest", choices=("slowest", "all"),
                    help="torch.profiler over each row's slowest rank; all: also every rank's GPU ms by kernel kind "
                         "(rank_kernels_ms)")
    ap.add_argument("--exchange", default="serial", choices=("serial", "overlapped"),
                    help="the all-gather mode's K/V and dK/dV exchange, simulated in the rank's own stream order "
                         "(its copies all counted) or on the communication stream (overlapping the rank's other "
                         "work, as the transports post it and as the dense ring's hops are simulated)")
    ap.add_argument("--out", default="benchmarks/results/varlen_sim.json")
    args = ap.parse_args()
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    worlds = [int(p) for p in args.worlds.split(",")]
    solver, solver_split = _solver_ms(), _solver_ms(one_split=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    for name in args.mixes.split(","):  # saved after every mix: a run cut short keeps what it measured
        rows += bench_mix(name, worlds, args.modes.split(","), be, args.rep, args.profile, args.rounds, args.exchange)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "method": "sustained_batches", "exchange": args.exchange,
                       "heads": H,
                       "kv_heads": HK, "head_dim": D,
                       "backend": be.name, "solver_ms_1000_docs": solver,
                       "solver_ms_1000_docs_one_split": solver_split, "rank_cost_fit": fit_rank_cost(rows),
                       "rows": rows}, f, indent=1)
    print(f"\npacked documents, each simulated rank alone on one {torch.cuda.get_device_name()} ({be.name}; "
          f"h={H}/{HK}, d={D}, bf16, causal); solver {solver:.2f} ms for 1,000 documents, "
          f"{solver_split:.2f} with one of them split")
    print("| mix | P | mode (K/V) | pass | split / docs | one call ms | slowest rank ms | efficiency | "
          "mean rank ms | rank host ms max | FLOPs max/mean | tokens max/mean | MiB a hop | key rows / S | pieces |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        total = sum(mix_lengths(r["mix"]))
        print(f"| {r['mix']} | {r['P']} | {r['mode']} ({r['travel']}) | {r['pass']} | {r['split_docs']} / "
              f"{r['docs']} | {r['full_ms']:.2f} | {r['slowest_rank_ms']:.3f} | {r['efficiency']:.3f} | "
              f"{r['mean_rank_ms']:.3f} | {max(r['rank_host_ms']):.3f} | {r['flops_balance']:.3f} | "
              f"{r['token_balance']:.3f} | "
              f"{r['mib_per_hop']:.1f} | {r['key_rows'] / total:.2f} | {r['pieces']} |")
    print("\nEach balanced rank's time fitted to its features (us per unit; R^2 of the fit, and of pairs alone):")
    for fit in fit_rank_cost(rows):
        terms = ", ".join(f"{k} {v:.3g}" for k, v in fit["us_per"].items())
        print(f"  {fit['pass']}: {terms}; R^2 {fit['r2']:.3f} (alone: pairs {fit['r2_pairs']:.3f}, whole-tile "
              f"pairs {fit['r2_tile_pairs']:.3f}; {fit['ranks']} ranks)")
    if args.profile:
        print("\n| mix | P | mode | pass | ideal ms (one call / P) | GPU span ms | busy share | idle ms (>= 5 us "
              "gaps, after a copy) | GPU ms by group |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            p, gp = r["profile"], r["profile"]["gaps"]
            grp = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p["groups_ms"].items(), key=lambda x: -x[1]))
            print(f"| {r['mix']} | {r['P']} | {r['mode']} | {r['pass']} | {r['full_ms'] / r['P']:.3f} | "
                  f"{p['span_ms']:.3f} | {p['busy_share']:.2f} | {gp['idle_ms']:.3f} ({gp['gaps']:.0f}, "
                  f"{gp['after_copy_ms']:.3f}) | {grp} |")
            for g in gp["top_gaps"][:3]:
                print(f"|  |  |  |  | gap {g['us']:.0f} us | after {g['after'][:40]} | before {g['before'][:40]} |"
                      "  |  |")
        for r in rows:
            for rank, kinds in enumerate(r.get("rank_kernels_ms") or ()):
                print(f"  {r['mix']} {r['pass']} rank {rank}: {r['rank_ms'][rank]:.3f} ms timed; "
                      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1])))
    if EXPOSED:
        print(f"\n{len(EXPOSED)} rows' batches took the host longer than the GPU load queued before them (up to "
              f"{max(EXPOSED):.2f}x): the GPU may have waited for the host there")
    assert all(math.isfinite(r["efficiency"]) for r in rows)


if __name__ == "__main__":
    main()
