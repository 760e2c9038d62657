"""Packed variable-length documents through the ring: per-document float64 reference (out, lse,
dq, dk, dv), no leakage across documents, load balance, placement, and bad input."""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers import TAIL_256K, random_cu_seqlens, reference_grads, rel_err

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend
from ringfa4.parallel import make_layout
from ringfa4.parallel.packing import Packing, cu_seqlens_from_position_ids

FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6}
MASKS = [{"causal": True}, {}, {"causal": True, "window": (5, None)}, {"window": (4, 3), "softcap": 2.0}]


def _lengths(seed, P, n=8):
    rnd = random.Random(seed)
    # zero, one, fewer tokens than P, ordinary, and one document longer than the rest together
    pool = [0, 1, max(1, P - 1), 2 * P + 1, rnd.randint(5, 40), rnd.randint(5, 40)]
    lengths = [rnd.choice(pool) for _ in range(n)]
    lengths.insert(rnd.randrange(len(lengths) + 1), sum(lengths) + 7)
    return lengths


def _data(lengths, dtype, seed, h=4, h_kv=2, d=8):
    T = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, n, d, generator=g).to(dtype) for n in (h, h_kv, h_kv, h))


def _base_errors(q, k, v, do, cu, kw, ref):
    longest = int((cu[1:] - cu[:-1]).max())
    spec = AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, **kw)
    be = get_backend("reference")
    out, lse = be.forward(q, k, v, spec)
    return [rel_err(x, r) for x, r in zip((out, lse, *be.backward(do, q, k, v, out, lse, spec)), ref)]


def _check(got, ref, base, dtype, label):
    for name, x, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        err = rel_err(x, r)
        assert err <= 2 * e0 + FLOOR[dtype], f"{label} {name}: {err:.3g} > 2 x {e0:.3g} + floor"


def _sim(P, layout, q, k, v, do, cu, kw, mode="ring"):
    cp = ringfa4.ContextParallel.simulated(P, layout=layout, backend="reference")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, packing=cp.pack(cu, mode), return_lse=True, **kw)
    out.backward(do)
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kw", MASKS, ids=str)
def test_simulated_packed_matches_per_document_float64(P, layout, kw, mode):
    dtype = torch.float64
    lengths = _lengths(P * 7 + len(kw), P)
    cu = random_cu_seqlens(lengths)
    q, k, v, do = _data(lengths, dtype, P)
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    base = _base_errors(q, k, v, do, cu, kw, ref)
    _check(_sim(P, layout, q, k, v, do, cu, kw, mode), ref, base, dtype, f"sim {mode} P={P} {layout} {kw} {lengths}")


@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("kw", MASKS, ids=str)
def test_allgather_in_two_groups_matches_float64(P, kw, monkeypatch):
    """The all-gather mode with its documents in two pipelined gather groups (forced here: small
    packs gather in one): exact against float64, the groups splitting the travelling documents."""
    from ringfa4.parallel import allgather

    monkeypatch.setattr(allgather, "PIPELINE_PAIRS", 0)
    lengths = [0, 23, 1, max(1, P - 1), 31, 2 * P + 1, 17, 0, 40, 9]  # zero, one, < P tokens; none dominant
    cu = random_cu_seqlens(lengths)
    pack = ringfa4.ContextParallel.simulated(P).pack(cu, "allgather").packing
    groups = pack.gather_groups(allgather.gather_group_count(pack))
    assert len(groups) == 2 and sorted(groups[0] + groups[1]) == [d for d in pack.split_docs() if lengths[d]]
    q, k, v, do = _data(lengths, torch.float64, P + 100)
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    base = _base_errors(q, k, v, do, cu, kw, ref)
    _check(_sim(P, "zigzag", q, k, v, do, cu, kw, "allgather"), ref, base, torch.float64, f"two groups P={P} {kw}")


