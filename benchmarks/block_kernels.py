"""Block-kernel throughput of every available backend, and ringfa4's overhead over raw FA4.

    python benchmarks/block_kernels.py [--quick] [--out bench_results/kernels.json]

Part 1: forward and backward TFLOP/s of each backend from ``ringfa4.kernels.available_backends``
(``reference`` skipped) on the shapes of shared/anchors.md: bf16, b·s = 32768 tokens, h·d = 2048,
d in {64, 128}. FLOPs: forward 4·b·h·s_q·s_k·d (halved when causal), backward 2.5x forward. Each
number is the median of ``triton.testing.do_bench`` over calls that rotate through several input
sets (randn, never zeros), after a warm-up call that pays any compile. A backend that raises
NotImplementedError for a shape is reported as n/a; any other failure as an error; the run goes on.

Part 2 (needs fa4): for s >= 4k, the fa4 backend called through ringfa4 against
``flash_attn.cute.interface._flash_attn_fwd(q, k, v, causal=..., return_lse=True)[:2]`` and
``_flash_attn_bwd(q, k, v, out, dout, lse, causal=...)`` called directly, interleaved in one run
(A/B then B/A, several repeats, median of the repeats' medians). Ratio = ringfa4 / direct; the bar
is 1.03.

Prints markdown tables last and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import ringfa4.kernels  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ringfa4.kernels import AttnSpec, available_backends, get_backend

TOKENS, HIDDEN = 32768, 2048
# (d, s, causal) of shared/anchors.md
SHAPES = [(128, 1024, False), (128, 4096, False), (128, 4096, True), (128, 16384, True),
          (128, 32768, False), (128, 32768, True), (64, 4096, True), (64, 32768, True)]
QUICK_SHAPES = [(128, 4096, False), (128, 4096, True)]
OVERHEAD_MIN_S = 4096
BAR = 1.03


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None


def make_sets(d: int, s: int, n: int, seed: int) -> list[Inputs]:
    b, h = TOKENS // s, HIDDEN // d
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return [Inputs(mk(), mk(), mk(), mk()) for _ in range(n)]


def fwd_flops(d: int, s: int, causal: bool) -> float:
    b, h = TOKENS // s, HIDDEN // d
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def timed(fn: Callable[[Inputs], object], sets: list[Inputs], rep: int) -> float:
    """Median ms of ``fn`` over calls rotating through ``sets`` (warm: compile paid before)."""
    from triton.testing import do_bench
    cycle = itertools.cycle(sets)
    return float(do_bench(lambda: fn(next(cycle)), warmup=25, rep=rep, return_mode="median"))


def warm(fn: Callable[[Inputs], object], sets: list[Inputs]) -> None:
    for st in sets:
        fn(st)
    torch.cuda.synchronize()


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def bench_backend(name: str, d: int, s: int, causal: bool, sets: list[Inputs], rep: int) -> dict:
    """One backend on one shape: fwd/bwd ms and TFLOP/s, or n/a / error."""
    row: dict = dict(backend=name, d=d, s=s, b=TOKENS // s, h=HIDDEN // d, causal=causal)
    spec = AttnSpec(causal=causal)
    flops = fwd_flops(d, s, causal)
    try:
        be = get_backend(name, "cuda")

        def fwd(st: Inputs):
            return be.forward(st.q, st.k, st.v, spec)

        def bwd(st: Inputs):
            return be.backward(st.dout, st.q, st.k, st.v, st.out, st.lse, spec)

        for st in sets:
            st.out, st.lse = fwd(st)
        torch.cuda.synchronize()
        row["fwd_ms"] = timed(fwd, sets, rep)
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        warm(bwd, sets)
        row["bwd_ms"] = timed(bwd, sets, rep)
        row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
        row["status"] = "ok"
    except NotImplementedError as exc:
        row["status"], row["reason"] = "n/a", short(exc)
    except Exception as exc:  # keep the run going; the JSON says what broke
        row["status"], row["reason"] = "error", short(exc)
        traceback.print_exc()
    return row


def bench_overhead(d: int, s: int, causal: bool, sets: list[Inputs], repeats: int, rep: int) -> dict:
    """fa4 through ringfa4 (A) vs flash-attn-4 called directly (B), interleaved."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    row: dict = dict(d=d, s=s, b=TOKENS // s, h=HIDDEN // d, causal=causal)
    be, spec = get_backend("fa4", "cuda"), AttnSpec(causal=causal)
    for st in sets:
        st.out, st.lse = be.forward(st.q, st.k, st.v, spec)
    pairs = {
        "fwd": (lambda st: be.forward(st.q, st.k, st.v, spec),
                lambda st: _flash_attn_fwd(st.q, st.k, st.v, causal=causal, return_lse=True)[:2]),
        "bwd": (lambda st: be.backward(st.dout, st.q, st.k, st.v, st.out, st.lse, spec),
                lambda st: _flash_attn_bwd(st.q, st.k, st.v, st.out, st.dout, st.lse, causal=causal)[:3]),
    }
    for kind, (a, b) in pairs.items():
        warm(a, sets)
        warm(b, sets)
        ra, rb = a(sets[0]), b(sets[0])  # same kernels: equal up to atomics' order in the backward
        row[f"{kind}_max_rel_diff"] = max(((x.float() - y.float()).norm() / y.float().norm()).item()
                                          for x, y in zip(ra, rb))
        ta, tb = [], []
        for r in range(repeats):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                (ta if which == 0 else tb).append(timed(a if which == 0 else b, sets, rep))
        row[f"{kind}_ms_ringfa4"], row[f"{kind}_ms_direct"] = statistics.median(ta), statistics.median(tb)
        row[f"{kind}_ratio"] = row[f"{kind}_ms_ringfa4"] / row[f"{kind}_ms_direct"]
        row[f"{kind}_ms_all"] = dict(ringfa4=ta, direct=tb)
    row["within_bar"] = row["fwd_ratio"] <= BAR and row["bwd_ratio"] <= BAR
    return row


