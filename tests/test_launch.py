"""Prepared launches (ringfa4.kernels.fa4.launch): a checked block call leaves a plan that later
calls of the same signature replay.

CPU: what the signature tells apart, the cache's bound, and the backend's dispatch (a stored plan
runs for an equal signature without the checked path; any other stride, dtype or a misaligned
pointer goes the checked path). GPU (``-m gpu``, sm90): the replayed forward, merging forward and
accumulating backward give bit for bit what the checked path gives on the same data.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ringfa4.kernels import AttnSpec
from ringfa4.kernels.fa4.launch import PlanCache, aligned, plain, signature


def test_signature_tells_apart_what_the_checks_read():
    x = torch.zeros(2, 8, 4, 16)
    assert signature(x) == signature(torch.ones(2, 8, 4, 16))
    assert signature(x) != signature(x.transpose(1, 2).contiguous().transpose(1, 2))  # strides
    assert signature(x) != signature(x.double())
    assert signature(x) != signature(torch.zeros(2, 9, 4, 16))
    assert signature(x[:, :4]) != signature(torch.zeros(2, 4, 4, 16))  # a view keeps its parent's strides
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(2, 8, 4, 16)
    assert signature(fake) != signature(x)  # fake tensors never match a real call's plan


def test_plan_cache_is_bounded_and_plain_detaches():
    cache = PlanCache(limit=3)
    for i in range(3):
        cache.put(i, str(i))
    assert len(cache) == 3 and cache.get(0) == "0"
    cache.put(3, "3")
    assert len(cache) == 1 and cache.get(0) is None and cache.get(3) == "3"
    x = torch.zeros(4, requires_grad=True)
    assert not plain(x).requires_grad and plain(x).data_ptr() == x.data_ptr()
    y = torch.zeros(4)
    assert plain(y) is y
    assert aligned((y,), 4) and not aligned((torch.zeros(8)[1:],), 8)


def test_backend_replays_a_plan_only_for_its_signature(monkeypatch):
    """A plan stored under a merge call's key runs for an equal call, skipping every check; a call
    of other strides, or with a pointer off the 16-byte alignment, goes the checked path."""
    from ringfa4.kernels.fa4 import backend as fa4

    ran, checked = [], []
    monkeypatch.setattr(fa4, "validate_block", lambda *a, **k: checked.append(1))
    be = fa4.Fa4Backend()
    q = torch.zeros(1, 64, 2, 16, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 32, 2, 16, dtype=torch.bfloat16)
    out, planes = torch.zeros(1, 64, 2, 16), torch.zeros(1, 2, 2, 64)
    spec = AttnSpec(causal=True)
    be._plans.put(("merge", spec, signature(q, k, v, out, planes)), lambda *t: ran.append(t))
    assert be.forward_merge(q, k, v, spec, out, planes) is planes
    assert len(ran) == 1 and ran[0][4].data_ptr() == planes.data_ptr() and not checked
    assert ran[0][4].shape == (1, 2, 64)  # the M plane
    wide = torch.zeros(1, 64, 4, 16, dtype=torch.bfloat16)[:, :, :2]  # same shape, other strides
    assert be.forward_merge(wide, k, v, spec, out, planes) is None  # checked path: not CUDA, declined
    off = torch.zeros(1 * 64 * 2 * 16 + 1, dtype=torch.bfloat16)[1:].view(1, 64, 2, 16)  # 2-byte aligned
    assert signature(off, k, v, out, planes) == signature(q, k, v, out, planes)
    assert be.forward_merge(off, k, v, spec, out, planes) is None
    assert len(ran) == 1


def test_varlen_replay_still_checks_the_cu_seqlens_values(monkeypatch):
    """A varlen plan replays for an equal signature with the call's own cu_seqlens, but their values
    are still validated (once per tensor version): a malformed pack of the same shape is refused."""
    from ringfa4.kernels.fa4 import backend as fa4

    ran = []
    be = fa4.Fa4Backend()
    q = torch.zeros(48, 2, 16, dtype=torch.bfloat16)
    k = v = torch.zeros(48, 2, 16, dtype=torch.bfloat16)
    out, lse = torch.zeros(48, 2, 16), torch.zeros(2, 48)
    cu = torch.tensor([0, 16, 48], dtype=torch.int32)
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32, max_seqlen_k=32)
    be._plans.put(("varlen", spec, signature(q, k, v, out, lse, cu, cu)), lambda *t: ran.append(t))
    other = torch.tensor([0, 30, 48], dtype=torch.int32)  # another pack, same signature
    be.forward(q, k, v, spec.replace(cu_seqlens_q=other, cu_seqlens_k=other), out=out, lse=lse)
    assert len(ran) == 1 and ran[0][5][0] is other
    bad = torch.tensor([0, 40, 30], dtype=torch.int32)  # decreasing: refused before any launch
    with pytest.raises(ValueError, match="non-decreasing"):
        be.forward(q, k, v, spec.replace(cu_seqlens_q=bad, cu_seqlens_k=bad), out=out, lse=lse)
    assert len(ran) == 1


def test_backend_replays_a_backward_plan_only_for_its_signature(monkeypatch):
    """The single call's backward (plain_backward.py): a plan stored under a backward call's key
    launches for an equal call, skipping every check, on the call's own tensors; a call of other
    strides goes the checked path (here: refused, no CUDA)."""
    from ringfa4.kernels.fa4 import backend as fa4

    ran, checked = [], []
    monkeypatch.setattr(fa4, "validate_block", lambda *a, **k: checked.append(1))

    class Plan:
        def launch_new(self, *tensors):
            ran.append(tensors)
            return tensors[:3]

    be = fa4.Fa4Backend()
    q, out, dout = (torch.zeros(1, 64, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    k = v = torch.zeros(1, 32, 2, 16, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 64)
    spec = AttnSpec(causal=True)
    be._plans.put(("backward", spec, signature(q, k, v, out, dout, lse)), Plan())
    assert be.backward(dout, q, k, v, out, lse, spec) == (q, k, v) and not checked
    assert ran[0][3] is out and ran[0][4] is dout and ran[0][5] is lse
    wide = torch.zeros(1, 64, 8, 16, dtype=torch.bfloat16)[:, :, :4]  # same shape, other strides
    with pytest.raises(fa4.Fa4Unsupported, match="CUDA"):
        be.backward(dout, wide, k, v, out, lse, spec)
    assert len(ran) == 1 and checked


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn-4 is not installed")
def test_prepared_backward_declines_before_anything_runs():
    """plain_backward.prepare_backward refuses what FA4's entry point must serve (the backend then
    calls it): other archs, sink specs, a varlen spec with unpacked tensors, cast inputs or inputs of
    last-dim stride not 1, head dims FA4 lacks; each before any compile."""
    from ringfa4.kernels.fa4 import plain_backward as pb

    q, out, dout = (torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    k = v = torch.zeros(1, 32, 2, 64, dtype=torch.bfloat16)
    lse, spec = torch.zeros(1, 4, 64), AttnSpec(causal=True)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    n = len(pb._CACHE)
    cases = [
        ("sm90 only", (q, k, v, out, dout, lse, spec, 100)),
        ("total_q", (q, k, v, out, dout, lse, AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64,
                                                       max_seqlen_k=64), 90)),  # varlen: packed tensors
        ("no sinks", (q, k, v, out, dout, lse, AttnSpec(causal=True, sinks=torch.zeros(4)), 90)),
        ("one dtype", (q, k, v, out.float(), dout, lse, spec, 90)),
        ("stride 1", (q, k, v, out, dout, lse.transpose(1, 2).contiguous().transpose(1, 2), spec, 90)),
        ("lse", (q, k, v, out, dout, torch.zeros(1, 4, 63), spec, 90)),
        ("head_dim", (q[..., :60].contiguous(), k[..., :60].contiguous(), v[..., :60].contiguous(),
                      out[..., :60].contiguous(), dout[..., :60].contiguous(), lse, spec, 90)),  # d = 60
    ]
    for why, args in cases:
        with pytest.raises((NotImplementedError, TypeError, ValueError), match=why):
            pb.prepare_backward(*args)
    assert len(pb._CACHE) == n


def test_packed_single_call_plans_wait_for_their_gpu_tests(monkeypatch):
    """The packed single call's prepared plans run only on generations in ``PACKED_RAN_ON`` (where
    their GPU tests passed) or with ``untested_archs=True``; elsewhere the checked path declines
    before anything is prepared and FA4's entry point serves the call."""
    from ringfa4.kernels.fa4 import bwd_accum
    from ringfa4.kernels.fa4.backend import Fa4Backend

    monkeypatch.setattr(bwd_accum, "_arch", lambda: 90)
    assert 9 in Fa4Backend.PACKED_RAN_ON and Fa4Backend()._packed_plans_here()  # sm90: its GPU tests passed
    monkeypatch.setattr(Fa4Backend, "PACKED_RAN_ON", ())  # a generation they have not passed on
    cu = torch.tensor([0, 64], dtype=torch.int32)
    spec = AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64)
    q = torch.zeros(64, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    closed = Fa4Backend()
    assert not closed._packed_plans_here()
    assert closed._forward_plain(q, k, k, spec, None) is None
    assert closed._backward_plain(q, k, k, (q, q, torch.zeros(4, 64)), spec, None) is None
    assert Fa4Backend(untested_archs=True)._packed_plans_here()


@pytest.fixture(scope="module")
def sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper (sm90) GPU")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed")