def test_simulated_packed_float32():
    lengths = _lengths(3, 4)
    cu = random_cu_seqlens(lengths)
    q, k, v, do = _data(lengths, torch.float32, 5)
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    base = _base_errors(q, k, v, do, cu, {"causal": True}, ref)
    _check(_sim(4, "zigzag", q, k, v, do, cu, {"causal": True}), ref, base, torch.float32, "f32")


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_packed_lse_as_accurate_as_one_call(mode):
    """bf16 documents, 8 ranks: the merged lse (float64 across blocks, rounded once) is at most as
    far from float64 math as one varlen call over the pack."""
    lengths = [300, 17, 650, 90, 411]
    q, k, v, _ = _data(lengths, torch.float64, seed=4, d=32)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    spec = AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                    causal=True)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    exact = get_backend("reference", compute_dtype=torch.float64).forward(qb.double(), kb.double(), vb.double(),
                                                                          spec)[1]
    full = get_backend("reference").forward(qb, kb, vb, spec)[1]
    cp = ringfa4.ContextParallel.simulated(8, backend="reference")
    lse = ringfa4.attention(qb, kb, vb, cp=cp, packing=cp.pack(cu, mode), causal=True, return_lse=True)[1]
    assert rel_err(lse, exact) <= rel_err(full, exact), (rel_err(lse, exact), rel_err(full, exact))


def test_allgather_bf16_calls_read_their_keys_in_place(monkeypatch):
    """bf16, 4 ranks, two gather groups, the all-gather mode's fp32 block gradients: every gathered
    call's keys are one contiguous range of its group's buffer (no key gather, no indexed dK/dV
    add), a rank holding a document's head and tail fills the head's slot by a copy of the tail's
    prefix (and folds its gradients back), and out / lse / dq / dk / dv stay within 2x one varlen
    call's error against float64."""
    from ringfa4.parallel import allgather
    from ringfa4.parallel.allgather import AllGatherSchedule
    from ringfa4.parallel.varlen import VarlenCall

    monkeypatch.setattr(allgather, "PIPELINE_PAIRS", 0)  # two gather groups even for this small pack
    lengths = [300, 17, 650, 90, 411]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v, do = _data(lengths, torch.float64, seed=6, d=16)
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    qb, kb, vb, dob = (t.to(torch.bfloat16) for t in (q, k, v, do))
    base = _base_errors(qb, kb, vb, dob, cu, {"causal": True}, ref)
    gathers = []
    real = VarlenCall._rows
    monkeypatch.setattr(VarlenCall, "_rows", lambda self, x, which, dim=0: (
        gathers.append(which) if which == "k" and not self.k_contiguous else None, real(self, x, which, dim))[1])
    got = _sim(4, "zigzag", qb, kb, vb, dob, cu, {"causal": True}, "allgather")
    sched = ringfa4.ContextParallel.simulated(4).pack(cu, "allgather").packing.schedule(AllGatherSchedule, True,
                                                                                       (None, None))
    layouts = [sched.layout(r, g) for r in range(4) for g in range(len(sched.groups))]
    assert len(sched.groups) == 2 and not gathers
    assert all(c.k_contiguous for lay in layouts for c in lay.calls)
    assert any(lay.copies for lay in layouts), "zigzag: a rank's head piece reads a prefix of its tail's keys"
    for name, x, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert rel_err(x.double(), r) <= 2 * e0, f"{name}: {rel_err(x.double(), r):.3g} > 2 x {e0:.3g}"


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("victim", [0, 3, 5])
def test_no_leakage_between_documents(P, victim, mode):
    lengths = [7, 1, 19, 0, 3, 26, 2 * P]
    cu = random_cu_seqlens(lengths)
    q, k, v, do = _data(lengths, torch.float32, 9)
    a = _sim(P, "zigzag", q, k, v, do, cu, {"causal": True}, mode)
    lo, hi = int(cu[victim]), int(cu[victim + 1])
    q2, k2, v2, do2 = (t.clone() for t in (q, k, v, do))
    for t in (q2, k2, v2, do2):
        t[lo:hi] += torch.randn_like(t[lo:hi])
    b = _sim(P, "zigzag", q2, k2, v2, do2, cu, {"causal": True}, mode)
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[lo:hi] = False
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        xs, ys = (x[:, keep] if name == "lse" else x[keep]), (y[:, keep] if name == "lse" else y[keep])
        assert torch.equal(xs, ys), f"{name} of other documents changed when document {victim} changed"
    if hi > lo:
        assert not torch.equal(a[0][lo:hi], b[0][lo:hi])  # the perturbed document itself did change


