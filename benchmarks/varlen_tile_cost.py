"""What one tile of FA4's sm90 varlen kernels costs besides its blocks: the per-tile constant that
``tile_schedule.py``'s model calls ``--tile-cost`` and that decides whether a placement should weigh
the key tiles its pieces run (session 24 fitted 16 key-block units a backward tile from 8 ranks' times
of one pack: a hypothesis, measured here directly).

Each configuration is one varlen call over ``R`` equal segments, each a document *piece*: ``n`` query
rows at depth ``p`` of its document, so its keys are the ``p + n`` rows up to the piece's end
(bottom-right causal, as a rank's segment of a split document). ``R`` is chosen so every call runs
at least ``--waves`` x 132 tiles a pass. A shallow long piece is mostly blocks; a deep short one
(``n = 256`` at ``p = 12k``: 98 key tiles, 4 query blocks each) mostly tiles. Per call and pass:

- fwd: ringfa4's FA4 backend forward (FA4's varlen kernel, q-dtype out: the all-gather mode's
  calls); its tiles are query tiles x heads, its blocks the key tiles each query tile sees;
- bwd: the accumulating varlen backward the ranks run (FA4's main kernel into padded fp32 dK/dV, the
  unpad pass; :mod:`ringfa4.kernels.fa4.varlen_bwd`), and FA4's own varlen backward (bf16 grads)
  beside it; tiles are key tiles x heads, blocks the 128-row query blocks (in 64-row steps) that
  see each key tile, times 2.5 (a backward block's work against a forward one's);

timed by ``_common.sustained_ms`` (a loaded GPU, each call behind an L2 flush). Per pass the least-
squares fit ``ms = a x blocks + b x tiles + c`` over the configurations gives the tile cost ``b / a``
in block units (and each configuration's residual). ``tile_schedule.py --tile-cost`` takes it. A
backward's key tiles go with its key rows (128 a tile), so its tile term also holds the passes over
every key row (the unpad of the fp32 dK/dV; FA4's own dK/dV postprocess): what a placement pays per
key tile either way, not the main kernel's alone.

    python3 benchmarks/varlen_tile_cost.py [--out benchmarks/results/varlen_tile_cost_h200.json]

Shapes: h = 32 / kv 8, d = 128, bf16, causal; pieces ``--pieces`` (n) by ``--depths`` (p).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from tile_schedule import HEADS, SMS, backward_tiles, forward_tiles

H, HK, D = HEADS, 8, 128


def segment_units(n: int, p: int) -> dict[str, float]:
    """Blocks and tiles of one segment (``n`` query rows at depth ``p``: keys ``p + n``) per pass,
    all heads, as ``tile_schedule.py`` counts them with no tile cost: fwd tiles = query tiles, each
    seeing the key tiles up to its last row; bwd tiles = key tiles, each seen by the 64-row query
    blocks at or below it (x 2.5 / 2: 128-row blocks of backward work)."""
    fwd, bwd = forward_tiles([(n, p + n)], 0.0), backward_tiles([(n, p + n)], 0.0)
    return {"fwd_tiles": len(fwd), "fwd_blocks": sum(fwd), "bwd_tiles": len(bwd), "bwd_blocks": sum(bwd)}


def segments_for(n: int, p: int, waves: float, sms: int = SMS, max_tokens: int = 1 << 20) -> int:
    """How many equal segments a call needs so its smaller pass runs ``waves`` x ``sms`` tiles
    (at most ``max_tokens`` key rows in all, at least one segment)."""
    u = segment_units(n, p)
    per = min(u["fwd_tiles"], u["bwd_tiles"])
    return max(1, min(math.ceil(waves * sms / per), max_tokens // (p + n)))


def fit_tile_cost(rows: list[dict], kind: str) -> dict:
    """Least squares ``ms = a x blocks + b x tiles + c`` over ``rows`` (each with ``kind``'s ``ms``
    and the call's ``<pass>_blocks`` / ``<pass>_tiles``, pass = ``kind``'s before any ``/``); returns
    a, b, c (us), the tile cost ``b / a`` in block units, R^2 and per-row residuals (ms)."""
    p = kind.split("/")[0]
    x = torch.tensor([[r[f"{p}_blocks"], r[f"{p}_tiles"], 1.0] for r in rows], dtype=torch.float64)
    y = torch.tensor([r[kind] for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    pred = x @ coef
    ss_res, ss_tot = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    a, b, c = (float(t) for t in coef)
    return {"pass": kind, "us_per_block": a * 1e3, "us_per_tile": b * 1e3, "us_per_call": c * 1e3,
            "tile_cost_blocks": b / a if a > 0 else None, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else None,
            "residual_ms": [float(t) for t in y - pred]}


def _call_inputs(n: int, p: int, R: int, device: str) -> tuple:
    """Packed q / dout (R x n rows), k / v (R x (p + n) rows) and the call's spec."""
    from ringfa4 import AttnSpec

    g = torch.Generator(device=device).manual_seed(n * 7919 + p)
    q, do = (torch.randn(R * n, H, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(R * (p + n), HK, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu_q = torch.arange(0, R * n + 1, n, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, R * (p + n) + 1, p + n, dtype=torch.int32, device=device)
    spec = AttnSpec(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=n, max_seqlen_k=p + n)
    return q, k, v, do, spec


def time_config(be, n: int, p: int, R: int, rounds: int, device: str = "cuda", measure=None) -> dict:
    """GPU ms of the forward, the accumulating backward and FA4's own backward of one call
    (``measure``: ``_common.sustained_ms`` unless given; ``device`` for the CPU test's run)."""
    if measure is None:
        from _common import sustained_ms as measure

    q, k, v, do, spec = _call_inputs(n, p, R, device)
    out, lse = be.forward(q, k, v, spec)
    grads = tuple(torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    if not be.backward_accumulate(do, q, k, v, out, lse, spec, grads):
        raise RuntimeError(f"the accumulating varlen backward of {be.name} refused the call (FA4: sm90 only)")
    fns = {"fwd": lambda: be.forward(q, k, v, spec),
           "bwd": lambda: be.backward_accumulate(do, q, k, v, out, lse, spec, grads),
           "bwd/fa4": lambda: be.backward(do, q, k, v, out, lse, spec)}
    timed = measure(fns, rounds=rounds)
    return {name: timed[name]["ms"] for name in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", default="128,256,512,1024,2048,4096", help="query rows a segment (n)")
    ap.add_argument("--depths", default="0,2048,6144,12288", help="segment depths in their document (p)")
    ap.add_argument("--waves", type=float, default=24.0, help="tiles a pass, in waves of 132")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/varlen_tile_cost_h200.json")
    args = ap.parse_args()
    from ringfa4.kernels import get_backend

    be = get_backend("fa4", "cuda", torch.bfloat16)
    rows = []
    for p in (int(x) for x in args.depths.split(",")):
        for n in (int(x) for x in args.pieces.split(",")):
            R = segments_for(n, p, args.waves)
            units = {k: R * u for k, u in segment_units(n, p).items()}
            rows.append({"n": n, "p": p, "segments": R, **units, **time_config(be, n, p, R, args.rounds)})
            r = rows[-1]
            print(f"n {n:5d} p {p:6d} R {R:5d}: fwd {r['fwd']:.3f} ms  bwd {r['bwd']:.3f}  fa4 bwd {r['bwd/fa4']:.3f}",
                  flush=True)
    fits = [fit_tile_cost(rows, kind) for kind in ("fwd", "bwd", "bwd/fa4")]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "heads": H, "kv_heads": HK, "head_dim": D,
                   "fits": fits, "rows": rows}, f, indent=1)
    print("| pass | us a block | us a tile | us a call | tile cost (blocks) | R^2 |")
    print("|---|---|---|---|---|---|")
    for fit in fits:
        cost = fit["tile_cost_blocks"]
        print(f"| {fit['pass']} | {fit['us_per_block']:.4f} | {fit['us_per_tile']:.4f} | {fit['us_per_call']:.1f} | "
              f"{'-' if cost is None else f'{cost:.1f}'} | {fit['r2']:.3f} |")


if __name__ == "__main__":
    main()
