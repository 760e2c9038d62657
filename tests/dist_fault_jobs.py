"""Fault, exit and metadata-check jobs run on every rank of a gloo pool (tests/dist_pool.py; tests/test_faults.py,
tests/test_stream_watch.py). Each returns plain data."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_jobs import _inputs, ring_case

import ringfa4
from ringfa4.kernels import PlainBackend, get_backend


# -- fault injection (tests/test_faults.py) ---------------------------------------------------------
class _FaultBackend(PlainBackend):
    """Reference backend that fails on ``fail_rank`` in ``where`` ("forward", "backward", "exit":
    the process ends mid-forward), and records the wall-clock time it failed."""

    name = "fault"

    def __init__(self, fail_rank, where):
        self.inner = get_backend("reference")
        self.fail_rank, self.where = fail_rank, where
        self.calls = 0

    def _maybe_fail(self, phase):
        import os
        import time

        self.calls += 1
        if dist.get_rank() == self.fail_rank and phase == self.where.replace("exit", "forward") and self.calls > 1:
            if self.where == "exit":
                os._exit(3)
            global _FAILED_AT
            _FAILED_AT = time.time()
            raise RuntimeError(f"injected {phase} failure")

    def forward(self, *args, **kw):
        self._maybe_fail("forward")
        return self.inner.forward(*args, **kw)

    def backward(self, *args, **kw):
        self._maybe_fail("backward")
        return self.inner.backward(*args, **kw)


_FAILED_AT = None


def _timed(fn):
    """``fn()``'s outcome as plain data: error type and message, when it ended, when (if this
    rank injected it) the failure happened."""
    import time

    global _FAILED_AT
    _FAILED_AT = None
    start = time.time()
    try:
        fn()
        kind, message = "ok", ""
    except Exception as exc:
        kind, message = type(exc).__name__, str(exc)
    return {"error": kind, "message": message, "start": start, "end": time.time(), "failed_at": _FAILED_AT}


def _options(timeout_s):
    return ringfa4.RingOptions(timeout_s=timeout_s)


def fault_ring(fail_rank, where, timeout_s, ulysses=1, after=3):
    """One CP call where ``fail_rank`` fails in ``where`` (forward / backward of the ring, "ulysses":
    its all-to-all, "exit": the process ends), then ``after`` correct calls (ring_case: float64
    results and bit identity with the simulated executor)."""
    world = dist.get_world_size()
    S, h = 8 * world, 4
    q, k, v, do = _inputs(1, S, h, 2, 8, torch.float64, 5)
    be = _FaultBackend(fail_rank, where) if where != "ulysses" else "reference"
    cp = ringfa4.ContextParallel(layout="zigzag", backend=be, ulysses=ulysses, options=_options(timeout_s))
    ql, kl, vl = (cp.shard(t).clone().requires_grad_() for t in (q, k, v))

    def call():
        if where == "ulysses" and dist.get_rank() == fail_rank:
            import ringfa4.parallel.groups as groups

            def broken(*a):
                global _FAILED_AT
                import time

                _FAILED_AT = time.time()
                raise RuntimeError("injected ulysses failure")

            groups.seq_to_heads = broken
        try:
            out = ringfa4.attention(ql, kl, vl, cp=cp, causal=True)
            out.backward(cp.shard(do))
        finally:
            import ringfa4.parallel.groups as groups
            from ringfa4.parallel.ulysses import seq_to_heads

            groups.seq_to_heads = seq_to_heads

    res = _timed(call)
    res["after"] = [ring_case("zigzag", torch.float64, (1, 4 * world, 4, 2, 8), {"causal": True}, 20 + i,
                              ulysses=ulysses, options=_options(timeout_s)) for i in range(after)]
    return res


def fault_absent(absent_rank, late_s, timeout_s):
    """``absent_rank`` does not call (``late_s`` None) or calls ``late_s`` seconds late; the others
    wait in the call's metadata check."""
    import time

    world = dist.get_world_size()
    q, k, v, _ = _inputs(1, 8 * world, 2, 2, 8, torch.float64, 1)
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference", options=_options(timeout_s))
    ql, kl, vl = (cp.shard(t) for t in (q, k, v))
    if dist.get_rank() == absent_rank:
        if late_s is None:
            return {"error": "skipped", "message": "", "start": time.time(), "end": time.time(), "failed_at": None}
        time.sleep(late_s)
    return _timed(lambda: ringfa4.attention(ql, kl, vl, cp=cp, causal=True))