def _bf16(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [AttnSpec(causal=True), AttnSpec(window=(96, 32)), AttnSpec(softcap=20.0)],
                         ids=["causal", "window", "softcap"])
def test_replayed_forwards_equal_the_checked_path(sm90, spec):
    from ringfa4.kernels.fa4.backend import Fa4Backend

    be = Fa4Backend()
    b, s, h, hk, d = 1, 384, 8, 2, 128
    for seed in range(3):  # seed 0 checks and stores the plans, 1 and 2 replay them
        q, k, v = _bf16(b, s, h, d, seed=seed), _bf16(b, s, hk, d, seed=seed + 10), _bf16(b, s, hk, d, seed=seed + 20)
        res = []
        for backend in (be, Fa4Backend()):  # a fresh backend: the checked path
            out, lse = torch.empty(b, s, h, d, device="cuda"), torch.empty(b, h, s, device="cuda")
            backend.forward(q, k, v, spec, out=out, lse=lse)
            acc, planes = out.clone(), torch.empty(b, h, 2, s, device="cuda")
            planes[:, :, 0], planes[:, :, 1] = lse, 1.0
            assert backend.forward_merge(q, k.flip(1), v.flip(1), spec, acc, planes) is planes
            res.append((out, lse, acc, planes))
        for x, y in zip(*res):
            assert torch.equal(x, y)
    assert len(be._plans) == 2


