"""Does a simulated ring hop hide behind the block kernels? One rank-step's worth of FA4 blocks
(the ring's kernels: fp32-output forward, fp32-accumulating backward) timed alone, the hop's
device-to-device copies alone (``copy_``, as the loopback
transport does them; an SM kernel), and both at once on two
streams; ``hidden`` is the share of the copy time that did not add to the wall time.

    python benchmarks/hop_overlap.py [--sizes 0.25,0.5,1,2] [--out bench_results/hop_overlap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def _time(fn, reps: int = 15) -> float:
    """Median ms of ``fn`` (all its streams joined into the current one before the end event)."""
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="q rows of a rank (kv: half)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per timed region (the simulated ranks)")
    ap.add_argument("--out", default="bench_results/hop_overlap.json")
    ap.add_argument("--sizes", default="", help="comma-separated byte scales (e.g. 0.25,0.5,1,2): instead of the "
                    "methods, time the loopback copies at each scale of the hop (paced and burst), to see "
                    "whether what a hop costs the kernels grows with its bytes")
    a = ap.parse_args()
    from ringfa4.kernels.fa4 import bwd_accum as acc
    from ringfa4.kernels.fa4.fp32_forward import fa4_forward_fp32

    dev, bf = torch.device("cuda"), torch.bfloat16
    m, n, h, d, nb = a.rows, a.rows // 2, a.heads, a.head_dim, a.blocks
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=bf, generator=g)  # noqa: E731
    qs = [rnd(1, m, h, d) for _ in range(nb)]
    ks = [rnd(1, n, h, d) for _ in range(nb)]
    vs = [rnd(1, n, h, d) for _ in range(nb)]
    out = torch.empty(1, m, h, d, device=dev)
    lse = torch.empty(1, h, m, device=dev)
    scale = d ** -0.5
    comm = torch.cuda.Stream()
    most = max([float(x) for x in a.sizes.split(",") if x] + [1.0])
    kv_src = [torch.randn(int(most * 2 * m * h * d), device=dev).to(bf) for _ in range(nb)]  # one rank's (k, v)
    kv_dst = [torch.empty_like(x) for x in kv_src]
    dkv_src = [torch.randn(int(most * m * h * d), device=dev) for _ in range(nb)]  # fp32 dK/dV, one of two groups
    dkv_dst = [torch.empty_like(x) for x in dkv_src]

    def fwd(i):
        fa4_forward_fp32(qs[i], ks[i], vs[i], causal=False, softmax_scale=scale, out=out, lse=lse)

    o16, l16 = qs[0].clone(), torch.randn(1, h, m, device=dev) + 8.0
    states = [acc.prepare(qs[i], o16, qs[(i + 1) % nb], l16, softmax_scale=scale) for i in range(nb)]
    lay = acc.TileKVLayout(states[0], ks[0], n)
    bufs = [torch.zeros(lay.numel, device=dev) for _ in range(nb)]

    def bwd(i):
        acc.accumulate_tiles(states[i], ks[i], vs[i], *lay.cols(bufs[i], n, 0, n))

    side, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

    def variant(kind: str, kernel, copy):
        """One timed region: ``nb`` kernels and ``nb`` copies as ``kind`` arranges them."""
        def run():
            cur = torch.cuda.current_stream()
            if kind == "kernels":
                for i in range(nb):
                    kernel(i)
                return
            stream = high if kind == "burst, high-priority comm" else comm
            if kind == "paced":  # copy i beside kernel i, as one real rank's hop beside its block
                for i in range(nb):
                    stream.wait_stream(cur)
                    with torch.cuda.stream(stream):
                        copy(i)
                    kernel(i)
            elif kind == "burst, kernels first":
                ev = cur.record_event()
                for i in range(nb):
                    kernel(i)
                stream.wait_event(ev)
                with torch.cuda.stream(stream):
                    for i in range(nb):
                        copy(i)
            else:
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    for i in range(nb):
                        copy(i)
                if kind == "copies":
                    pass
                elif kind == "burst, kernels on a side stream":
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        for i in range(nb):
                            kernel(i)
                    cur.wait_stream(side)
                else:
                    for i in range(nb):
                        kernel(i)
            cur.wait_stream(stream)
        return run

    kinds = ("burst, copies first", "burst, kernels first", "burst, kernels on a side stream",
             "burst, high-priority comm", "paced")
    rows = []
    def copier(method: str, src, dst):
        def copy(i):
            if method == "SM kernel":
                torch.neg(src[i], out=dst[i])
            else:
                dst[i].copy_(src[i], non_blocking=True)
        return copy

    methods = ("copy_", "SM kernel")
    scales = [float(x) for x in a.sizes.split(",") if x]
    for name, kernel, (src_all, dst_all) in (("fwd", fwd, (kv_src, kv_dst)), ("bwd", bwd, (dkv_src, dkv_dst))):
        for scale_b in scales:  # --sizes: the loopback's copies at each byte scale of the hop
            base = src_all[0].numel() / most
            src, dst = ([x[: int(scale_b * base)] for x in xs] for xs in (src_all, dst_all))
            copy = copier("copy_", src, dst)
            t_k = _time(variant("kernels", kernel, copy))
            t_c = _time(variant("copies", kernel, copy))
            mb = sum(x.numel() * x.element_size() for x in src) / 2 ** 20
            for kind in ("burst, copies first", "paced"):
                t_b = _time(variant(kind, kernel, copy))
                rows.append(dict(kernels=name, copy="copy_", order=kind, scale=scale_b,
                                 kernels_ms=t_k, copies_ms=t_c, copies_mb=mb, both_ms=t_b,
                                 hidden=(t_k + t_c - t_b) / t_c, cost_ms=t_b - t_k))
                print(json.dumps(rows[-1]), flush=True)
        src, dst = ([x[: int(x.numel() / most)] for x in xs] for xs in (src_all, dst_all))
        for method in methods if not scales else ():
            copy = copier(method, src, dst)
            for x in dst:
                x.zero_()
            copy(0)
            torch.cuda.synchronize()
            want = -src[0] if method == "SM kernel" else src[0]
            assert torch.equal(dst[0], want), f"{method} copy is wrong"
            t_k = _time(variant("kernels", kernel, copy))
            t_c = _time(variant("copies", kernel, copy))
            mb = sum(x.numel() * x.element_size() for x in src) / 2 ** 20
            for kind in (kinds if method == "copy_" else ("burst, copies first", "paced")):
                t_b = _time(variant(kind, kernel, copy))
                rows.append(dict(kernels=name, copy=method, order=kind, kernels_ms=t_k,
                                 copies_ms=t_c, copies_mb=mb, both_ms=t_b, hidden=(t_k + t_c - t_b) / t_c))
                print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows_q": m, "rows_kv": n, "heads": h, "head_dim": d,
                   "blocks": nb, "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                   "rows": rows}, f, indent=1)
    print(f"\nhop overlap on {torch.cuda.get_device_name()} ({nb} blocks of {m} x {n}, h={h}, d={d}; "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')})")
    print("| kernels | copy | order | kernels ms | copies ms (MB) | both ms | hidden | cost ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernels']} | {r['copy']} | {r['order']} | {r['kernels_ms']:.3f} | {r['copies_ms']:.3f} "
              f"({r['copies_mb']:.0f}) | {r['both_ms']:.3f} | {100 * r['hidden']:.0f}% | "
              f"{r['both_ms'] - r['kernels_ms']:.3f} |")


if __name__ == "__main__":
    main()
