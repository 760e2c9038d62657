"""CUDA graphs of the ring (RingOptions.cuda_graphs, ringfa4.parallel.ring.graphs).

CPU: a call that cannot be captured (CPU tensors, packed documents) runs eagerly with the same
result and says why once. GPU (``-m gpu``, simulated executor, the auto backend): replays are bit
for bit the eager calls (forward; backward with the deterministic block backward), also with two
layers of the same shape interleaved (each replay reuses the graph's buffers), the default
accumulating backward is within the eager error against float64, and the graphs report their
memory.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import random_qkv, reference_grads, rel_err

import ringfa4
from ringfa4 import AttnSpec, RingOptions


def _run(cp, q, k, v, do, **kw):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, return_lse=True, **kw)
    out.backward(do)
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


def test_uncapturable_calls_run_eagerly_and_say_why_once():
    q, k, v, do = random_qkv(1, 64, 64, 4, 2, 16, dtype=torch.float64, seed=0)
    eager = ringfa4.ContextParallel.simulated(4, backend="reference")
    graphed = ringfa4.ContextParallel.simulated(4, backend="reference", options=RingOptions(cuda_graphs=True))
    want = _run(eager, q, k, v, do, causal=True)
    with pytest.warns(UserWarning, match="needs CUDA tensors") as caught:
        got = _run(graphed, q, k, v, do, causal=True)
    assert len([w for w in caught if "cuda_graphs" in str(w.message)]) == 1  # forward and backward: said once
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")
        _run(graphed, q, k, v, do, causal=True)  # said once per reason
    assert graphed.graph_memory() == 0 and eager.graph_memory() == 0


def test_graphs_option_reaches_the_check_and_the_hybrid_ring():
    cp = ringfa4.ContextParallel.simulated(4, backend="reference", ulysses=2, options=RingOptions(cuda_graphs=True))
    assert cp.graphs is not None and cp._ring.graphs is not None
    assert "options.cuda_graphs" in __import__("ringfa4.parallel.checks", fromlist=["_FIELDS"])._FIELDS


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
def test_replays_equal_eager_bit_for_bit():
    _gpu()
    P, kw = 4, {"causal": True, "deterministic": True}
    eager = ringfa4.ContextParallel.simulated(P)
    graphed = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")  # nothing falls back
        for seed in range(3):  # seed 0 captures, 1 and 2 replay
            q, k, v, do = random_qkv(1, 8192, 8192, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=seed)
            want = _run(eager, q, k, v, do, **kw)
            got = _run(graphed, q, k, v, do, **kw)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), (seed, name)
    assert len(graphed.graphs.captured) == 2 and all(graphed.graphs.captured.values())
    assert graphed.graph_memory() > 0


@pytest.mark.gpu
def test_interleaved_layers_and_the_accumulating_backward():
    """Two layers of the same shape (forward 1, forward 2, backward 2, backward 1, as autograd runs
    them) through one graph pair, captured (no call falls back to eager): each layer's result equals
    its eager call (forward bit for bit; the default backward, whose fp32 reductions are atomic, within
    the eager error vs float64)."""
    _gpu()
    P, kw = 8, {"causal": True}
    eager = ringfa4.ContextParallel.simulated(P)
    graphed = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
    layers = [random_qkv(1, 8192, 8192, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=10 + i)
              for i in range(2)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")  # nothing falls back to eager
        for cp in (graphed, graphed):  # the second round replays
            ins = [[t.clone().requires_grad_() for t in layer[:3]] for layer in layers]
            outs = [ringfa4.attention(*x, cp=cp, return_lse=True, **kw) for x in ins]
            torch.autograd.backward([o for o, _ in outs], [layer[3] for layer in layers])
    assert len(graphed.graphs.captured) == 2 and all(graphed.graphs.captured.values())
    for layer, x, (o, l) in zip(layers, ins, outs):
        q, k, v, do = layer
        want = _run(eager, q, k, v, do, **kw)
        assert torch.equal(o.detach(), want[0]) and torch.equal(l, want[1])
        ref = reference_grads(q, k, v, do, **kw)
        for name, g, e, r in zip(("dq", "dk", "dv"), (x[0].grad, x[1].grad, x[2].grad), want[2:], ref[2:]):
            assert rel_err(g, r) <= 1.05 * rel_err(e, r) + 1e-6, name


class _Channel:
    """Records the waits a transport hands its error channel."""

    def __init__(self):
        self.waits = []

    def wait(self, work, call, what, peers=None, gloo=None, group=None):
        self.waits.append((work, call, what, peers))


def test_transports_say_whether_their_hops_can_be_captured():
    import datetime

    from ringfa4.parallel.transport import LoopbackTransport, P2PTransport, Transport

    assert LoopbackTransport().capture_blocker() is None
    assert "does not say" in Transport().capture_blocker()  # a transport must opt in
    nccl = P2PTransport(None, 1, 2, datetime.timedelta(seconds=5))  # no gloo group: NCCL's path
    assert nccl.capture_blocker() is None
    assert nccl.graph_key() == (None, 1, 2) and LoopbackTransport().graph_key() == ()
    nccl.gloo = True
    assert "gloo" in nccl.capture_blocker()


def test_a_captured_wait_is_only_stream_ordered_and_a_replay_is_watched(monkeypatch):
    """Under ``capturing()`` a hop's wait is ``work.wait()`` alone (a captured work's event must never
    reach the watch thread); outside it the error channel gets it; a replay goes to the channel as
    one wait of the call, for all its peers, through an event recorded after it on the current
    stream (CUDA events stood in for here)."""
    import datetime

    from dist_fault_jobs import _NeverDone

    from ringfa4.parallel.transport import P2PTransport, _Replayed

    class _Event:
        def record(self, stream):
            self.stream = stream

        def query(self):
            return True
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    channel = _Channel()
    hops = P2PTransport(None, 0, 2, datetime.timedelta(seconds=5), channel)
    hops.call = 7
    work = _NeverDone()
    with hops.capturing():
        assert hops.in_capture
        hops._wait(work, "a ring hop", [1])
    assert work.waits == [()] and channel.waits == [] and not hops.in_capture
    hops._wait(work, "a ring hop", [1])
    assert channel.waits == [(work, 7, "a ring hop", [1])]
    with pytest.raises(RuntimeError), hops.capturing():
        raise RuntimeError("a capture that failed")
    assert not hops.in_capture  # left on failure too
    hops.current_stream = lambda device: f"current stream of {device}"
    hops.after_replay("cuda:0")
    replay, call, what, peers = channel.waits[-1]
    assert isinstance(replay, _Replayed) and (call, peers) == (7, None) and "replay" in what
    assert replay.event.stream == "current stream of cuda:0" and replay.is_completed() and replay.wait()


@pytest.mark.gpu
def test_real_ranks_replay_equal_eager_and_are_watched(pools):
    """Two real ranks (spawned, gloo control group, one GPU, hops stood in for by GPU copies on the
    communication stream): calls 1-3 bit-identical to eager (deterministic backward), the forward
    and the backward captured, every replay handed to the error channel's watch and seen done."""
    _gpu()
    for status, res in pools(2).run("graphs_real_rank", timeout=600):
        assert status == "ok", res
        assert res["same"] == [[True] * 5] * 3 and res["fell_back"] == []
        assert res["captured"]
        assert res["replays_watched"] == 6  # 3 calls x (forward, backward): the first call replays too
        assert res["in_flight"] == 0 and res["failure"] is None


