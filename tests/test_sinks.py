"""Learnable attention sinks (gpt-oss) through every path against float64 math: one call, ring
(P = 1..8, both layouts, both backward sides), Ulysses and hybrid, packed documents (ring and
all-gather), windows and GQA, simulated and gloo; out, lse, dq, dk, dv and dsinks. Criterion as
everywhere: at most 2x the same backend's full-call error plus a floor (float64: 1e-12)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_cu_seqlens, random_qkv, rel_err, sink_attention_grads, sink_reference_grads
from test_packing import _data, _lengths

import ringfa4
from ringfa4 import RingOptions
from ringfa4.kernels import AttnSpec, get_backend
from ringfa4.kernels.sinks import apply_sinks_, sink_grad

FLOOR = 1e-12
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _sinks(h, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(h, generator=g, dtype=torch.float64) * scale).requires_grad_()


_ref, _run = sink_reference_grads, sink_attention_grads


def _check(got, ref, base, label):
    for name, x, r, e0 in zip(NAMES, got, ref, base):
        err = rel_err(x, r)
        assert err <= 2 * e0 + FLOOR, f"{label} {name}: {err:.3g} > 2 x {e0:.3g} + floor"


def _dense_case(P, layout, kw, ulysses=1, options=None, seed=0, h=4, h_kv=2):
    q, k, v, do = random_qkv(2, 2 * P * 6, 2 * P * 6, h, h_kv, 8, dtype=torch.float64, seed=seed)
    s = _sinks(h, seed)
    ref = _ref(q, k, v, do, s, **kw)
    base = [rel_err(x, r) for x, r in zip(_run(q, k, v, do, s, backend="reference", **kw), ref)]
    cp = ringfa4.ContextParallel.simulated(P, layout=layout, backend="reference", ulysses=ulysses, options=options)
    _check(_run(q, k, v, do, s, cp=cp, **kw), ref, base, f"P={P} U={ulysses} {layout} {kw}")


MASKS = [{"causal": True}, {}, {"causal": True, "window": (9, None)}, {"window": (5, 3), "softcap": 2.0}]


def test_one_call_matches_float64_and_the_returned_lse_has_the_sink():
    q, k, v, do = random_qkv(2, 40, 40, 4, 2, 8, dtype=torch.float64, seed=1)
    s = _sinks(4, 1)
    got = _run(q, k, v, do, s, causal=True, backend="reference")
    ref = _ref(q, k, v, do, s, causal=True)
    for name, x, r in zip(NAMES, got, ref):
        assert rel_err(x, r) < 1e-13, name
    plain = ringfa4.attention(q, k, v, causal=True, return_lse=True, backend="reference")[1]
    torch.testing.assert_close(got[1], torch.logaddexp(plain, s.detach().view(1, -1, 1)))


@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring(P, layout, kw):
    _dense_case(P, layout, kw, seed=P + 3)


@pytest.mark.parametrize("bwd_ring", ["kv", "q"])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 1)])
def test_ring_both_backward_sides_and_gqa(bwd_ring, h, h_kv):
    _dense_case(4, "zigzag", {"causal": True}, options=RingOptions(bwd_ring=bwd_ring), seed=h_kv, h=h, h_kv=h_kv)


@pytest.mark.parametrize("P,U", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_ulysses_and_hybrid(P, U):
    """The sinks split with their heads: Ulysses index u gets the u-th head slice."""
    _dense_case(P, "zigzag", {"causal": True}, ulysses=U, seed=P * U)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("P,U", [(1, 1), (3, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("kw", MASKS[:3], ids=str)
def test_packed(mode, P, U, kw):
    """Once per row of every document (zero-length, one-token and shorter-than-P documents)."""
    lengths = _lengths(P * 11 + U, P)
    cu = random_cu_seqlens(lengths)
    q, k, v, do = _data(lengths, torch.float64, P + U)
    s = _sinks(4, P + U)
    vk = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    ref = _ref(q, k, v, do, s, **vk, **kw)
    longest = max(lengths)
    spec_kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, **kw)
    be = get_backend("reference")
    spec = AttnSpec(sinks=s.detach(), **spec_kw)
    o, l = be.forward(q, k, v, spec)
    base = [rel_err(x, r) for x, r in zip((o, l, *be.backward(do, q, k, v, o, l, spec),
                                           sink_grad(do, o, l, s.detach())), ref)]
    cp = ringfa4.ContextParallel.simulated(P, backend="reference", ulysses=U)
    x = [t.clone().requires_grad_() for t in (q, k, v, s.detach())]
    out, lse = ringfa4.attention(*x[:3], cp=cp, packing=cp.pack(cu, mode), sinks=x[3], return_lse=True, **kw)
    out.backward(do)
    _check((out.detach(), lse, *(t.grad for t in x)), ref, base, f"packed {mode} P={P} U={U} {kw} {lengths}")


def test_apply_sinks_guards_minus_inf_rows():
    """A row with no key gets lse = s, out = 0; a sink of -inf changes nothing; both -inf stay
    (0, -inf), never NaN; the gradient of such rows is 0."""
    out = torch.ones(1, 3, 2, 4, dtype=torch.float64)
    lse = torch.tensor([[[0.0, -math.inf, -math.inf], [1.0, -math.inf, 2.0]]], dtype=torch.float64)
    sinks = torch.tensor([0.5, -math.inf], dtype=torch.float64)
    apply_sinks_(out, lse, sinks)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(lse[0, 0, 1:], torch.full((2,), 0.5, dtype=torch.float64))
    assert torch.equal(out[0, 1:, 0], torch.zeros(2, 4, dtype=torch.float64))
    assert lse[0, 1, 1] == -math.inf and torch.equal(out[0, 1, 1], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(out[0, 2, 1], torch.ones(4, dtype=torch.float64)) and lse[0, 1, 2] == 2.0
    g = sink_grad(torch.ones_like(out), out, lse, sinks)
    assert torch.isfinite(g).all() and g[1] == 0


@pytest.mark.parametrize("bad,message", [
    (lambda h: torch.zeros(h + 1), r"sinks must be a \(4,\) tensor of per-q-head logits, got \(5,\)"),
    (lambda h: torch.zeros(1, h), r"sinks must be a \(4,\) tensor"),
    (lambda h: torch.zeros(h, dtype=torch.int64), r"sinks must be floating point"),
    (lambda h: torch.zeros(h, device="meta"), r"sinks must be on q's device cpu, got meta"),
])
def test_bad_sinks(bad, message):
    q, k, v, _ = random_qkv(1, 16, 16, 4, 2, 8, seed=2)
    for cp in (None, ringfa4.ContextParallel.simulated(2, backend="reference"),
               ringfa4.ContextParallel.simulated(4, backend="reference", ulysses=2)):
        with pytest.raises(ValueError, match=message):
            ringfa4.attention(q, k, v, cp=cp, causal=True, sinks=bad(4), backend="reference")


@pytest.mark.parametrize("world,kw", [(2, {"causal": True}), (3, {"causal": True, "window": (7, None)})], ids=str)
def test_gloo_sinks(pools, world, kw):
    """Distributed ranks: out, lse and dq, dk, dv as float64 and bit-identical to the simulated
    executor; each rank's dsinks covers its own rows and their sum equals float64's."""
    res = pools(world).run("sinks_case", world, kw)
    assert all(status == "ok" for status, _ in res), res
    assert all(value["identical"] for _, value in res), res
    dsinks = sum(value["dsinks"] for _, value in res)
    full = res[0][1]
    ref = _ref(*full["inputs"], **kw)
    for name, x, r in zip(NAMES, (*full["full"], dsinks), ref):
        assert rel_err(x, r) < 1e-12, name