def fault_bad_input(kind):
    """Bad input on one rank that used to escape the metadata check; the same ValueError everywhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind in ("ulysses_degree", "ulysses_invalid"):
        bad = world if kind == "ulysses_degree" else 2  # a valid degree only rank 1 asks for; one that divides nothing
        ringfa4.ContextParallel(backend="reference", ulysses=bad if rank == 1 else 1)
        return "no error"
    if kind in ("cu_malformed", "cu_differs", "pack_mode"):
        cp = ringfa4.ContextParallel(backend="reference")
        cu = [0, 5, 9, 12]
        if kind == "cu_malformed" and rank == 1:
            cu = [0, 5, 3, 12]
        if kind == "cu_differs" and rank == world - 1:
            cu = [0, 5, 10, 12]
        cp.pack(torch.tensor(cu, dtype=torch.int32), mode="bogus" if kind == "pack_mode" and rank == 0 else "auto")
        return "no error"
    if kind == "pack_shard":  # rank 1 shards a tensor of the wrong length; the others wait in the call
        cp = ringfa4.ContextParallel(backend="reference")
        pack = cp.pack(torch.tensor([0, 5, 9, 12], dtype=torch.int32))
        x = torch.randn(12 + (1 if rank == 1 else 0), 2, 8)
        xl = pack.shard(x)
        ringfa4.attention(xl, xl, xl, cp=cp, packing=pack, causal=True)
        return "no error"
    q, k, v, _ = _inputs(1, 8 * world, 2, 2, 8, torch.float32, 1)
    cp = ringfa4.ContextParallel(backend="reference")
    ql, kl, vl = (cp.shard(t) for t in (q, k, v))
    if kind == "device" and rank == 1:
        ql, kl, vl = (t.to("meta") for t in (ql, kl, vl))
    ringfa4.attention(ql, kl, vl, cp=cp, causal=True)
    return "no error"


def packed_exit_sequence(seed, mode):
    """The issue's exit case: six packed calls (random lengths, zero- and one-token documents),
    forward and backward, on this group (the caller destroys it and exits)."""
    from helpers import random_cu_seqlens

    g = torch.Generator().manual_seed(seed)
    cp = ringfa4.ContextParallel(backend="reference")
    for _ in range(6):
        lengths = [int(x) for x in torch.randint(0, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)]
        lengths += [0, 1]
        cu = random_cu_seqlens(lengths)
        T = sum(lengths)
        q, k, v, do = (torch.randn(T, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2, 4))
        pack = cp.pack(cu, mode)
        ql, kl, vl = (pack.shard(t).clone().requires_grad_() for t in (q, k, v))
        out = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, causal=True)
        out.backward(pack.shard(do))
    return "ok"
from trainer_jobs import trainer_bad, trainer_recipe_run, trainer_run  # noqa: E402,F401 (tests/test_trainer.py)


def uneven_case(layout, S, kw, ulysses=1, bad_rank=None):
    """Dense ring (or Ulysses x ring) on a sequence length the layout does not divide: this rank's
    uneven shard; the full results after cp.unshard (rank 0) and bit identity with the simulated
    executor. ``bad_rank``: that rank drops its last token (the others must raise too)."""
    q, k, v, do = _inputs(2, S, 4, 2, 8, torch.float64, S)
    be = get_backend("reference", tile=2)
    cp = ringfa4.ContextParallel(layout=layout, backend=be, ulysses=ulysses)
    x = [cp.shard(t, 1).clone() for t in (q, k, v, do)]
    if dist.get_rank() == bad_rank:
        x = [t[:, :-1].clone() for t in x]
    ql, kl, vl = (t.requires_grad_() for t in x[:3])
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, return_lse=True, **kw)
    out.backward(x[3])
    mine = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
    full = [cp.unshard(mine[0], 1), cp.unshard(lse, 2), cp.unshard(ql.grad, 1), cp.unshard(kl.grad, 1),
            cp.unshard(vl.grad, 1)]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout=layout, backend=be, ulysses=ulysses)
    y = [t.clone().requires_grad_() for t in (q, k, v)]
    so, sl = ringfa4.attention(*y, cp=sim, return_lse=True, **kw)
    so.backward(do)
    sim_mine = [cp.shard(so.detach(), 1), cp.shard(sl, 2), *(cp.shard(t.grad, 1) for t in y)]
    res = {"identical": all(torch.equal(a, b) for a, b in zip(mine, sim_mine)), "rows": out.shape[1]}
    if dist.get_rank() == 0:
        res["full"], res["inputs"] = full, (q, k, v, do)
    return res


def dp_ulysses_case():
    """Two dp replicas of a CP group of 2 with Ulysses 2 (a (dp, cp) mesh of 2 x 2): each CP group
    creates only its own subgroups; attention matches the simulated executor bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = ringfa4.ContextParallel(mesh["cp"], backend="reference", ulysses=2)
    q, k, v, do = _inputs(1, 16, 4, 2, 8, torch.float64, 3 + mesh["dp"].get_local_rank())
    out = ringfa4.attention(*(cp.shard(t, 1) for t in (q, k, v)), cp=cp, causal=True)
    sim = ringfa4.ContextParallel.simulated(2, backend="reference", ulysses=2)
    want = cp.shard(ringfa4.attention(q, k, v, cp=sim, causal=True), 1)
    return {"identical": torch.equal(out, want), "cp_rank": cp.rank}


