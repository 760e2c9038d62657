"""Ring CP against float64 full-sequence attention: simulated executor (P = 1..16) and gloo
(P = 2, 3, 4), out, lse, dq, dk, dv; bit identity of the two executors; validation on all ranks.

Criterion: error against float64 <= 2x the same backend's error on the full sequence + a floor
(1e-12 float64, 1e-6 float32, relative)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_pool import Pool
from helpers import HeadMajorGrads, random_qkv, reference_grads, rel_err

import ringfa4
from ringfa4 import RingOptions
from ringfa4.kernels import AttnSpec, get_backend
from ringfa4.parallel import LoopbackTransport

FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6}

MASKS = [
    {"causal": True},
    {},
    {"causal": True, "window": (5, None)},  # window smaller than a chunk
    {"causal": True, "window": (40, None)},
    {"window": (9, 4)},
    {"causal": True, "softcap": 2.5},
]


def _full_backend_errors(q, k, v, do, kw, ref):
    """The reference backend's own error on the full sequence (one call, no CP)."""
    spec = AttnSpec(**kw)
    be = get_backend("reference")
    out, lse = be.forward(q, k, v, spec)
    grads = be.backward(do, q, k, v, out, lse, spec)
    return [rel_err(x, r) for x, r in zip((out, lse, *grads), ref)]


def _assert_close(got, ref, base, dtype, label):
    for name, x, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        err = rel_err(x, r)
        assert err <= 2 * e0 + FLOOR[dtype], f"{label} {name}: {err:.3g} > 2 x {e0:.3g} + floor"


def _sim_case(P, layout, dtype, kw, b=2, chunk=6, h=4, h_kv=2, d=16, seed=0, options=None):
    S = 2 * P * chunk
    q, k, v, do = random_qkv(b, S, S, h, h_kv, d, dtype=dtype, seed=seed)
    ref = reference_grads(q, k, v, do, **kw)
    base = _full_backend_errors(q, k, v, do, kw, ref)
    cp = ringfa4.ContextParallel.simulated(P, layout=layout, backend="reference", options=options)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, return_lse=True, **kw)
    out.backward(do)
    got = (out, lse, qq.grad, kk.grad, vv.grad)
    _assert_close(got, ref, base, dtype, f"sim P={P} {layout} {kw}")
    return got


@pytest.mark.parametrize("P", list(range(1, 17)))
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_simulated_causal_all_world_sizes(P, layout):
    _sim_case(P, layout, torch.float64, {"causal": True}, seed=P)


@pytest.mark.parametrize("kw", MASKS[1:], ids=lambda kw: str(kw))
@pytest.mark.parametrize("P", [2, 5, 8, 16])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_simulated_masks(kw, P, layout, dtype):
    _sim_case(P, layout, dtype, kw, seed=P + 100)


def test_simulated_mqa_and_batch():
    _sim_case(4, "zigzag", torch.float32, {"causal": True}, b=3, h=6, h_kv=1, d=8)


def test_cp_none_and_one_rank_group_are_one_backend_call():
    q, k, v, do = random_qkv(1, 24, 24, 2, 2, 8)
    a = ringfa4.attention(q, k, v, causal=True, backend="reference")
    ref, _ = get_backend("reference").forward(q, k, v, AttnSpec(causal=True))
    assert torch.equal(a, ref)
    cp = ringfa4.ContextParallel(backend="reference")  # no process group: one rank
    assert cp.world_size == 1 and torch.equal(ringfa4.attention(q, k, v, cp=cp, causal=True), ref)


def test_simulated_validation_errors():
    cp = ringfa4.ContextParallel.simulated(4, layout="zigzag", backend="reference")
    q, k, v, _ = random_qkv(1, 12, 12, 2, 2, 8)
    ringfa4.attention(q, k, v, cp=cp)  # any length (test_any_length.py): 12 is not a multiple of 8
    q, k, v, _ = random_qkv(1, 16, 16, 3, 2, 8)
    with pytest.raises(ValueError, match="k heads must divide q heads 3"):
        ringfa4.attention(q, k, v, cp=cp)


# -- gloo ------------------------------------------------------------------------------------------


GLOO_CASES = [
    (2, "zigzag", torch.float64, {"causal": True}),
    (2, "contiguous", torch.float32, {}),
    (3, "zigzag", torch.float64, {"causal": True, "window": (5, None)}),
    (3, "contiguous", torch.float64, {"causal": True, "softcap": 2.5}),
    (4, "zigzag", torch.float32, {"causal": True}),
    (4, "zigzag", torch.float64, {"window": (9, 4)}),
    (4, "contiguous", torch.float64, {"causal": True, "window": (40, None)}),
    (4, "zigzag", torch.float64, {}),
]


@pytest.mark.parametrize("world,layout,dtype,kw", GLOO_CASES, ids=lambda x: str(x))
def test_gloo_ring_matches_float64_and_simulated(pools, world, layout, dtype, kw):
    shape = (2, 2 * world * 6, 4, 2, 16)
    res = pools(world).run("ring_case", layout, dtype, shape, kw, 7)
    assert all(status == "ok" for status, _ in res), res
    assert all(value["identical"] for _, value in res), "distributed and simulated executors differ"
    q, k, v, do = random_qkv(*shape[:2], shape[1], *shape[2:], dtype=dtype, seed=7)
    ref = reference_grads(q, k, v, do, **kw)
    base = _full_backend_errors(q, k, v, do, kw, ref)
    _assert_close(res[0][1]["full"], ref, base, dtype, f"gloo P={world} {layout} {kw}")


