"""Launch tapes on the GPU (``-m gpu``; FA4 on sm90, the simulated executor): a replay puts the
kernels, copies and memsets an untaped call puts on the GPU, no fewer and no more (a launch site that bypassed
``ringfa4.kernels.tape.launch`` would be missing); replays equal untaped calls (bit for bit with
the deterministic backward; the default backward, whose fp32 reductions are atomic, within the
untaped error against float64); packs are taped at their second call; a replay makes no host
sync."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from helpers import random_cu_seqlens, random_qkv, reference_grads, rel_err

import ringfa4
from ringfa4 import RingOptions

pytestmark = pytest.mark.gpu


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _run(cp, q, k, v, do, **kw):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, return_lse=True, **kw)
    out.backward(do)
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


def _kernels(fn) -> collections.Counter:
    """What ``fn()`` puts on the GPU, counted by name: kernels, copies and memsets (a cast replayed as
    a cast and a copy shows as one more device-to-device copy)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("P,h,hk", [(4, 8, 2), (8, 8, 8)])  # GQA: K/V travel; MHA: the q side travels
def test_a_replay_launches_the_untaped_calls_kernels_and_equals_it(P, h, hk):
    _gpu()
    kw = {"causal": True, "deterministic": True}
    taped = ringfa4.ContextParallel.simulated(P, options=RingOptions(launch_tapes="on"))
    plain = ringfa4.ContextParallel.simulated(P, options=RingOptions(launch_tapes="off"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*launch_tapes.*")  # every call taped
        for seed in range(3):  # seed 0 records, 1 and 2 replay
            q, k, v, do = random_qkv(1, 4096 * P // 4, 4096 * P // 4, h, hk, 128, dtype=torch.bfloat16,
                                     device="cuda", seed=seed)
            want = _run(plain, q, k, v, do, **kw)
            got = _run(taped, q, k, v, do, **kw)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), (seed, name)
    assert taped.tapes.recorded == 2 and taped.tape_memory() > 0
    replayed = _kernels(lambda: _run(taped, q, k, v, do, **kw))
    untaped = _kernels(lambda: _run(plain, q, k, v, do, **kw))
    assert sum(untaped.values()) > 0  # the profiler saw the kernels
    assert replayed == untaped, (replayed - untaped, untaped - replayed)


def test_the_default_backward_replayed_is_within_the_untaped_error():
    _gpu()
    P, kw = 8, {"causal": True}
    taped = ringfa4.ContextParallel.simulated(P)  # the defaults: launch_tapes="auto" tapes CUDA calls
    plain = ringfa4.ContextParallel.simulated(P, options=RingOptions(launch_tapes="off"))
    q, k, v, do = random_qkv(1, 8192, 8192, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    for _ in range(2):
        got = _run(taped, q, k, v, do, **kw)
    assert taped.tapes.recorded == 2
    want = _run(plain, q, k, v, do, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the forward has no atomics
    ref = reference_grads(q, k, v, do, **kw)
    for name, g, e, r in zip(("dq", "dk", "dv"), got[2:], want[2:], ref[2:]):
        assert rel_err(g, r) <= 1.05 * rel_err(e, r) + 1e-6, name


def test_packs_are_taped_at_their_second_call_and_replays_make_no_host_sync():
    _gpu()
    P = 4
    taped = ringfa4.ContextParallel.simulated(P, options=RingOptions(launch_tapes="on"))
    plain = ringfa4.ContextParallel.simulated(P, options=RingOptions(launch_tapes="off"))
    cu = random_cu_seqlens([3000, 129, 0, 5000, 700, 1], device="cuda")
    total = int(cu[-1])
    kw = {"causal": True, "deterministic": True}
    results = {}
    for name, cp in (("taped", taped), ("plain", plain)):
        pack = cp.pack(cu)
        res = []
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v, do = (torch.randn(total, n, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                           for n in (8, 2, 2, 8))
            if name == "taped" and seed == 2:  # the third call replays: no host sync on its path
                torch.cuda.set_sync_debug_mode("error")
            try:
                res.append(_run(cp, *(pack.shard(t, 0) for t in (q, k, v, do)), packing=pack, **kw))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        results[name] = res
    for got, want in zip(results["taped"], results["plain"]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert taped.tapes.recorded == 2
