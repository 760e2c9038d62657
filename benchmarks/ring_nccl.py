"""Real NCCL ring on several GPUs: correctness against the simulated executor, and weak scaling
against PyTorch's own context parallel (cuDNN SDPA) in the same run.

    torchrun --standalone --nproc-per-node 2 benchmarks/ring_nccl.py [--out bench_results/ring_nccl.json]

1. Same inputs on every rank; the distributed executor (NCCL, fa4 blocks) on this rank's zigzag
   shard against the simulated executor run on the full sequence on the same GPU: out, lse, dq,
   dk, dv bit-identical with the deterministic backward; with the default one (fp32 gradients
   reduce-added in place into kv-head groups, two dK/dV hops a step) out / lse bit-identical and
   the gradients equal up to the order of fp32 atomics.
   With ``RingOptions(cuda_graphs=True)`` (NCCL hops captured): three calls (the first captures)
   bit-identical to eager with the deterministic backward, and every call captured. With launch
   tapes (``launch_tapes="on"``, NCCL's gate ``P2PTransport.TAPED_NCCL`` forced open): three calls
   (the second records, the third replays) bit-identical to untaped ones (``tapes_check``).
2. Weak scaling at 16k and 32k tokens per GPU (h=32, d=128, bf16, causal): efficiency =
   time(one GPU, full sequence) / (P x time per rank), forward and forward+backward, for ringfa4
   and for torch.distributed.tensor.experimental.context_parallel with the cuDNN SDPA backend.
3. Packed mixes of varlen_sim.py (``--packed``): forward+backward with the split documents' K/V by
   ring hops, by the all-gather mode's exchange in one group and in two pipelined groups (whether the
   collectives hide behind the attention on real ranks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist
from _common import bits_against, cp_step, full_call, graphs_against_eager

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, resolve


def _timed(fn, sets, iters=5, windows=5):
    """Median over windows of the mean time per call (ms); ranks start each window together."""
    fn(*sets[0])
    torch.cuda.synchronize()
    out = []
    for _ in range(windows):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(*sets[i % len(sets)])
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def check_against_simulated(cp, be, rank, P, deterministic: bool):
    """This rank's out, lse, dq, dk, dv from the distributed executor against the simulated one on
    the same GPU. Deterministic: bit-identical. Default (fp32 block gradients reduce-added by
    atomics, in place into kv-head groups): out and lse bit-identical, gradients equal up to the
    order of the fp32 atomics (relative L2 difference under 1e-2)."""
    S, h, d = 2 * P * 2048, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v, do = (torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    ql, kl, vl = (cp.shard(t).detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, causal=True, return_lse=True, deterministic=deterministic)
    out.backward(cp.shard(do).contiguous())
    sim = ringfa4.ContextParallel.simulated(P, layout="zigzag", backend=be, options=cp.options)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    so, sl = ringfa4.attention(qs, ks, vs, cp=sim, causal=True, return_lse=True, deterministic=deterministic)
    so.backward(do)
    pairs = {"out": (out, cp.shard(so)), "lse": (lse, cp.shard(sl, 2)), "dq": (ql.grad, cp.shard(qs.grad)),
             "dk": (kl.grad, cp.shard(ks.grad)), "dv": (vl.grad, cp.shard(vs.grad))}
    result, good = {}, True
    for name, (a, b) in pairs.items():
        b = b.contiguous()
        same = torch.equal(a, b)
        rel = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        result[name] = {"identical": same, "max_abs_diff": (a.float() - b.float()).abs().max().item(), "rel_l2": rel}
        good &= same if (deterministic or name in ("out", "lse")) else rel < 1e-2
    ok = torch.tensor([int(good)], device="cuda", dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"S": S, "h": h, "d": d, "rank": rank, "deterministic": deterministic, "per_tensor": result,
            "all_ranks_ok": bool(ok.item())}


def check_graphs(be, rank, P):
    """Real ranks' CUDA graphs: a ``RingOptions(cuda_graphs=True)`` group (the NCCL hops inside the
    graphs, each replay watched by the error channel) against an eager one
    (:func:`_common.graphs_against_eager`: three calls, the first captures): bit-identical with the
    deterministic backward on every rank, and both keys (forward, backward) captured."""
    S = 2 * P * 2048
    eager = ringfa4.ContextParallel(layout="zigzag", backend=be)
    graphed = ringfa4.ContextParallel(layout="zigzag", backend=be, options=ringfa4.RingOptions(cuda_graphs=True))
    res = graphs_against_eager(eager, graphed, S)
    good = all(all(s) for s in res["same"]) and res["captured"] and not res["fell_back"]
    ok = torch.tensor([int(good)], device="cuda", dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"S": S, "h": 8, "d": 128, "rank": rank, **res, "graph_mib": graphed.graph_memory() / 2**20,
            "all_ranks_ok": bool(ok.item())}


def check_tapes(be, rank, P):
    """Real ranks' launch tapes over NCCL (``P2PTransport.TAPED_NCCL`` forced on for this check; it
    gates ``launch_tapes="auto"``): a ``launch_tapes="on"`` group against an untaped
    one, three calls of new inputs (the second records, the third replays: NCCL posts and watched
    waits as tape entries), bit-identical with the deterministic backward on every rank, both keys
    recorded and replayed."""
    from ringfa4.kernels.tape import Tape
    from ringfa4.parallel.transport import P2PTransport

    S, h, d = 2 * P * 2048, 8, 128
    gate, P2PTransport.TAPED_NCCL = P2PTransport.TAPED_NCCL, True
    replays, real = [], Tape.replay
    Tape.replay = lambda self, *a, **kw: (replays.append(1), real(self, *a, **kw))[1]
    try:
        cps = [ringfa4.ContextParallel(layout="zigzag", backend=be, options=ringfa4.RingOptions(launch_tapes=t))
               for t in ("off", "on")]
        same, said = bits_against(*cps, S, "launch_tapes", h=h, d=d)
        torch.cuda.synchronize()
    finally:
        P2PTransport.TAPED_NCCL, Tape.replay = gate, real
    good = all(all(x) for x in same) and cps[1].tapes.recorded == 2 and len(replays) == 2 and not said
    ok = torch.tensor([int(good)], device="cuda", dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"S": S, "h": h, "d": d, "rank": rank, "same": same, "recorded": cps[1].tapes.recorded,
            "replays": len(replays), "said": said, "tape_mib": cps[1].tape_memory() / 2**20,
            "all_ranks_ok": bool(ok.item())}


def weak_scaling(cp, be, P, s_local, h=32, d=128):
    S = P * s_local
    spec = AttnSpec(causal=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    full = [[torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
            for _ in range(2)]
    row = {"s_per_gpu": s_local, "S": S, "P": P}

    row["one_gpu_fwd_ms"] = _timed(full_call(be, spec, False), full)
    row["one_gpu_fwdbwd_ms"] = _timed(full_call(be, spec, True), full)
    local = [[cp.shard(t).contiguous() for t in s] for s in full]

    row["ringfa4_fwd_ms"] = _timed(cp_step(cp, False), local)
    row["ringfa4_fwdbwd_ms"] = _timed(cp_step(cp, True), local)
    del local
    row.update(_torch_cp(full, P))
    for name in ("ringfa4", "torch_cp_cudnn"):
        for p in ("fwd", "fwdbwd"):
            key = f"{name}_{p}_ms"
            if row.get(key):
                row[f"{name}_{p}_eff"] = row[f"one_gpu_{p}_ms"] / (P * row[key])
    return row


def _torch_cp(full, P):
    """PyTorch's context_parallel (its default rotation) with cuDNN SDPA, causal."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        return {"torch_cp_error": str(exc)}
    mesh = init_device_mesh("cuda", (P,), mesh_dim_names=("cp",))
    res = {}
    bufs = [[t.transpose(1, 2).contiguous() for t in s] for s in full]  # (b, h, s, d)
    flat = [t for s in bufs for t in s]
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), context_parallel(mesh, buffers=flat,
                                                                        buffer_seq_dims=[2] * len(flat)):
            sets = [flat[i:i + 4] for i in range(0, len(flat), 4)]

            # context_parallel patches F.scaled_dot_product_attention: look it up at call time
            def run_fwd(q, k, v, do):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def run_fb(q, k, v, do):
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), do)

            res["torch_cp_cudnn_fwd_ms"] = _timed(run_fwd, sets)
            res["torch_cp_cudnn_fwdbwd_ms"] = _timed(run_fb, sets)
    except Exception as exc:  # report, don't hide: the row says why it is missing
        res["torch_cp_error"] = f"{type(exc).__name__}: {exc}"
    return res