@pytest.mark.parametrize("layout,kw,native", [("contiguous", {"causal": True, "window": (20, 0)}, False),
                                               ("zigzag", {"causal": True}, True)], ids=str)
def test_gloo_fp32_grads_in_a_backend_layout(pools, layout, kw, native):
    """Distributed ranks choose the same dK/dV layout (they pass the buffers on): with a window,
    some rank's blocks start off the layout's alignment, so every rank takes the dense one; else
    every rank adds in place into two kv-head groups (two dK/dV hops a step over gloo); the
    gradients match float64 and the simulated executor bit for bit."""
    world, shape = 2, (1, 2 * 2 * 16, 2, 2, 8)
    res = pools(world).run("ring_case_backend_layout", layout, shape, kw, 16)
    assert all(status == "ok" for status, _ in res), res
    assert all(value["identical"] for _, value in res), "distributed and simulated executors differ"
    # native: the blocks added in place into the two kv-head groups' layouts, not the whole-head one, and
    # at home the groups' buffers are evenly spaced in one: one write for both (through group 0's layout)
    assert all(value["used"] == ([None, "groups", None] if native else [None] * len(value["used"]))
               for _, value in res), res
    q, k, v, do = random_qkv(*shape[:2], shape[1], *shape[2:], dtype=torch.float64, seed=7)
    ref = reference_grads(q, k, v, do, **kw)
    _assert_close(res[0][1]["full"], ref, _full_backend_errors(q, k, v, do, kw, ref), torch.float64,
                  f"gloo backend layout {layout} {kw}")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_gloo_placement(pools, world, layout):
    S = 4 * world
    res = pools(world).run("placement", layout, S)
    layout_obj = ringfa4.parallel.make_layout(layout, world)
    for rank, (status, value) in enumerate(res):
        assert status == "ok", value
        assert torch.equal(value["positions"], layout_obj.indices(S, rank))
        assert torch.equal(value["local"], layout_obj.indices(S, rank).float())
        assert value["roundtrip"]


BAD = [
    ("shape_mismatch", r"rank 1: q.shape is \(1, 8, 2, 8\), expected \(1, 8, 4, 8\)"),
    ("causal_mismatch", r"rank 1: causal is False, expected True"),
    ("bad_dtype", r"rank 3: k must have q's dtype torch.float32"),
    ("uneven_wrong", r"rank 2: q.shape is \(1, 3, 4, 8\), expected \(1, 2, 4, 8\) as on rank 0 \(all CP ranks "
                     r"must agree\); dim 1: rank 2's part of the 9-token sequence"),
    ("heads", r"rank 0: k heads must divide q heads 4"),
    ("options_groups", r"rank 2: options.dkv_groups is 1, expected 2 as on rank 0"),
    ("options_ring", r"rank 1: options.bwd_ring is q, expected auto as on rank 0"),
    ("options_timeout", r"rank 3: options.timeout_s is 77.0, expected 300.0 as on rank 0"),
]


@pytest.mark.parametrize("kind,message", BAD, ids=[b[0] for b in BAD])
def test_gloo_bad_input_same_error_on_every_rank(pools, kind, message):
    import re

    res = pools(4).run("bad_input", kind, timeout=60)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({value for _, value in res}) == 1, res
    assert re.search(message, res[0][1]), res[0][1]


def test_gloo_failing_rank_is_reported_without_hang():
    """Rank 1's kernel fails after it posted its first hop: rank 2, which waits for rank 1's second
    hop, must time out and name rank 1's error (from the store); nobody hangs."""
    pool = Pool(3, pg_timeout_s=20)
    try:
        res = pool.run("failing_rank", 1, 5.0, timeout=90)
    finally:
        pool.close()
    assert res[1] == ("RuntimeError", "injected kernel failure")
    assert res[2][0] == "RuntimeError" and "rank 1: RuntimeError: injected kernel failure" in res[2][1], res
    assert res[0][0] in ("ok", "RuntimeError"), res


# -- Ulysses and hybrid ----------------------------------------------------------------------------
HYBRID_GLOO = [
    (4, "zigzag", torch.float64, {"causal": True}, 8),
    (2, "zigzag", torch.float64, {"causal": True}, 2),
    (1, "zigzag", torch.float64, {"causal": True}, 2),
    (4, "zigzag", torch.float32, {}, 1),
    (2, "contiguous", torch.float64, {}, 1),
    (2, "zigzag", torch.float64, {"causal": True, "window": (5, None)}, 8),
    (4, "zigzag", torch.float64, {"window": (9, 4)}, 2),
]