@pytest.mark.gpu
def test_replayed_varlen_forward_equals_the_checked_path(sm90):
    from ringfa4.kernels.fa4.backend import Fa4Backend

    be, h, hk, d = Fa4Backend(), 8, 2, 128
    for seed, lengths in enumerate(((300, 84, 640), (128, 700, 196), (1000, 12, 12))):  # same total and count
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024)
        q = _bf16(total, h, d, seed=seed)
        k, v = _bf16(total, hk, d, seed=seed + 10), _bf16(total, hk, d, seed=seed + 20)
        res = []
        for backend in (be, Fa4Backend()):
            out, lse = torch.empty(total, h, d, device="cuda"), torch.empty(h, total, device="cuda")
            backend.forward(q, k, v, spec, out=out, lse=lse)
            res.append((out, lse))
        for x, y in zip(*res):
            assert torch.equal(x, y), seed
    assert len(be._plans) == 1


@pytest.mark.gpu
def test_replayed_accumulate_tiles_equals_the_checked_path(sm90):
    from ringfa4.kernels.fa4 import bwd_accum as acc

    b, s, h, hk, d = 1, 512, 8, 2, 128
    scale = d ** -0.5
    got = []
    for replay in (False, True):
        q, o, do = (_bf16(b, s, h, d, seed=i) for i in range(3))
        k, v = _bf16(b, s, hk, d, seed=3), _bf16(b, s, hk, d, seed=4)
        lse = torch.randn(b, h, s, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).abs() + 5
        acc._PLANS.plans.clear()
        for round_ in range(2 if replay else 1):  # replay: the second round runs from the plans
            state = acc.prepare(q, o, do, lse, softmax_scale=scale)
            layout = acc.TileKVLayout(state, k, s)
            buf = torch.zeros(layout.numel, device="cuda")
            for q0, q1, k0, k1, causal in ((0, s, 0, s, True), (256, s, 0, 256, False), (100, 300, 128, 512, False)):
                acc.accumulate_tiles(state, k[:, k0:k1], v[:, k0:k1], *layout.cols(buf, s, k0, k1), q0=q0, q1=q1,
                                     causal=causal)
            if round_ == 0 and replay:
                assert len(acc._PLANS) == 3
        got.append((acc.finish(state, torch.float32), buf))
    for x, y in zip(*got):  # dQ / dK / dV are reduce-added by many CTAs: equal up to the order of fp32 adds
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))
