"""The q ring backward (parallel/ring/q_side.py QSide): q side and dq travel, K/V and dK/dV stay.

Against float64 with the CP criterion (at most 2x the reference backend's own full-sequence error
plus a floor), simulated at several world sizes, layouts, masks, head groups and GQA; distributed
(gloo) bit-identical to simulated; which side ``RingOptions.bwd_ring`` picks, and by how many bytes."""

from __future__ import annotations

import pytest
import torch
from helpers import random_qkv, reference_grads
from test_ring import MASKS, _assert_close, _full_backend_errors, _sim_case

import ringfa4
from ringfa4 import RingOptions
from ringfa4.parallel.ring import backward as bwd_sides


@pytest.fixture
def sides(monkeypatch):
    """The side class every ring backward of the test ran."""
    used = []
    real = bwd_sides.backward_side

    def spy(*args):
        side = real(*args)
        used.append(type(side).__name__)
        return side

    monkeypatch.setattr(bwd_sides, "backward_side", spy)
    return used


@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("P", [2, 3, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_q_ring_simulated(kw, P, layout, sides):
    _sim_case(P, layout, torch.float64, kw, seed=P + 7, options=RingOptions(bwd_ring="q"))
    assert sides == ["QSide"]


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (6, 1)])
def test_q_ring_head_groups_and_gqa(groups, h, h_kv, sides):
    """dq travels in ``dkv_groups`` q-head groups (one group where the count does not divide the
    kv heads); fp32 inputs, MHA and GQA; the same grads as the K/V ring to rounding."""
    got = _sim_case(4, "zigzag", torch.float32, {"causal": True}, h=h, h_kv=h_kv, seed=groups * 10 + h_kv,
                    options=RingOptions(bwd_ring="q", dkv_groups=groups))
    other = _sim_case(4, "zigzag", torch.float32, {"causal": True}, h=h, h_kv=h_kv, seed=groups * 10 + h_kv,
                      options=RingOptions(bwd_ring="kv", dkv_groups=groups))
    assert sides == ["QSide", "KVSide"]
    for a, b in zip(got, other):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,layout,kw", [(2, "zigzag", {"causal": True}), (3, "contiguous", {}),
                                             (4, "zigzag", {"causal": True, "window": (9, None)})], ids=str)
def test_gloo_q_ring_matches_simulated_and_float64(pools, world, layout, kw):
    shape = (2, 2 * world * 6, 4, 4, 16)
    res = pools(world).run("ring_case_options", {"bwd_ring": "q"}, layout, torch.float64, shape, kw, 11)
    assert all(status == "ok" for status, _ in res), res
    assert all(value["identical"] and value["sides"] == ["QSide", "QSide"] for _, value in res), res
    q, k, v, do = random_qkv(*shape[:2], shape[1], *shape[2:], dtype=torch.float64, seed=11)
    ref = reference_grads(q, k, v, do, **kw)
    base = _full_backend_errors(q, k, v, do, kw, ref)
    _assert_close(res[0][1]["full"], ref, base, torch.float64, f"gloo q ring world={world}")


@pytest.mark.parametrize("options,dtype,h_kv,want", [
    ({}, torch.bfloat16, 4, "QSide"),  # MHA bf16: q + dout + out + dq (10 B an element) < K, V, dK, dV (12 B)
    ({}, torch.bfloat16, 2, "KVSide"),  # GQA 2:1: the K/V side moves half as many elements
    ({}, torch.float32, 4, "KVSide"),  # fp32 MHA: 16 B both ways, the K/V side on a tie
    ({"bwd_ring": "q"}, torch.bfloat16, 1, "QSide"),
    ({"bwd_ring": "kv"}, torch.bfloat16, 4, "KVSide"),
    ({"fp32_grads": False}, torch.bfloat16, 4, "KVSide"),  # no AccumBackward state: no q side
    ({"dkv_wire": "input"}, torch.bfloat16, 4, "KVSide"),  # a 16-bit dK/dV wire asked for
    ({"bwd_ring": "q", "fp32_grads": False}, torch.bfloat16, 4, "KVSide"),
], ids=str)
def test_bwd_ring_choice(options, dtype, h_kv, want, sides):
    q, k, v, do = random_qkv(1, 32, 32, 4, h_kv, 8, dtype=dtype, seed=3)
    cp = ringfa4.ContextParallel.simulated(2, backend="reference", options=RingOptions(**options))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    ringfa4.attention(*x, cp=cp, causal=True).backward(do)
    assert sides == [want]


def test_hop_bytes_and_bad_option():
    """Bytes a hop moves per rank, both sides (reference backend, bf16, MHA), and a bad option
    value named in the error."""
    from ringfa4.kernels import AttnSpec

    b, s, h, d = 1, 16, 4, 8
    q, k, v, do = random_qkv(b, 2 * s, 2 * s, h, h, d, dtype=torch.bfloat16, seed=4)
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    run = cp.run(q, AttnSpec(causal=True))
    qs, ks, vs, dos = (cp.comm.split(cp.layout, t, 1) for t in (q, k, v, do))
    be = run.backend
    outs, lses = [], []
    for qi, ki, vi in zip(qs, ks, vs):
        o, l = be.forward(qi, ki, vi, AttnSpec(causal=True))
        outs.append(o)
        lses.append(l)
    states = [be.begin_backward(d_, q_, o, l, AttnSpec(causal=True)) for d_, q_, o, l in zip(dos, qs, outs, lses)]
    n = b * s * h * d
    got = bwd_sides.hop_bytes(run, qs, ks, vs, states)
    assert got == {"kv": 2 * n * (2 + 4), "q": 3 * n * 2 + b * h * s * 4 + n * 4}, got
    with pytest.raises(ValueError, match=r"RingOptions.bwd_ring must be one of \('auto', 'kv', 'q'\), got 'both'"):
        RingOptions(bwd_ring="both")


