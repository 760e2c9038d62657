"""What a taped ring call launches, entry by entry: the launch tapes a simulated ``ContextParallel``
records for ``ringfa4.attention`` (forward, and forward+backward), counted by what each entry runs
(a kernel's callable, or the aten op a torch launch replays as). The launch counts of
``host_cost.py`` say how many; this says which, so a count that moves can be traced to its kernels.

    python3 benchmarks/tape_entries.py --worlds 4,8 --out bench_results/tape_entries.json   # GPU: FA4
    python3 benchmarks/tape_entries.py --null --tokens 256                                  # CPU: no-op kernels

Shapes: ``--tokens`` a rank (default 4096), h = 32 / kv 8, d = 128, bf16, causal zigzag, default
options with ``launch_tapes="on"``. Per world size and pass: the entries of the forward's tape and
the backward's, by name, per rank and call (each rank of the simulated call issues the same kinds).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from _common import cp_step
from _null_backend import NullBackend

import ringfa4
from ringfa4 import RingOptions


def tape_rows(P: int, tokens: int, null: bool) -> list[dict]:
    """Rows for one world size: per pass and tape, the entry names with their counts per rank."""
    h, hk, d = (8, 2, 16) if null else (32, 8, 128)
    device = "cpu" if null else "cuda"
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(1, tokens * P, n, d, generator=g).to(torch.bfloat16).to(device) for n in (h, hk, hk, h))
    rows = []
    for backward in (False, True):
        backend = {"backend": NullBackend()} if null else {}
        cp = ringfa4.ContextParallel.simulated(P, options=RingOptions(launch_tapes="on"), **backend)
        step = cp_step(cp, backward)
        for _ in range(4):  # recorded at a key's second call, replayed from the third
            step(q, k, v, do)
        for key, tape in cp.tapes.captured.items():
            if tape is None:
                continue
            counts = collections.Counter(e.name for e in tape.entries)
            rows.append({"P": P, "tokens_per_rank": tokens, "pass": "fwd+bwd" if backward else "fwd",
                         "tape": key[0].__name__, "entries": len(tape.entries),
                         "per_rank": {n: c / P for n, c in counts.most_common()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--null", action="store_true", help="no-op kernels on the CPU (_null_backend.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [r for P in map(int, args.worlds.split(",")) for r in tape_rows(P, args.tokens, args.null)]
    seen = set()
    for r in rows:
        if (r["P"], r["tape"]) in seen:  # the fwd+bwd run records the forward's tape again
            continue
        seen.add((r["P"], r["tape"]))
        print(f"P = {r['P']}, {r['tape']}: {r['entries']} entries, {r['entries'] / r['P']:.2f} a rank")
        for name, c in r["per_rank"].items():
            print(f"    {c:6.2f}  {name}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        device = "cpu-null" if args.null else torch.cuda.get_device_name()
        with open(args.out, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
