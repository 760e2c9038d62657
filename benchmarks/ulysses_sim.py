"""Compute side of Ulysses and hybrid Ulysses x ring CP on one GPU (simulated executor).

efficiency = time(one full-sequence call) / (simulated time of all P ranks). The simulation runs
each rank's block work; the Ulysses all-to-alls are a head split on one device and cost nothing
here, so the table also gives the all-to-all volume per rank, to predict multi-GPU runs:
forward sends (U-1)/U of q, k', v' and receives the same share of the output (k', v' after GQA
replication); backward the same again for dout and dq, dk', dv'.

    python benchmarks/ulysses_sim.py [--seq 65536] [--out bench_results/ulysses_sim.json]

``--packed uniform_64k,...`` times packed documents instead (``varlen_sim.py``'s mixes, its
``mix_lengths``): ``cp.pack(cu_seqlens)`` at the ring level (the default placement over the R ring
ranks; with R = 1 every document is whole) against one FA4 varlen call over the pack, the same
method (``do_bench`` medians of the whole simulated call), so U x R can be set beside the ring's
balanced dispatch for the same pack. The Ulysses pieces of a rank's tokens are its packed rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import NamedTuple

import torch
from _common import cp_step, full_call, median_ms

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, resolve
from ringfa4.parallel import HeadSplit


def a2a_mb_per_rank(S, P, U, h, h_kv, d, bytes_per=2):
    """MB each rank sends in the all-to-alls of one forward (and of one backward)."""
    if U == 1:
        return 0.0, 0.0
    n = S // P
    kv = HeadSplit(h, h_kv, U).kv_heads_total
    fwd = n * d * bytes_per * (h + 2 * kv + h) * (U - 1) / U  # q, k', v' out; out back
    bwd = n * d * bytes_per * (h + h + 2 * kv) * (U - 1) / U  # dout out; dq, dk', dv' back
    return fwd / 1e6, bwd / 1e6


class Inputs(NamedTuple):
    """What a set of configurations runs on: its name, the token count S, two rotating input sets
    (q, k, v, dout), the one-call spec and the cu_seqlens of a pack (None: one dense sequence)."""

    name: str
    S: int
    sets: list
    spec: AttnSpec
    cu: torch.Tensor | None


def dense_inputs(S: int, h: int, hk: int, d: int) -> Inputs:
    """One dense sequence of ``S`` tokens: ``(1, S, n, d)`` bf16 tensors on the GPU, causal."""
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [[torch.randn(1, S, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (h, hk, hk, h)]
            for _ in range(2)]
    return Inputs(f"dense {S // 1024}k", S, sets, AttnSpec(causal=True), None)


def mix_inputs(mix: str, h: int, hk: int, d: int) -> Inputs:
    """varlen_sim.py's packed ``mix``."""
    from varlen_sim import mix_lengths

    return packed_inputs(mix, mix_lengths(mix), (h, hk, d))


def packed_inputs(name: str, lengths: list[int], heads: tuple[int, int, int], device: str = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> Inputs:
    """Documents of ``lengths`` packed: ``(total, n, d)`` tensors for ``heads = (h, h_kv, d)`` and the
    one call's varlen spec."""
    h, hk, d = heads
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    S = int(cu[-1])
    g = torch.Generator(device=device).manual_seed(0)
    sets = [[torch.randn(S, n, d, device=device, dtype=dtype, generator=g) for n in (h, hk, hk, h)]
            for _ in range(2)]
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                    max_seqlen_k=max(lengths))
    return Inputs(f"{name} ({len(lengths)} docs)", S, sets, spec, cu)


def config_rows(be, inp: Inputs, configs: list[tuple[int, int]]) -> list[dict]:
    """Per (P, U) and pass: the simulated call's time over P (each rank's share) against one call."""
    q0, k0 = inp.sets[0][0], inp.sets[0][1]
    h, hk, d = q0.shape[-2], k0.shape[-2], q0.shape[-1]
    t_full = {b: median_ms(full_call(be, inp.spec, b), inp.sets, 200) for b in (False, True)}
    rows = []
    for P, U in configs:
        cp = ringfa4.ContextParallel.simulated(P, layout="zigzag", backend=be, ulysses=U,
                                                options=ringfa4.RingOptions.from_env())
        pack = cp.pack(inp.cu) if inp.cu is not None else None
        fwd_mb, bwd_mb = a2a_mb_per_rank(inp.S, P, U, h, hk, d)
        for backward in (False, True):
            t = median_ms(cp_step(cp, backward, pack), inp.sets, 200)
            rows.append({"input": inp.name, "S": inp.S, "P": P, "U": U, "R": P // U,
                         "pass": "fwd+bwd" if backward else "fwd", "full_ms": t_full[backward], "ms_per_rank": t / P,
                         "efficiency": t_full[backward] / t,
                         "a2a_MB_per_rank": fwd_mb + (bwd_mb if backward else 0.0)}
                        | ({"split_docs": len(pack.packing.split_docs())} if pack is not None else {}))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--configs", default="8x1,8x2,8x4,8x8", help="PxU list")
    ap.add_argument("--packed", default="", help="varlen_sim.py mixes to time as packs (instead of --seq)")
    ap.add_argument("--out", default="bench_results/ulysses_sim.json")
    args = ap.parse_args()
    h, hk, d = args.heads, args.kv_heads, 128
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    configs = [tuple(int(x) for x in item.split("x")) for item in args.configs.split(",")]
    if args.packed:
        rows = [r for mix in args.packed.split(",") for r in config_rows(be, mix_inputs(mix, h, hk, d), configs)]
    else:
        rows = config_rows(be, dense_inputs(args.seq, h, hk, d), configs)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "heads": h, "kv_heads": hk, "head_dim": d,
                   "backend": be.name, "rows": rows}, f, indent=1)
    print(f"\nUlysses x ring, simulated on one {torch.cuda.get_device_name()} ({be.name}, h={h}/{hk}, d={d}, bf16, "
          "causal)")
    print("| input | P | U x R | pass | full ms | ms/rank | efficiency | a2a MB/rank (not simulated) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['input']} | {r['P']} | {r['U']} x {r['R']} | {r['pass']} | {r['full_ms']:.2f} | "
              f"{r['ms_per_rank']:.3f} | {r['efficiency']:.3f} | {r['a2a_MB_per_rank']:.0f} |")


if __name__ == "__main__":
    main()
