"""Compute-side efficiency of packed (varlen) ring CP on one GPU (simulated executor).

A pack of random documents (lengths uniform in [--min-doc, --max-doc]) totalling --tokens tokens;
efficiency = time(one varlen FA4 call over the whole pack) / (simulated time of all P ranks), for
the ring and the all-gather-KV modes, forward and forward+backward. Anchor: ring-flash-attn's
varlen zigzag reaches 75.9% of ideal on 8xH800 including communication.

    python benchmarks/varlen_sim.py [--out bench_results/varlen_sim.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from _common import cp_step, full_call, median_ms

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--min-doc", type=int, default=1024)
    ap.add_argument("--max-doc", type=int, default=16384)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--out", default="bench_results/varlen_sim.json")
    args = ap.parse_args()
    rnd = random.Random(0)
    lengths, total = [], 0
    while total < args.tokens:
        n = min(rnd.randint(args.min_doc, args.max_doc), args.tokens - total)
        lengths.append(n)
        total += n
    h, hk, d = 32, 8, 128
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [[torch.randn(total, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (h, hk, hk, h)]
            for _ in range(2)]
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                    max_seqlen_k=max(lengths))
    rows = []
    t_full = {b: median_ms(full_call(be, spec, b), sets, 200) for b in (False, True)}
    for P in (int(p) for p in args.worlds.split(",")):
        cp = ringfa4.ContextParallel.simulated(P, layout="zigzag", backend=be,
                                                options=ringfa4.RingOptions.from_env())
        for mode in ("ring", "allgather"):
            pack = cp.pack(cu, mode)
            for backward in (False, True):
                t = median_ms(cp_step(cp, backward, pack), sets, 200)
                rows.append({"P": P, "mode": mode, "pass": "fwd+bwd" if backward else "fwd",
                             "full_ms": t_full[backward], "ms_per_rank": t / P, "efficiency": t_full[backward] / t})
                print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "lengths": lengths, "heads": h, "kv_heads": hk,
                   "head_dim": d, "backend": be.name, "rows": rows}, f, indent=1)
    print(f"\npacked ring, simulated on one {torch.cuda.get_device_name()} ({be.name}; {len(lengths)} documents, "
          f"{total // 1024}k tokens, h={h}/{hk}, d={d}, bf16, causal zigzag)")
    print("| P | mode | pass | one varlen call ms | ms/rank | efficiency |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['mode']} | {r['pass']} | {r['full_ms']:.2f} | {r['ms_per_rank']:.3f} | "
              f"{r['efficiency']:.3f} |")


if __name__ == "__main__":
    main()
