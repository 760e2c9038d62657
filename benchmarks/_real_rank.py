"""The real-rank path of a ring call on one machine, for host_cost.py: P processes form a gloo
process group (its metadata checks go over the gloo control group, as on any real rank), each holds
its own shard and runs ``ringfa4.attention`` through a distributed ``ContextParallel`` whose hops are
a stub: a one-rank loopback transport, so every hop copies the rank's own buffers into its receive
buffers on the communication stream (the bytes a real rank receives; contents stale: timing only).
All P ranks may share one GPU.

``real_rank_rows(P, tokens, ...)`` spawns the ranks, times each rank's host microseconds per call
(the queued-sleep method on CUDA, wall time on CPU) and returns rank 0's rows.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_us(fn, reps: int, cuda: bool, cycles: int, barrier=None) -> list[float]:
    """Host microseconds of each of ``reps`` calls of ``fn``, each behind ``cycles`` of queued GPU
    sleep; ``barrier()`` (the ranks' CPU barrier) right before each call starts the ranks together:
    the call's metadata check is a collective, so a rank timed while another is still draining its
    GPU queue (P processes sharing one GPU run their sleeps in turn) would measure the wait."""
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return times


def _worker(rank: int, world: int, port: int, spec: dict, results) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    import ringfa4
    from ringfa4.parallel import LoopbackTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cuda = spec["device"] == "cuda"
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        dt = torch.bfloat16 if cuda else torch.float32
        g = torch.Generator(device="cpu").manual_seed(rank)
        n, (h, hk, d) = spec["tokens"], spec["heads"]
        q, k, v, do = (torch.randn(1, n, x, d, generator=g).to(dev, dt) for x in (h, hk, hk, h))
        # the stub hops: a one-rank loopback, so a hop copies this rank's own buffers into its receive buffers
        cp = ringfa4.ContextParallel(backend=spec["backend"], _transport=LoopbackTransport())
        steps = cp.run(q, ringfa4.kernels.AttnSpec(causal=True)).active_steps
        rows = []
        for backward in (False, True):
            def call(backward=backward):
                qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
                out = ringfa4.attention(qq, kk, vv, cp=cp, causal=True)
                if backward:
                    out.backward(do)
            _host_us(call, 3, cuda, spec["cycles"], dist.barrier)  # warm-up (compiles), the same count everywhere
            times = _host_us(call, spec["reps"], cuda, spec["cycles"], dist.barrier)
            rows.append({"path": "real-rank", "mode": "eager", "pass": "fwd+bwd" if backward else "fwd",
                         "P": world, "tokens_per_rank": n, "layout": "dense", "rank_steps": steps,
                         "us_per_rank_step": statistics.median(times) / steps,
                         "min_us_per_rank_step": min(times) / steps})
        results.put((rank, "ok", rows))
    except BaseException as exc:  # every failure reaches the parent
        results.put((rank, type(exc).__name__, str(exc)))
    finally:
        dist.destroy_process_group()


def real_rank_rows(world: int, tokens: int, heads: tuple[int, int, int], device: str = "cuda", backend: str = "auto",
                   reps: int = 10, cycles: int = 0, timeout_s: float = 600.0) -> list[dict]:
    """Rank 0's rows (fwd, fwd+bwd) of the real-rank path with ``world`` spawned gloo ranks of
    ``tokens`` tokens each, ``heads = (h, h_kv, d)``; ``cycles``: the GPU sleep queued before each
    timed call (CUDA). Raises RuntimeError naming the rank that failed."""
    spec = {"tokens": tokens, "heads": heads, "device": device, "backend": backend, "reps": reps, "cycles": cycles}
    return spawn_ranks(_worker, world, spec, timeout_s, "real-rank host cost")[0]


def spawn_ranks(worker, world: int, arg, timeout_s: float, what: str) -> dict:
    """Run ``worker(rank, world, port, arg, results)`` in ``world`` spawned processes (a free local
    port for their gloo group); each puts ``(rank, "ok", value)`` or ``(rank, error type, message)``
    on ``results``. Returns ``{rank: value}``; raises RuntimeError naming the first rank that failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, arg, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            rank, status, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RuntimeError(f"{what}: rank {rank} failed: {status}: {value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got