@pytest.mark.parametrize("ulysses,layout,dtype,kw,h_kv", HYBRID_GLOO, ids=lambda x: str(x))
def test_gloo_ulysses_and_hybrid(pools, ulysses, layout, dtype, kw, h_kv):
    world = 4
    shape = (2, 2 * world * 3, 8, h_kv, 16)
    res = pools(world).run("ring_case", layout, dtype, shape, kw, 11, ulysses)
    assert all(status == "ok" for status, _ in res), res
    assert all(value["identical"] for _, value in res), "distributed and simulated executors differ"
    q, k, v, do = random_qkv(*shape[:2], shape[1], *shape[2:], dtype=dtype, seed=11)
    ref = reference_grads(q, k, v, do, **kw)
    base = _full_backend_errors(q, k, v, do, kw, ref)
    _assert_close(res[0][1]["full"], ref, base, dtype, f"gloo U={ulysses} {layout} {kw} h_kv={h_kv}")


@pytest.mark.parametrize("ulysses", [2, 4])
def test_gloo_hybrid_placement(pools, ulysses):
    S = 48
    res = pools(4).run("placement", "zigzag", S, ulysses)
    lay = ringfa4.parallel.HybridLayout(4, ringfa4.parallel.make_layout("zigzag", 4 // ulysses), ulysses)
    for rank, (status, value) in enumerate(res):
        assert status == "ok", value
        assert torch.equal(value["positions"], lay.indices(S, rank)) and value["roundtrip"]


def test_gloo_ulysses_bad_heads_same_error_everywhere(pools):
    res = pools(4).run("bad_input", "ulysses_heads", 4, timeout=60)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({value for _, value in res}) == 1
    assert "q heads 6 cannot be split over a Ulysses degree of 4" in res[0][1]


@pytest.mark.parametrize("P,U", [(2, 2), (4, 2), (8, 8), (8, 4), (12, 4), (16, 2), (16, 16)])
@pytest.mark.parametrize("h_kv", [1, 2, 8])
@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"causal": True, "window": (7, None)}], ids=str)
def test_simulated_hybrid(P, U, h_kv, kw):
    R = P // U
    S = 2 * R * U * 2
    q, k, v, do = random_qkv(1, S, S, 16, h_kv, 8, dtype=torch.float64, seed=P * 31 + U)
    ref = reference_grads(q, k, v, do, **kw)
    base = _full_backend_errors(q, k, v, do, kw, ref)
    cp = ringfa4.ContextParallel.simulated(P, layout="zigzag", backend="reference", ulysses=U)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, return_lse=True, **kw)
    out.backward(do)
    _assert_close((out, lse, qq.grad, kk.grad, vv.grad), ref, base, torch.float64, f"sim P={P} U={U}")


@pytest.mark.parametrize("domain,heads,kv,packed,want", [(2, 8, 2, False, (2, 2)), (4, 8, 1, False, (4, 1)),
                                                         (4, 6, 6, False, (2, 2)), (1, 8, 8, False, (1, 4)),
                                                         (4, 8, 1, True, (1, 4))])  # packed documents: the ring
def test_gloo_auto_plan(pools, domain, heads, kv, packed, want):
    res = pools(4).run("auto_plan", domain, heads, kv, packed)
    for status, value in res:
        assert status == "ok", value
        assert (value["ulysses"], value["ring"]) == want and value["err"] < 1e-12
    assert f"Ulysses {want[0]} x ring {want[1]}" in res[0][1]["describe"]


def _sim(P, options=None, **kw):
    return ringfa4.ContextParallel.simulated(P, backend="reference", options=options, **kw)


@pytest.mark.parametrize("P", [4, 16])
def test_fp32_partials_remove_the_rounding_between_steps(P):
    """bf16 inputs, simulated ring (reference backend, fp32 math): with fp32_partials the block
    outputs are not rounded to bf16 before merging, so out is as accurate as one full call (the
    merged fp32 result is rounded once); with bf16 partials the error grows with P."""
    S = 2 * P * 32
    q, k, v, do = random_qkv(1, S, S, 4, 2, 32, dtype=torch.float64, seed=P)
    ref = reference_grads(q, k, v, do, causal=True)[0]
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    full = get_backend("reference").forward(qb, kb, vb, AttnSpec(causal=True))[0]
    errs = {flag: rel_err(ringfa4.attention(qb, kb, vb, cp=_sim(P, RingOptions(fp32_partials=flag)), causal=True),
                          ref) for flag in (False, True)}
    e_full = rel_err(full, ref)
    assert errs[True] <= 1.02 * e_full, (errs, e_full)
    assert errs[True] < errs[False], (errs, e_full)


@pytest.mark.parametrize("P", [8, 32])
def test_ring_lse_as_accurate_as_one_call(P):
    """bf16 inputs, reference backend: the ring's lse is kept in float64 across steps and rounded
    once, so its error is at most one full call's (the fp32 merges alone gave 2.1x at P = 32)."""
    S = 2 * P * 32
    q, k, v, _ = random_qkv(1, S, S, 4, 2, 32, dtype=torch.float64, seed=P + 1)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    exact = get_backend("reference", compute_dtype=torch.float64).forward(
        qb.double(), kb.double(), vb.double(), AttnSpec(causal=True))[1]
    full = get_backend("reference").forward(qb, kb, vb, AttnSpec(causal=True))[1]
    lse = ringfa4.attention(qb, kb, vb, cp=_sim(P), causal=True, return_lse=True)[1]
    assert lse.dtype == torch.float32
    assert rel_err(lse, exact) <= rel_err(full, exact), (rel_err(lse, exact), rel_err(full, exact))