def test_load_balance_of_zigzag_packing():
    rnd = random.Random(1)
    for P in (2, 4, 8):
        lengths, total = [], 0
        while total < 65536:
            n = rnd.randint(4 * P + 1, 6000)
            lengths.append(n)
            total += n
        pack = Packing(random_cu_seqlens(lengths).tolist(), make_layout("zigzag", P))
        work = [pack.work(r) for r in range(P)]
        ratio = max(work) / min(work)
        print(f"P={P}: {len(lengths)} documents, {total} tokens, max/min causal work per rank {ratio:.4f}")
        assert ratio < 1.1
        contiguous = Packing(random_cu_seqlens(lengths).tolist(), make_layout("contiguous", P))
        cw = [contiguous.work(r) for r in range(P)]
        assert max(cw) / min(cw) > 1.5  # what zigzag fixes


def test_pack_placement_and_position_ids():
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 8] and cu.dtype == torch.int32
    with pytest.raises(ValueError, match="restart at 0"):
        cu_seqlens_from_position_ids(torch.tensor([0, 1, 3]))
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    pack = cp.pack_from_position_ids(pos)
    assert torch.equal(pack.positions(), pos)
    packing = pack.packing
    x = torch.arange(8)
    parts = [packing.shard(x, 0, r) for r in range(2)]
    assert torch.equal(packing.unshard(parts, 0), x)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))


def test_packed_validation_simulated():
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    pack = cp.pack(random_cu_seqlens([4, 5]))
    q = torch.randn(8, 2, 8)
    with pytest.raises(ValueError, match="must have this rank's 9 packed tokens, got 8"):
        ringfa4.attention(q, q, q, cp=cp, packing=pack)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        cp.pack(torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="packing must come from this cp"):
        ringfa4.attention(q, q, q, cp=ringfa4.ContextParallel.simulated(2), packing=pack)


# -- gloo -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout,kw,mode", [("zigzag", {"causal": True}, "ring"), ("contiguous", {}, "ring"),
                                            ("zigzag", {"causal": True, "window": (5, None)}, "ring"),
                                            ("zigzag", {"causal": True}, "allgather"),
                                            ("zigzag", {"window": (4, 3)}, "allgather")], ids=str)
