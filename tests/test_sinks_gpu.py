"""Learnable sinks on the GPU (the auto backend: fa4 on the H200) against float64: one FA4 call
(FA4's own ``learnable_sink``), the simulated ring (fp32 partials, epilogue merge, accumulating
backward; the sink applied once after the merge), Ulysses x ring, and packed documents. out, lse,
dq, dk, dv and dsinks within 2x one full FA4 call's error (with the sink) + a floor."""

import pytest
import torch
from helpers import random_cu_seqlens, random_qkv, rel_err, sink_attention_grads, sink_reference_grads

import ringfa4
from ringfa4.kernels.sinks import sink_grad

pytestmark = pytest.mark.gpu
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _ref(*args, **kw):
    return sink_reference_grads(*args, **kw)


def _run(*args, **kw):
    got = sink_attention_grads(*args, **kw)
    torch.cuda.synchronize()
    return got


def _inputs(S, h, h_kv, seed, b=1):
    q, k, v, do = random_qkv(b, S, S, h, h_kv, 128, dtype=torch.bfloat16, device="cuda", seed=seed)
    g = torch.Generator().manual_seed(seed)
    sinks = (torch.randn(h, generator=g) * 2).to("cuda")  # fp32
    return q, k, v, do, sinks


def _assert_close(got, ref, base, label, floor=1e-3):
    for name, x, r, e0 in zip(NAMES, got, ref, base):
        err = rel_err(x, r)
        assert err <= 2 * e0 + floor, f"{label} {name}: {err:.3g} vs one full call {e0:.3g}"


@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"causal": True, "window": (300, 0)}], ids=str)
def test_one_call_fa4_sinks(kw):
    """One FA4 call with its learnable_sink: within 2x torch float32 math on the same bf16 inputs."""
    q, k, v, do, s = _inputs(2048, 8, 2, 1)
    ref = _ref(q, k, v, do, s, **kw)
    got = _run(q, k, v, do, s, backend="fa4", **kw)
    f32 = _run(*(t.float() for t in (q, k, v, do)), s, backend="reference", **kw)
    # the yardstick as in test_fa4_gpu: float32 math, its bf16 results rounded to bf16 (lse and
    # dsinks stay float32; dsinks from the rounded out, as the bf16 path computes it)
    out16 = f32[0].to(torch.bfloat16)
    base = [f32[0].to(torch.bfloat16), f32[1], *(g.to(torch.bfloat16) for g in f32[2:5]),
            sink_grad(do, out16, f32[1], s)]
    _assert_close(got, ref, [rel_err(x, r) for x, r in zip(base, ref)], f"fa4 one call {kw}")


@pytest.mark.parametrize("P,U,h_kv", [(4, 1, 2), (8, 1, 8), (8, 2, 2)])
def test_ring_fa4_sinks(P, U, h_kv):
    q, k, v, do, s = _inputs(8192, 8, h_kv, P + U)
    ref = _ref(q, k, v, do, s, causal=True)
    base = [rel_err(x, r) for x, r in zip(_run(q, k, v, do, s, backend="fa4", causal=True), ref)]
    cp = ringfa4.ContextParallel.simulated(P, backend="fa4", ulysses=U)
    _assert_close(_run(q, k, v, do, s, cp=cp, causal=True), ref, base, f"ring P={P} U={U}")


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_packed_fa4_sinks(mode):
    lengths = [1500, 0, 1, 700, 3000, 64, 2100]
    cu = random_cu_seqlens(lengths, device="cuda")
    T = sum(lengths)
    q, k, v, do, s = _inputs(T, 8, 2, 7)
    q, k, v, do = (t[0] for t in (q, k, v, do))
    vk = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    ref = _ref(q, k, v, do, s, causal=True, **vk)
    one = ringfa4.ContextParallel.simulated(1, backend="fa4")
    base = [rel_err(x, r) for x, r in zip(_run(q, k, v, do, s, cp=one, packing=one.pack(cu.cpu()), causal=True),
                                          ref)]
    cp = ringfa4.ContextParallel.simulated(4, backend="fa4")
    got = _run(q, k, v, do, s, cp=cp, packing=cp.pack(cu.cpu(), mode), causal=True)
    _assert_close(got, ref, base, f"packed {mode}")
