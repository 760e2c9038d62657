"""The balanced solver's host time (``dispatch.balance_documents``, CPU, no GPU needed) on 1,000-document
packs: all short and whole, one 2M-token document beside them, ten of 0.2M-2M tokens, and a
log-uniform 128-2M tail; P = 8 and 64, tile 128. Median (and min) over ``--reps`` calls, with the
balance reached (FLOPs / tokens max/mean, split documents).

    python3 benchmarks/solver_time.py --out benchmarks/results/solver_time_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from ringfa4.parallel.dispatch import balance_documents


def packs(seed: int = 1) -> dict[str, tuple[int, ...]]:
    """The packs timed, by name (deterministic)."""
    rnd = random.Random(seed)
    short = lambda n: [rnd.randint(100, 4000) for _ in range(n)]  # noqa: E731
    return {"1000 short": tuple(short(1000)), "999 short + one 2M": tuple(short(999) + [2_000_000]),
            "990 short + ten 0.2M-2M": tuple(short(990) + [rnd.randint(200_000, 2_000_000) for _ in range(10)]),
            "1000 log-uniform 128-2M": tuple(int(2 ** rnd.uniform(7, 21)) for _ in range(1000))}


def rows(reps: int, worlds=(8, 64)) -> list[dict]:
    out = []
    for name, lengths in packs().items():
        for P in worlds:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                pl = balance_documents(lengths, P, 128)
                times.append((time.perf_counter() - t0) * 1e3)
            out.append({"pack": name, "P": P, "ms": statistics.median(times), "min_ms": min(times),
                        "flops_balance": pl.flop_balance(), "token_balance": pl.token_balance(),
                        "split_docs": len(pl.split)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_results/solver_time.json")
    args = ap.parse_args()
    result = rows(args.reps)
    print("| pack | P | ms, median (min) | FLOPs / tokens max/mean | split |\n|---|---|---|---|---|")
    for r in result:
        print(f"| {r['pack']} | {r['P']} | {r['ms']:.2f} ({r['min_ms']:.2f}) | {r['flops_balance']:.3f} / "
              f"{r['token_balance']:.3f} | {r['split_docs']} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpus": os.cpu_count(), "rows": result}, f, indent=1)


if __name__ == "__main__":
    main()
