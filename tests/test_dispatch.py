"""The balanced placement of packed documents (``cp.pack``'s default; ringfa4/parallel/dispatch.py)
through the executors: the layout's invariants, float64 exactness through the ring and the all-gather
on the simulated executor and gloo with a small reference tile (so documents are cut into several
pieces), what the exchange moves, and packs whose documents all stay whole moving nothing. The solver
on its own: tests/test_dispatch_solver.py."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import random_cu_seqlens, reference_grads, rel_err
from test_packing import FLOOR, _base_errors, _check

import ringfa4
from ringfa4.kernels import get_backend
from ringfa4.parallel import allgather as allgather_module
from ringfa4.parallel import context as context_module
from ringfa4.parallel import make_layout
from ringfa4.parallel.dispatch import piece_bounds, zigzag_placement
from ringfa4.parallel.packing import Packing

TILE = 8
MASKS = [{"causal": True}, {}, {"causal": True, "window": (13, None)}, {"window": (9, 6), "softcap": 2.0}]


def _lengths(seed: int, P: int, n: int = 10) -> list[int]:
    """Zero- and one-token documents, shorter than P, ordinary, and one longer than the pack / P."""
    rnd = random.Random(seed)
    pool = [0, 1, max(1, P - 1), 2 * P + 1, rnd.randint(5, 60), rnd.randint(20, 90), rnd.randint(40, 140)]
    lengths = [rnd.choice(pool) for _ in range(n)]
    lengths.insert(rnd.randrange(len(lengths) + 1), sum(lengths) // P + 3 * TILE + 5)
    return lengths


def _layout(P: int):
    return make_layout("zigzag", P, tile=TILE)


def _run(cp, q, k, v, do, cu, kw, mode="balanced"):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(qq, kk, vv, cp=cp, packing=cp.pack(cu, mode), return_lse=True, **kw)
    out.backward(do)
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


# -- the solver ------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_layout_invariants(P):
    for seed in range(12):
        lengths = _lengths(seed, P, n=6 + seed)
        pack = Packing(random_cu_seqlens(lengths).tolist(), _layout(P), balanced=True)
        pl = pack.placement
        seen = torch.cat([pack.indices(r) for r in range(P)])
        assert sorted(seen.tolist()) == list(range(pack.total)), "every token on exactly one rank"
        for r in range(P):
            segs = pack.segments(r)
            assert [s.local for s in segs] == [sum(x.length for x in segs[:i]) for i in range(len(segs))]
            n_travel = pack.travel_rows(r)
            assert all(s.travels == (s.local < n_travel) for s in segs), "travelling rows are a prefix"
            assert pack.rows(r) == pl.tokens[r] and pack.work(r) == pl.pairs[r]
        for doc in pl.split:
            _check_pieces(pl, doc, lengths[doc], P)
        for doc, owner in enumerate(pl.owner):
            if owner >= 0 and lengths[doc]:
                assert [s.doc for s in pack.segments(owner) if not s.travels].count(doc) == 1


def _check_pieces(pl, doc: int, L: int, P: int) -> None:
    """A split document's pieces tile it in order, each on one rank, every piece starting on a tile
    and a tile multiple long but the last non-empty one; the zigzag candidates' pieces are
    ``piece_bounds(L, 2m)``, two a rank."""
    m, table = pl.holders(doc), pl.bounds(doc)
    assert 2 <= m <= P
    assert [a for a, _ in table] == [sum(n for _, n in table[:j]) for j in range(len(table))] and \
        sum(n for _, n in table) == L, "the pieces tile the document in order"
    held = sorted(j for r in range(P) for j in pl.pieces(doc, r))
    assert held == list(range(len(table))), "each piece on exactly one rank"
    assert all(list(pl.pieces(doc, r)) == sorted(pl.pieces(doc, r)) for r in range(P)), "position order"
    last = max((j for j, (_, n) in enumerate(table) if n), default=0)
    assert all(a % TILE == 0 for a, _ in table[:last + 1]), "pieces start on a tile"
    assert all(n % TILE == 0 for _, n in table[:last]), "tile-aligned but the last"
    if table == tuple(piece_bounds(L, 2 * m, TILE)):
        assert all(len(pl.pieces(doc, r)) in (0, 2) for r in range(P)), "zigzag: two pieces a holder"


FILLED = [232, 114, 210, 244, 124, 26, 74]  # a small pack whose fill placement wins at P = 3, 4 (tile 8)


def _is_fill(pl, lengths, P, tile) -> bool:
    """Whether ``pl`` is not the zigzag candidate (unequal pieces)."""
    zig, _ = zigzag_placement(list(lengths), P, tile)
    return pl.split != zig.split or any(pl.bounds(d) != zig.bounds(d) for d in pl.split)


@pytest.mark.parametrize("travel", ["ring", "allgather"])
@pytest.mark.parametrize("P", [3, 4])
@pytest.mark.parametrize("kw", MASKS[:3], ids=str)
def test_fill_placement_float64(P, kw, travel, monkeypatch):
    """A pack the fill placement wins (unequal pieces, one or two a holder): exact through the
    ring and the all-gather."""
    monkeypatch.setattr(context_module, "prefer_allgather", lambda *a: travel == "allgather")
    cu = random_cu_seqlens(FILLED)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    pack = cp.pack(cu)
    assert _is_fill(pack.packing.placement, FILLED, P, TILE)
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(sum(FILLED), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    _check(_run(cp, q, k, v, do, cu, kw), ref, _base_errors(q, k, v, do, cu, kw, ref), torch.float64,
           f"fill {travel} P={P} {kw}")


def test_whole_documents_move_nothing(monkeypatch):
    """P documents of at most S / P tokens: every one whole on its own rank; no hop and no exchange
    byte, forward or backward, and the result exact."""
    P = 4
    lengths = [37] * P
    cu = random_cu_seqlens(lengths)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    pack = cp.pack(cu)
    assert not pack.packing.split_docs() and "no hop" in pack.describe(2, 8)
    moved = []
    t = cp.transport
    monkeypatch.setattr(t, "shift", lambda send, recv, off: moved.append(sum(x.numel() for x in send)) or None)
    monkeypatch.setattr(t, "move_start", lambda sends, *a, **kw: moved.append(sum(x.numel() for s in sends
                                                                                   for _, x in s)))
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    got = _run(cp, q, k, v, do, cu, {"causal": True})
    assert moved == [], f"a pack of whole documents moved {moved}"
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    _check(got, ref, _base_errors(q, k, v, do, cu, {"causal": True}, ref), torch.float64, "whole documents")


@pytest.mark.parametrize("P", [3, 4])
def test_exchange_sends_each_rank_only_the_keys_it_sees(P, monkeypatch):
    """The all-gather mode's exchange over a fill placement: what each rank receives is, per split
    document it holds pieces of, that document's keys up to the end of its last piece (causal), so
    the rows received over all ranks are the placement's key rows; every byte sent is received and
    every chunk is what its receiver expects; and the result stays exact."""
    monkeypatch.setattr(context_module, "prefer_allgather", lambda *a: True)
    cu = random_cu_seqlens(FILLED)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    pack = cp.pack(cu)
    placement = pack.packing.placement
    assert _is_fill(placement, FILLED, P, TILE)
    t, seen = cp.transport, []
    real = t.move_start

    def watch(sends, recvs, what="an exchange"):
        for dst, got in enumerate(recvs):  # what each rank receives from each is what that one sends it
            for src in range(P):
                assert [x.shape for s, x in got if s == src] == [x.shape for d, x in sends[src] if d == dst], what
        seen.append((what, [sum(x.shape[0] for _, x in got) for got in recvs]))
        return real(sends, recvs, what)
    monkeypatch.setattr(t, "move_start", watch)
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(sum(FILLED), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    got = _run(cp, q, k, v, do, cu, {"causal": True})
    kv = [rows for what, rows in seen if what == "the K/V exchange"]
    assert kv and all(rows == kv[0] for rows in kv), "the forward and the backward exchange the same rows"
    assert sum(kv[0]) == 2 * placement.key_rows(), (sum(kv[0]) // 2, placement.key_rows())  # K and V
    assert sum(sum(pack.packing.piece_ends(r).values()) for r in range(P)) == placement.key_rows()
    back = [rows for what, rows in seen if what == "the dK/dV exchange"]
    sched = pack.packing.schedule(context_module.AllGatherSchedule, True, (None, None))
    own = [sum(n for dst, _, n in sched.sends(r, 0) if dst == r) for r in range(P)]
    assert back == [[2 * (sum(n for _, _, n in sched.sends(r, 0)) - own[r]) for r in range(P)]], \
        "each owner receives the gradients of the rows it sent others (its own it adds in place)"
    for r in range(P):  # each travelling row written once: the sum of every piece of it, own and returned
        sums = sched.return_sums(r, 0, torch.device("cpu"))
        lay, staged = sched.layout(r, 0), sched.return_rows(r, 0)
        assert staged == back[0][r] // 2
        assert sorted(sums.dst.tolist()) == list(range(pack.packing.travel_rows(r)))
        assert sums.idx.numel() == sum(m.n for m in lay.moves if m.src == r) + staged
        assert sums.idx.numel() == 0 or int(sums.idx.max()) < lay.rows + staged
        times_sent = torch.zeros(pack.packing.travel_rows(r), dtype=torch.int64)
        for _, row, n in sched.sends(r, 0):
            times_sent[row:row + n] += 1
        assert torch.equal(sums.ptr.diff(), times_sent[sums.dst]), "a row's pieces: one per time it was sent"
        sizes, piece, slots, returns = sched.pieces(r, 0)  # the buffer's cut: each view one piece of one split
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        assert sum(sizes) == lay.rows + staged and sum(sizes[:slots]) == lay.rows
        assert all((starts[j], sizes[j]) == (m.slot_row, m.n) for m, j in zip(lay.moves, piece))
        returned = [n for dst, _, n in sched.sends(r, 0) if dst != r]
        assert [sizes[j] for j in returns] == returned and all(j >= slots for j in returns)
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    _check(got, ref, _base_errors(q, k, v, do, cu, {"causal": True}, ref), torch.float64, f"exchange P={P}")


@pytest.fixture
def foreach_launches(monkeypatch) -> list:
    """The destination lists of every ``torch._foreach_copy_`` call (one multi-tensor copy launch each)."""
    launches = []
    real = torch._foreach_copy_

    def counted(dsts, srcs, **kw):
        launches.append(list(dsts))
        return real(dsts, srcs, **kw)
    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    return launches


def test_mixed_dtype_pieces_go_as_bytes_where_they_can():
    """A hop's pieces of several dtypes become byte views of the same memory (one multi-tensor copy
    of one dtype); pieces of one dtype, a pair whose dtypes differ, or a piece whose last dim is
    strided stay as they are."""
    from ringfa4.kernels.copies import one_dtype

    k, acc = torch.randn(2, 3, 4).bfloat16(), torch.randn(5)
    dk, dacc = torch.empty_like(k), torch.empty_like(acc)
    dsts, srcs = one_dtype((dk, dacc), (k, acc))
    assert all(t.dtype == torch.uint8 for t in dsts + srcs)
    assert dsts[0].data_ptr() == dk.data_ptr() and srcs[1].data_ptr() == acc.data_ptr()
    torch._foreach_copy_(dsts, srcs)
    assert torch.equal(dk, k) and torch.equal(dacc, acc)
    same = (torch.empty(4), torch.empty(2))
    differ = ((torch.empty(4), torch.empty(2, dtype=torch.float64)), (torch.empty(4), torch.empty(2)))
    strided = ((torch.empty(4, 4).bfloat16()[:, ::2], torch.empty(3)), (torch.empty(4, 4).bfloat16()[:, ::2],
                                                                         torch.empty(3)))
    for a, b in ((same, same), differ, strided):
        got = one_dtype(a, b)
        assert got[0] is a and got[1] is b



def test_copy_all_is_one_multi_tensor_copy_a_dtype_at_most(foreach_launches):
    """What a CUDA-graph replay copies in and out (``copy_all``): every pair copied; mixed dtypes that
    take byte views in one multi-tensor copy, a strided bf16 piece beside fp32 ones in one a dtype;
    lists of different lengths refused."""
    from ringfa4.kernels.copies import copy_all

    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(2, 8, 4, generator=g).bfloat16(), torch.randn(3, 5, generator=g),
            torch.randn(6, generator=g).bfloat16()]
    dsts = [torch.empty_like(s) for s in srcs]
    copy_all(dsts, srcs)
    assert len(foreach_launches) == 1 and all(t.dtype == torch.uint8 for t in foreach_launches[0])
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    strided = torch.randn(4, 8, generator=g).bfloat16()[:, ::2]
    srcs2 = [strided, srcs[1], torch.randn(7, generator=g), srcs[2]]
    dsts2 = [torch.empty_like(s) for s in srcs2]
    foreach_launches.clear()
    copy_all(dsts2, srcs2)
    assert sorted(len(x) for x in foreach_launches) == [2, 2]
    assert all(torch.equal(d, s) for d, s in zip(dsts2, srcs2))
    with pytest.raises(ValueError, match="2 destinations for 3 sources"):
        copy_all(dsts[:2], srcs)

def test_loopback_hop_of_pieces_is_one_copy_per_rank(foreach_launches):
    """A ring hop whose rank sends several pieces (the first K/V hop: K and V; the q side's first:
    four) is one NCCL batch on a real rank, so one multi-tensor copy per receiving rank here; each
    receive gets its sender's matching piece; a piece count that differs is refused."""
    from ringfa4.parallel import LoopbackTransport

    P = 3
    send = [(torch.full((4,), float(r)), torch.full((2,), 10.0 + r, dtype=torch.float64)) for r in range(P)]
    recv = [(torch.empty(4), torch.empty(2, dtype=torch.float64)) for _ in range(P)]
    LoopbackTransport().shift(send, recv, 1)
    # one dtype a launch (a multi-tensor copy of mixed dtypes would run a copy a piece): bytes
    assert len(foreach_launches) == P and all(len(dsts) == 2 for dsts in foreach_launches)
    assert all({t.dtype for t in dsts} == {torch.uint8} for dsts in foreach_launches)
    for r in range(P):
        assert torch.equal(recv[r][0], send[(r - 1) % P][0]) and torch.equal(recv[r][1], send[(r - 1) % P][1])
    with pytest.raises(ValueError, match="pieces"):
        LoopbackTransport().shift(send, [t[0] for t in recv], 1)


