"""The real-rank path of a ring call on one machine, for host_cost.py: P processes form a gloo
process group (its metadata checks go over the gloo control group, as on any real rank), each holds
its own shard and runs ``ringfa4.attention`` through a distributed ``ContextParallel`` whose hops are
a stub: every hop copies the rank's own buffers into its receive buffers on the communication stream
(the bytes a real rank receives; contents stale: timing only). All P ranks may share one GPU.
``hops`` picks how a hop is waited for:

- ``"loopback"``: a one-rank loopback transport (the compute stream waits on the copy's event; no
  error channel);
- ``"stream-ordered"``: the P2P transport's path with a stand-in NCCL work per hop, waited through
  the error channel as on NCCL (``work.wait()``, the watch thread polling it);
- ``"blocking"``: the same, waited as NCCL with a timeout is (``work.wait(timeout)`` blocks the CPU
  until the copy is done: the path before stream-ordered waits);
- ``"nccl"``: real hops, the ranks an NCCL group with one GPU each (P GPUs; the data really moves);
- ``"nccl-self"`` (stub peers only): real NCCL hops over a one-rank NCCL group, each to and from the
  rank itself (:func:`self_nccl_p2p`): NCCL's host path a hop on one GPU.

``real_rank_rows(P, tokens, ...)`` spawns the ranks, times each rank's host microseconds per call
(the queued-sleep method on CUDA, wall time on CPU) and returns rank 0's rows. With ``peers="stub"``
rank 0 runs alone in this process, a member of torch's fake process group of P ranks (its
collectives return at once, its own data as every rank's, so every check agrees): the same rank's
host path without the spawned ranks' contention for one GPU and host.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import statistics
import sys
import time
from collections.abc import Iterator

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


class _CopyWork:
    """A stand-in NCCL work: the hop's copy event. ``wait()`` orders the current stream after it;
    ``wait(timeout)`` blocks the CPU until it is done (NCCL's behaviour with a timeout)."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self, timeout=None) -> bool:
        if timeout is None:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            self.event.synchronize()
        return True

    def is_completed(self) -> bool:
        return self.event.query()


def _stub_p2p(transport, blocking: bool):
    """``transport`` (this rank's P2PTransport) with its hops replaced by own-buffer copies on the
    communication stream, each handed to the error channel as a :class:`_CopyWork`: one post a hop
    (fork, copies, event: one launched function, as NCCL's batch is one call) and its watched wait."""
    from ringfa4.kernels.copies import one_dtype
    from ringfa4.parallel.transport import P2PTransport, _Handle, _pieces

    class StubP2P(P2PTransport):
        def capture_blocker(self):  # GPU copies on the communication stream, as NCCL's hops would be
            return None

        def tape_blocker(self):  # a post and a watched wait a hop: what a tape records of NCCL's hops
            return None         # (P2PTransport.TAPED_NCCL), without NCCL's own host time a hop

        def shift(self, send, recv, offset):
            (s,), (r,) = send, recv
            done = self.post_copies(_pieces(s)[0].device, [one_dtype(_pieces(r), _pieces(s))])
            return _Handle(works=[_CopyWork(done)], event=((self.rank - offset) % self.world_size,
                                                            (self.rank + offset) % self.world_size, None, None))

    stub = StubP2P(transport.group, transport.rank, transport.world_size, transport.timeout, transport.channel,
                   transport.cp_ranks)
    stub.channel.gloo = blocking  # the gloo path's sliced wait(timeout) blocks like NCCL's wait(timeout)
    return stub


def self_nccl_p2p(transport, group):
    """``transport`` (this rank's P2PTransport in a fake world, see :func:`_stub_peers_rows`) with
    real NCCL hops over ``group``, a one-rank NCCL group: every hop sends to and receives from this
    rank itself (NCCL's send/receive to self), posted, taped and waited exactly as a rank's hops to its
    peers are; what arrives is the rank's own buffers (as the loopback stub's copies)."""
    from ringfa4.parallel.transport import P2PTransport

    class SelfP2P(P2PTransport):
        def _peer(self, group_rank: int) -> int:
            return 0  # (the one-rank group's only rank: this one)

        def _global(self, group_rank: int) -> int:  # (trees before session 41 post through torch's
            return dist.get_global_rank(self.group, 0)  # batch_isend_irecv: compare_parent.sh's parent)

    return SelfP2P(group, transport.rank, transport.world_size, transport.timeout, transport.channel,
                   transport.cp_ranks)


def _profiled(call, steps: int, top: int = 0) -> dict:
    """One call under cProfile (every rank, so the collectives match): Python calls per rank-step,
    and the share of the call's profiled time spent in the metadata check (``exchange_and_check``,
    its gloo all-gather included); ``top`` > 0: also the ``top`` functions with the most own time
    (``profile``: function, calls, own and cumulative us)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    call()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(tt for (_, _, tt, _, _) in stats.values())
    check = sum(ct for (file, _, fn), (_, _, _, ct, _) in stats.items()
                if fn == "exchange_and_check" and file.endswith("checks.py"))
    out = {"python_calls_per_rank_step": sum(nc for (_, nc, _, _, _) in stats.values()) / steps,
           "check_share": check / total if total else 0.0}
    if top:
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        out["profile"] = [{"function": f"{os.path.basename(file)}:{line}:{fn}", "calls": nc, "own_us": tt * 1e6,
                           "cum_us": ct * 1e6} for (file, line, fn), (_, nc, tt, ct, _) in rows]
    return out


def _rank_rows(rank: int, world: int, spec: dict, barrier) -> list[dict]:
    """This rank's rows (fwd, fwd+bwd) once its process group is up; ``barrier``: the ranks' CPU
    barrier before each timed call (None for one process standing for all)."""
    import ringfa4
    from ringfa4.parallel import LoopbackTransport

    nccl = spec["hops"] == "nccl"  # real NCCL hops, one GPU a rank (the two-GPU kind)
    cuda = spec["device"] == "cuda"
    dev = torch.device("cuda", rank if nccl else 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    null = spec["backend"] == "null"  # kernels that do nothing (executor_floor.py's real-rank rows)
    dt = torch.bfloat16 if cuda or null else torch.float32
    if null:
        from _null_backend import NullBackend

        spec = dict(spec, backend=NullBackend())
    g = torch.Generator(device="cpu").manual_seed(rank)
    n, (h, hk, d) = spec["tokens"], spec["heads"]
    q, k, v, do = (torch.randn(1, n, x, d, generator=g).to(dev, dt) for x in (h, hk, hk, h))
    opts = ringfa4.RingOptions.from_env().replace(**{"metadata_check": "every_call", "cuda_graphs": False,
                                                     **spec["options"]})
    # the stub hops: a hop copies this rank's own buffers into its receive buffers
    if spec["hops"] == "loopback":
        cp = ringfa4.ContextParallel(backend=spec["backend"], _transport=LoopbackTransport(), options=opts)
    elif nccl:  # the library's own P2P transport over the NCCL group (stream-ordered waits)
        cp = ringfa4.ContextParallel(backend=spec["backend"], options=opts)
    elif spec["hops"] == "nccl-self":  # real NCCL hops, each to this rank itself (stub peers, one GPU)
        cp = ringfa4.ContextParallel(backend=spec["backend"], options=opts)
        cp.transport = cp.comm.transport = self_nccl_p2p(cp.comm.transport, spec["self_group"])
    else:
        cp = ringfa4.ContextParallel(backend=spec["backend"], options=opts)
        cp.transport = cp.comm.transport = _stub_p2p(cp.comm.transport, spec["hops"] == "blocking")
    steps = cp.run(q, ringfa4.kernels.AttnSpec(causal=True)).active_steps
    rows = []
    for backward in (False, True):
        def call(backward=backward):
            qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
            out = ringfa4.attention(qq, kk, vv, cp=cp, causal=True)
            if backward:
                out.backward(do)
        _host_us(call, 3, cuda, spec["cycles"], barrier)  # warm-up (compiles), the same count everywhere
        times = _host_us(call, spec["reps"], cuda, spec["cycles"], barrier)
        captured = cp.graphs is not None and any(cp.graphs.captured.values())
        taped = cp.tapes is not None and cp.tapes.recorded > 0
        rows.append({"path": "real-rank", "peers": "spawned" if barrier is not None else "stub",
                     "hops": spec["hops"], "mode": "graphs" if captured else "eager",
                     "metadata_check": opts.metadata_check, "taped": taped,
                     "pass": "fwd+bwd" if backward else "fwd",
                     "P": world, "tokens_per_rank": n, "layout": "dense", "rank_steps": steps,
                     "us_per_rank_step": statistics.median(times) / steps,
                     "min_us_per_rank_step": min(times) / steps,
                     **_profiled(call, steps, 25 if spec.get("profile") else 0)})
    return rows


def _worker(rank: int, world: int, port: int, spec: dict, results) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    torch.set_num_threads(1)
    nccl = spec["hops"] == "nccl"
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        results.put((rank, "ok", _rank_rows(rank, world, spec, dist.barrier)))
    except BaseException as exc:  # every failure reaches the parent
        results.put((rank, type(exc).__name__, str(exc)))
    finally:
        dist.destroy_process_group()


STUB_PEER_HOPS = ("loopback", "stream-ordered", "nccl-self")  # (no peer to hold a blocking wait)


@contextlib.contextmanager
def stub_world(world: int, nccl_self: bool = False, teardown: bool = True) -> Iterator[dist.ProcessGroup | None]:
    """This process as rank 0 of torch's fake process group of ``world`` ranks, for the ``with``
    block: its collectives return at once, this rank's data as every rank's, so the peers agree with
    every check. ``nccl_self``: also a one-rank NCCL group (yielded, else None) for
    :func:`self_nccl_p2p`'s hops. ``teardown`` False: the groups stay up after the block, for a
    process about to end (destroying a one-rank NCCL group after its sends to self was seen to hang:
    torch 2.11, one H100)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ringfa4.parallel import checks

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    gather = checks.gather_ints
    try:
        mine, every = torch.arange(3), torch.full((3 * world,), -1)
        dist.all_gather_into_tensor(every, mine)
        if not torch.equal(every, mine.repeat(world)):  # an older fake group leaves the output as it was: the
            checks.gather_ints = lambda comm, call, values, what: [list(values)] * comm.world_size  # peers agree
        yield _one_rank_group("nccl") if nccl_self else None
    finally:
        checks.gather_ints = gather
        if teardown:
            dist.destroy_process_group()


def _one_rank_group(backend: str) -> dist.ProcessGroup:
    """A group of this fake world's rank 0 alone, on ``backend``, made over a store of its own (an NCCL
    communicator's id goes through the store; the fake world's keeps nothing, so its error channel
    finds no peer's keys to wait for)."""
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    kind, store = c10d._world.pg_map[default]
    c10d._world.pg_map[default] = (kind, dist.HashStore())
    try:
        return dist.new_group([0], backend=backend, use_local_synchronization=True)
    finally:
        c10d._world.pg_map[default] = (kind, store)


def _stub_peers_rows(world: int, spec: dict) -> list[dict]:
    """Rank 0's rows in this process, its peers stubbed (:func:`stub_world`) and stub hops: a real
    rank's host path without P processes sharing one GPU and host (whose contention the spawned rows
    pay) and without the network's latency. NCCL's hops to self run in a process of their own
    (:func:`_self_nccl_worker`)."""
    if spec["hops"] not in STUB_PEER_HOPS:
        raise ValueError(f"stub peers take {', '.join(STUB_PEER_HOPS)} hops, got {spec['hops']!r}")
    if spec["hops"] == "nccl-self":
        return spawn_ranks(_self_nccl_worker, 1, (world, spec), 600.0, "real-rank host cost, NCCL hops to self")[0]
    with stub_world(world) as group:
        return _rank_rows(0, world, dict(spec, self_group=group), None)


def _self_nccl_worker(rank: int, _one: int, port: int, arg: tuple, results) -> None:
    """:func:`_stub_peers_rows` with NCCL's hops to self (``arg``: the fake world's size and the spec),
    in a process that ends without tearing its groups down (:func:`stub_world`'s ``teardown``)."""
    sys.path.insert(0, os.path.dirname(HERE))
    world, spec = arg
    try:
        with stub_world(world, nccl_self=True, teardown=False) as group:
            results.put((0, "ok", _rank_rows(0, world, dict(spec, self_group=group), None)))
    except BaseException as exc:  # every failure reaches the parent
        results.put((0, type(exc).__name__, str(exc)))
    results.close()
    results.join_thread()  # (what was put is sent before the process ends)
    os._exit(0)


def real_rank_rows(world: int, tokens: int, heads: tuple[int, int, int], device: str = "cuda", backend: str = "auto",
                   reps: int = 10, cycles: int = 0, hops: str = "loopback", options: dict | None = None,
                   peers: str = "spawned", profile: bool = False) -> list[dict]:
    """Rank 0's rows (fwd, fwd+bwd) of the real-rank path with ``world`` spawned gloo ranks of
    ``tokens`` tokens each, ``heads = (h, h_kv, d)``; ``cycles``: the GPU sleep queued before each
    timed call (CUDA); ``hops``: how a hop is waited for (module doc; CUDA only for the P2P ones);
    ``backend`` "null": kernels that do nothing (``_null_backend.py``, bf16 on the CPU too);
    ``options``: RingOptions fields over ``RingOptions.from_env()`` with ``metadata_check="every_call"``
    and ``cuda_graphs=False``: e.g. ``metadata_check="new_shapes"`` (the calls after the first repeat its
    key, so they skip the check), ``cuda_graphs=True`` (a row's mode says "graphs" only where the calls
    were captured), ``launch_tapes="on"`` (a row's ``taped`` says whether a tape was recorded);
    ``peers``: "spawned" (``world`` processes) or "stub" (rank 0 alone in this process, a fake process
    group: :func:`_stub_peers_rows`); ``profile``: each row also lists the 25 functions with the most
    own time in one profiled call. Raises RuntimeError naming the rank that failed."""
    spec = {"tokens": tokens, "heads": heads, "device": device, "backend": backend, "reps": reps, "cycles": cycles,
            "hops": hops, "options": dict(options or {}), "profile": profile}
    if peers == "stub":
        return _stub_peers_rows(world, spec)
    return spawn_ranks(_worker, world, spec, 600.0, "real-rank host cost")[0]


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