@pytest.mark.parametrize("P,h_kv,kw", [(16, 2, {"causal": True}), (8, 4, {"causal": True, "window": (40, 0)}),
                                         (4, 2, {"softcap": 3.0})])
def test_fp32_block_gradients(P, h_kv, kw):
    """fp32_grads (reference backend's AccumBackward): no block gradient is rounded to bf16, so
    dq / dk / dv are as accurate as one full call (rounded once) and more accurate than with bf16
    block gradients; the default is on, bit for bit the same as asking for it."""
    S = 2 * P * 24
    q, k, v, do = random_qkv(1, S, S, 4, h_kv, 32, dtype=torch.float64, seed=P + h_kv)
    qb, kb, vb, dob = (t.to(torch.bfloat16) for t in (q, k, v, do))
    ref = reference_grads(qb, kb, vb, dob, **kw)[2:]
    be = get_backend("reference")
    o, l = be.forward(qb, kb, vb, AttnSpec(**kw))
    full = be.backward(dob, qb, kb, vb, o, l, AttnSpec(**kw))

    def grads(options=None):
        x = [t.clone().requires_grad_() for t in (qb, kb, vb)]
        ringfa4.attention(*x, cp=_sim(P, options), **kw).backward(dob)
        return [t.grad for t in x]

    bf16 = grads(RingOptions(fp32_grads=False))
    fp32 = grads(RingOptions(fp32_grads=True))
    for name, a, b, f, r in zip("qkv", fp32, bf16, full, ref):
        e32, e16, ef = rel_err(a, r), rel_err(b, r), rel_err(f, r)
        assert e32 <= 1.02 * ef, (name, e32, ef)
        assert e32 < e16, (name, e32, e16)
    assert all(torch.equal(a, b) for a, b in zip(grads(), fp32))


def test_group_stride_finds_groups_cut_evenly_from_one_buffer():
    """One strided view spans the head groups' buffers only where they are evenly spaced,
    non-overlapping, contiguous views of one allocation, in order."""
    from ringfa4.kernels.spec import group_stride

    flat = torch.zeros(3 * 64)
    even = [flat.narrow(0, g * 64, 48) for g in range(3)]
    assert group_stride(even, 48) == 64 and group_stride(even[:2], 48) == 64
    assert group_stride(even[:1], 48) is None  # one group: nothing to span
    assert group_stride(even[::-1], 48) is None  # out of order
    assert group_stride([flat.narrow(0, 0, 48), flat.narrow(0, 64, 48), flat.narrow(0, 140, 48)], 48) is None
    assert group_stride([flat.narrow(0, 0, 48), flat.narrow(0, 40, 48)], 48) is None  # overlapping
    assert group_stride(even, 40) is None  # not the layout's size
    apart = [torch.zeros(48), torch.zeros(48)]
    assert group_stride(apart, 48) is None  # two allocations, however they lie in memory
    strided = flat.view(3, 64)[:, ::2]
    assert group_stride([strided[0], strided[1]], 32) is None


def test_fa4_tile_layout_writes_its_groups_as_one_batch(monkeypatch):
    """FA4's tile layout writes G kv-head groups evenly spaced in one buffer with one dK and one dV
    postprocess, the groups as the batch: each batch entry is exactly group g's accumulator half
    and its heads of dk / dv (the same memory a write a group would use); b = 2, or groups from
    separate buffers, take a write a group."""
    from types import SimpleNamespace

    from ringfa4.kernels.fa4 import bwd_accum

    calls = []
    monkeypatch.setattr(bwd_accum, "_kv_postprocess", lambda acc, out, state, scale: calls.append((acc, out, scale)))
    state = SimpleNamespace(plan=SimpleNamespace(kv_align=128), head_dim_rounded=128, softmax_scale=0.125)
    G, h_g, rows, d = 2, 2, 200, 128
    k = torch.zeros(1, rows, h_g, d, dtype=torch.bfloat16)
    lay = bwd_accum.TileKVLayout(state, k, rows)
    flat = torch.zeros(G * lay.numel)
    bufs = [flat.narrow(0, g * lay.numel, lay.numel) for g in range(G)]
    dk, dv = (torch.zeros(1, rows, G * h_g, d, dtype=torch.bfloat16) for _ in range(2))
    lay.write_groups(bufs, rows, dk, dv)
    assert [c[2] for c in calls] == [0.125, 1.0] and all(c[0].shape[0] == G == c[1].shape[0] for c in calls)
    for (acc, out, _), half, whole in zip(calls, range(2), (dk, dv)):
        for g in range(G):
            mine = lay._halves(bufs[g])[half][0]
            assert acc[g].shape == mine.shape and acc[g].stride() == mine.stride()
            assert acc[g].data_ptr() == mine.data_ptr()
            theirs = whole.narrow(2, g * h_g, h_g)[0]
            assert out[g].shape == theirs.shape and out[g].stride() == theirs.stride()
            assert out[g].data_ptr() == theirs.data_ptr()
    calls.clear()
    lay.write_groups([torch.zeros(lay.numel) for _ in range(G)], rows, dk, dv)
    assert len(calls) == 2 * G and all(c[0].shape[0] == 1 for c in calls)  # a write a group
    calls.clear()
    k2 = torch.zeros(2, rows, h_g, d, dtype=torch.bfloat16)
    lay2 = bwd_accum.TileKVLayout(state, k2, rows)
    flat2 = torch.zeros(G * lay2.numel)
    dk2, dv2 = (torch.zeros(2, rows, G * h_g, d, dtype=torch.bfloat16) for _ in range(2))
    lay2.write_groups([flat2.narrow(0, g * lay2.numel, lay2.numel) for g in range(G)], rows, dk2, dv2)
    assert len(calls) == 2 * G and all(c[0].shape[0] == 2 for c in calls)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("align,window,native", [(16, None, True), (4, (20, 0), True), (8, (20, 0), False)])
