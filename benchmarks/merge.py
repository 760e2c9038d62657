"""Bandwidth of the fused LSE merge: our CuTe DSL kernel, the Triton kernel and the torch version,
against a plain device copy (the ceiling), on one rank's zigzag half at S=64k, P=8 (8192 rows of
h=32 x d=128) and a full 32k-row accumulator.

    python benchmarks/merge.py [--out bench_results/merge.json]

Bytes per merge: the fp32 accumulator read and written, the block read (bf16 or fp32), both lse
read and one written. Inputs rotate over 4 sets (more than the 50 MB L2).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _common import median_ms

from ringfa4.kernels.cute_merge import merge_lse_cute_
from ringfa4.kernels.merge import merge_lse_torch_
from ringfa4.kernels.merge_triton import merge_lse_triton_

IMPLS = {"cute": merge_lse_cute_, "triton": merge_lse_triton_, "torch": merge_lse_torch_}


def _sets(rows: int, h: int, d: int, dtype, n: int = 4):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(n):
        acc = torch.randn(1, 2 * rows, h, d, device="cuda", generator=g)
        lacc = torch.randn(1, h, 2 * rows, device="cuda", generator=g)
        blk = torch.randn(1, rows, h, d, device="cuda", generator=g).to(dtype)
        lblk = torch.randn(1, h, rows, device="cuda", generator=g)
        out.append((acc[:, rows:], lacc[:, :, rows:], blk, lblk))  # the second zigzag half
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/merge.json")
    a = ap.parse_args()
    rows_out = []
    for rows, dtype in ((8192, torch.bfloat16), (8192, torch.float32), (32768, torch.bfloat16)):
        h, d = 32, 128
        sets = _sets(rows, h, d, dtype)
        n = rows * h * d
        nbytes = n * (8 + torch.finfo(dtype).bits // 8) + rows * h * 12
        src = [torch.randn(n * 2, device="cuda") for _ in range(4)]
        dst = [torch.empty_like(t) for t in src]
        copy_ms = median_ms(lambda x, y: y.copy_(x), list(zip(src, dst)))
        ceiling = 2 * src[0].numel() * 4 / copy_ms / 1e6  # GB/s (ms timings)
        for name, fn in IMPLS.items():
            ms = median_ms(fn, sets)
            row = {"rows": rows, "h": h, "d": d, "blk": str(dtype).split(".")[-1], "impl": name, "ms": ms,
                   "gbps": nbytes / ms / 1e6, "copy_gbps": ceiling}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nmerge into an fp32 accumulator half, {torch.cuda.get_device_name()}")
    print("| rows x h x d | block | impl | ms | GB/s | % of copy |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rows']} x {r['h']} x {r['d']} | {r['blk']} | {r['impl']} | {r['ms']:.3f} | {r['gbps']:.0f} | "
              f"{100 * r['gbps'] / r['copy_gbps']:.0f}% |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
