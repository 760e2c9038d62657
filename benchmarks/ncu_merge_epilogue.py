"""The ring's forward kernels of one block shape under Nsight Compute: FA4's forward (bf16 out), our
fp32-output forward and the merging forward (kernels/fa4/epilogue_merge.py), one launch each after a warm-up,
inside cudaProfilerStart/Stop; then a summary per kernel from the report: duration, the warp-state
stall shares, and the SASS instructions with the most stall samples.

    bash benchmarks/ncu_merge_epilogue.sh   # on a GPU machine with ncu: runs this under ncu, then --summary
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys

import torch


def _launch(s_q: int, s_k: int, h: int, d: int) -> None:
    from flash_attn.cute.interface import flash_attn_func

    from ringfa4.kernels.fa4.epilogue_merge import fa4_forward_merge_
    from ringfa4.kernels.fa4.fp32_forward import fa4_forward_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, s_q, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, s_k, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    acc, planes = torch.empty(1, s_q, h, d, device="cuda"), torch.empty(1, h, 2, s_q, device="cuda")
    scale = d ** -0.5

    def run():
        flash_attn_func(q, k, v, softmax_scale=scale)
        fa4_forward_fp32(q, k, v, causal=False, softmax_scale=scale, out=acc, lse=planes[:, :, 0])
        planes[:, :, 1] = 1.0
        fa4_forward_merge_(q, k, v, acc, planes, causal=False, softmax_scale=scale)

    run()  # compile and warm
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _summary(rep: str, top: int) -> None:
    details = subprocess.run(["ncu", "-i", rep, "--page", "details", "--csv"], capture_output=True, text=True).stdout
    rows = list(csv.DictReader(io.StringIO(details)))
    keep = ("Duration", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Achieved Occupancy",
            "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "L2 Hit Rate", "L1/TEX Hit Rate",
            "Warp Cycles Per Issued Instruction", "Issued Warp Per Scheduler", "Stall")
    for r in rows:
        name = r.get("Metric Name", "")
        if any(k in name for k in keep):
            print(f"{r.get('ID')} {r.get('Kernel Name', '')[:40]:40s} {name:55s} {r.get('Metric Value')} "
                  f"{r.get('Metric Unit')}")
    src = subprocess.run(["ncu", "-i", rep, "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True)
    with open(rep.replace(".ncu-rep", "_source.csv"), "w") as f:
        f.write(src.stdout)
    lines = src.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if '"Address"' in line and '"Source"' in line]
    if not heads:
        print(f"no source page: {src.stderr.strip()[:300]} / {lines[:3]}")
    for n, start in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        body = [line for line in lines[start:end] if line.startswith('"')]
        table = list(csv.DictReader(io.StringIO("\n".join(body))))
        col = next((c for c in table[0] if "Sampling (All" in c), None) if table else None
        if col is None:
            print(f"section {n}: columns {list(table[0])[:14] if table else None}")
            continue
        num = lambda x: float((x or "0").replace(",", "") or 0)  # noqa: E731
        total = sum(num(t[col]) for t in table) or 1.0
        print(f"\nsection {n} ({lines[start - 1][:100] if start else ''}): {total:.0f} samples, {len(table)} lines")
        for t in sorted(table, key=lambda t: -num(t[col]))[:top]:
            print(f"  {num(t[col]) / total:6.1%}  {t.get('Address', '')}  {t.get('Source', '')[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", metavar="REPORT", help="summarize an ncu report instead of launching")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--shape", default="8192,4096,32,128", help="s_q,s_k,h,d")
    a = ap.parse_args()
    if a.summary:
        _summary(a.summary, a.top)
    else:
        _launch(*(int(x) for x in a.shape.split(",")))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
