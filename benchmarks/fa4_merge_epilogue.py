"""What the ring's forward kernel costs over FA4's own, per block shape of a zigzag ring at 64k,
P = 8 (h = 32, d = 128, bf16): FA4's forward (bf16 out, TMA store), our fp32-output forward
(kernels/fa4/fp32_forward.py: stores fp32 from registers), and the merging forward
(kernels/fa4/epilogue_merge.py: every load of the epilogue issued before any store). All in one
process, rotating over 3 input sets; each merge runs into its own
accumulator (planes initialized by one stored block).

    python benchmarks/fa4_merge_epilogue.py [--shapes ring|paired] [--out bench_results/fa4_merge_epilogue.json]

Shapes: ``8k x 4k`` (all q rows over the first kv chunk of an earlier rank), ``4k x 8k`` (the second
q chunk over all of a later rank's kv), ``8k causal`` (step 0, the rank's own chunks); with
``--shapes paired`` also ``8k x 8k`` and ``4k x 16k``, two such steps in one call.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _common import median_ms

from ringfa4.kernels.fa4.epilogue_merge import fa4_forward_merge_
from ringfa4.kernels.fa4.fp32_forward import fa4_forward_fp32

SHAPES = (("8k x 4k", 8192, 4096, False), ("4k x 8k", 4096, 8192, False), ("8k causal", 8192, 8192, True))
# two consecutive ring steps of the same kind in one call (their kv side by side): what a merge
# costs when it comes once per two steps
PAIRED = (("8k x 8k", 8192, 8192, False), ("4k x 16k", 4096, 16384, False))


def _sets(s_q: int, s_k: int, h: int, d: int, n: int = 3):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(n):
        q = torch.randn(1, s_q, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, s_k, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        acc = torch.empty(1, s_q, h, d, device="cuda")
        planes = torch.empty(1, h, 2, s_q, device="cuda")
        out.append((q, k, v, acc, planes))
    return out


def _impls(causal: bool, scale: float) -> dict:
    from flash_attn.cute.interface import flash_attn_func

    def merge(q, k, v, acc, planes):
        return fa4_forward_merge_(q, k, v, acc, planes, causal=causal, softmax_scale=scale)

    return {
        "fa4 (bf16 out)": lambda q, k, v, acc, planes: flash_attn_func(q, k, v, causal=causal, softmax_scale=scale),
        "fp32 store": lambda q, k, v, acc, planes: fa4_forward_fp32(
            q, k, v, causal=causal, softmax_scale=scale, out=acc, lse=planes[:, :, 0]),
        "merge": merge,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/fa4_merge_epilogue.json")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--shapes", choices=("ring", "paired"), default="ring")
    a = ap.parse_args()
    h, d = a.heads, a.head_dim
    scale = d ** -0.5
    rows = []
    for name, s_q, s_k, causal in SHAPES + (PAIRED if a.shapes == "paired" else ()):
        sets = _sets(s_q, s_k, h, d)
        for q, k, v, acc, planes in sets:  # a first block stored: M = its lse, S = 1
            fa4_forward_fp32(q, k, v, causal=causal, softmax_scale=scale, out=acc, lse=planes[:, :, 0])
            planes[:, :, 1] = 1.0
        flops = 4 * s_q * s_k * h * d * (0.5 if causal else 1.0)
        impls = _impls(causal, scale)
        base = None
        for impl, fn in impls.items():
            ms = median_ms(fn, sets, rep=300)
            base = ms if base is None else base
            row = {"shape": name, "s_q": s_q, "s_k": s_k, "causal": causal, "h": h, "d": d, "impl": impl,
                   "ms": ms, "tflops": flops / ms / 1e9, "over_fa4": ms / base - 1}
            rows.append(row)
            print(json.dumps(row), flush=True)
        for *_, acc, planes in sets:  # the merges kept the accumulators finite
            assert torch.isfinite(acc).all() and torch.isfinite(planes).all(), name
        del sets
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\nthe ring's forward kernels, {torch.cuda.get_device_name()}, h={h}, d={d}, bf16")
    print("| block | kernel | ms | TFLOP/s | over FA4 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} | {100 * r['over_fa4']:+.1f}% |")


if __name__ == "__main__":
    main()