def test_q_side_travels_as_one_buffer_after_the_first_hop(monkeypatch):
    """The q side's first hop sends each rank's own pieces (the state's tensors, never received
    into), every later hop one flat byte buffer a rank (one copy, or one NCCL send / receive pair,
    a hop) whose typed views the blocks read; the grads stay float64-exact (the case's own check)."""
    from ringfa4.parallel.ring import q_side
    from ringfa4.parallel.transport import LoopbackTransport

    sent, rings = [], []
    real_shift, real_ring = LoopbackTransport.shift, q_side._QSideRing

    def shift(self, send, recv, offset):
        sent.append(send[0] if isinstance(send[0], tuple) else (send[0],))
        return real_shift(self, send, recv, offset)

    def ring(own):
        rings.append((real_ring(own), [tuple(p.data_ptr() for p in pieces) for pieces in own]))
        return rings[-1][0]

    monkeypatch.setattr(LoopbackTransport, "shift", shift)
    monkeypatch.setattr(q_side, "_QSideRing", ring)
    P = 4
    _sim_case(P, "zigzag", torch.float64, {"causal": True}, h=4, h_kv=4, seed=5,
              options=RingOptions(bwd_ring="q", dkv_groups=1))
    ((r, own),) = rings
    flat_bytes = r.nxt[0].numel()
    data = [pieces for pieces in sent if len(pieces) == len(r.layout) or pieces[0].dtype == torch.uint8]
    first, *later = data[-(P - 1):]  # the backward's data hops (the forward's K/V hops come first)
    assert [p.dtype for p in first] == [dtype for _, _, dtype, _ in r.layout]
    assert len(later) == P - 2 and all(len(x) == 1 and x[0].dtype == torch.uint8 and x[0].numel() == flat_bytes
                                       for x in later), [[(p.dtype, p.numel()) for p in x] for x in later]
    assert sum(p.numel() * p.element_size() for p in first) <= flat_bytes < \
        sum(p.numel() * p.element_size() for p in first) + 256 * len(first)
    received = {b.data_ptr() for b in (*r.cur, *r.nxt)}
    assert not received & {ptr for pieces in own for ptr in pieces}  # the own pieces were never received into


@pytest.mark.parametrize("ring", ["q", "kv"])
def test_poisoned_hops_change_nothing(ring):
    """Loopback receives poisoned before every hop (the GPU tests' check for a missing wait) work on
    every buffer a hop receives into, the q side's flat byte buffer included (all bits set, so its
    float views read NaN), and give the same gradients bit for bit: every byte a block reads was
    written by the hop."""
    from ringfa4.parallel.transport import LoopbackTransport, _poison_

    buf = torch.zeros(8, dtype=torch.uint8)
    _poison_(buf)
    assert buf.view(torch.float32).isnan().all() and buf.view(torch.bfloat16).isnan().all()
    q, k, v, do = random_qkv(2, 48, 48, 4, 4, 16, dtype=torch.float64, seed=3)
    got = []
    for transport in (None, LoopbackTransport(poison=True)):
        cp = ringfa4.ContextParallel.simulated(4, backend="reference", transport=transport,
                                               options=RingOptions(bwd_ring=ring, dkv_groups=2))
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = ringfa4.attention(qq, kk, vv, cp=cp, causal=True)
        out.backward(do)
        got.append((out, qq.grad, kk.grad, vv.grad))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *got):
        assert torch.equal(a, b), f"{name} changed under poisoned hops ({ring} ring)"
    ref = reference_grads(q, k, v, do, causal=True)
    torch.testing.assert_close(got[1][1], ref[2], rtol=1e-9, atol=1e-9)


def test_visiting_states_are_made_per_step(monkeypatch):
    """A visiting state may keep what it derives from the q side it was made for (FA4's accumulating
    backward copies the lse rows of a block whose rows it pads): here the reference backend's
    visiting state snapshots its lse at creation, so a state kept past the hop that replaced its
    pieces' contents would compute with another rank's lse. The grads stay float64-exact (the case's
    own check) only if every step makes its own."""
    from ringfa4.kernels import reference

    real = reference._ReferenceAccum.visiting

    def snapshot(self, pieces, h0, h1, dq):
        state = real(self, pieces, h0, h1, dq)
        state.lse = state.lse.clone()
        return state

    monkeypatch.setattr(reference._ReferenceAccum, "visiting", snapshot)
    _sim_case(4, "zigzag", torch.float64, {"causal": True}, h=4, h_kv=4, seed=9,
              options=RingOptions(bwd_ring="q", dkv_groups=2))
