"""The ring executor's own host time, without kernels: the simulated executor on the CPU with a
backend whose kernels return at once (``_null_backend.py``; it answers like FA4 on sm90, so the ring
takes FA4's paths: the merge in the kernel, the in-place head-group backward). What is left is the
executor's Python per rank-step (loops, views, plans, the loopback hops' copies of tiny buffers;
no CUDA streams or events, no kernel launches): the floor under ``host_cost.py``'s numbers, and a
host-cost regression check that needs no GPU.

    python3 benchmarks/executor_floor.py --worlds 4,8 --out bench_results/executor_floor.json

Per world size and pass (fwd, fwd+bwd), at the executor level (each rank's ring on its shards) and
the API level (``ringfa4.attention`` with autograd; untaped, and with ``launch_tapes="on"``: from the
third call a replay of the recorded launches, the null kernels' no-op launches included): host us per
rank-step (median over ``--reps`` calls, and the minimum), Python function calls per rank-step
(cProfile, one call: a count that does not depend on the machine) and the torch ops a rank-step
dispatches (views included; on the device each costs host time: a proxy for it without one). Shapes: ``--tokens`` a rank
(default 256), h = 8 / kv 2, d = 16, bf16, causal zigzag; and one packed mix (``--packed`` tokens of
128-2048-token documents, the default placement), whose rows are per rank and call; and the API on real
ranks (:func:`real_rank_floor`): ``--real-rank`` spawned gloo ranks, ``--stub-peers`` rank 0 alone in a fake
process group of P ranks.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch
from _common import cp_step, executor_step
from _null_backend import NullBackend

import ringfa4
from ringfa4 import AttnSpec, RingOptions
from ringfa4.parallel.ring.run import active_steps

H, HK, D = 8, 2, 16


def _time_us(fn, reps: int) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), min(times)


def _calls(fn) -> int:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return sum(nc for (_, nc, _, _, _) in pstats.Stats(prof).stats.values())


def _torch_ops(fn) -> tuple[int, dict]:
    """The aten ops one call of ``fn`` dispatches (views included: on the device each is host time, a
    few microseconds for a view, 5-20 for a launch), and the counts by op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.by_op: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.by_op[name] = self.by_op.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn()
    return sum(count.by_op.values()), dict(sorted(count.by_op.items(), key=lambda x: -x[1]))


def floor_rows(P: int, tokens: int, reps: int) -> list[dict]:
    """Rows of one world size: executor and API level, fwd and fwd+bwd."""
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(1, tokens * P, n, D, generator=g).to(torch.bfloat16) for n in (H, HK, HK, H))
    cp = ringfa4.ContextParallel.simulated(P, backend=NullBackend(), options=RingOptions(launch_tapes="off"))
    taped = ringfa4.ContextParallel.simulated(P, backend=NullBackend(), options=RingOptions(launch_tapes="on"))
    spec = AttnSpec(causal=True)
    rank_steps = P * active_steps(cp.run(q, spec).schedule)
    rows = []
    for backward in (False, True):
        for level, fn in (("executor", executor_step(cp, spec, backward)), ("api", cp_step(cp, backward)),
                          ("api, taped", cp_step(taped, backward))):
            call = lambda fn=fn: fn(q, k, v, do)  # noqa: E731
            for _ in range(3):
                call()
            med, low = _time_us(call, reps)
            ops, by_op = _torch_ops(call)
            rows.append({"P": P, "tokens_per_rank": tokens, "pass": "fwd+bwd" if backward else "fwd", "level": level,
                         "rank_steps": rank_steps, "us_per_rank_step": med / rank_steps,
                         "min_us_per_rank_step": low / rank_steps,
                         "python_calls_per_rank_step": _calls(call) / rank_steps,
                         "torch_ops_per_rank_step": ops / rank_steps, "torch_ops_by_kind": by_op})
    return rows