def cell(rows: list[dict], name: str, d: int, s: int, causal: bool) -> str:
    for r in rows:
        if (r["backend"], r["d"], r["s"], r["causal"]) == (name, d, s, causal):
            return f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}" if r["status"] == "ok" else r["status"]
    return "-"


def tables(result: dict) -> str:
    names, shapes, rows = result["backends"], result["shapes"], result["kernels"]
    k = lambda s: f"{s // 1024}k" if s >= 1024 else str(s)
    lines = ["### Block kernels, TFLOP/s forward / backward (bf16, b·s = 32768, h·d = 2048)", "",
             "| d | s | causal | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for d, s, c in shapes:
        lines.append(f"| {d} | {k(s)} | {'yes' if c else 'no'} | "
                     + " | ".join(cell(rows, n, d, s, c) for n in names) + " |")
    ov = result.get("overhead")
    lines.append("")
    if isinstance(ov, list) and ov:
        lines += [f"### fa4 through ringfa4 / flash-attn-4 direct (time ratio, bar {BAR})", "",
                  "| d | s | causal | fwd ratio | bwd ratio | fwd ms (ours / direct) | bwd ms (ours / direct) "
                  "| within bar |", "|---|---|---|---|---|---|---|---|"]
        for r in ov:
            if "fwd_ratio" not in r:
                lines.append(f"| {r['d']} | {k(r['s'])} | {'yes' if r['causal'] else 'no'} | error: "
                             f"{r.get('reason', '')} | | | | no |")
                continue
            lines.append(
                f"| {r['d']} | {k(r['s'])} | {'yes' if r['causal'] else 'no'} | {r['fwd_ratio']:.3f} | "
                f"{r['bwd_ratio']:.3f} | {r['fwd_ms_ringfa4']:.3f} / {r['fwd_ms_direct']:.3f} | "
                f"{r['bwd_ms_ringfa4']:.3f} / {r['bwd_ms_direct']:.3f} | {'yes' if r['within_bar'] else 'NO'} |")
    else:
        lines.append(f"fa4 overhead check: {ov}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/kernels.json", help="JSON output path")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK_SHAPES} (d, s, causal), fewer repeats")
    ap.add_argument("--backends", nargs="*", default=None, help="subset of the available backends")
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated through (default 3)")
    ap.add_argument("--repeats", type=int, default=None, help="A/B repeats of the overhead check (default 6, quick 4)")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench rep time in ms (default 100)")
    ap.add_argument("--no-overhead", action="store_true", help="skip the fa4 overhead check")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/block_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.time()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    repeats = args.repeats or (4 if args.quick else 6)
    names = [n for n in available_backends("cuda") if n != "reference"]
    if args.backends:
        names = [n for n in names if n in args.backends]
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version(),
               python=sys.version.split()[0])
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "triton"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    result: dict = dict(env=env, backends=names, shapes=shapes, tokens=TOKENS, hidden=HIDDEN, quick=args.quick,
                        kernels=[], overhead=[])
    for i, (d, s, causal) in enumerate(shapes):
        sets = make_sets(d, s, args.sets, seed=i)
        for name in names:
            row = bench_backend(name, d, s, causal, sets, args.rep_ms)
            result["kernels"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "reason"} | {"t": round(time.time() - t0, 1)}),
                  flush=True)
        if "fa4" in names and not args.no_overhead and s >= OVERHEAD_MIN_S:
            try:
                row = bench_overhead(d, s, causal, sets, repeats, max(25, args.rep_ms // 2))
            except Exception as exc:
                traceback.print_exc()
                row = dict(d=d, s=s, causal=causal, reason=short(exc))
            result["overhead"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        del sets
        torch.cuda.empty_cache()
    if "fa4" not in names:
        result["overhead"] = "skipped: fa4 is not available on this device"
    elif args.no_overhead:
        result["overhead"] = "skipped (--no-overhead)"
    result["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} ({result['seconds']} s)\n")
    print(tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