def test_a_pack_is_captured_when_it_comes_again_and_few_packs_are_kept():
    """Graph keys are schedules by value (a new ``cp.pack`` of the same cu_seqlens has its old key);
    a dense key is captured at its first call, a pack's at its second; at most ``pack_graphs``
    packs keep graphs (the least recently replayed goes, and must come twice again); the sightings
    remembered are bounded."""
    from types import SimpleNamespace

    from ringfa4.parallel.allgather import AllGatherSchedule
    from ringfa4.parallel.ring.graphs import RingGraphs
    from ringfa4.parallel.varlen import PackedRingSchedule

    cp = ringfa4.ContextParallel.simulated(4, backend="reference")

    def sched(cu, kind=PackedRingSchedule, causal=True):
        return cp.pack(torch.tensor(cu, dtype=torch.int32)).packing.schedule(kind, causal, (None, None))

    a = sched([0, 5, 9, 40])
    assert a.graph_key() == sched([0, 5, 9, 40]).graph_key() and a is not sched([0, 5, 9, 40])
    for other in (sched([0, 6, 9, 40]), sched([0, 5, 9, 40], AllGatherSchedule), sched([0, 5, 9, 40], causal=False)):
        assert other.graph_key() != a.graph_key()
    dense = cp.run(torch.zeros(1, 64, 2, 8), AttnSpec(causal=True)).schedule
    assert dense.graph_key() == cp.run(torch.zeros(1, 64, 2, 8), AttnSpec(causal=True)).schedule.graph_key()
    assert dense.graph_sightings() == 1 and a.graph_sightings() == 2

    graphs, made = RingGraphs(pack_graphs=2, pack_memory=3), []

    def at(s, fn="fwd"):
        key = (fn, s.graph_key())

        def capture():
            made.append(key)
            return key  # stands in for the captured graph
        return graphs.entry(key, SimpleNamespace(schedule=s), capture)

    assert at(dense) == ("fwd", dense.graph_key())  # dense: the first call
    packs = [sched([0, n, 40]) for n in (3, 4, 5)]
    assert at(packs[0]) is None and at(packs[0], "bwd") is None  # first sighting: eager
    assert at(packs[0]) is not None and at(packs[0], "bwd") is not None  # second: captured
    assert at(packs[0]) is not None and len(made) == 3  # replayed, not captured again
    at(packs[1]), at(packs[1])
    at(packs[0])  # pack 0 replayed last: pack 1 is the oldest
    at(packs[2]), at(packs[2])  # a third pack: pack 1's graph goes
    assert ("fwd", packs[1].graph_key()) not in graphs.captured
    assert ("fwd", packs[0].graph_key()) in graphs.captured and ("bwd", packs[0].graph_key()) in graphs.captured
    assert at(packs[1]) is None and at(packs[1]) is not None  # must come twice again
    for n in range(6, 12):  # one-off packs: sightings stay bounded
        at(sched([0, n, 40]))
    assert len(graphs.sightings) == 3 and ("fwd", dense.graph_key()) in graphs.captured
    at(packs[2])  # kept: packs 1 and 2, pack 2 the recent one
    assert list(graphs.packs) == [packs[1].graph_key(), packs[2].graph_key()]
    at(packs[1], "fwd2"), at(packs[1], "fwd2")  # a new key of kept pack 1, captured: pack 1 is the recent one
    assert list(graphs.packs) == [packs[2].graph_key(), packs[1].graph_key()]

    # dense schedules (lengths) are bounded too: a length that changes every batch (or a one-document
    # pack that runs the dense ring) keeps at most ``dense_graphs`` of them, the least recent going
    graphs, made = RingGraphs(dense_graphs=2), []
    lengths = [cp.run(torch.zeros(1, n, 2, 8), AttnSpec(causal=True)).schedule for n in (64, 80, 96)]
    for s in lengths:
        assert at(s) is not None
    assert [("fwd", s.graph_key()) in graphs.captured for s in lengths] == [False, True, True]
    assert at(lengths[0]) is not None and len(made) == 4  # evicted: captured again, at its first call
    graphs.key_bytes = {k: 10 for k in graphs.captured}
    at(lengths[2]), at(cp.run(torch.zeros(1, 112, 2, 8), AttnSpec(causal=True)).schedule)
    assert graphs.memory_bytes() == 10 and len(graphs.captured) == 2  # the evicted key's bytes left too

    graphs, made = RingGraphs(pack_graphs=0, dense_graphs=0), []  # none kept: nothing is captured
    assert at(dense) is None and at(packs[0]) is None and at(packs[0]) is None and made == []


