"""Stream-ordered waits (issue 23): over NCCL a hop's wait only orders the CUDA stream, and a watch
thread ends a wait that never completes, named, without the host blocking on it. CPU tests with
stand-in works: the watch alone, and the error channel's NCCL path forced over a gloo group's
store (the store protocol is the same; NCCL itself runs in ``benchmarks/gpu.sh nccl``)."""

from __future__ import annotations

import time

import pytest
from dist_fault_jobs import _NeverDone
from dist_pool import Pool

from ringfa4.parallel.watch import StreamWatch


class _DoneAfter(_NeverDone):
    def __init__(self, seconds):
        super().__init__()
        self.at = time.monotonic() + seconds

    def is_completed(self):
        return time.monotonic() >= self.at


class _Judge:
    """Asked about the oldest wait in flight: an error once it is overdue."""

    def __init__(self):
        self.asked = []

    def verdict(self, call, what, peers, overdue):
        self.asked.append((call, what, overdue))
        return RuntimeError(f"{what} of call {call} timed out on rank(s) {peers}") if overdue else None


def _until(pred, limit_s=5.0):
    end = time.monotonic() + limit_s
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return pred()


def test_completed_waits_leave_without_a_verdict():
    judge = _Judge()
    watch = StreamWatch(judge, timeout_s=5.0, poll_s=0.02, watch_after_s=0.5)
    works = [_DoneAfter(0.05) for _ in range(20)]
    start = time.monotonic()
    for i, w in enumerate(works):
        watch.add(w, 1, f"hop {i}", [1])
    assert time.monotonic() - start < 0.5  # the host never waited for a transfer
    assert all(w.waits == [()] for w in works)  # wait() with no timeout: stream-ordered for NCCL
    assert _until(lambda: watch.in_flight() == 0)
    assert judge.asked == [] and watch.failure is None
    assert _until(lambda: watch._thread is None)  # idle: the watch thread ended
    watch.add(_NeverDone(), 2, "a later hop")  # a new one starts and watches it
    assert watch._thread is not None and watch._thread.is_alive() and watch.in_flight() == 1


def test_a_stuck_wait_fails_once_at_its_deadline_and_aborts_its_groups():
    judge, aborted = _Judge(), []
    watch = StreamWatch(judge, timeout_s=0.3, abort=aborted.append, poll_s=0.02, watch_after_s=0.1)
    watch.add(_DoneAfter(0.0), 1, "an early hop", [2], group="g0")
    watch.add(_NeverDone(), 1, "a ring hop", [1], group="g1")
    watch.add(_NeverDone(), 1, "the next hop", [1], group="g1")
    start = time.monotonic()
    assert _until(lambda: watch.failure is not None)
    assert 0.2 <= time.monotonic() - start < 2.0
    # the verdict is published before the abort (so an error the abort causes finds it): wait for both
    assert _until(lambda: aborted) and aborted == [["g1", "g1"]]  # the groups of the waits still in flight
    assert [a for a in judge.asked if a[2]] == [(1, "a ring hop", True)]
    with pytest.raises(RuntimeError, match=r"a ring hop of call 1 timed out on rank\(s\) \[1\]"):
        watch.add(_DoneAfter(0.0), 2, "a hop of the next call")
    watch.add(_DoneAfter(0.0), 2, "a hop of the next call")  # raised once: the watch goes on
    assert watch.failure is None


@pytest.fixture(scope="module")
def pool2():
    pool = Pool(2, pg_timeout_s=30)
    yield pool
    pool.close(join_s=2)


@pytest.mark.timeout(120)
def test_a_peers_posted_error_ends_a_stream_ordered_wait(pool2):
    (s0, r0), (s1, r1) = pool2.run("stream_watch_case", 0, "posts", 10.0, timeout=60)
    assert s0 == "ok" and s1 == "ok", (r0, r1)
    assert r0["held_s"] < 0.2 and r0["wait_args"] == [[]], r0
    assert r0["error"] is not None and "because rank 1 failed first (rank 1: injected hop failure)" in r0["error"], r0
    assert r0["raised_at_s"] < 5.0, r0  # within about a second of the posting, far before the timeout


@pytest.mark.timeout(120)
def test_a_missing_peer_is_named_at_the_timeout_without_blocking_the_host(pool2):
    (s0, r0), (s1, r1) = pool2.run("stream_watch_case", 0, "absent", 2.0, timeout=60)
    assert s0 == "ok" and s1 == "ok", (r0, r1)
    assert r0["held_s"] < 0.2, r0
    assert r0["error"] is not None and "rank(s) 1 never arrived" in r0["error"], r0
    assert "destroy the process group and initialise it again" in r0["error"], r0
    assert 2.0 <= r0["raised_at_s"] < 2.0 + 8.0, r0