def test_loopback_moves_launch_per_rank_as_real_ranks(foreach_launches):
    """The simulated executor issues a real rank's launches (issue 23): the loopback's exchange
    copies each receiving rank's moves from others in one multi-tensor copy (its NCCL batch) and its
    moves to itself in another (its local copies), never one launch for several ranks; every
    receive gets its matching send."""
    from ringfa4.parallel import LoopbackTransport

    P = 3
    data = [torch.arange(10.0) + 100 * r for r in range(P)]
    # rank r sends rows [r, r + 2) to every rank (itself included) and rows [5, 6) to rank (r + 1) % P
    sends = [[(d, data[r][r:r + 2]) for d in range(P)] + [((r + 1) % P, data[r][5:6])] for r in range(P)]
    recvs = [[(s, torch.empty(2)) for s in range(P)] + [((r - 1) % P, torch.empty(1))] for r in range(P)]
    LoopbackTransport().move_start(sends, recvs)
    owner = {id(t): r for r in range(P) for _, t in recvs[r]}
    assert len(foreach_launches) == 2 * P and all(len({owner[id(t)] for t in dsts}) == 1 for dsts in foreach_launches)
    for r in range(P):
        for s, t in recvs[r][:P]:
            assert torch.equal(t, data[s][s:s + 2])
        assert torch.equal(recvs[r][P][1], data[(r - 1) % P][5:6])


