"""Predicted against measured peak GPU memory: ringfa4.memory.estimate on every ringfa4 row of the
capacity results, and the least-squares refit of its constants (CPU only; reads JSON, prints a table,
writes JSON).

    python benchmarks/memory_formula.py benchmarks/results/capacity_h200.json \
        benchmarks/results/capacity_2l_h200.json --out benchmarks/results/memory_formula_h200.json

The working set of a row is its measured peak less the weights and state, the checkpointed inputs on
the GPU and any cached attention outputs. Rows whose working set is above the floor (by more than
``AT_FLOOR_GIB``: the 32k steps, at 16.4-16.8 GiB, are loss/optimizer dominated) fit, by least squares
(rows the fitted line puts under the floor, where the formula predicts the floor, leave the fit),

    working set = SLOPE * u + INTERCEPT + old * OLD_EXTRA * u

with ``old`` 1 for rows measured before fp32 LoRA and transformers' norms stopped being the defaults
(no ``lora_fp32`` key in their args; they had both, so only the sum OLD_EXTRA is identifiable).
Each row is also predicted leave-one-out: refit without it (a floor row is not in the fit, so its
leave-one-out error is its in-sample one). Roles: the 2-layer rows are "fit" (the only points at
u = 4 and 8 GiB: they anchor the extrapolation to 1M and their leave-one-out error is large), the
32-layer rows "validation". The exit status is nonzero if the constants of ringfa4/memory/estimate.py
differ from the refit by more than ``TOLERANCE`` (then no JSON is written). A row whose weights exceed
the smallest of its depth by over 1 GiB held an earlier row's model (fixed since): that excess is taken off.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import ringfa4.memory.estimate as est  # noqa: E402
from ringfa4.memory.estimate import GIB, StepMemory, step_peak_bytes  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, BYTES = 4096, 32, 128, 2
AT_FLOOR_GIB = 0.5  # working sets within this of FLOOR are at the floor (the 32k steps spread 16.4-16.8 GiB)
TOLERANCE = {"SLOPE": 0.05, "INTERCEPT_GIB": 0.1, "OLD_EXTRA": 0.05}  # estimate.py against the refit


def placement(text: str) -> tuple[int, int, int]:
    m = re.search(r"(\d+) on GPU, (\d+) on host, (\d+) rebuilt \(group (\d+)\)", text)
    if not m:
        raise ValueError(f"no placement in {text!r}")
    gpu, host, _, group = (int(x) for x in m.groups())
    return gpu, host, group


def is_old(row: dict) -> bool:
    return "lora_fp32" not in row.get("args", {})  # measured when fp32 LoRA and transformers' norms were the defaults


def predict(row: dict, state_gib: float) -> dict:
    args = row.get("args", {})
    old = is_old(row)
    gpu, host, group = placement(row["placement"])
    cached = "cached" in row["placement"]
    m = StepMemory(tokens=row["seq"], hidden=HIDDEN, dtype_bytes=BYTES, state_bytes=state_gib * GIB, gpu=gpu,
                   host=host, group=group, lora_fp32=old or args.get("lora_fp32", False),
                   plain_norms=old or args.get("plain_norms", False),
                   cached_attention_bytes=row["layers"] * row["seq"] * HEADS * (HEAD_DIM * BYTES + 4) if cached else 0)
    return step_peak_bytes(m)


def fit(points: list[dict]) -> np.ndarray | None:
    """Least squares (SLOPE, INTERCEPT GiB, OLD_EXTRA) on points with u (GiB), old (0/1), working (GiB);
    None if they do not determine all three."""
    a = np.array([[p["u"], 1.0, p["old"] * p["u"]] for p in points])
    b = np.array([p["working"] for p in points])
    if len(points) < 3 or np.linalg.matrix_rank(a) < 3:
        return None
    return np.linalg.lstsq(a, b, rcond=None)[0]


def fit_above_floor(points: list[dict]) -> tuple[np.ndarray | None, list[dict]]:
    """The fit on the points above the floor; points the fitted line then puts under the floor
    (where ``max(FLOOR, line)`` predicts them at the floor anyway) leave it, until none does.
    Returns the constants and the points fitted."""
    use = [p for p in points if p["working"] > est.FLOOR_GIB + AT_FLOOR_GIB]
    while True:
        c = fit(use)
        if c is None:
            return None, use
        keep = [p for p in use if (c[0] + p["old"] * c[2]) * p["u"] + c[1] > est.FLOOR_GIB]
        if len(keep) == len(use):
            return c, use
        use = keep


def refit_total(p: dict, c: np.ndarray | None) -> float | None:
    """A point's peak (GiB) with constants c: its fixed parts plus max(FLOOR, line)."""
    if c is None:
        return None
    slope, intercept, extra = c
    return p["fixed"] + max(est.FLOOR_GIB, (slope + p["old"] * extra) * p["u"] + intercept)


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        data = json.load(open(path))
        for r in data["rows"]:
            if isinstance(r.get("args"), type(None)) and isinstance(data.get("args"), dict):
                r["args"] = data["args"]
        rows += [r for r in data["rows"] if r.get("mode") == "ringfa4" and "peak_gib" in r]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = load(a.results)
    base = {}
    for r in rows:
        base[r["layers"]] = min(base.get(r["layers"], 1e9), r["weights_gib"])
    points = []
    for r in sorted(rows, key=lambda r: (r["layers"], r["seq"], not is_old(r), "cached" in r["placement"])):
        excess = r["weights_gib"] - base[r["layers"]]
        measured = r["peak_gib"] - (excess if excess > 1.0 else 0.0)
        p = {k: v / GIB for k, v in predict(r, base[r["layers"]] if excess > 1.0 else r["weights_gib"]).items()}
        fixed = p["state"] + p["inputs_gpu"] + p["cached_attention"]
        old = is_old(r)
        gpu, host, group = placement(r["placement"])
        points.append({
            "row": r, "measured": measured, "parts": p, "fixed": fixed, "working": measured - fixed,
            "u": r["seq"] * HIDDEN * BYTES / GIB, "old": int(old), "placement": f"{gpu} GPU/{host} host, group {group}",
            "settings": ("fp32 LoRA, HF norms" if old else "bf16 LoRA, lean norms") + (
                ", cached attn" if "cached" in r["placement"] else "")})
    c, linear = fit_above_floor(points)
    if c is None:
        sys.exit("memory_formula: the rows above the floor do not determine SLOPE, INTERCEPT and OLD_EXTRA")

    out = []
    print("| layers | tokens | settings | placement | working set GiB | measured GiB | predicted GiB "
          "| in-sample error | leave-one-out error | role |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in points:
        r = p["row"]
        in_fit = any(q is p for q in linear)
        loo = refit_total(p, fit_above_floor([q for q in points if q is not p])[0] if in_fit else c)
        predicted = p["parts"]["total"]  # the constants of estimate.py
        err = predicted / p["measured"] - 1
        loo_err = None if loo is None else loo / p["measured"] - 1
        role = "fit" if r["layers"] < 32 else "validation"
        tokens = f"{r['seq'] // 1024}k" + ("" if in_fit else " (floor)")
        loo_txt = "n/a" if loo_err is None else f"{loo_err:+.1%}"
        print(f"| {r['layers']} | {tokens} | {p['settings']} | {p['placement']} | {p['working']:.1f} | "
              f"{p['measured']:.1f} | {predicted:.1f} | {err:+.1%} | {loo_txt} | {role} |")
        out.append({"layers": r["layers"], "seq": r["seq"], "settings": p["settings"], "measured_gib": p["measured"],
                    "predicted_gib": predicted, "error": err, "loo_predicted_gib": loo, "loo_error": loo_err,
                    "in_fit": in_fit, "role": role, "refit": {"SLOPE": c[0], "INTERCEPT_GIB": c[1], "OLD_EXTRA": c[2]},
                    "parts_gib": p["parts"]})
    have = {"SLOPE": est.SLOPE, "INTERCEPT_GIB": est.INTERCEPT_GIB, "OLD_EXTRA": sum(est.EXTRA_UNITS.values())}
    refit = dict(zip(("SLOPE", "INTERCEPT_GIB", "OLD_EXTRA"), (float(x) for x in c)))
    print(f"\nleast squares on {len(linear)} rows above the floor: SLOPE {refit['SLOPE']:.3f}, "
          f"INTERCEPT {refit['INTERCEPT_GIB']:.3f} GiB, OLD_EXTRA {refit['OLD_EXTRA']:.3f} u "
          f"(estimate.py: SLOPE {have['SLOPE']}, INTERCEPT {have['INTERCEPT_GIB']} GiB, "
          f"EXTRA_UNITS sum {have['OLD_EXTRA']:.2f} u, FLOOR {est.FLOOR_GIB} GiB)")
    drift = [f"{k} {have[k]:.3f} vs refit {refit[k]:.3f}" for k in refit if abs(have[k] - refit[k]) > TOLERANCE[k]]
    if drift:
        sys.exit("memory_formula: ringfa4/memory/estimate.py differs from the least-squares refit: " + "; ".join(drift))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
