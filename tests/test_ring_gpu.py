"""Ring CP on one GPU (simulated executor, the auto backend: fa4 on the H200) in bf16.

- loopback hops with poisoned receive buffers and a delayed communication stream give results
  bit-identical to plain hops, while a transport that skips its wait is caught by the same check;
- out, lse, dq, dk, dv against float64 within 2x the same backend's full-sequence error + 1e-3.
"""

import pytest
import torch
from helpers import random_qkv, reference_grads, rel_err

import ringfa4
from ringfa4 import RingOptions
from ringfa4.kernels import AttnSpec, get_backend
from ringfa4.parallel import LoopbackTransport

pytestmark = pytest.mark.gpu


class _NoWaitTransport(LoopbackTransport):
    """A broken transport: never makes compute wait for the copy (the bug the test must catch)."""

    def wait(self, handle):
        pass


def _fa4_full_grads(q, k, v, do, kw):
    """The float64 reference (out, lse, dq, dk, dv) and one full FA4 call's dq, dk, dv."""
    ref = reference_grads(q, k, v, do, **kw)
    be = get_backend("fa4")
    spec = AttnSpec(**kw)
    o, l = be.forward(q, k, v, spec)
    return ref, be.backward(do, q, k, v, o, l, spec)


def _run(cp, q, k, v, do, **kw):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, return_lse=True, **kw)
    out.backward(do)
    torch.cuda.synchronize()
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_loopback_poison_and_delay_are_exact(layout):
    P = 4
    q, k, v, do = random_qkv(1, 4096, 4096, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    kw = {"causal": True, "deterministic": True}  # FA4's default dq reduction is atomic
    plain = _run(ringfa4.ContextParallel.simulated(P, layout=layout), q, k, v, do, **kw)
    slow = LoopbackTransport(poison=True, delay_cycles=20_000_000)  # ~10 ms per hop
    hard = _run(ringfa4.ContextParallel.simulated(P, layout=layout, transport=slow), q, k, v, do, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, hard):
        assert torch.equal(a, b), f"{name} changed under poisoned, delayed hops"
    broken = _NoWaitTransport(poison=True, delay_cycles=20_000_000)
    bad = _run(ringfa4.ContextParallel.simulated(P, layout=layout, transport=broken), q, k, v, do, **kw)
    assert not all(torch.equal(a, b) for a, b in zip(plain, bad)), "the check cannot see a missing wait"


@pytest.mark.parametrize("ring", ["kv", "q"])
def test_in_place_dkv_groups_under_poison_and_delay(ring):
    """The default backward (fp32 block gradients; the travelling accumulators, dK/dV of the K/V
    ring or dq of the q ring, in two head groups reduce-added in place, each group waiting for its
    own hop): poisoned, delayed hops change nothing beyond the order of fp32 atomics, while a
    transport that skips its wait is caught."""
    opts = RingOptions(fp32_grads=True, dkv_groups=2, bwd_ring=ring)
    P = 4
    q, k, v, do = random_qkv(1, 4096, 4096, 8, 4, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    plain = _run(ringfa4.ContextParallel.simulated(P, options=opts), q, k, v, do, causal=True)
    slow = LoopbackTransport(poison=True, delay_cycles=20_000_000)
    hard = _run(ringfa4.ContextParallel.simulated(P, transport=slow, options=opts), q, k, v, do, causal=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, hard):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3, msg=f"{name} changed under poisoned, delayed hops")
    broken = _NoWaitTransport(poison=True, delay_cycles=20_000_000)
    bad = _run(ringfa4.ContextParallel.simulated(P, transport=broken, options=opts), q, k, v, do, causal=True)
    assert any(not torch.allclose(a, b, rtol=2e-2, atol=2e-3) for a, b in zip(plain[2:], bad[2:])), \
        "the check cannot see a missing wait"


@pytest.mark.parametrize("h_kv,kw", [(8, {"causal": True}), (2, {"causal": True}), (8, {}),
                                     (8, {"causal": True, "window": (700, 0)})], ids=str)
def test_bwd_rings_fa4(h_kv, kw, monkeypatch):
    """Both backward rings on FA4's accumulating backward (parallel/ring/), P = 16, h = 8:
    the q ring (q side and fp32 dq travel) and the K/V ring (K/V and fp32 dK/dV travel) each
    within 1.1x one full FA4 call's error against float64, MHA and GQA, and the two agree to fp32
    rounding of the atomics; ``auto`` takes the q ring for MHA and the K/V ring for GQA."""
    from ringfa4.parallel.ring import backward as bwd_sides

    P, S = 16, 8192
    q, k, v, do = random_qkv(1, S, S, 8, h_kv, 128, dtype=torch.bfloat16, device="cuda", seed=h_kv + 40)
    ref, full = _fa4_full_grads(q, k, v, do, kw)
    used, real = [], bwd_sides.backward_side

    def spy(*args):
        side = real(*args)
        used.append(type(side).__name__)
        return side

    monkeypatch.setattr(bwd_sides, "backward_side", spy)
    got = {}
    for ring in ("q", "kv", "auto"):
        cp = ringfa4.ContextParallel.simulated(P, backend="fa4", options=RingOptions(bwd_ring=ring))
        used.clear()
        got[ring] = _run(cp, q, k, v, do, **kw)[2:]
        got[ring + " side"] = used[0]
    assert (got["q side"], got["kv side"]) == ("QSide", "KVSide")
    assert got["auto side"] == ("QSide" if h_kv == 8 else "KVSide")
    for ring in ("q", "kv"):
        for name, a, f, r in zip(("dq", "dk", "dv"), got[ring], full, ref[2:]):
            assert rel_err(a, r) <= 1.1 * rel_err(f, r), (ring, name, rel_err(a, r) / rel_err(f, r))
    for name, a, b in zip(("dq", "dk", "dv"), got["q"], got["kv"]):
        assert rel_err(a, b.double()) <= 1e-2, name


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"causal": True, "window": (300, None)}], ids=str)
def test_ring_bf16_matches_float64(P, kw):
    S = 2048
    q, k, v, do = random_qkv(2, S, S, 4, 2, 128, dtype=torch.bfloat16, device="cuda", seed=P)
    ref = reference_grads(q, k, v, do, **kw)
    be = get_backend("auto", q.device)
    spec = AttnSpec(**kw)
    o, l = be.forward(q, k, v, spec)
    base = [rel_err(x, r) for x, r in zip((o, l, *be.backward(do, q, k, v, o, l, spec)), ref)]
    got = _run(ringfa4.ContextParallel.simulated(P, layout="zigzag"), q, k, v, do, **kw)
    for name, x, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        err = rel_err(x, r)
        assert err <= 2 * e0 + 1e-3, f"P={P} {kw} {name}: {err:.3g} vs full-sequence {e0:.3g}"