def test_describe_reports_the_balance():
    cp = ringfa4.ContextParallel.simulated(4, layout=_layout(4), backend="reference")
    text = cp.pack(random_cu_seqlens([300, 20, 31, 7, 90, 0, 1])).describe(num_kv_heads=2, head_dim=8)
    assert "balance (max / mean): tokens" in text and "rows a hop" in text and "MiB of K/V a hop" in text
    assert f"in whole {TILE}-token tiles" in text, text
    assert "keys of split ones seen" in text
    assert text.count("rank ") == 4


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("travel", ["ring", "allgather"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("kw", MASKS, ids=str)
def test_balanced_matches_per_document_float64(P, kw, travel, monkeypatch):
    monkeypatch.setattr(context_module, "prefer_allgather", lambda *a: travel == "allgather")
    lengths = _lengths(P * 11 + len(kw), P)
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    base = _base_errors(q, k, v, do, cu, kw, ref)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    pack = cp.pack(cu)
    if P > 1:
        assert pack.packing.split_docs() and len(pack.packing.split_docs()) < len(lengths), "some split, some whole"
    _check(_run(cp, q, k, v, do, cu, kw), ref, base, torch.float64, f"balanced {travel} P={P} {kw} {lengths}")


@pytest.mark.parametrize("lengths", [[0], [1], [3], [257], [0, 0, 5, 0], [1] * 9, [200, 1, 1]], ids=str)
def test_balanced_edge_packs(lengths):
    P = 4
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 1, 1, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    base = _base_errors(q, k, v, do, cu, {"causal": True}, ref)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    _check(_run(cp, q, k, v, do, cu, {"causal": True}), ref, base, torch.float64, f"edge {lengths}")


def test_balanced_float32_accumulates_like_one_call():
    """float32 inputs: the reference backend's own compute dtype, errors within 2x one varlen call."""
    P, lengths = 8, _lengths(5, 8, n=14)
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g) for n in (4, 2, 2, 4))
    ref = reference_grads(q.double(), k.double(), v.double(), do.double(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                          causal=True)
    base = _base_errors(q, k, v, do, cu, {"causal": True}, ref)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    _check(_run(cp, q, k, v, do, cu, {"causal": True}), ref, base, torch.float32, "float32")
    assert get_backend("reference").tile == 1 and FLOOR[torch.float32] > 0


@pytest.mark.parametrize("world,kw,lengths", [(w, kw, None) for w in (2, 3, 4) for kw in ({"causal": True},
                                                                                         {"window": (9, 6)})]
                         + [(2, {"causal": True}, [8200, 5, 300, 17, 0, 1]), (3, {"causal": True}, [0, 480])],
                         ids=str)
def test_gloo_balanced(pools, world, kw, lengths, monkeypatch):
    """Short packs take the all-gather (its exchange) for their split documents; the 8200-token
    document, with the rule's held-rows bound set to 0 (here and in the workers), the ring
    (bit-identical to the simulated executor); the lone 480-token document the dense ring."""
    lengths = lengths or _lengths(world * 5 + len(kw), world)
    rule = {"HELD_SHARE": 0} if sum(lengths) > 8000 else None
    if rule:
        monkeypatch.setattr(allgather_module, "HELD_SHARE", 0)
    res = pools(world).run("packed_case", "zigzag", torch.float64, lengths, kw, world, "balanced", 1, 2, TILE, rule)
    assert all(status == "ok" for status, _ in res), res
    cu = random_cu_seqlens(lengths)
    sim = ringfa4.ContextParallel.simulated(world, layout=_layout(world), backend="reference")
    ring = not sim.pack(cu).uses_allgather(4, 2)
    assert ring == (sum(lengths) > 8000)
    if ring:  # the exchange's returned gradients add in their own order: equal to rounding only
        assert all(value["identical"] for _, value in res), "distributed and simulated balanced runs differ"
    g = torch.Generator().manual_seed(world)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 2, 2, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    _check(res[0][1]["full"], ref, _base_errors(q, k, v, do, cu, kw, ref), torch.float64, f"gloo {world} {kw}")
    packing = Packing(cu.tolist(), _layout(world), balanced=True)
    for rank, (_, value) in enumerate(res):
        assert torch.equal(value["positions"], packing.positions(rank)) and value["rows"] == packing.rows(rank)


@pytest.mark.parametrize("P", [8, 32])
def test_bf16_pack_error_like_one_call(P):
    """bf16 inputs on the reference backend: fp32 block outputs and fp32 block gradients
    (``backward_accumulate``) keep the pack's error within 1.02x (out, lse) and 1.05x (dq, dk, dv)
    of one varlen call; with fp32 gradients off the block gradients round to bf16 (worse)."""
    lengths = [1, 300, 7, 45, 520, 2, 96, 410, 33, 260]
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(sum(lengths), n, 16, generator=g).to(torch.bfloat16) for n in (4, 2, 2, 4))
    ref = reference_grads(q.double(), k.double(), v.double(), do.double(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                          causal=True)
    base = _base_errors(q, k, v, do, cu, {"causal": True}, ref)
    errs = {}
    for fp32_grads in (True, False):
        cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference",
                                                options=ringfa4.RingOptions(fp32_grads=fp32_grads))
        assert cp.pack(cu).packing.split_docs()
        got = _run(cp, q, k, v, do, cu, {"causal": True})
        errs[fp32_grads] = [rel_err(x, r) for x, r in zip(got, ref)]
    for name, e, e0, bound in zip(("out", "lse", "dq", "dk", "dv"), errs[True], base, (1.02, 1.02, 1.05, 1.05, 1.05)):
        assert e <= bound * e0, f"P={P} {name}: {e:.4g} > {bound} x one call {e0:.4g}"
    assert sum(errs[False][2:]) > sum(errs[True][2:]), "bf16 block gradients should cost precision"


