"""A real rank's NCCL hops on one GPU (``-m gpu``): rank 0 of torch's fake process group of P ranks
(its peers stubbed: ``benchmarks/_real_rank.stub_world``), its hops real NCCL batches over a one-rank
NCCL group, each sent to and received from the rank itself (NCCL's send/receive to self: the rank's
own buffers arrive, as the loopback's copies bring them). Against the same rank over the loopback:
eager, launch-taped (``P2PTransport.TAPED_NCCL`` forced on in the check's process: the gate this
check opens) and CUDA-graphed calls bit for bit with the deterministic backward; a taped hop is two entries (its post
from the compute stream and its watched wait, no stream switches); replays make no host sync. What
one GPU cannot show (peers that post in another process, their matching order) is ``gpu.sh nccl``'s."""

from __future__ import annotations

import collections
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import random_qkv

import ringfa4
from ringfa4 import RingOptions
from ringfa4.parallel import LoopbackTransport

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks"), os.path.join(HERE, "..")]


def _calls(cp, seeds, sync_check=False):
    """Per seed, rank 0's (out, lse, dq, dk, dv) of one forward+backward (1k tokens a rank, GQA 8 / 2,
    d = 128, bf16, causal, deterministic); ``sync_check``: the last call under sync debug "error"."""
    got = []
    for i, seed in enumerate(seeds):
        q, k, v, do = random_qkv(1, 1024, 1024, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=seed)
        qq, kk, vv = (t.requires_grad_() for t in (q, k, v))
        last = sync_check and i == len(seeds) - 1
        if last:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse = ringfa4.attention(qq, kk, vv, cp=cp, causal=True, deterministic=True, return_lse=True)
            out.backward(do)
        finally:
            if last:
                torch.cuda.set_sync_debug_mode(0)
        got.append([out.detach(), lse, qq.grad, kk.grad, vv.grad])
    torch.cuda.synchronize()
    return got


def _check_nccl_hops_to_self() -> None:
    """The test's body, in a process of its own (:func:`main`)."""
    from _real_rank import self_nccl_p2p, stub_world

    from ringfa4.parallel.transport import P2PTransport

    P2PTransport.TAPED_NCCL = True  # (this process only)
    P, seeds = 4, (0, 1, 2, 3)  # a key's first call runs, its second is recorded or captured, then replays
    torch.cuda.set_device(0)
    with stub_world(P, nccl_self=True, teardown=False) as group:  # (the process ends after: main)
        base = RingOptions(timeout_s=60.0, metadata_check="new_shapes")
        cps = {}
        for name, opts in (("loopback", base.replace(launch_tapes="off")), ("eager", base.replace(launch_tapes="off")),
                           ("taped", base), ("graphs", base.replace(cuda_graphs=True))):
            if name == "loopback":
                cps[name] = ringfa4.ContextParallel(_transport=LoopbackTransport(), options=opts)
            else:
                cps[name] = cp = ringfa4.ContextParallel(options=opts)
                cp.transport = cp.comm.transport = self_nccl_p2p(cp.comm.transport, group)
                assert isinstance(cp.transport, P2PTransport) and not cp.transport.gloo
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*(launch_tapes|cuda_graphs).*")  # taped / captured, or fail
            want = _calls(cps["loopback"], seeds)
            got = {name: _calls(cps[name], seeds, sync_check=name == "taped")
                   for name in ("eager", "taped", "graphs")}
        assert cps["taped"].transport.tape_blocker() is None
        for name, calls in got.items():
            for seed, (g, w) in enumerate(zip(calls, want)):
                for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), g, w):
                    assert torch.equal(a, b), (name, seed, what)
        taped = cps["taped"].tapes
        assert taped.recorded == 2, taped.recorded  # the forward's tape and the backward's
        names = collections.Counter(e.name for tape in taped.captured.values() if tape is not None
                                    for e in tape.entries)
        hops = names["P2PTransport._post_p2p"]
        assert hops >= 2 * (P - 1), names  # the forward's K/V hops and the backward's at least
        assert names["P2PTransport._wait_posted"] == hops, names  # each waited once, watched
        assert not any("set_stream" in n or "_fork" in n or "_record" in n for n in names), names
        assert any(cps["graphs"].graphs.captured.values())
        streams = cps["taped"].comm.channel.streams
        assert streams.failure is None


def main() -> None:
    """Run the check and leave without tearing the process group down: destroying a one-rank NCCL
    group after its sends to self was seen to hang (torch 2.11, one H100); the process ends instead."""
    try:
        _check_nccl_hops_to_self()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print("nccl-self check passed", flush=True)
    os._exit(0)


def test_nccl_hops_to_self_equal_the_loopback_eager_taped_and_graphed():
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    import subprocess

    done = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=420)
    assert done.returncode == 0 and "nccl-self check passed" in done.stdout, (done.stdout + done.stderr)[-4000:]


if __name__ == "__main__":
    main()