def packed_modes(cp, be, P, mix: str):
    """A packed mix of ``varlen_sim.py`` (balanced placement) on real ranks: forward+backward ms a
    rank with the split documents' K/V moved by ring hops, by the all-gather in one group and in
    two pipelined groups (the collectives overlapping the attention), each forced; efficiency
    against one GPU's varlen call over the whole pack in the same run."""
    from varlen_sim import HK, D, H, mix_lengths

    from ringfa4.parallel import allgather
    from ringfa4.parallel import context as context_module

    lengths = mix_lengths(mix)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    full = [[torch.randn(sum(lengths), n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (H, HK, HK, H)]
            for _ in range(2)]
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                    max_seqlen_k=max(lengths))
    row = {"mix": mix, "P": P, "one_gpu_fwdbwd_ms": _timed(full_call(be, spec, True), full)}
    kept = (context_module.prefer_allgather, allgather.PIPELINE_PAIRS)
    for name, gathered, pairs in (("ring", False, kept[1]), ("allgather_1_group", True, 1 << 62),
                                  ("allgather_2_groups", True, 0)):
        context_module.prefer_allgather = lambda *a, gathered=gathered: gathered
        allgather.PIPELINE_PAIRS = pairs
        try:
            pack = cp.pack(cu)
            row[f"{name}_split_docs"] = len(pack.packing.split_docs())
            local = [[pack.shard(t) for t in s] for s in full]
            row[f"{name}_fwdbwd_ms"] = _timed(cp_step(cp, True, pack), local)
            row[f"{name}_eff"] = row["one_gpu_fwdbwd_ms"] / (P * row[f"{name}_fwdbwd_ms"])
        finally:
            context_module.prefer_allgather, allgather.PIPELINE_PAIRS = kept
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/ring_nccl.json")
    ap.add_argument("--per-gpu", default="16384,32768")
    ap.add_argument("--packed", default="uniform_64k,tail_256k", help="varlen_sim mixes, '' for none")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", local_rank))
    rank, P = dist.get_rank(), dist.get_world_size()
    be = get_backend(resolve("auto", "cuda", torch.bfloat16))
    cp = ringfa4.ContextParallel(layout="zigzag", backend=be, options=ringfa4.RingOptions.from_env())
    report = {"device": torch.cuda.get_device_name(), "P": P, "backend": be.name}
    report["check"] = [check_against_simulated(cp, be, rank, P, det) for det in (True, False)]
    report["graphs_check"] = check_graphs(be, rank, P)
    report["tapes_check"] = check_tapes(be, rank, P)
    report["weak_scaling"] = [weak_scaling(cp, be, P, int(s)) for s in args.per_gpu.split(",")]
    report["packed"] = [packed_modes(cp, be, P, mix) for mix in args.packed.split(",") if mix]
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report["check"]))
        print(json.dumps(report["graphs_check"]))
        print(json.dumps(report["tapes_check"]))
        print(f"\nweak scaling on {P} x {report['device']}, causal, h=32, d=128, bf16 ({be.name} blocks)")
        print("| S/GPU | one GPU fwd / fwd+bwd ms | ringfa4 fwd / fwd+bwd ms | eff | torch CP+cuDNN ms | eff |")
        print("|---|---|---|---|---|---|")
        for r in report["weak_scaling"]:
            nan = float("nan")
            tc = (f"{r.get('torch_cp_cudnn_fwd_ms', nan):.2f} / {r.get('torch_cp_cudnn_fwdbwd_ms', nan):.2f}"
                  if "torch_cp_cudnn_fwd_ms" in r else r.get("torch_cp_error", "n/a"))
            te = (f"{r.get('torch_cp_cudnn_fwd_eff', 0):.3f} / {r.get('torch_cp_cudnn_fwdbwd_eff', 0):.3f}"
                  if "torch_cp_cudnn_fwd_eff" in r else "n/a")
            print(f"| {r['s_per_gpu'] // 1024}k | {r['one_gpu_fwd_ms']:.2f} / {r['one_gpu_fwdbwd_ms']:.2f} | "
                  f"{r['ringfa4_fwd_ms']:.2f} / {r['ringfa4_fwdbwd_ms']:.2f} | {r['ringfa4_fwd_eff']:.3f} / "
                  f"{r['ringfa4_fwdbwd_eff']:.3f} | {tc} | {te} |")
        print("\npacked (balanced placement), fwd+bwd ms a rank / efficiency")
        print("| mix | one GPU ms | ring | all-gather, one group | all-gather, two groups |")
        print("|---|---|---|---|---|")
        for r in report["packed"]:
            cells = " | ".join(f"{r[f'{n}_fwdbwd_ms']:.2f} / {r[f'{n}_eff']:.3f}"
                               for n in ("ring", "allgather_1_group", "allgather_2_groups"))
            print(f"| {r['mix']} | {r['one_gpu_fwdbwd_ms']:.2f} | {cells} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