def test_fp32_grads_in_a_backend_layout(align, window, native, groups, monkeypatch):
    """An AccumBackward's ``kv_layout``: dK/dV accumulate and travel in the backend's own layout
    (FA4: its tile layout) and give the same gradients as the dense layout, bit for bit; a
    schedule with a block starting off the layout's alignment falls back to the dense layout. With
    ``dkv_groups=2`` the blocks add in place into two travelling kv-head groups, each in a layout
    of its own (one per group), both written out in one pass a rank at the end (b = 1: the groups'
    buffers are evenly spaced in one allocation at home)."""
    from ringfa4.kernels.reference import _ReferenceAccum

    P, S = 4, 2 * 4 * 16  # zigzag chunks of 16 rows; the window's blocks start at kv rows 0, 12, 16, 28
    q, k, v, do = random_qkv(1, S, S, 4, 2, 16, dtype=torch.bfloat16, seed=7)
    cp = _sim(P, RingOptions(fp32_grads=True, dkv_groups=groups))

    def grads():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        ringfa4.attention(*x, cp=cp, causal=True, window=window or (None, None)).backward(do)
        return [t.grad for t in x]

    dense = grads()
    made = []
    monkeypatch.setattr(_ReferenceAccum, "kv_layout", lambda self, k, cap: made.append(
        HeadMajorGrads(k, cap, align)) or made[-1])
    got = grads()
    if groups == 2 and native:  # at home the groups' buffers are evenly spaced in one: a write for both
        batched = [lay for lay in made if lay.group_writes]
        assert len(batched) == 1 and batched[0].group_writes == P and batched[0].shape[1] == 1, made
        assert not any(lay.dense_calls for lay in made)
    else:
        used = [lay for lay in made if lay.dense_calls]
        assert len(used) == (groups if native else 0), [m.dense_calls for m in made]
        assert all(lay.dense_calls == P and lay.shape[1] == 2 // groups for lay in used)
    assert all(torch.equal(a, b) for a, b in zip(got, dense))


@pytest.mark.parametrize("side", ["kv", "q"])
def test_in_place_groups_send_the_data_with_group_0s_accumulators(side, monkeypatch):
    """In place in two head groups, the travelling data (K/V, or the q side) goes in the same hop
    as group 0's accumulators: a backward of s active steps makes 2 s hops (each group's s - 1
    and its hop home), not 3 s - 1. K/V: the gradients are the bits of the dense layout's backward
    (one group through a scratch, its data hopping alone); the q side (MHA) is in place in two
    groups with either layout."""
    from ringfa4.kernels.reference import _ReferenceAccum
    from ringfa4.parallel import LoopbackTransport
    from ringfa4.parallel.ring.run import active_steps

    P, S = 4, 2 * 4 * 16
    q, k, v, do = random_qkv(1, S, S, 4, 2 if side == "kv" else 4, 16, dtype=torch.bfloat16, seed=5)
    cp = _sim(P, RingOptions(fp32_grads=True, dkv_groups=2, bwd_ring=side))
    hops, real = [], LoopbackTransport.shift

    def shift(self, send, recv, offset):
        hops.append(len(send[0]) if isinstance(send[0], tuple) else 1)
        return real(self, send, recv, offset)

    def grads():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ringfa4.attention(*x, cp=cp, causal=True)
        hops.clear()
        out.backward(do)
        return [t.grad for t in x]

    monkeypatch.setattr(LoopbackTransport, "shift", shift)
    dense = grads()
    steps = active_steps(cp.run(q, AttnSpec(causal=True)).schedule)
    assert len(hops) == (2 * steps if side == "q" else (steps - 1) + steps), hops  # kv dense: one group
    made = []
    monkeypatch.setattr(_ReferenceAccum, "kv_layout", lambda self, k, cap: made.append(
        HeadMajorGrads(k, cap, 1)) or made[-1])
    got = grads()
    assert sum(m.group_writes for m in made) == P  # both groups' dK/dV written in one pass a rank
    assert len(hops) == 2 * steps, hops
    first = 3 if side == "kv" else 5  # K, V (q, dout, out, lse) as pieces on the first hop, then one buffer
    assert hops.count(first) == 1 and hops.count(2) == steps - 2, hops
    assert all(torch.equal(a, b) for a, b in zip(got, dense))


def _layout(*ts):
    return tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in ts)


@pytest.mark.parametrize("P,S,groups,window,side", [(4, 256, 2, None, "kv"), (8, 2 * 8 * 16 + 40, 2, (60, 0), "kv"),
                                                    (4, 200, 1, None, "kv"), (4, 256, 2, None, "q"),
                                                    (8, 256, 1, (60, 0), "q")])
