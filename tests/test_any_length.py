"""Any sequence length on the dense path: a length the layout does not divide is cut into chunks
of which only the last non-empty one is shorter (tile-aligned where that leaves it non-empty),
shard / unshard / positions follow, and attention is exact against float64 (out, lse, dq, dk,
dv) for every length from 1 to 4P+3 at P = 2, 3, 4 on both layouts, with Ulysses, both backward
sides, windows and GQA."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_qkv, reference_grads, rel_err

import ringfa4
from ringfa4 import RingOptions
from ringfa4.kernels import AttnSpec, get_backend
from ringfa4.parallel import HybridLayout, make_layout
from ringfa4.parallel.layouts import chunk_bounds

FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6}


@pytest.mark.parametrize("n,tile", [(4, 1), (6, 1), (8, 4), (16, 128)])
def test_chunk_bounds(n, tile):
    for S in list(range(0, 3 * n * tile + 5)) + [65536 + 1000]:
        bounds = chunk_bounds(S, n, tile)
        assert len(bounds) == n and sum(b for _, b in bounds) == S
        assert all(bounds[i][0] + bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
        sizes = [b for _, b in bounds]
        if S % n == 0:
            assert len(set(sizes)) == 1
            continue
        full = sizes[0]
        filled = [b for b in sizes if b]
        assert all(b == full for b in filled[:-1]) and 0 < filled[-1] <= full  # only the last is shorter
        assert all(b == 0 for b in sizes[len(filled):])
        aligned = -(-math.ceil(S / n) // tile) * tile
        if S - (n - 1) * aligned > 0:
            assert full % tile == 0  # tile-aligned where that leaves the last chunk non-empty
    assert chunk_bounds(65536 + 1000, 16, 128)[0][1] == 4224  # FA4's tile at 64k + 1000, P = 8


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "hybrid"])
def test_shard_unshard_positions_every_length(P, layout):
    lay = HybridLayout(2 * P, make_layout("zigzag", P, tile=2), 2) if layout == "hybrid" else \
        make_layout(layout, P, tile=2)
    for S in range(0, 4 * P + 4):
        x = torch.arange(S).view(1, S, 1)
        parts = [lay.shard(x, 1, r) for r in range(lay.world_size)]
        assert torch.equal(lay.unshard(parts, 1), x)
        assert sorted(torch.cat(parts, 1).flatten().tolist()) == list(range(S))
        for r, part in enumerate(parts):
            assert torch.equal(lay.positions(S, r), part.flatten()) and part.shape[1] == lay.rows(S, r)
        assert lay.all_rows(S) == tuple(p.shape[1] for p in parts)  # (the metadata check's lengths, cached)
        padded = [torch.nn.functional.pad(p, (0, 0, 0, lay.max_rows(S) - p.shape[1])) for p in parts]
        assert torch.equal(lay.unshard(padded, 1, S), x)  # all-gathered buffers padded to the largest rank
        together = lay.split_all(x, 1)  # the simulated group's split: one gather, every rank's part a slice
        assert len(together) == lay.world_size and all(p.is_contiguous() for p in together)
        assert all(torch.equal(a, b) for a, b in zip(together, parts))
        batch = torch.arange(2 * S).view(2, S, 1)  # a batch: a copy a rank
        assert all(torch.equal(a, lay.shard(batch, 1, r)) and a.is_contiguous()
                   for r, a in enumerate(lay.split_all(batch, 1)))


def _case(P, layout, S, kw, ulysses=1, options=None, dtype=torch.float64, h_kv=2):
    q, k, v, do = random_qkv(2, S, S, 4, h_kv, 8, dtype=dtype, seed=S + P)
    ref = reference_grads(q, k, v, do, **kw)
    be = get_backend("reference", tile=2)
    spec = AttnSpec(**kw)
    o, l = be.forward(q, k, v, spec)
    base = [rel_err(x, r) for x, r in zip((o, l, *be.backward(do, q, k, v, o, l, spec)), ref)]
    cp = ringfa4.ContextParallel.simulated(P, layout=layout, backend=be, ulysses=ulysses, options=options)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ringfa4.attention(*x, cp=cp, return_lse=True, **kw)
    out.backward(do)
    floor = FLOOR.get(dtype, 1e-3)
    for name, got, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *(t.grad for t in x)), ref, base):
        err = rel_err(got, r)
        assert err <= 2 * e0 + floor, f"P={P} U={ulysses} {layout} S={S} {kw} {name}: {err:.3g} vs {e0:.3g}"


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("bwd_ring", ["kv", "q"])
def test_every_length(P, layout, bwd_ring):
    for S in range(1, 4 * P + 4):
        _case(P, layout, S, {"causal": True}, options=RingOptions(bwd_ring=bwd_ring))


@pytest.mark.parametrize("P,U", [(2, 2), (4, 2), (4, 4)])
def test_every_length_ulysses(P, U):
    for S in range(1, 4 * P + 4):
        _case(P, "zigzag", S, {"causal": True}, ulysses=U)


@pytest.mark.parametrize("kw", [{}, {"causal": True, "window": (5, None)}, {"window": (3, 2), "softcap": 2.0}],
                         ids=str)
@pytest.mark.parametrize("S", [7, 13, 30])
def test_uneven_masks_and_gqa(kw, S):
    _case(4, "zigzag", S, kw, h_kv=1)
    _case(3, "contiguous", S, kw, ulysses=1)


@pytest.mark.parametrize("S", [37, 64 + 5])
def test_uneven_bf16_keeps_fp32_partials_and_the_epilogue_merge(S, monkeypatch):
    """bf16 inputs on the reference backend: the uneven ring still runs the epilogue merge (the
    reference's forward_merge) and the accumulating backward, within the criterion."""
    from ringfa4.kernels.reference import ReferenceBackend

    merged, begun = [], []
    native_merge, native_begin = ReferenceBackend.forward_merge, ReferenceBackend.begin_backward
    monkeypatch.setattr(ReferenceBackend, "forward_merge", lambda self, *a: merged.append(1) or native_merge(self, *a))
    monkeypatch.setattr(ReferenceBackend, "begin_backward", lambda self, *a: begun.append(1) or native_begin(self, *a))
    _case(4, "zigzag", S, {"causal": True}, dtype=torch.bfloat16)
    assert merged and begun


def test_cp_shard_any_length_and_shard_batch():
    """cp.shard / positions / hf.shard_batch take any length (no "must be a multiple" refusal)."""
    pytest.importorskip("transformers")
    import ringfa4.hf as rhf

    cp = ringfa4.ContextParallel.simulated(3, backend="reference")
    ids = torch.arange(2 * 31).view(2, 31)
    shard = rhf.shard_batch({"input_ids": ids}, cp)
    assert shard.input_ids.shape == (2, 31) and shard.num_targets == 2 * 30
    assert torch.equal(cp.positions(31), torch.arange(31))


@pytest.mark.parametrize("world,layout,S,U", [(2, "zigzag", 13, 1), (3, "contiguous", 10, 1), (3, "zigzag", 7, 1),
                                              (4, "zigzag", 21, 2), (4, "zigzag", 3, 1)], ids=str)
def test_gloo_uneven_lengths(pools, world, layout, S, U):
    """Distributed ranks holding different counts: the check sums their lengths into S, the ring
    and Ulysses move uneven parts, unshard gathers them back; float64 exact and bit-identical to
    the simulated executor."""
    res = pools(world).run("uneven_case", layout, S, {"causal": True}, U)
    assert all(status == "ok" for status, _ in res), res
    assert all(value["identical"] for _, value in res), res
    lay = HybridLayout(world, make_layout(layout, world // U, tile=2), U) if U > 1 else make_layout(layout, world,
                                                                                                     tile=2)
    assert [value["rows"] for _, value in res] == [lay.rows(S, r) for r in range(world)]
    full = res[0][1]
    ref = reference_grads(*full["inputs"], causal=True)
    for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), full["full"], ref):
        assert rel_err(x, r) < 1e-12, name


def test_gloo_uneven_wrong_length_same_error_everywhere(pools):
    """A rank whose shard does not match the layout's part of the summed length: the same ValueError
    on every rank, naming it, before any data moves. (S = 14 over 3 zigzag ranks holds 3 / 5 / 6; rank
    2 dropping a token sums to 13, whose parts are 3 / 4 / 6. A drop that leaves a valid split of a
    shorter sequence cannot be told apart from it.)"""
    res = pools(3).run("uneven_case", "zigzag", 14, {"causal": True}, 1, 2, timeout=60)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({v for _, v in res}) == 1 and "q.shape is" in res[0][1], res
