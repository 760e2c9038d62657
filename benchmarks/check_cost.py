"""Host time of the per-call metadata check on a real rank: P spawned gloo processes (CPU, no GPU
needed), each times the check's all-gather (``ringfa4.parallel.checks.gather_ints`` over its
``ContextParallel``'s control group, watched by the error channel) after a barrier, as every
distributed ring call runs it once before any data moves.

    python3 benchmarks/check_cost.py --worlds 2,4,8 --out bench_results/check_cost.json

Prints a table (us per call, median and min over the ranks' medians / mins) and writes JSON rows
``{"P": n, "us_median": x, "us_min": y, "per_rank": [...]}``. On a machine with fewer cores than P
the processes share cores and the numbers grow with that too (say so beside them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world: int, port: int, reps: int, results) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        import ringfa4
        from ringfa4.parallel.checks import gather_ints

        cp = ringfa4.ContextParallel(backend="reference")
        times = []
        for i in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            gather_ints(cp.comm, cp.comm.channel.next_call(), [i] * 40, "the metadata all-gather")
            times.append((time.perf_counter() - t0) * 1e6)
        warm = times[reps // 5:]
        results.put((rank, "ok", (statistics.median(warm), min(warm))))
    except BaseException as exc:  # every failure reaches the parent
        results.put((rank, type(exc).__name__, str(exc)))
    finally:
        dist.destroy_process_group()


def check_cost(world: int, reps: int = 300) -> dict:
    """One row: the check's host us per call with ``world`` gloo ranks."""
    from _real_rank import spawn_ranks

    got = spawn_ranks(_worker, world, reps, 300.0, "check_cost")
    per_rank = [got[r] for r in range(world)]
    return {"P": world, "us_median": statistics.median(m for m, _ in per_rank),
            "us_min": min(m for _, m in per_rank), "per_rank": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default="bench_results/check_cost.json")
    args = ap.parse_args()
    rows = [check_cost(int(p), args.reps) for p in args.worlds.split(",")]
    out = {"cpus": os.cpu_count(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nmetadata check, gloo, {os.cpu_count()} CPUs\n| P | us / call, median | min |\n|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['us_median']:.0f} | {r['us_min']:.0f} |")


if __name__ == "__main__":
    main()