class _NeverDone:
    """A stand-in for an NCCL work whose transfer never completes: ``wait()`` (stream-ordered)
    returns at once, ``is_completed()`` stays False; ``waits`` records the arguments of each wait."""

    def __init__(self):
        self.waits = []

    def wait(self, *args):
        self.waits.append(args)
        return True

    def is_completed(self):
        return False


def stream_watch_case(stuck_rank, peer, timeout_s, surface="entry"):
    """``stuck_rank`` waits stream-ordered (the NCCL path of the error channel, forced) on a work
    that never completes, then keeps queueing host work while the watch thread decides; the other
    rank, in the same call, posts an error (``peer`` "posts") or never waits ("absent"). Returns
    how long the wait held the host, the wait's arguments, and the error raised: by the channel's
    next entry (``surface`` "entry"), or by a step of the call that then fails as a post on an
    aborted communicator would ("guarded": the CP group raises the watch's verdict instead, and
    posts nothing as this rank's root cause)."""
    import time

    from ringfa4.parallel.errors import Channel

    rank = dist.get_rank()
    channel = Channel(dist.group.WORLD, rank, dist.get_world_size(), timeout_s)
    call = channel.next_call()
    if rank != stuck_rank:
        if peer == "posts":
            channel.post(call, f"rank {rank}: injected hop failure", "RuntimeError")
        return {"posted": peer == "posts"}
    channel.gloo = False  # the stream-ordered (NCCL) path, over this gloo group's store
    work = _NeverDone()
    start = time.monotonic()
    channel.wait(work, call, "a ring hop", [1 - rank], group=dist.group.WORLD)
    held_s = time.monotonic() - start
    error, end = None, start + timeout_s + 20
    if surface == "guarded":
        import datetime

        from ringfa4.parallel.groups import DistributedGroup

        cp_group = DistributedGroup(dist.group.WORLD, datetime.timedelta(seconds=timeout_s), channel=channel)
        while channel.streams.failure is None and time.monotonic() < end:
            time.sleep(0.05)

        def post_on_aborted():
            raise RuntimeError("NCCL communicator was aborted")
        try:
            cp_group._guarded(call, post_on_aborted)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    while error is None and time.monotonic() < end:
        time.sleep(0.05)
        try:
            channel.next_call()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    raised_at = time.monotonic() - start
    return {"held_s": held_s, "wait_args": [list(a) for a in work.waits], "error": error, "raised_at_s": raised_at,
            "posted": channel.posted(call)}


