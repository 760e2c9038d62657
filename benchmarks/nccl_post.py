"""What posting one ring hop over NCCL costs the host: torch's ``batch_isend_irecv`` (P2P op objects,
their checks, the coalescing manager) against the P2P transport's own batch
(``P2PTransport._nccl_batch``: the process group's coalescing calls, its sends and receives), one GPU;
and a hop after the first (one flat ``[k | v]`` buffer, :class:`~ringfa4.parallel.ring.buffers.KVRing`)
as that batch against one ``all_to_all_single`` collective of the flat buffer (one call into the
process group where the batch makes four).

    python3 benchmarks/nccl_post.py --out benchmarks/results/nccl_post_h100.json

A one-rank NCCL group (this process; NCCL sends to and receives from the rank itself), a hop of two
pieces as a GQA K/V hop is: ``--tokens`` x 8 kv heads x 128, bf16, each sent to and received from
rank 0. A GPU sleep is queued first, so a post only enqueues (host time, not the transfer); each
timed post is then waited (stream-ordered) outside the timing. Per path: host us a post, median and
minimum over ``--reps`` posts, ``--rounds`` rounds with the paths interleaved; every round checks
the received pieces equal the sent ones. The process ends without tearing the group down
(destroying a one-rank NCCL group after its sends to self was seen to hang: torch 2.11, one H100).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ringfa4.parallel.transport import P2PTransport  # noqa: E402


def _timed(post, sent: list, received: list, reps: int) -> list[float]:
    """Host us of ``reps`` posts behind a queued GPU sleep, each waited after its timing; the
    ``received`` tensors must then equal the ``sent`` ones."""
    for work in post():  # first use (the communicator's)
        work.wait()
    torch.cuda.synchronize()
    for r in received:
        r.zero_()
    torch.cuda._sleep(1 << 28)  # queued GPU work: a post only enqueues behind it
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        works = post()
        times.append((time.perf_counter() - t0) * 1e6)
        for work in works:
            work.wait()
    torch.cuda.synchronize()
    if not all(torch.equal(r, t) for r, t in zip(received, sent, strict=True)):
        raise RuntimeError("a hop to self did not deliver its pieces")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_results/nccl_post.json")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    k, v = (torch.randn(args.tokens, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rk, rv = torch.empty_like(k), torch.empty_like(v)
    flat = torch.cat([k.reshape(-1), v.reshape(-1)])  # a later hop's flat [k | v]
    rflat = torch.empty_like(flat)
    hops = P2PTransport(group, 0, 1, datetime.timedelta(seconds=60))

    def torch_batch():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, k, 0, group), dist.P2POp(dist.irecv, rk, 0, group),
                                       dist.P2POp(dist.isend, v, 0, group), dist.P2POp(dist.irecv, rv, 0, group)])

    def transport_batch():
        return hops._nccl_batch([k, v], [0, 0], [rk, rv], [0, 0])

    def transport_flat():
        return hops._nccl_batch([flat], [0], [rflat], [0])

    def all_to_all_flat():
        return [dist.all_to_all_single(rflat, flat, [flat.numel()], [flat.numel()], group=group, async_op=True)]

    def pg_all_to_all_flat():  # the process group's own call, without dist.all_to_all_single's Python
        return [group.alltoall_base(rflat, flat, [flat.numel()], [flat.numel()], dist.AllToAllOptions())]

    two, one = ([k, v], [rk, rv]), ([flat], [rflat])
    paths = {"batch_isend_irecv": (torch_batch, two), "P2PTransport._nccl_batch": (transport_batch, two),
             "flat: P2PTransport._nccl_batch": (transport_flat, one),
             "flat: all_to_all_single": (all_to_all_flat, one),
             "flat: ProcessGroup.alltoall_base": (pg_all_to_all_flat, one)}
    rounds: dict[str, list[list[float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, (post, (sent, received)) in paths.items():
            rounds[name].append(_timed(post, sent, received, args.reps))
    rows = [{"path": name, "us_per_post": statistics.median(t for r in got for t in r),
             "min_us_per_post": min(t for r in got for t in r),
             "round_medians_us": [statistics.median(r) for r in got]} for name, got in rounds.items()]
    print(f"\nNCCL hop post, host us ({args.tokens} x 8 x 128 bf16 K and V to self, {torch.cuda.get_device_name()})")
    print("| path | median | min | round medians |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['us_per_post']:.1f} | {r['min_us_per_post']:.1f} | "
              + ", ".join(f"{m:.1f}" for m in r["round_medians_us"]) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "tokens": args.tokens, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # (no teardown: see the module doc)


if __name__ == "__main__":
    main()
