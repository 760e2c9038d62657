"""How a rank's varlen calls fill the GPU's SMs, modelled on the CPU (no GPU): the tiles of FA4's sm90
varlen kernels list-scheduled in the order its tile schedulers hand them out, for each simulated rank
of ``varlen_sim.py``'s packed mixes (balanced placement, the all-gather mode's calls, tile 128).

Why: FA4's varlen tile schedulers walk a call's segments in cu_seqlens order, so a heavy segment last
in a call starts its longest tiles when the others are done and leaves SMs idle while they finish;
a rank's local order decides the segments' order (``parallel/packing.py``). The model measures that
tail; it is not a timing.

Model (h = 32 query heads, one CTA an SM): forward: per segment (n query rows, bottom-right causal
against the kl keys before its end) ``ceil(n / 128)`` query tiles x h, the last query tile of a
segment first (FA4's LPT order inside a segment), a tile costing the key tiles it sees plus
``--tile-cost``; backward: per segment ``ceil(kl / 128)`` key tiles x h in order, a tile costing
2.5 x the 128-row query blocks that see it (in blocks of 64 rows) plus ``--tile-cost``. Each tile
goes to the SM that frees first; a rank's time is the sum of its calls' makespans (calls run one after
another). Reported per mix and P (and per rank in the JSON: ``rank_fwd``, ``rank_fwd+bwd``, to set beside
``varlen_sim.py``'s ``rank_ms``): the slowest rank's time over its share (1 / P) of the one full
call's tile work (the pack's documents as the segments of one call), with the calls' segments in the
placement's local order ("local", heaviest first since fd597b3) and in document order (the order
before: each part's pieces, then the whole documents, by document index).

    python3 benchmarks/tile_schedule.py [--mixes uniform_64k,...] [--worlds 8] \
        [--out benchmarks/results/tile_schedule_cpu.json]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os

import torch
from varlen_sim import MIXES, mix_lengths

import ringfa4
from ringfa4.kernels.reference import ReferenceBackend
from ringfa4.parallel.allgather import AllGatherSchedule

TILE, HEADS, BWD_M, BWD_WORK = 128, 32, 64, 2.5
SMS = 132  # H100 / H200


def makespan(costs: list[float], sms: int) -> float:
    """Greedy list schedule: each tile, in order, on the SM that frees first; the last to finish."""
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def forward_tiles(segments: list[tuple[int, int]], tile_cost: float) -> list[float]:
    """Tile costs of a forward call over ``segments`` = [(n query rows, kl keys)], in hand-out order."""
    out = []
    for n, kl in segments:
        for i in reversed(range(-(-n // TILE))):
            end = kl - n + min((i + 1) * TILE, n)  # the tile's last row sees keys up to here
            out += [-(-end // TILE) + tile_cost] * HEADS
    return out


def backward_tiles(segments: list[tuple[int, int]], tile_cost: float) -> list[float]:
    """Tile costs of a backward call (key tiles; ``BWD_M``-row query blocks) in hand-out order."""
    out = []
    for n, kl in segments:
        first_q = kl - n
        costs = [BWD_WORK * -(-(kl - max(first_q, j * TILE)) // BWD_M) * BWD_M / TILE + tile_cost
                 for j in range(-(-kl // TILE))]
        out += costs * HEADS
    return out


def rank_calls(packing, rank: int, order: str) -> list[list[tuple[int, int]]]:
    """``rank``'s calls (the all-gather mode's: home documents, then each gather group's pieces) as
    lists of (n, kl) segments, in the local order or in document order."""
    sched = packing.schedule(AllGatherSchedule, True, (None, None))
    seg_at = {s.local: s for s in packing.segments(rank)}
    calls = []
    for call in sched.blocks(rank):
        segs = [(seg_at[q0], q1 - q0, k1 - k0) for q0, q1, k0, k1 in call.pairs]
        if order == "document":  # the order before fd597b3: part by part, each part's documents in order
            segs.sort(key=lambda x: (x[0].part, x[0].doc))
        calls.append([(n, kl) for _, n, kl in segs])
    return calls


def mix_rows(name: str, P: int, sms: int, tile_cost: float) -> dict:
    lengths = [L for L in mix_lengths(name) if L]
    cp = ringfa4.ContextParallel.simulated(P, backend=ReferenceBackend(tile=TILE))
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    packing = cp.pack(cu, "balanced").packing
    whole = [(L, L) for L in lengths]
    share = {p: sum(f(whole, tile_cost)) / sms / P for p, f in (("fwd", forward_tiles), ("bwd", backward_tiles))}
    row = {"mix": name, "P": P, "sms": sms, "tile_cost": tile_cost}
    for order in ("local", "document"):
        per_rank = []
        for r in range(P):
            calls = rank_calls(packing, r, order)
            per_rank.append({p: sum(makespan(f(c, tile_cost), sms) for c in calls if c)
                             for p, f in (("fwd", forward_tiles), ("bwd", backward_tiles))})
        row[order] = {"fwd": max(t["fwd"] for t in per_rank) / share["fwd"],
                      "fwd+bwd": max(t["fwd"] + t["bwd"] for t in per_rank) / (share["fwd"] + share["bwd"]),
                      "rank_fwd": [t["fwd"] / share["fwd"] for t in per_rank],  # each rank / its share
                      "rank_fwd+bwd": [(t["fwd"] + t["bwd"]) / (share["fwd"] + share["bwd"]) for t in per_rank]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", default=",".join(m for m in MIXES if m != "one_64k"))
    ap.add_argument("--worlds", default="8")
    ap.add_argument("--sms", type=int, default=SMS)
    ap.add_argument("--tile-cost", type=float, default=7.0,
                    help="a tile's fixed cost, in key / query blocks (varlen_tile_cost.py, H100: 6.3 fwd, 7.3 bwd)")
    ap.add_argument("--out", default="benchmarks/results/tile_schedule_cpu.json")
    args = ap.parse_args()
    rows = [mix_rows(m, int(P), args.sms, args.tile_cost) for m in args.mixes.split(",")
            for P in args.worlds.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": "list schedule of FA4 sm90 varlen tiles (see the module doc)", "heads": HEADS,
                   "rows": rows}, f, indent=1)
    print(f"slowest rank / its share of the one call's tile work ({args.sms} SMs, tile cost {args.tile_cost})")
    print("| mix | P | fwd, local order | fwd, document order | fwd+bwd, local | fwd+bwd, document |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mix']} | {r['P']} | {r['local']['fwd']:.3f} | {r['document']['fwd']:.3f} | "
              f"{r['local']['fwd+bwd']:.3f} | {r['document']['fwd+bwd']:.3f} |")


if __name__ == "__main__":
    main()
