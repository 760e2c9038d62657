"""Compute side of Ulysses and hybrid Ulysses x ring CP on one GPU (simulated executor).

efficiency = time(one full-sequence call) / (simulated time of all P ranks). The simulation runs
each rank's block work; the Ulysses all-to-alls are a head split on one device and cost nothing
here, so the table also gives the all-to-all volume per rank, to predict multi-GPU runs:
forward sends (U-1)/U of q, k', v' and receives the same share of the output (k', v' after GQA
replication); backward the same again for dout and dq, dk', dv'.

    python benchmarks/ulysses_sim.py [--seq 65536] [--out bench_results/ulysses_sim.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _common import cp_step, full_call, median_ms

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, resolve
from ringfa4.parallel import HeadSplit


def a2a_mb_per_rank(S, P, U, h, h_kv, d, bytes_per=2):
    """MB each rank sends in the all-to-alls of one forward (and of one backward)."""
    if U == 1:
        return 0.0, 0.0
    n = S // P
    kv = HeadSplit(h, h_kv, U).kv_heads_total
    fwd = n * d * bytes_per * (h + 2 * kv + h) * (U - 1) / U  # q, k', v' out; out back
    bwd = n * d * bytes_per * (h + h + 2 * kv) * (U - 1) / U  # dout out; dq, dk', dv' back
    return fwd / 1e6, bwd / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--configs", default="8x1,8x2,8x4,8x8", help="PxU list")
    ap.add_argument("--out", default="bench_results/ulysses_sim.json")
    args = ap.parse_args()
    S, h, hk, d = args.seq, args.heads, args.kv_heads, 128
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [[torch.randn(1, S, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (h, hk, hk, h)]
            for _ in range(2)]
    spec = AttnSpec(causal=True)
    rows = []
    t_full = {b: median_ms(full_call(be, spec, b), sets, 200) for b in (False, True)}
    for item in args.configs.split(","):
        P, U = (int(x) for x in item.split("x"))
        cp = ringfa4.ContextParallel.simulated(P, layout="zigzag", backend=be, ulysses=U,
                                                options=ringfa4.RingOptions.from_env())
        fwd_mb, bwd_mb = a2a_mb_per_rank(S, P, U, h, hk, d)
        for backward in (False, True):
            t = median_ms(cp_step(cp, backward), sets, 200)
            rows.append({"S": S, "P": P, "U": U, "R": P // U, "pass": "fwd+bwd" if backward else "fwd",
                         "full_ms": t_full[backward], "ms_per_rank": t / P, "efficiency": t_full[backward] / t,
                         "a2a_MB_per_rank": fwd_mb + (bwd_mb if backward else 0.0)})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "heads": h, "kv_heads": hk, "head_dim": d,
                   "backend": be.name, "rows": rows}, f, indent=1)
    print(f"\nUlysses x ring, simulated on one {torch.cuda.get_device_name()} ({be.name}, S={S // 1024}k, "
          f"h={h}/{hk}, d={d}, bf16, causal)")
    print("| P | U x R | pass | full ms | ms/rank | efficiency | a2a MB/rank (not simulated) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['U']} x {r['R']} | {r['pass']} | {r['full_ms']:.2f} | {r['ms_per_rank']:.3f} | "
              f"{r['efficiency']:.3f} | {r['a2a_MB_per_rank']:.0f} |")


if __name__ == "__main__":
    main()
