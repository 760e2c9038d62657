"""Predicted against measured peak GPU memory: ringfa4.memory.estimate on every ringfa4 row of the
capacity results (CPU only; reads JSON, prints a table, writes JSON).

    python benchmarks/memory_formula.py benchmarks/results/capacity_h200.json \
        benchmarks/results/capacity_2l_h200.json --out benchmarks/results/memory_formula_h200.json

Rows of the fit (the 2-layer 512k and 1M steps, the 32-layer 32k step) are marked; the others test
the formula. Rows measured before fp32 LoRA and transformers' norms stopped being the defaults (no
``lora_fp32`` key in their args) are predicted with those settings. A row whose weights exceed the
smallest of its depth by over 1 GiB held an earlier row's model (fixed since): that excess is taken off.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from ringfa4.memory.estimate import GIB, StepMemory, step_peak_bytes  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, BYTES = 4096, 32, 128, 2
FIT = {(2, 524288), (2, 1048576), (32, 32768)}


def placement(text: str) -> tuple[int, int, int]:
    m = re.search(r"(\d+) on GPU, (\d+) on host, (\d+) rebuilt \(group (\d+)\)", text)
    if not m:
        raise ValueError(f"no placement in {text!r}")
    gpu, host, _, group = (int(x) for x in m.groups())
    return gpu, host, group


def predict(row: dict, state_gib: float) -> dict:
    args = row.get("args", {})
    old = "lora_fp32" not in args  # measured when fp32 LoRA and transformers' norms were the defaults
    gpu, host, group = placement(row["placement"])
    cached = "cached" in row["placement"]
    m = StepMemory(tokens=row["seq"], hidden=HIDDEN, dtype_bytes=BYTES, state_bytes=state_gib * GIB, gpu=gpu,
                   host=host, group=group, lora_fp32=old or args.get("lora_fp32", False),
                   plain_norms=old or args.get("plain_norms", False),
                   cached_attention_bytes=row["layers"] * row["seq"] * HEADS * (HEAD_DIM * BYTES + 4) if cached else 0)
    return step_peak_bytes(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for path in a.results:
        data = json.load(open(path))
        for r in data["rows"]:
            if isinstance(r.get("args"), type(None)) and isinstance(data.get("args"), dict):
                r["args"] = data["args"]
        rows += [r for r in data["rows"] if r.get("mode") == "ringfa4" and "peak_gib" in r]
    base = {}
    for r in rows:
        base[r["layers"]] = min(base.get(r["layers"], 1e9), r["weights_gib"])
    out = []
    print("| layers | tokens | settings | placement | measured GiB | predicted GiB | error | role |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["layers"], r["seq"], "cached" in r["placement"])):
        excess = r["weights_gib"] - base[r["layers"]]
        measured = r["peak_gib"] - (excess if excess > 1.0 else 0.0)
        p = predict(r, base[r["layers"]] if excess > 1.0 else r["weights_gib"])
        old = "lora_fp32" not in r.get("args", {})
        settings = ("fp32 LoRA, HF norms" if old else "bf16 LoRA, lean norms") + (
            ", cached attn" if "cached" in r["placement"] else "")
        gpu, host, group = placement(r["placement"])
        role = "fit" if (r["layers"], r["seq"]) in FIT and "cached" not in r["placement"] else "test"
        err = p["total"] / GIB / measured - 1
        print(f"| {r['layers']} | {r['seq'] // 1024}k | {settings} | {gpu} GPU/{host} host, group {group} | "
              f"{measured:.1f} | {p['total'] / GIB:.1f} | {err:+.1%} | {role} |")
        out.append({"layers": r["layers"], "seq": r["seq"], "settings": settings, "measured_gib": measured,
                    "predicted_gib": p["total"] / GIB, "error": err, "role": role,
                    "parts_gib": {k: v / GIB for k, v in p.items()}})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