def packed_rows(P: int, total: int, reps: int, seed: int = 0) -> list[dict]:
    """Rows of one packed mix (documents of 128-2048 tokens, ``total`` in all; the default
    placement), API level: host us per rank per call (a pack's ranks run different step counts)."""
    import random

    rnd, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rnd.randint(128, 2048), total - sum(lengths)))
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(total, n, D, generator=g).to(torch.bfloat16) for n in (H, HK, HK, H))
    cp = ringfa4.ContextParallel.simulated(P, backend=NullBackend())
    pack = cp.pack(cu)
    rows = []
    for backward in (False, True):
        step = cp_step(cp, backward, pack)
        call = lambda step=step: step(q, k, v, do)  # noqa: E731
        for _ in range(3):
            call()
        med, low = _time_us(call, reps)
        rows.append({"P": P, "tokens_per_rank": total // P, "pass": "fwd+bwd" if backward else "fwd",
                     "level": f"api, packed {len(lengths)} docs", "rank_steps": P, "us_per_rank_step": med / P,
                     "min_us_per_rank_step": low / P, "python_calls_per_rank_step": _calls(call) / P})
    return rows


def real_rank_floor(P: int, tokens: int, reps: int, peers: str = "spawned") -> list[dict]:
    """The API level on real ranks: a distributed ContextParallel with kernels that do nothing and
    loopback stub hops, so the metadata check is in: on every call (the default), and once per call
    key (``RingOptions(metadata_check="new_shapes")``: the timed calls repeat the first one's key), and
    so with launch tapes (``launch_tapes="on"``: CPU calls are untaped by default); rank 0's rows, with
    the check's share of the profiled call. ``peers``: "spawned" (``P`` gloo ranks: the check a gloo
    all-gather on the control group; P processes share this machine's CPUs) or "stub" (rank 0 alone, a
    fake process group: no contention, a check that agrees at once)."""
    from _real_rank import real_rank_rows

    rows = []
    variants = (("every_call", "auto", "check every call"), ("new_shapes", "auto", "check once per key"),
                ("new_shapes", "on", "check once per key, taped"))
    what = "gloo" if peers == "spawned" else "stub peers"
    for check, tapes, level in variants:
        rows += [dict(r, level=f"api, real rank ({what}, {level})")
                 for r in real_rank_rows(P, tokens, (H, HK, D), device="cpu", backend="null", reps=reps,
                                         options={"metadata_check": check, "launch_tapes": tapes}, peers=peers)]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--packed", type=int, default=8192,
                    help="tokens of the packed mix (documents of 128-2048 tokens); 0: none. Its rows are per rank "
                         "and call ('rank_steps' = P), not per rank-step")
    ap.add_argument("--real-rank", default="2",
                    help="world sizes of the real-rank rows (spawned gloo ranks, loopback stub hops, the metadata "
                         "check on every call and once per key; _real_rank.py); empty: none")
    ap.add_argument("--stub-peers", default="4,8",
                    help="world sizes of real-rank rows with stub peers (rank 0 alone in this process, a fake "
                         "process group; _real_rank.py); empty: none")
    ap.add_argument("--out", default="bench_results/executor_floor.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    worlds = [int(P) for P in filter(None, args.worlds.split(","))]  # "": no simulated rows
    rows = [r for P in worlds for r in floor_rows(P, args.tokens, args.reps)]
    if args.packed:
        rows += [r for P in worlds for r in packed_rows(P, args.packed, args.reps)]
    for P in filter(None, args.real_rank.split(",")):
        rows += real_rank_floor(int(P), args.tokens, args.reps)
    for P in filter(None, args.stub_peers.split(",")):
        rows += real_rank_floor(int(P), args.tokens, args.reps, peers="stub")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpus": os.cpu_count(), "heads": H, "kv_heads": HK, "head_dim": D, "rows": rows}, f, indent=1)
    print(f"\nexecutor floor (kernels that do nothing, CPU, h={H}/{HK}, d={D}, {args.tokens} tokens a rank)")
    print("| P | pass | level | host us / rank-step, median (min) | Python calls / rank-step "
          "| torch ops / rank-step |\n|---|---|---|---|---|---|")
    for r in rows:
        share = f", check {r['check_share']:.0%} of it" if "check_share" in r else ""
        ops = f"{r['torch_ops_per_rank_step']:.1f}" if "torch_ops_per_rank_step" in r else "-"
        print(f"| {r['P']} | {r['pass']} | {r['level']} | {r['us_per_rank_step']:.0f} "
              f"({r['min_us_per_rank_step']:.0f}){share} | {r['python_calls_per_rank_step']:.0f} | {ops} |")


if __name__ == "__main__":
    main()