def test_travelled_blocks_replay_their_first_call(P, S, groups, window, side, monkeypatch):
    """Blocks against data that came by a hop repeat a prepared launch (AccumBackward.replay), one
    per (head group, state class, block, held rows), with no checks: every argument of a replayed
    block has the shapes, strides, dtypes and alignment of the call that prepared it, also across
    ranks of uneven length (S not a multiple of 2P tiles), with b = 2, in the backend's own dK/dV
    layout and a plain one, K/V travelling or the q side (MHA); gradients are the same bits as
    without replays."""
    from ringfa4.kernels.reference import _ReferenceAccum

    made = []
    monkeypatch.setattr(_ReferenceAccum, "kv_layout", lambda self, k, cap: made.append(
        HeadMajorGrads(k, cap, 1)) or made[-1])
    q, k, v, do = random_qkv(2, S, S, 4, 2 if side == "kv" else 4, 16, dtype=torch.bfloat16, seed=11)
    cp = _sim(P, RingOptions(fp32_grads=True, dkv_groups=groups, bwd_ring=side))

    def grads():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        ringfa4.attention(*x, cp=cp, causal=True, window=window or (None, None)).backward(do)
        return [t.grad for t in x]

    monkeypatch.setattr(_ReferenceAccum, "replay", lambda self, *a: None)
    plain = grads()
    binds, replays = [], []

    def replay(self, q0, q1, k_, v_, spec, dk, dv):
        seen = (_layout(self.q, self.dout), _layout(k_, v_, dk, dv))
        binds.append(seen)

        def again(state, k2, v2, dk2, dv2):
            assert (_layout(state.q, state.dout), _layout(k2, v2, dk2, dv2)) == seen
            replays.append(1)
            state.add_block(q0, q1, k2, v2, spec, dk2, dv2)
        return again

    monkeypatch.setattr(_ReferenceAccum, "replay", replay)
    monkeypatch.setattr(_ReferenceAccum, "replay_class", lambda self: _layout(self.q, self.dout))
    import ringfa4.parallel.ring.backward as bwd

    real, used = bwd.backward_side, []
    monkeypatch.setattr(bwd, "backward_side", lambda *a: used.append(real(*a)) or used[-1])
    got = grads()
    assert [type(x).__name__ for x in used] == [{"kv": "KVSide", "q": "QSide"}[side]]
    assert binds and len(replays) > len(binds), (len(binds), len(replays))
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


@pytest.mark.parametrize("P,S,b", [(4, 256, 2), (8, 2 * 8 * 16 + 40, 1)])
def test_travelled_merging_blocks_replay_their_first_call(P, S, b, monkeypatch):
    """Merging forward blocks against K/V that came by a hop repeat a prepared launch
    (BlockBackend.merge_replay), one per (q class, block, held K/V layout), with no checks: every
    argument of a replayed block has the shapes, strides, dtypes and alignment of the call that
    prepared it, also across ranks of uneven length; out and lse are the same bits as without."""
    from ringfa4.kernels.reference import ReferenceBackend

    q, k, v, do = random_qkv(b, S, S, 4, 2, 16, dtype=torch.bfloat16, seed=13)
    cp = _sim(P, RingOptions(epilogue_merge=True))

    def run():
        out, lse = ringfa4.attention(q, k, v, cp=cp, causal=True, return_lse=True)
        return out, lse

    monkeypatch.setattr(ReferenceBackend, "merge_replay", lambda self, *a: None)
    plain = run()
    binds, replays = [], []
    native = ReferenceBackend._merge_into

    def merge_replay(self, q_, k_, v_, spec, o_, p_):
        seen = _layout(q_, k_, v_, o_, p_)
        binds.append(seen)

        def again(q2, k2, v2, o2, p2):
            assert _layout(q2, k2, v2, o2, p2) == seen
            replays.append(1)
            native(self, q2, k2, v2, spec, o2, p2)
        return again

    monkeypatch.setattr(ReferenceBackend, "merge_replay", merge_replay)
    got = run()
    assert binds and len(replays) > len(binds), (len(binds), len(replays))
    assert all(torch.equal(a, c) for a, c in zip(got, plain))


@pytest.mark.parametrize("decline", [False, True])
def test_epilogue_merge_executor(decline, monkeypatch):
    """epilogue_merge with a backend offering ``forward_merge`` (the reference backend's torch
    version of FA4's merging epilogue): every block goes through it, into (b, h, 2, s) running
    (M, S) planes, and out / lse / grads equal the scratch-and-merge path's (float64 running lse);
    blocks the backend declines (returns None) are merged into the same planes in torch."""
    from ringfa4.kernels.reference import ReferenceBackend

    calls = []
    native = ReferenceBackend.forward_merge

    def forward_merge(self, q, k, v, spec, out_acc, planes):
        assert planes.shape == (q.shape[0], q.shape[2], 2, q.shape[1]) and planes.stride(1) == 2 * planes.stride(2)
        calls.append(q.shape[1])
        if decline and len(calls) % 3 == 0:
            return None
        return native(self, q, k, v, spec, out_acc, planes)

    monkeypatch.setattr(ReferenceBackend, "forward_merge", forward_merge)
    q, k, v, do = random_qkv(2, 128, 128, 4, 2, 16, dtype=torch.bfloat16, seed=5)

    def run(options):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ringfa4.attention(*x, cp=_sim(4, options), causal=True, window=(40, 0), return_lse=True)
        out.backward(do)
        return [out, lse] + [t.grad for t in x]

    plain = run(RingOptions(epilogue_merge=False))
    assert not calls  # off: never called
    fused = run(RingOptions(epilogue_merge=True))
    assert len(calls) >= 4 * 3
    for a, b in zip(fused, plain):  # fp32 lse to its rounding; bf16 out / grads to one bf16 ulp
        torch.testing.assert_close(a, b, rtol=1e-6 if a.dtype == torch.float32 else 2 ** -7, atol=1e-6)