@pytest.mark.parametrize("P,L", [(2, 96), (4, 256), (4, 200)])
def test_one_document_runs_the_dense_ring(P, L):
    """A pack of one document that the balanced placement cuts exactly as the dense zigzag layout
    (every piece a tile multiple) runs the dense ring: bit-identical to the dense call; a length
    whose pieces differ keeps the packed ring, and both are exact."""
    from ringfa4.parallel.layouts import chunk_bounds

    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    cu = torch.tensor([0, 0, L, L], dtype=torch.int32)  # empty documents around it
    pack = cp.pack(cu)
    dense_like = [n for _, n in chunk_bounds(L, 2 * P, TILE)] == [n for _, n in piece_bounds(L, 2 * P, TILE)]
    assert pack.is_one_dense_sequence() == dense_like
    g = torch.Generator().manual_seed(L)
    q, k, v, do = (torch.randn(L, n, 8, generator=g).double() for n in (4, 2, 2, 4))
    got = _run(cp, q, k, v, do, cu, {"causal": True})
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    _check(got, ref, _base_errors(q, k, v, do, cu, {"causal": True}, ref), torch.float64, f"one doc {L}")
    if dense_like:
        qq, kk, vv = (t.unsqueeze(0).clone().requires_grad_() for t in (q, k, v))
        out, lse = ringfa4.attention(qq, kk, vv, cp=cp, causal=True, return_lse=True)
        out.backward(do.unsqueeze(0))
        for a, b in zip(got, (out[0].detach(), lse[0], qq.grad[0], kk.grad[0], vv.grad[0])):
            assert torch.equal(a, b)