def metadata_check_once(kind, timeout_s=30.0):
    """``RingOptions(metadata_check="new_shapes")``. ``"repeat"``: three dense calls of one shape, a
    pack and two calls with it, a dense call of another length; returns the metadata all-gathers
    each made and whether every result is bit-identical to the default (check every call).
    ``"one_rank_changes"``: after an agreed call, rank 1 alone calls with other head counts while
    the others repeat the agreed key: every rank's outcome (``_timed``) and the next call's.
    ``"bad_input_after_agreed"`` / ``"bad_input_on_two"``: the same with a local check failing on
    rank 1 / on ranks 1 and 2."""
    from ringfa4.parallel import checks

    world, rank = dist.get_world_size(), dist.get_rank()
    counted = {"n": 0}
    real = checks.gather_ints

    def gather(comm, call, values, what):
        counted["n"] += what == "the metadata all-gather"
        return real(comm, call, values, what)
    checks.gather_ints = gather
    try:
        opts = ringfa4.RingOptions(metadata_check="new_shapes", timeout_s=timeout_s)
        once = ringfa4.ContextParallel(layout="zigzag", backend="reference", options=opts)
        every = ringfa4.ContextParallel(layout="zigzag", backend="reference", options=opts.replace(
            metadata_check="every_call"))
        if kind in ("bad_input_after_agreed", "bad_input_on_two"):  # k in another dtype than q: a local check
            q, k, v, _ = _inputs(1, 8 * world, 4, 2, 8, torch.float64, 3)
            qkv = [once.shard(t) for t in (q, k, v)]
            ringfa4.attention(*qkv, cp=once, causal=True)
            bad = [qkv[0], qkv[1].float(), qkv[2]] if rank == 1 or (kind == "bad_input_on_two" and rank == 2) else qkv
            res = _timed(lambda: ringfa4.attention(*bad, cp=once, causal=True))
            res["after"] = _timed(lambda: ringfa4.attention(*qkv, cp=once, causal=True))["error"]
            return res
        if kind == "one_rank_changes":
            q, k, v, _ = _inputs(1, 8 * world, 4, 2, 8, torch.float64, 3)
            ringfa4.attention(*(once.shard(t) for t in (q, k, v)), cp=once, causal=True)
            h = 2 if rank == 1 else 4
            res = _timed(lambda: ringfa4.attention(*(once.shard(t[:, :, :h]) for t in (q, k, v)), cp=once,
                                                   causal=True))
            res["after"] = _timed(lambda: ringfa4.attention(*(once.shard(t) for t in (q, k, v)), cp=once,
                                                            causal=True))["error"]
            return res

        def dense(cp, S, seed):
            q, k, v, do = _inputs(1, S, 4, 2, 8, torch.float64, seed)
            ql, kl, vl = (cp.shard(t).clone().requires_grad_() for t in (q, k, v))
            out = ringfa4.attention(ql, kl, vl, cp=cp, causal=True)
            out.backward(cp.shard(do))
            return [out.detach(), ql.grad, kl.grad, vl.grad]

        def packed(cp, pack, seed):
            g = torch.Generator().manual_seed(seed)
            q, k, v, do = (torch.randn(12 * world, n, 8, generator=g).double() for n in (4, 2, 2, 4))
            ql, kl, vl = (pack.shard(t).clone().requires_grad_() for t in (q, k, v))
            out = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, causal=True)
            out.backward(pack.shard(do))
            return [out.detach(), ql.grad, kl.grad, vl.grad]

        cu = torch.tensor([0, 5, 9, 12 * world], dtype=torch.int32)
        counts, same = [], True
        for cp in (once, every):
            counted["n"] = 0
            got = [dense(cp, 8 * world, s) for s in range(3)]
            pack = cp.pack(cu)
            got += [packed(cp, pack, s) for s in range(2)]
            got.append(dense(cp, 16 * world, 9))
            counts.append(counted["n"])
            if cp is once:
                first = got
            else:
                same = all(torch.equal(a, b) for x, y in zip(first, got) for a, b in zip(x, y))
        return {"checks_once": counts[0], "checks_every": counts[1], "identical": same}
    finally:
        checks.gather_ints = real