def test_no_epilogue_merge_where_the_backend_cannot(monkeypatch):
    """A backend whose ``can_forward_merge`` says no for the inputs (FA4 on sm100) gets no
    ``forward_merge`` call: the ring runs each block into a scratch and a merge kernel, bit for bit
    the epilogue_merge=False results, instead of asking (and being declined) block by block."""
    from ringfa4.kernels.reference import ReferenceBackend

    calls = []
    native = ReferenceBackend.forward_merge
    monkeypatch.setattr(ReferenceBackend, "forward_merge", lambda self, *a: calls.append(1) or native(self, *a))
    q, k, v, _ = random_qkv(1, 64, 64, 4, 2, 16, dtype=torch.bfloat16, seed=8)
    plain = ringfa4.attention(q, k, v, cp=_sim(4, RingOptions(epilogue_merge=False)), causal=True, return_lse=True)
    monkeypatch.setattr(ReferenceBackend, "can_forward_merge", lambda self, q, v: False)
    got = ringfa4.attention(q, k, v, cp=_sim(4), causal=True, return_lse=True)
    assert not calls and all(torch.equal(a, b) for a, b in zip(got, plain))
    monkeypatch.undo()
    monkeypatch.setattr(ReferenceBackend, "forward_merge", lambda self, *a: calls.append(1) or native(self, *a))
    ringfa4.attention(q, k, v, cp=_sim(4), causal=True)
    assert calls  # the same inputs where it can: merged in "the kernel"


@pytest.mark.parametrize("first_covers", [True, False])
def test_epilogue_merge_uninitialized_accumulator(first_covers, monkeypatch):
    """The epilogue-merge forward allocates its accumulator and (M, S) planes uninitialized: a rank's
    first block that covers all its rows is stored into them (never read), otherwise they are
    zeroed first. With every float ``torch.empty`` poisoned by NaN the results equal, bit for bit,
    those of the same path unpoisoned, both when the first blocks are stored and when they merge
    (``covers`` patched to False: a merge into (0, -inf, 0) gives the stored values exactly)."""
    from ringfa4.parallel.blocks import Block

    q, k, v, do = random_qkv(2, 96, 96, 4, 2, 16, dtype=torch.bfloat16, seed=6)
    cp = _sim(3)

    def run():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ringfa4.attention(*x, cp=cp, causal=True, return_lse=True)
        out.backward(do)
        return [out, lse] + [t.grad for t in x]

    clean = run()
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    if not first_covers:
        monkeypatch.setattr(Block, "covers", lambda self, rows: False)
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, clean))


@pytest.mark.parametrize("fp32_grads", [False, True])
def test_dkv_on_the_wire_in_the_input_dtype(fp32_grads, monkeypatch):
    """dkv_wire="input": dK/dV travel (and accumulate) in bf16; "fp32" (default) keeps their error
    flat in P. Both run, with bf16 or fp32 block gradients (the backend's AccumBackward is used on
    either wire exactly when asked); the bf16 wire is the less accurate one at P = 16."""
    from ringfa4.kernels.reference import ReferenceBackend

    begun = []
    begin = ReferenceBackend.begin_backward
    monkeypatch.setattr(ReferenceBackend, "begin_backward", lambda self, *a: begun.append(1) or begin(self, *a))
    P, S = 16, 2 * 16 * 16
    q, k, v, do = random_qkv(1, S, S, 4, 2, 32, dtype=torch.float64, seed=3)
    ref = reference_grads(q, k, v, do, causal=True)
    errs = {}
    for wire in ("fp32", "input"):
        cp = _sim(P, RingOptions(fp32_grads=fp32_grads, dkv_wire=wire))
        qb, kb, vb = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
        ringfa4.attention(qb, kb, vb, cp=cp, causal=True).backward(do.to(torch.bfloat16))
        errs[wire] = (rel_err(kb.grad, ref[3]), rel_err(vb.grad, ref[4]))
        assert len(begun) == (P if fp32_grads else 0), (wire, len(begun))
        begun.clear()
    assert errs["input"][0] > errs["fp32"][0] and errs["input"][1] > errs["fp32"][1], errs