def test_a_stuck_replay_times_out_without_an_error_channel():
    """Without an error channel a replay's wait polls its end event and raises TimeoutError at the
    timeout (a stuck graph ends like a stuck hop), and returns at once when the replay is done."""
    import datetime
    import time

    from ringfa4.parallel.transport import _Replayed

    class Event:
        def __init__(self, done_after: float) -> None:
            self.at = time.monotonic() + done_after

        def query(self) -> bool:
            return time.monotonic() >= self.at

    assert _Replayed(Event(0.02)).wait(datetime.timedelta(seconds=5))
    assert _Replayed(Event(1e9)).wait() is True  # stream-ordered: nothing to wait on the host
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="CUDA graph replay"):
        _Replayed(Event(1e9)).wait(datetime.timedelta(seconds=0.1))
    assert time.monotonic() - t0 < 2.0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["balanced", "ring"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default_bwd"])
def test_a_recurring_pack_replays_its_eager_result(mode, deterministic):
    """A pack that comes again (a new ``cp.pack`` of the same cu_seqlens each call, as a trainer
    makes them; another pack in between) is captured at its second call and replayed after: every
    call equals the eager one (out and lse bit for bit; dq, dk, dv bit for bit with the deterministic
    backward, within the eager error against float64 with the default one), nothing falls back, and
    the one-off pack is never captured."""
    from helpers import random_cu_seqlens

    _gpu()
    P, kw = 4, {"causal": True, "deterministic": deterministic}
    eager = ringfa4.ContextParallel.simulated(P)
    graphed = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
    recurring, one_off = [1, 700, 1500, 5, 3000, 2100, 1000, 2], [4000, 1, 3000, 1307]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")  # nothing falls back
        for seed, lengths in enumerate([recurring, one_off, recurring, recurring]):
            cu = random_cu_seqlens(lengths, device="cuda")
            g = torch.Generator(device="cpu").manual_seed(seed)
            q, k, v, do = (torch.randn(sum(lengths), n, 128, generator=g).to("cuda", torch.bfloat16)
                           for n in (8, 2, 2, 8))
            want = _run(eager, q, k, v, do, packing=eager.pack(cu, mode), **kw)
            got = _run(graphed, q, k, v, do, packing=graphed.pack(cu, mode), **kw)
            ref = None if deterministic else reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
            for i, (name, a, b) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, want)):
                if deterministic or i < 2:
                    assert torch.equal(a, b), (seed, name)
                else:
                    assert rel_err(a, ref[i]) <= 1.05 * rel_err(b, ref[i]) + 1e-6, (seed, name)
    captured = graphed.graphs.captured
    assert len(captured) == 2 and all(captured.values())  # the recurring pack's forward and backward
    assert len(graphed.graphs.packs) == 1


