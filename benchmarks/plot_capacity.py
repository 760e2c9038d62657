"""Plot peak GPU memory against sequence length from capacity JSON (needs matplotlib).

    python benchmarks/plot_capacity.py benchmarks/results/capacity_h200.json \
        benchmarks/results/capacity_2l_h200.json benchmarks/results/capacity_h200.png

Rows whose ``weights_gib`` exceeds the smallest of their group by more than 1 GiB carried memory
of an earlier row (a leak of the script, since fixed): their peak is corrected by that excess and
drawn hollow. The dashed line is the formula of ringfa4.memory.estimate for all 32 layers with the
1M config's budgets (16 GiB GPU, 96 GiB host).
"""

from __future__ import annotations

import json
import sys


def series(rows):
    out = {}
    for r in rows:
        if "peak_gib" not in r:
            continue
        base = min(x["weights_gib"] for x in rows if "weights_gib" in x and x["layers"] == r["layers"])
        old = r["mode"] == "ringfa4" and "lora_fp32" not in (r.get("args") or {})  # before the lean defaults
        label = f"{r['mode']}, {r['layers']} layers" + (" (fp32 LoRA, HF norms)" if old else "") + (
            " + cached attention" if "cached" in r.get("placement", "") else "")
        excess = r["weights_gib"] - base
        corrected = excess > 1.0
        out.setdefault(label, []).append((r["seq"], r["peak_gib"] - (excess if corrected else 0.0), corrected,
                                          r.get("host_pinned_gib", 0.0)))
    return {k: sorted(v) for k, v in out.items()}


def formula_32_layers(seqs=(262144, 524288, 1048576)):
    from ringfa4.memory import plan_offload
    from ringfa4.memory.estimate import GIB, StepMemory, step_peak_bytes

    pts = []
    for n in seqs:
        u = n * 4096 * 2
        c = (plan := plan_offload(32, u, 16 * GIB, 96 * GIB)).counts()
        m = StepMemory(tokens=n, hidden=4096, dtype_bytes=2, state_bytes=15.2 * GIB, gpu=c["gpu"], host=c["host"],
                       group=plan.group)
        pts.append((n / 1024, step_peak_bytes(m)["total"] / GIB))
    return pts


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    *srcs, dst = sys.argv[1:]
    rows = []
    for src in srcs:
        data = json.load(open(src))
        for r in data["rows"]:  # rows of a one-call file share its top-level args
            rows.append({**r, "args": r["args"]} if r.get("args") is not None else {**r, "args": data.get("args")})
    fig, ax = plt.subplots(figsize=(7, 5.6))
    xs, ys = zip(*formula_32_layers())
    ax.plot(xs, ys, linestyle="--", color="gray", label="32 layers, formula (1M config budgets)")
    for label, pts in series(rows).items():
        xs = [p[0] / 1024 for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", label=label)
        for x, (_, y, corrected, host) in zip(xs, pts):
            if corrected:
                ax.plot([x], [y], marker="o", markerfacecolor="white", color="gray")
            if host:
                ax.annotate(f"+{host:.0f} GiB host", (x, y), textcoords="offset points", xytext=(-70, 6), fontsize=8)
    ax.axhline(139, color="red", linestyle="--", linewidth=1)
    ax.text(40, 141, "H200 memory", color="red", fontsize=8)
    ax.scatter([64], [139], marker="x", color="C0", zorder=5)
    ax.annotate("plain: OOM at 64k (anchors.md)", (64, 139), textcoords="offset points", xytext=(5, -14), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (k)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title("Llama-3.1-8B shape, LoRA r=16, one H200: peak memory per step")
    ax.set_ylim(0, 150)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