def test_fa4_offers_fp32_paths_only_where_they_ran(monkeypatch):
    """What FA4 offers the ring is a property of the backend and the GPU generation: the fp32
    block outputs and the accumulating backward on sm90 (run on the H200), not on sm100 (compiled
    only), unless the backend is built with ``untested_archs=True``."""
    from ringfa4.kernels.fa4 import bwd_accum
    from ringfa4.kernels.fa4.backend import Fa4Backend

    arch = {"now": 100}
    monkeypatch.setattr(bwd_accum, "_arch", lambda: arch["now"])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not Fa4Backend().fp32_block_outputs(cuda) and not Fa4Backend().fp32_block_outputs(cpu)
    assert Fa4Backend(untested_archs=True).fp32_block_outputs(cuda)
    arch["now"] = 90
    assert Fa4Backend().fp32_block_outputs(cuda)
    q = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)  # CPU: no state whatever the arch
    assert Fa4Backend().begin_backward(q, q, q, torch.empty(1, 2, 8), AttnSpec()) is None


def test_gloo_dp_replicas_with_ulysses(pools):
    """CP groups inside a (dp, cp) mesh create only their own Ulysses and ring subgroups (a
    new_group over one CP group's ranks would wait for the other replica's ranks)."""
    res = pools(4).run("dp_ulysses_case", timeout=60)
    assert all(status == "ok" and value["identical"] for status, value in res), res
    assert sorted(value["cp_rank"] for _, value in res) == [0, 0, 1, 1]


class _CountingTransport(LoopbackTransport):
    """Loopback hops that record, per shift, how many pieces each rank sends."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[list[int]] = []

    def shift(self, send, recv, offset):
        self.pieces.append([len(s) if isinstance(s, tuple) else 1 for s in send])
        return super().shift(send, recv, offset)


@pytest.mark.parametrize("contiguous", [True, False])
def test_kv_hops_after_the_first_move_one_flat_buffer(contiguous):
    """The first K/V hop sends (k, v) as two pieces (the inputs themselves where they can), every
    later hop each rank's flat [k | v] buffer as one (the same on every rank); results unchanged."""
    P = 4
    q, k, v, do = random_qkv(1, 64, 64, 4, 2, 16, dtype=torch.float64, seed=3)
    if not contiguous:  # non-contiguous K/V: step 0 copies them into a flat buffer first
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    count = _CountingTransport()
    cp = ringfa4.ContextParallel.simulated(P, backend="reference", transport=count,
                                           options=RingOptions(fp32_grads=False))
    got = _run_with_grads(cp, q, k, v, do)
    want = reference_grads(q, k, v, do, causal=True)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12
    assert count.pieces[0] == [2] * P  # the forward's first hop
    assert all(p == [1] * P for p in count.pieces[1:P - 1]), count.pieces  # its later hops
    assert [p for p in count.pieces if p != [1] * P] == [[2] * P] * 2  # and the backward's first K/V hop


def _run_with_grads(cp, q, k, v, do):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, causal=True, return_lse=True)
    out.backward(do)
    return out.detach(), lse, qq.grad, kk.grad, vv.grad


def test_view_memo_makes_each_view_once_per_base_object():
    """The executors' per-call view memo: one make per (base objects, key); another object, even
    an equal one, gets its own; and KVBuffers hands back the very same views of a held buffer."""
    from ringfa4.parallel.memo import ViewMemo
    from ringfa4.parallel.ring.buffers import KVBuffers

    memo, made = ViewMemo(), []

    def make(x, a, b):
        made.append((a, b))
        return x.narrow(1, a, b - a)

    x, y = torch.zeros(1, 8), torch.zeros(1, 8)
    first = memo.get((x,), ("rows", 2, 5), make, x, 2, 5)
    assert memo.get((x,), ("rows", 2, 5), make, x, 2, 5) is first and made == [(2, 5)]
    assert memo.get((y,), ("rows", 2, 5), make, y, 2, 5) is not first and len(made) == 2
    assert memo.get((x,), ("rows", 2, 6), make, x, 2, 6).shape == (1, 4) and len(made) == 3
    k, v = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4)
    bufs = KVBuffers(k, v, 6)
    buf = bufs.filled(k, v)
    kb, vb = bufs.view(buf, 4)
    assert bufs.view(buf, 4)[0] is kb and bufs.view(buf, 4)[1] is vb
    assert torch.equal(kb, k[:, :4]) and torch.equal(vb, v[:, :4])
    assert bufs.view((k, v), 6)[0] is k  # all rows of an input pair: the input itself


def _lse_fills(fn) -> int:
    """Zero fills of a (1, 2, 16) tensor (the lse's shape below) that ``fn()`` makes."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_")
               and [1, 2, 16] in [list(s) for s in e.input_shapes])


def test_no_zeros_made_for_the_lse_gradient():
    """lse carries no gradient, so autograd makes no zero tensor for it in the backward (one fill
    launch a call): the ring's backward fills nothing of lse's shape, and a single call's backward
    fills exactly what the backend's own backward does."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    spec = AttnSpec(causal=True)
    out = ringfa4.attention(q, k, v, cp=ringfa4.ContextParallel.simulated(2, backend="reference"), causal=True)
    assert _lse_fills(lambda: out.sum().backward()) == 0
    out, lse = ringfa4.attention(q, k, v, causal=True, backend="reference", return_lse=True)
    be = get_backend("reference")
    own = _lse_fills(lambda: be.backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                                         lse, spec))
    assert _lse_fills(lambda: out.sum().backward()) == own