def test_gloo_packed(pools, world, layout, kw, mode):
    lengths = _lengths(world * 13, world)
    res = pools(world).run("packed_case", layout, torch.float64, lengths, kw, world, mode)
    assert all(status == "ok" for status, _ in res), res
    if mode == "ring":  # all-gather mode sums dK/dV in the collective's order: equal to rounding only
        assert all(value["identical"] for _, value in res), "distributed and simulated packed runs differ"
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(world)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    base = _base_errors(q, k, v, do, cu, kw, ref)
    _check(res[0][1]["full"], ref, base, torch.float64, f"gloo P={world} {layout} {kw}")
    packing = Packing(cu.tolist(), make_layout(layout, world))
    for rank, (_, value) in enumerate(res):
        assert torch.equal(value["positions"], packing.positions(rank)) and value["rows"] == packing.rows(rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_allgather_in_two_groups(pools, world):
    """Real ranks (gloo): the all-gather mode's two gather groups (forced in the workers), each
    group's K/V exchange posted while the last one computes and its dK/dV exchange while the next
    one does, exact against float64."""
    lengths = [0, 23, 1, max(1, world - 1), 31, 2 * world + 1, 17, 0, 40, 9]
    kw = {"causal": True}
    res = pools(world).run("packed_case", "zigzag", torch.float64, lengths, kw, world, "allgather", 1, 2, 1,
                           {"PIPELINE_PAIRS": 0})
    assert all(status == "ok" for status, _ in res), res
    assert all(value["groups"] == 2 for _, value in res)
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(world)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    _check(res[0][1]["full"], ref, _base_errors(q, k, v, do, cu, kw, ref), torch.float64, f"gloo groups P={world}")


@pytest.mark.parametrize("kind,message", [("rows", r"rank 0: q must have this rank's \d+ packed tokens"),
                                          ("cu_mismatch", r"rank 1: cu_seqlens\[1\] is 6, expected 5 as on rank 0")])
def test_gloo_packed_bad_input(pools, kind, message):
    res = pools(2).run("packed_bad", kind, timeout=60)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({value for _, value in res}) == 1 and re.search(message, res[0][1]), res


def test_auto_mode_rule():
    from ringfa4.parallel.allgather import HELD_SHARE, held_rows, prefer_allgather

    short_cu = [0] + [64 * (i + 1) for i in range(64)]  # 64 docs of 64
    short = Packing(short_cu, make_layout("zigzag", 8))
    long = Packing([0, 65536], make_layout("zigzag", 8))
    assert prefer_allgather(short, 32, 8) and not prefer_allgather(long, 32, 8)
    bench_cu = [0, 12000, 20000, 36000, 44000, 52000, 60000, 65536]
    bench = Packing(bench_cu, make_layout("zigzag", 8))
    assert prefer_allgather(bench, 32, 8)  # l ~ 10k < 4096 x 8: varlen_sim measured all-gather ahead
    cp = ringfa4.ContextParallel.simulated(8, backend="reference")
    # balanced (the default): 64 short documents all stay whole, nothing travels: the ring, no hop
    auto = cp.pack(torch.tensor(short_cu, dtype=torch.int32))
    assert auto.packing.balanced and not auto.packing.split_docs() and not auto.uses_allgather(32, 8)
    assert cp.pack(torch.tensor(short_cu, dtype=torch.int32), mode="allgather").uses_allgather(32, 8)
    assert not cp.pack(torch.tensor(short_cu, dtype=torch.int32), mode="ring").uses_allgather(32, 8)
    # the rule over the split documents only: the 7 long ones of the benchmark pack are split
    balanced = cp.pack(torch.tensor(bench_cu, dtype=torch.int32), mode="balanced")
    assert balanced.packing.split_docs() and balanced.uses_allgather(32, 8)
    assert not cp.pack(torch.tensor([0, 65536], dtype=torch.int32)).uses_allgather(32, 8)
    # long documents (l >= 4096 x 8): the all-gather (exchange) where no rank would hold more than
    # 4 x S / P received rows of one group, the ring where one document dominates
    even = Packing([0, 60000, 110000, 160000, 200000], make_layout("zigzag", 8, tile=128), balanced=True)
    assert even.split_docs() == (0, 1, 2, 3) and even.gather_groups(2) == ((0, 1), (2, 3))
    assert held_rows(even) * 8 <= HELD_SHARE * 200000 and prefer_allgather(even, 32, 8)
    lone = Packing([0, 200000, 210000, 225000], make_layout("zigzag", 8))
    assert held_rows(lone) * 8 > HELD_SHARE * 225000 and not prefer_allgather(lone, 32, 8)
    # benchmarks/varlen_sim.py's long tail (measured: all-gather ahead)
    tail = Packing([sum(TAIL_256K[:i]) for i in range(len(TAIL_256K) + 1)], make_layout("zigzag", 8, tile=128),
                   balanced=True)
    assert len(tail.split_docs()) == 4 and prefer_allgather(tail, 32, 8)
    with pytest.raises(ValueError, match="mode must be"):
        cp.pack(torch.tensor(short_cu, dtype=torch.int32), mode="fast")


@pytest.mark.parametrize("ulysses,h_kv,mode,kw", [(2, 2, "ring", {"causal": True}), (4, 1, "ring", {"causal": True}),
                                                  (2, 2, "allgather", {"causal": True}), (4, 4, "ring", {}),
                                                  (2, 1, "ring", {"causal": True, "window": (5, None)})], ids=str)
def test_gloo_packed_ulysses_and_hybrid(pools, ulysses, h_kv, mode, kw):
    world = 4
    lengths = _lengths(ulysses * 17 + h_kv, world)
    res = pools(world).run("packed_case", "zigzag", torch.float64, lengths, kw, 5, mode, ulysses, h_kv)
    assert all(status == "ok" for status, _ in res), res
    if mode == "ring":
        assert all(value["identical"] for _, value in res), "distributed and simulated packed runs differ"
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, h_kv, h_kv, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    base = _base_errors(q, k, v, do, cu, kw, ref)
    _check(res[0][1]["full"], ref, base, torch.float64, f"gloo U={ulysses} h_kv={h_kv} {mode} {kw}")


@pytest.mark.parametrize("P,U", [(4, 2), (4, 4), (8, 2), (8, 8)])
@pytest.mark.parametrize("mode", ["ring", "allgather", "balanced"])
@pytest.mark.parametrize("h_kv", [1, 2, 8])
def test_simulated_packed_hybrid(P, U, mode, h_kv):
    lengths = _lengths(P * U + h_kv, P)
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(P + U)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (8, h_kv, h_kv, 8))
    kw = {"causal": True}
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    base = _base_errors(q, k, v, do, cu, kw, ref)
    cp = ringfa4.ContextParallel.simulated(P, backend="reference", ulysses=U)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, packing=cp.pack(cu, mode), return_lse=True, **kw)
    out.backward(do)
    _check((out.detach(), lse, qq.grad, kk.grad, vv.grad), ref, base, torch.float64, f"sim P={P} U={U} {mode}")


