"""The LSE merge: random K/V splits merged in random order equal full attention."""

import math
import random

import pytest
import torch
from helpers import attention64, rel_err

from ringfa4.kernels import AttnSpec, get_backend, merge_lse, merge_lse_


@pytest.mark.parametrize("n_blocks", range(1, 9))
@pytest.mark.parametrize("causal", [False, True])
def test_split_kv_merge_equals_full(n_blocks, causal):
    rnd = random.Random(n_blocks * 2 + causal)
    g = torch.Generator().manual_seed(n_blocks)
    b, s, h, h_kv, d = 2, 48, 4, 2, 16
    q = torch.randn(b, s, h, d, generator=g)
    k = torch.randn(b, s, h_kv, d, generator=g)
    v = torch.randn(b, s, h_kv, d, generator=g)
    cuts = sorted(rnd.sample(range(1, s), n_blocks - 1))
    bounds = list(zip([0] + cuts, cuts + [s]))
    rnd.shuffle(bounds)
    be = get_backend("reference")
    out = torch.zeros(b, s, h, d)
    lse = torch.full((b, h, s), -math.inf)
    for k0, k1 in bounds:
        if not causal:
            o_b, l_b = be.forward(q, k[:, k0:k1], v[:, k0:k1], AttnSpec())
        else:
            # rows i < k0 see no key of [k0, k1); rows i >= k0 see keys j <= i: with block-local
            # i' = i - k0, j' = j - k0 that is j' - i' <= 0, i.e. window right = s_q' - s_k' = s - k1.
            o_b = torch.zeros(b, s, h, d)
            l_b = torch.full((b, h, s), -math.inf)
            be.forward(q[:, k0:], k[:, k0:k1], v[:, k0:k1], AttnSpec(window=(None, s - k1)),
                       out=o_b[:, k0:], lse=l_b[:, :, k0:])
        merge_lse_(out, lse, o_b, l_b)
    ro, rl = attention64(q, k, v, causal=causal)
    assert rel_err(out, ro) < 1e-6 and rel_err(lse, rl) < 1e-6


def test_merge_on_slices_of_accumulator():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 20, 2, 8, generator=g)
    k = torch.randn(1, 30, 2, 8, generator=g)
    v = torch.randn(1, 30, 2, 8, generator=g)
    be = get_backend("reference")
    out = torch.zeros(1, 20, 2, 8)
    lse = torch.full((1, 2, 20), -math.inf)
    for half in (slice(0, 10), slice(10, 20)):
        for kb in (slice(0, 12), slice(12, 30)):
            o, l = be.forward(q[:, half], k[:, kb], v[:, kb], AttnSpec())
            merge_lse_(out[:, half], lse[:, :, half], o, l)
    ro, rl = attention64(q, k, v)
    assert rel_err(out, ro) < 1e-6 and rel_err(lse, rl) < 1e-6


def _ones(lse_value):
    return torch.full((1, 3, 1, 2), 2.0), torch.full((1, 1, 3), lse_value)


@pytest.mark.parametrize("a,b", [(-math.inf, 0.5), (0.5, -math.inf), (-math.inf, -math.inf), (1.0, 1.0)])
def test_merge_infinite_sides(a, b):
    out_a, lse_a = _ones(a)
    out_b, lse_b = _ones(b)
    out_a = out_a * (0 if a == -math.inf else 1)  # a row with lse -inf has out 0
    out_b = out_b * (0 if b == -math.inf else 3)
    out, lse = merge_lse(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if a == b == -math.inf:
        assert torch.isneginf(lse).all() and (out == 0).all()
    elif a == -math.inf:
        assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
    elif b == -math.inf:
        assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    else:
        assert torch.allclose(lse, torch.full_like(lse, 1.0 + math.log(2.0)))
        assert torch.allclose(out, torch.full_like(out, 4.0))


def test_merge_first_block_into_empty_accumulator_is_exact():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(2, 5, 3, 4, generator=g)
    l = torch.randn(2, 3, 5, generator=g)
    acc, lacc = torch.zeros_like(o), torch.full_like(l, -math.inf)
    merge_lse_(acc, lacc, o, l)
    assert torch.equal(acc, o) and torch.equal(lacc, l)


def test_merge_rejects_bad_shapes():
    with pytest.raises(ValueError, match="lse_blk"):
        merge_lse_(torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="out_acc must be float32"):
        merge_lse_(torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 4),
                   torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4))


