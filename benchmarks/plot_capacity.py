"""Plot peak GPU memory against sequence length from capacity JSON (needs matplotlib).

    python benchmarks/plot_capacity.py benchmarks/results/capacity_h200.json benchmarks/results/capacity_h200.png

Rows whose ``weights_gib`` exceeds the smallest of their group by more than 1 GiB carried memory
of an earlier row (a leak of the script, since fixed): their peak is corrected by that excess and
drawn hollow.
"""

from __future__ import annotations

import json
import sys


def series(rows):
    base = min(r["weights_gib"] for r in rows if "weights_gib" in r)
    out = {}
    for r in rows:
        if "peak_gib" not in r or r["layers"] != 32:
            continue
        label = r["mode"] + (" + cached attention" if "cached" in r.get("placement", "") else "")
        excess = r["weights_gib"] - base
        corrected = excess > 1.0
        out.setdefault(label, []).append((r["seq"], r["peak_gib"] - (excess if corrected else 0.0), corrected,
                                          r.get("host_pinned_gib", 0.0)))
    return {k: sorted(v) for k, v in out.items()}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, dst = sys.argv[1], sys.argv[2]
    rows = json.load(open(src))["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, pts in series(rows).items():
        xs = [p[0] / 1024 for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", label=label)
        for x, (_, y, corrected, host) in zip(xs, pts):
            if corrected:
                ax.plot([x], [y], marker="o", markerfacecolor="white", color="gray")
            if host:
                ax.annotate(f"+{host:.0f} GiB host", (x, y), textcoords="offset points", xytext=(-70, 6), fontsize=8)
    ax.axhline(139, color="red", linestyle="--", linewidth=1)
    ax.text(180, 141, "H200 memory", color="red", fontsize=8)
    ax.scatter([64], [139], marker="x", color="C0", zorder=5)
    ax.annotate("plain: OOM at 64k (anchors.md)", (64, 139), textcoords="offset points", xytext=(5, -14), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (k)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title("Llama-3.1-8B shape, LoRA r=16, one H200: peak memory per step")
    ax.set_ylim(0, 150)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