@pytest.mark.parametrize("P", [2, 4, 8])
def test_no_call_has_an_empty_segment(P):
    from ringfa4.parallel.allgather import AllGatherSchedule
    from ringfa4.parallel.varlen import PackedRingSchedule

    lengths = [0, 1, 0, 2, P - 1, 3 * P + 1, 0, 50]
    pack = Packing(random_cu_seqlens(lengths).tolist(), make_layout("zigzag", P))
    for window in ((None, None), (3, None)):
        ring = PackedRingSchedule(pack, True, window)
        ag = AllGatherSchedule(pack, True, window)
        calls = [c for r in range(P) for t in range(P) for c in ring.blocks(r, t)]
        calls += [c for r in range(P) for c in ag.blocks(r)]
        assert calls and all(q1 > q0 and k1 > k0 for c in calls for q0, q1, k0, k1 in c.pairs)


def test_repeated_calls_on_a_pack_read_nothing_back_from_the_device(monkeypatch):
    """Schedules, cu_seqlens and indices are built once per pack: later layers cost no host sync
    (reads by the reference backend itself, which loops over documents on the host, don't count)."""
    import sys

    cp = ringfa4.ContextParallel.simulated(4, backend="reference")
    pack = cp.pack(random_cu_seqlens([30, 50, 7]), "ring")
    q = torch.randn(87, 2, 8, requires_grad=True)
    ringfa4.attention(q, q, q, cp=cp, packing=pack, causal=True).sum().backward()
    reads = []
    real_cpu, real_tolist = torch.Tensor.cpu, torch.Tensor.tolist

    def note():
        caller = sys._getframe(2).f_code.co_filename
        if not caller.endswith("reference.py"):
            reads.append(caller)

    import ringfa4.parallel.varlen as varlen

    built = []  # device-side cu_seqlens built (a host-to-device copy each)
    real_mark = varlen.mark_valid
    monkeypatch.setattr(varlen, "mark_valid", lambda cu, n: built.append(n) or real_mark(cu, n))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: note() or real_cpu(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: note() or real_tolist(self))
    ringfa4.attention(q, q, q, cp=cp, packing=pack, causal=True).sum().backward()
    assert not reads, reads
    assert not built, f"{len(built)} cu_seqlens rebuilt for a pack already used"


@pytest.mark.parametrize("P", [2, 3, 8])
def test_a_packs_split_all_is_every_ranks_shard_and_unshard_inverts_it(P):
    """The simulated group's split (one gather, each rank's part a slice) equals the per-rank
    shards; unshard (one scatter) puts padded parts back in global order; zero-length documents
    and ranks that hold nothing included."""
    lengths = [7, 0, 1, 19, 3, 0, 26, 2]
    pack = Packing(random_cu_seqlens(lengths).tolist(), make_layout("zigzag", P, tile=2))
    x = torch.arange(sum(lengths) * 3).view(-1, 3)
    parts = pack.split_all(x, 0)
    assert all(torch.equal(a, pack.shard(x, 0, r)) and a.is_contiguous() for r, a in enumerate(parts))
    padded = [torch.cat([p, torch.full((pack.max_rows - p.shape[0], 3), -1)]) for p in parts]
    assert torch.equal(pack.unshard(padded, 0), x)
    lse = x.T.contiguous()  # (h, total): split along dim 1, each part contiguous
    parts = pack.split_all(lse, 1)
    assert all(torch.equal(a, pack.shard(lse, 1, r)) and a.is_contiguous() for r, a in enumerate(parts))
    assert torch.equal(pack.unshard(parts, 1), lse)
    with pytest.raises(ValueError, match="expected the pack's total"):
        pack.split_all(x[1:], 0)