@pytest.mark.parametrize("P,U,h_kv", [(8, 2, 2), (8, 4, 1), (8, 8, 8)])
def test_hybrid_bf16_matches_float64(P, U, h_kv):
    S = 2048
    kw = {"causal": True}
    q, k, v, do = random_qkv(1, S, S, 8, h_kv, 128, dtype=torch.bfloat16, device="cuda", seed=P + U)
    ref = reference_grads(q, k, v, do, **kw)
    be = get_backend("auto", q.device)
    spec = AttnSpec(**kw)
    o, l = be.forward(q, k, v, spec)
    base = [rel_err(x, r) for x, r in zip((o, l, *be.backward(do, q, k, v, o, l, spec)), ref)]
    got = _run(ringfa4.ContextParallel.simulated(P, layout="zigzag", ulysses=U), q, k, v, do, **kw)
    for name, x, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        err = rel_err(x, r)
        assert err <= 2 * e0 + 1e-3, f"P={P} U={U} {name}: {err:.3g} vs full-sequence {e0:.3g}"


@pytest.mark.parametrize("h_kv,S,window,wire", [(8, 8192, None, "fp32"), (2, 8192, None, "fp32"),
                                                (8, 3200, None, "fp32"), (8, 8192, (700, 0), "fp32"),
                                                (8, 8192, None, "input")])