@pytest.mark.parametrize("travel", ["ring", "allgather"])
@pytest.mark.parametrize("P", [2, 4])
def test_whole_documents_take_one_call_backward(P, travel, monkeypatch):
    """bf16 on the reference backend: a rank's whole documents, one call of exactly the rows after
    its travelling prefix, get their dq / dk / dv from that call's plain backward (no fp32
    accumulator, no backward_accumulate), bit-identical to one varlen call over those documents;
    the travelling rows still accumulate in fp32."""
    from ringfa4.parallel.ring import calls

    monkeypatch.setattr(context_module, "prefer_allgather", lambda *a: travel == "allgather")
    seen = {"plain_home": 0, "fp32_home": 0, "fp32_travel": 0}
    plain, fp32 = calls.backward, calls.backward_fp32

    def spy_plain(backend, blk, *a):
        seen["plain_home"] += blk.home
        return plain(backend, blk, *a)

    def spy_fp32(backend, blk, *a):
        seen["fp32_home" if blk.home else "fp32_travel"] += 1
        return fp32(backend, blk, *a)

    monkeypatch.setattr(calls, "backward", spy_plain)
    monkeypatch.setattr(calls, "backward_fp32", spy_fp32)
    lengths = [30, 5, 60, 200, 7, 1, 90, 33, 0, 44]
    cu = random_cu_seqlens(lengths)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    packing = cp.pack(cu).packing
    g = torch.Generator().manual_seed(P)
    q, k, v, do = (torch.randn(sum(lengths), n, 8, generator=g).to(torch.bfloat16) for n in (4, 2, 2, 4))
    got = _run(cp, q, k, v, do, cu, {"causal": True})
    whole = [r for r in range(P) if packing.travel_rows(r) < packing.rows(r)]
    assert whole and seen["plain_home"] == len(whole) and seen["fp32_home"] == 0 and seen["fp32_travel"] > 0
    be = get_backend("reference")
    for r in whole:  # the rank's whole documents alone, in its local order, through one backward
        idx, n = packing.indices(r), packing.travel_rows(r)
        home = idx[n:]
        segs = [s.length for s in packing.segments(r) if not s.travels]
        hcu = torch.tensor([0] + [sum(segs[:i + 1]) for i in range(len(segs))], dtype=torch.int32)
        spec = ringfa4.kernels.AttnSpec(causal=True, cu_seqlens_q=hcu, cu_seqlens_k=hcu, max_seqlen_q=max(segs),
                                        max_seqlen_k=max(segs))
        o, lse = be.forward(q[home], k[home], v[home], spec)
        dq, dk, dv = be.backward(do[home], q[home], k[home], v[home], o, lse, spec)
        for name, a, b in (("dq", got[2], dq), ("dk", got[3], dk), ("dv", got[4], dv)):
            assert torch.equal(a[home], b), f"rank {r} {name}: whole documents differ from one call"


@pytest.mark.parametrize("P", [2, 3])
def test_allgather_value_dim_differs(P, monkeypatch):
    """The all-gather with V rows of another shape than K rows (d_v = 2 d): its gathered rows and
    the reduce-scatter's buffer are copies, not views; float64 exact."""
    monkeypatch.setattr(context_module, "prefer_allgather", lambda *a: True)
    lengths = [30, 5, 60, 200, 7, 1, 90, 33, 0, 44]
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(P)
    q, k = (torch.randn(sum(lengths), n, 8, generator=g).double() for n in (4, 2))
    v, do = (torch.randn(sum(lengths), n, 16, generator=g).double() for n in (2, 4))
    ref = reference_grads(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    cp = ringfa4.ContextParallel.simulated(P, layout=_layout(P), backend="reference")
    assert cp.pack(cu).uses_allgather(4, 2) and cp.pack(cu).packing.split_docs()
    base = _base_errors(q, k, v, do, cu, {"causal": True}, ref)
    _check(_run(cp, q, k, v, do, cu, {"causal": True}), ref, base, torch.float64, f"d_v = 2 d, P={P}")