@pytest.mark.gpu
def test_a_key_first_seen_in_inference_mode_serves_training_calls():
    """A key captured under ``torch.inference_mode`` (a validation pass before training) replays for
    later training calls of the same shapes: its static buffers are normal tensors (inference ones
    refuse in-place copies outside inference mode), and both calls equal eager, bit for bit."""
    _gpu()
    P, kw = 4, {"causal": True, "deterministic": True}
    eager = ringfa4.ContextParallel.simulated(P)
    graphed = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")
        q, k, v, do = random_qkv(1, 4096, 4096, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=30)
        with torch.inference_mode():
            got = ringfa4.attention(q, k, v, cp=graphed, return_lse=True, **kw)
            want = ringfa4.attention(q, k, v, cp=eager, return_lse=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        q, k, v, do = random_qkv(1, 4096, 4096, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=31)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), _run(graphed, q, k, v, do, **kw),
                              _run(eager, q, k, v, do, **kw)):
            assert torch.equal(a, b), name
    assert len(graphed.graphs.captured) == 2 and all(graphed.graphs.captured.values())  # the forward's
    # key captured under inference mode is the one the training call replayed; its backward's the other


@pytest.mark.gpu
def test_evicted_pack_graphs_free_their_keys_and_replays_stay_exact():
    """With one pack's graphs kept, two recurring packs alternating for three rounds evict each
    other's graphs (real graphs in the shared pool): every call still equals eager bit for bit
    (deterministic backward), and the kept memory is one pack's."""
    from helpers import random_cu_seqlens

    from ringfa4.parallel.ring.graphs import RingGraphs

    _gpu()
    P, kw = 4, {"causal": True, "deterministic": True}
    eager = ringfa4.ContextParallel.simulated(P)
    graphed = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
    graphed.graphs = RingGraphs(pack_graphs=1)
    packs = [[1, 700, 1500, 5, 3000, 2100], [3000, 1, 2000, 2305]]
    sizes, per_key = [], []  # per round: the kept graphs' bytes, and by key (the step function's name)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")
        for seed in range(6):
            lengths = packs[seed % 2]
            cu = random_cu_seqlens(lengths, device="cuda")
            g = torch.Generator(device="cpu").manual_seed(seed)
            q, k, v, do = (torch.randn(sum(lengths), n, 128, generator=g).to("cuda", torch.bfloat16)
                           for n in (8, 2, 2, 8))
            for _ in range(2):  # two layers a batch: the pack's second call captures
                want = _run(eager, q, k, v, do, packing=eager.pack(cu), **kw)
                got = _run(graphed, q, k, v, do, packing=graphed.pack(cu), **kw)
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                    assert torch.equal(a, b), (seed, name)
            assert len(graphed.graphs.packs) == 1 and len(graphed.graphs.captured) == 2
            sizes.append(graphed.graph_memory())
            kept = graphed.graphs.key_bytes.items()
            per_key.append(sorted((getattr(k[0], "__name__", str(k[0])), b) for k, b in kept))
    assert all(s > 0 for s in sizes) and sizes[4] == sizes[2] and sizes[5] == sizes[3], (sizes, per_key)