@pytest.mark.timeout(120)
def test_a_step_failing_on_the_aborted_communicator_raises_the_watchs_verdict(pool2):
    """After the watch named the missing rank (and aborted the communicator), the call's next post
    fails on its own; the CP group raises the watch's verdict instead and posts no root cause."""
    (s0, r0), (s1, r1) = pool2.run("stream_watch_case", 0, "absent", 2.0, "guarded", timeout=60)
    assert s0 == "ok" and s1 == "ok", (r0, r1)
    assert r0["error"] is not None and r0["error"].startswith("RuntimeError: rank 0: a ring hop of call"), r0
    assert "rank(s) 1 never arrived" in r0["error"] and "communicator was aborted" not in r0["error"], r0
    assert r0["posted"] is None, r0  # a peer's failure is never posted as this rank's root cause


@pytest.mark.gpu
@pytest.mark.parametrize("blocking", [False, True], ids=["stream-ordered", "blocking"])
def test_a_hop_wait_leaves_the_host_free_and_orders_the_stream(blocking):
    """The P2P transport's hop wait through the error channel, with a hop that copies on the
    communication stream behind a queued GPU sleep (a stand-in NCCL work): stream-ordered, the host
    returns while the sleep still runs and the compute stream reads the received bytes after the
    copy; blocking (NCCL's ``wait(timeout)``, the path before) the host waits out the sleep."""
    import datetime
    import os
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from _real_rank import _stub_p2p

    from ringfa4.parallel.errors import Channel
    from ringfa4.parallel.transport import P2PTransport

    channel = Channel(None, 0, 1, 30.0)
    hops = _stub_p2p(P2PTransport(None, 0, 1, datetime.timedelta(seconds=30), channel, [0]), blocking)
    send = torch.randn(1 << 22, device="cuda")
    recv = torch.full_like(send, float("nan"))
    hops.wait(hops.shift([send], [recv], 1))  # first use (streams, lazily loaded kernels) off the timed round
    torch.cuda._sleep(1 << 20)
    torch.cuda.synchronize()
    recv.fill_(float("nan"))
    torch.cuda._sleep(1 << 30)  # about half a second of queued GPU work
    queued = torch.cuda.Event()
    queued.record()
    hops.wait(hops.shift([send], [recv], 1))
    host_free = not queued.query()
    got = recv * 2  # on the compute stream, after the wait
    torch.cuda.synchronize()
    assert torch.equal(got, send * 2)
    assert host_free != blocking
    assert _until(lambda: channel.streams.in_flight() == 0) and channel.streams.failure is None


class _RecordingGroup:
    """A process group that records what a hop posts (NCCL's calls: a coalesced group of sends and
    receives); ``fail_on``: the send that raises."""

    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on

    def _start_coalescing(self, device):
        self.calls.append(("start", device.type))

    def send(self, tensors, peer, tag):
        if self.fail_on is not None and tensors[0] is self.fail_on:
            raise RuntimeError("NCCL refused the send")
        self.calls.append(("send", tensors[0], peer))

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", tensors[0], peer))

    def _end_coalescing(self, device):
        self.calls.append(("end", device.type))
        return "the batch's work"


def _nccl_rank(group, rank, world):
    import datetime

    from ringfa4.parallel.transport import P2PTransport

    hops = P2PTransport(None, rank, world, datetime.timedelta(seconds=5))
    hops.group = group  # (NCCL's path: not a gloo group)
    return hops


def test_an_nccl_hop_posts_one_coalesced_batch_to_its_ring_neighbours():
    """A hop of two pieces from rank 1 of 4 by offset 1: both pieces sent to rank 2 and received
    from rank 0 in one coalesced batch whose one work the hop waits on; an exchange's batch goes to
    each send's and receive's own rank; a send that fails still ends the batch, its error raised."""
    import torch

    from ringfa4.parallel.transport import _Posted

    group = _RecordingGroup()
    hops = _nccl_rank(group, 1, 4)
    k, v, rk, rv = (torch.zeros(4) for _ in range(4))
    handle = hops.shift([(k, v)], [(rk, rv)], 1)
    assert group.calls == [("start", "cpu"), ("send", k, 2), ("send", v, 2), ("recv", rk, 0), ("recv", rv, 0),
                           ("end", "cpu")]
    assert handle.works.works == ["the batch's work"] and handle.event[:2] == (0, 2)
    group.calls.clear()
    hops.shift([(k, v)], [(rk, rv)], 3)  # backwards round the ring: to rank 0, from rank 2
    assert [c[2] for c in group.calls if c[0] in ("send", "recv")] == [0, 0, 2, 2]
    group.calls.clear()
    posted = _Posted()
    hops._post_pairs(posted, [k, v], [3, 0], [rk], [2])
    assert group.calls == [("start", "cpu"), ("send", k, 3), ("send", v, 0), ("recv", rk, 2), ("end", "cpu")]
    hops._post_pairs(posted, [], [], [], [])
    assert posted.works == [] and len(group.calls) == 5  # nothing to move: no batch
    failing = _RecordingGroup(fail_on=v)
    with pytest.raises(RuntimeError, match="refused"):
        _nccl_rank(failing, 1, 4).shift([(k, v)], [(rk, rv)], 1)
    assert failing.calls == [("start", "cpu"), ("send", k, 2), ("end", "cpu")]