@pytest.mark.parametrize("n_blocks", [1, 3, 8, 32])
def test_merge_planes_equals_full_and_rounds_once(n_blocks):
    """The planes form (running M, S; FA4's merging epilogue does the same): random K/V splits
    merged in random order give full attention; -inf rows (a block that saw no key, or none yet)
    stay out 0, M -inf, S 0, and the lse is as close to float64 as one rounding."""
    from ringfa4.kernels.merge import fresh_planes, merge_planes_, planes_lse

    rnd = random.Random(n_blocks)
    g = torch.Generator().manual_seed(n_blocks)
    b, s, h, d = 2, 40, 3, 8
    q, k, v = (torch.randn(b, n, h, d, generator=g) for n in (s, 4 * 32, 4 * 32))
    q[:, :4] *= 30.0  # large lse values: the once-rounded sum matters
    cuts = sorted(rnd.sample(range(1, k.shape[1]), n_blocks - 1))
    bounds = list(zip([0] + cuts, cuts + [k.shape[1]]))
    rnd.shuffle(bounds)
    be = get_backend("reference")
    out, planes = torch.zeros(b, s, h, d), fresh_planes(b, h, s, torch.device("cpu"))
    dead = torch.zeros(b, 5, h, d), fresh_planes(b, h, 5, torch.device("cpu"))  # rows that never see a key
    for k0, k1 in bounds:
        o_b, l_b = be.forward(q, k[:, k0:k1], v[:, k0:k1], AttnSpec())
        merge_planes_(out, planes, o_b, l_b)
        merge_planes_(*dead, torch.zeros(b, 5, h, d), torch.full((b, h, 5), -math.inf))
    ro, rl = attention64(q, k, v)
    full_o, full_l = be.forward(q, k, v, AttnSpec())  # the same backend on the whole sequence
    lse = planes_lse(planes)
    assert rel_err(out, ro) <= 2 * rel_err(full_o, ro) + 1e-6
    ulp = torch.finfo(torch.float32).eps * rl.abs().max()
    assert (lse.double() - rl).abs().max() <= 2 * (full_l.double() - rl).abs().max() + ulp
    assert (dead[0] == 0).all() and (dead[1][:, :, 0] == -math.inf).all() and (dead[1][:, :, 1] == 0).all()
    assert (planes_lse(dead[1]) == -math.inf).all()


def test_merge_planes_matches_merge_lse_on_infinite_sides():
    """(-inf, x), (x, -inf), (-inf, -inf) and finite pairs: the planes form equals merge_lse_."""
    from ringfa4.kernels.merge import merge_planes_, planes_lse

    inf = math.inf
    acc_l = torch.tensor([[[-inf, 1.5, -inf, 0.25]]])
    blk_l = torch.tensor([[[2.0, -inf, -inf, 3.0]]])
    acc_o = torch.tensor([0.0, 1.0, 0.0, -2.0]).view(1, 4, 1, 1).expand(1, 4, 1, 4).clone()
    blk_o = torch.tensor([5.0, 0.0, 0.0, 4.0]).view(1, 4, 1, 1).expand(1, 4, 1, 4).clone()
    ref_o, ref_l = acc_o.clone(), acc_l.clone()
    merge_lse_(ref_o, ref_l, blk_o, blk_l)
    planes = torch.stack([acc_l, torch.where(acc_l == -inf, 0.0, 1.0)], dim=2)  # (M, S) of one block
    got_o = acc_o.clone()
    merge_planes_(got_o, planes, blk_o, blk_l)
    torch.testing.assert_close(got_o, ref_o)
    torch.testing.assert_close(planes_lse(planes), ref_l)
    assert not torch.isnan(got_o).any()