@pytest.mark.gpu
def test_a_captures_memory_is_its_own_when_gc_frees_older_tensors_during_it(monkeypatch):
    """Device tensors in reference cycles made before a capture (a first call's compiles leave some)
    are freed whenever Python's gc runs, maybe inside the capture (forced here at its start, with the
    automatic gc off): their bytes are not taken off the capture's count."""
    import gc

    _gpu()
    P, kw = 4, {"causal": True, "deterministic": True}
    q, k, v, do = random_qkv(1, 4096, 4096, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=3)

    def counted(garbage: bool) -> int:
        cp = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
        _run(cp, q, k, v, do, **kw)  # seen once: eager
        if garbage:
            cycle = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda")]
            cycle.append(cycle)
            del cycle
        gc.disable()
        try:
            _run(cp, q, k, v, do, **kw)  # captured (forward and backward)
        finally:
            gc.enable()
        assert len(cp.graphs.captured) == 2 and all(cp.graphs.captured.values())
        return cp.graph_memory()

    begin = torch.cuda.CUDAGraph.capture_begin

    def begin_then_collect(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        gc.collect()

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuda_graphs.*")
        counted(False)  # the process's first captures of this shape (compiles, lazy state)
        clean = counted(False)
        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_collect)
        collected = counted(True)
    assert clean > 0 and collected == clean, (clean, collected)


@pytest.mark.gpu
def test_a_failed_capture_leaves_the_callers_stream_and_runs_eagerly():
    """A ring step that cannot be captured (a host sync inside it) fails its capture: the call runs
    eagerly with the eager result, says so once, the caller's stream is current again, the key
    stays eager, and a later capturable call still captures and replays exactly."""
    from ringfa4.parallel.ring import ring_forward

    _gpu()
    P = 4
    graphed = ringfa4.ContextParallel.simulated(P, options=RingOptions(cuda_graphs=True))
    q, k, v, _ = random_qkv(1, 4096, 4096, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=40)
    run = graphed.run(q, AttnSpec(causal=True))
    qs, ks, vs = (graphed.comm.split(graphed.layout, t, 1) for t in (q, k, v))

    def syncing_forward(run, qs, ks, vs):
        outs, lses = ring_forward(run, qs, ks, vs)
        float(outs[0].float().sum())  # a host sync: illegal while capturing
        return outs, lses

    want = ring_forward(run, qs, ks, vs)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.warns(UserWarning, match="capture failed"):
            got = graphed.graphs.call(syncing_forward, run, qs, ks, vs)
        assert torch.cuda.current_stream() == stream
        again = graphed.graphs.call(syncing_forward, run, qs, ks, vs)  # the key stays eager: no new warning

        def plain(run, *lists):
            return ring_forward(run, *lists)
        ok = graphed.graphs.call(plain, run, qs, ks, vs)  # captured (and replayed)
        ok2 = graphed.graphs.call(plain, run, qs, ks, vs)  # replayed
        assert torch.cuda.current_stream() == stream
    torch.cuda.synchronize()
    assert graphed.graphs.captured[next(k for k in graphed.graphs.captured if k[0] is syncing_forward)] is None
    assert graphed.graphs.captured[next(k for k in graphed.graphs.captured if k[0] is plain)] is not None
    for res in (got, again):
        assert all(torch.equal(a, b) for a, b in zip(res[0] + res[1], want[0] + want[1]))
    assert all(torch.equal(a, b) for a, b in zip(ok2[0] + ok2[1], want[0] + want[1]))
    assert all(torch.equal(a, b) for a, b in zip(ok[0] + ok[1], want[0] + want[1]))
