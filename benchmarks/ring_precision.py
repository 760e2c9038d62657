"""Precision of the ring against float64, relative to one full-sequence call of the same backend.

For P in 2..32 (simulated executor, causal zigzag, bf16): rel-L2 error of out, lse, dq, dk, dv
against float64 math, divided by the error of one full-sequence call of the same backend.
Anchors (../shared/anchors.md, S=16k, h=8, d=128): forward 1.03 (P=2) .. 1.11 (P=32) with bf16
block outputs; backward with fp32 accumulation 1.12 / 1.21 / 1.23 (dq / dk / dv) at P=32.

    python benchmarks/ring_precision.py [--seq 16384] [--out bench_results/ring_precision.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, resolve


def rel(x, ref):
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    return (torch.linalg.vector_norm(x[fin] - ref[fin]) / torch.linalg.vector_norm(ref[fin])).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--worlds", default="2,4,8,16,32", help="P values, or PxU for Ulysses U x ring P/U")
    ap.add_argument("--out", default="bench_results/ring_precision.json")
    args = ap.parse_args()
    S, h, d = args.seq, args.heads, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    spec = AttnSpec(causal=True)
    exact = get_backend("reference", compute_dtype=torch.float64)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    ref_o, ref_l = exact.forward(q64, k64, v64, spec)
    ref = [ref_o, ref_l, *exact.backward(do64, q64, k64, v64, ref_o, ref_l, spec)]
    del q64, k64, v64, do64
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    o, l = be.forward(q, k, v, spec)
    full = [rel(x, r) for x, r in zip((o, l, *be.backward(do, q, k, v, o, l, spec)), ref)]
    rows = []
    for item in args.worlds.split(","):
        P, U = (int(x) for x in item.split("x")) if "x" in item else (int(item), 1)
        cp = ringfa4.ContextParallel.simulated(P, layout="zigzag", backend=be, ulysses=U,
                                                options=ringfa4.RingOptions.from_env())
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ringfa4.attention(qq, kk, vv, cp=cp, causal=True, return_lse=True)
        out.backward(do)
        errs = [rel(x, r) for x, r in zip((out, lse, qq.grad, kk.grad, vv.grad), ref)]
        rows.append({"P": P, "U": U, "errors": errs, "ratios": [e / f for e, f in zip(errs, full)]})
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "S": S, "heads": h, "head_dim": d, "backend": be.name,
                   "full_errors": full, "rows": rows}, f, indent=1)
    names = ("out", "lse", "dq", "dk", "dv")
    print(f"\nring / full-sequence {be.name} error vs float64 (S={S}, h={h}, d={d}, bf16, causal zigzag)")
    print("full-call errors: " + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, full)))
    print("| P | U x R | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['P']} | {r['U']} x {r['P'] // r['U']} | " + " | ".join(f"{x:.3f}" for x in r["ratios"]) + " |")


if __name__ == "__main__":
    main()