def test_ring_fp32_block_gradients_fa4(h_kv, S, window, wire, monkeypatch):
    """fp32_grads on the fa4 backend (sm90: kernels/fa4/bwd_accum.py): P = 16 causal ring
    gradients within 1.1x one full FA4 call's error against float64 (MHA and GQA), and at least as
    accurate as with bf16 block gradients. dK/dV travel in FA4's tile layout (two kv-head groups,
    reduce-added in place, written out in one pass for both) where every block starts on a kv tile
    (causal zigzag blocks start at kv row 0, also with chunks of 100 rows), else dense (this window's
    blocks start at kv rows 68 and 324). With dK/dV travelling in bf16 (``dkv_wire="input"``, one
    rounding a hop) dk / dv are only held to the bf16-gradient ring."""
    from ringfa4.kernels.fa4 import bwd_accum as acc

    P = 16
    kw = dict(causal=True) if window is None else dict(causal=True, window=window)
    gathered = []  # a write a group (its rows), or ("groups", rows): the groups written in one pass
    write, write_groups = acc.TileKVLayout.write, acc.TileKVLayout.write_groups
    monkeypatch.setattr(acc.TileKVLayout, "write", lambda self, buf, rows, dk, dv: gathered.append(rows) or write(
        self, buf, rows, dk, dv))
    monkeypatch.setattr(acc.TileKVLayout, "write_groups", lambda self, bufs, rows, dk, dv: gathered.append(
        ("groups", rows)) or write_groups(self, bufs, rows, dk, dv))
    q, k, v, do = random_qkv(1, S, S, 8, h_kv, 128, dtype=torch.bfloat16, device="cuda", seed=h_kv)
    ref, full = _fa4_full_grads(q, k, v, do, kw)
    def cp(fp32_grads):
        return ringfa4.ContextParallel.simulated(P, backend="fa4", options=RingOptions(dkv_wire=wire,
                                                                                      fp32_grads=fp32_grads))

    bf16 = _run(cp(False), q, k, v, do, **kw)[2:]
    fp32 = _run(cp(True), q, k, v, do, **kw)[2:]
    # fp32 wire: in place in two kv-head groups (dkv_groups=2), both written in one pass a rank (b = 1)
    want = [("groups", S // P) if wire == "fp32" else S // P] * P
    assert gathered == (want if window is None else []), gathered
    for name, a, b, f, r in zip(("dq", "dk", "dv"), fp32, bf16, full, ref[2:]):
        e32, e16, ef = rel_err(a, r), rel_err(b, r), rel_err(f, r)
        if wire == "fp32" or name == "dq":
            assert e32 <= 1.1 * ef, (name, e32 / ef, e16 / ef)
            assert e32 <= e16 * 1.001, (name, e32, e16)
        else:  # the hops' bf16 rounding dominates (H200: 2.8x one full call's error, both ways)
            assert e32 <= 1.05 * e16, (name, e32, e16)


@pytest.mark.parametrize("h_kv,kw", [(8, {"causal": True}), (2, {"causal": True, "window": (700, 0)}), (2, {})],
                         ids=str)
def test_ring_epilogue_merge_fa4(h_kv, kw):
    """epilogue_merge (kernels/fa4/epilogue_merge.py, sm90): every block but a rank's first when
    it covers all rows (step 0, stored by the fp32-output forward into the uninitialized accumulator) merges inside
    FA4's epilogue; P = 8 ring out / lse within 1.0x one full FA4 call's error against float64
    (+1%) and equal to the scratch-and-merge ring's up to fp32 rounding."""
    from ringfa4.kernels.fa4 import fp32_forward as fa4_fp32

    P = 8
    q, k, v, do = random_qkv(1, 8192, 8192, 8, h_kv, 128, dtype=torch.bfloat16, device="cuda", seed=h_kv)
    ref = reference_grads(q, k, v, do, **kw)
    be = get_backend("fa4")
    o, l = be.forward(q, k, v, AttnSpec(**kw))
    plain = _run(ringfa4.ContextParallel.simulated(P, backend="fa4", options=RingOptions(epilogue_merge=False)),
                 q, k, v, do, **kw)
    fa4_fp32._CACHE.clear()
    fused = _run(ringfa4.ContextParallel.simulated(P, backend="fa4"), q, k, v, do, **kw)
    # the step-0 store: one kernel kind; none with this window (step 0 comes in two blocks, neither
    # covering all rows, so the accumulator is zeroed and both merge)
    stored = [key for key in fa4_fp32._CACHE if not key.merge]
    assert any(key.merge for key in fa4_fp32._CACHE), list(fa4_fp32._CACHE)
    assert len(stored) == (0 if "window" in kw else 1), stored
    for name, a, b, f, r in zip(("out", "lse"), fused, plain, (o, l), ref):
        ea, eb, ef = rel_err(a, r), rel_err(b, r), rel_err(f, r)
        assert ea <= 1.01 * ef, (name, ea / ef, eb / ef)
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), fused[2:], plain[2:]):
        assert rel_err(a, b.double()) <= 1e-2, name  # the same backward from (almost) the same out, lse


@pytest.mark.parametrize("options", [RingOptions(), RingOptions(cuda_graphs=True)], ids=["eager", "graphs"])
def test_ring_makes_no_host_sync(options):
    """A warmed-up ring forward + backward (simulated, dense, causal) runs under
    ``torch.cuda.set_sync_debug_mode("error")``: no call on the hot path waits for the GPU."""
    cp = ringfa4.ContextParallel.simulated(4, options=options)
    q, k, v, do = random_qkv(1, 8192, 8192, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    _run(cp, q, k, v, do, causal=True)  # compiles, captures
    torch.cuda.set_sync_debug_mode("error")
    try:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ringfa4.attention(qq, kk, vv, cp=cp, causal=True).backward(do)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
