"""The ring schedule as pure geometry: over all steps, each rank's blocks cover exactly the visible
(query, key) pairs of the global mask, each once; zigzag balances causal work."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringfa4.parallel import RingSchedule, band_block, make_layout


def _block_pairs(block, causal, window):
    """Visible local (i, j) pairs of one FA call on the block (FA convention)."""
    m, n = block.q1 - block.q0, block.k1 - block.k0
    i = torch.arange(m)[:, None]
    j = torch.arange(n)[None, :]
    d = j - i - (n - m)
    ok = torch.ones(m, n, dtype=torch.bool)
    left, right = block.window
    right = 0 if block.causal else right
    if left is not None:
        ok &= d >= -left
    if right is not None:
        ok &= d <= right
    return ok


@settings(max_examples=150, deadline=None)
@given(P=st.integers(1, 6), chunk=st.integers(1, 5), layout=st.sampled_from(["zigzag", "contiguous"]),
       causal=st.booleans(), left=st.one_of(st.none(), st.integers(0, 30)),
       right=st.one_of(st.none(), st.integers(0, 30)))
def test_blocks_cover_global_mask_exactly_once(P, chunk, layout, causal, left, right):
    lay = make_layout(layout, P)
    S = lay.multiple * chunk
    sched = RingSchedule(lay, S, causal, (left, right))
    gi = torch.arange(S)[:, None]
    gj = torch.arange(S)[None, :]
    rel = gj - gi
    want = torch.ones(S, S, dtype=torch.bool)
    if left is not None:
        want &= rel >= -left
    hi = 0 if causal else right
    if hi is not None:
        want &= rel <= hi
    count = torch.zeros(S, S, dtype=torch.int32)
    for r in range(P):
        q_idx = lay.indices(S, r)
        for t in range(P):
            k_idx = lay.indices(S, sched.source(r, t, P))
            for b in sched.blocks(r, t):
                ok = _block_pairs(b, b.causal, b.window)
                qi = q_idx[b.q0:b.q1][:, None].expand_as(ok)[ok]
                kj = k_idx[b.k0:b.k1][None, :].expand_as(ok)[ok]
                count.index_put_((qi, kj), torch.ones_like(qi, dtype=torch.int32), accumulate=True)
    assert torch.equal(count, want.int())


def test_band_block_trims_to_an_fa_call():
    # window smaller than a chunk: q [16, 32) against kv [11, 16) of the previous chunk
    b = band_block((0, 16, 16), (0, 0, 16), -5, 0)
    assert (b.q0, b.q1, b.k0, b.k1, b.causal, b.window) == (0, 5, 11, 16, False, (0, None))
    assert band_block((0, 32, 16), (0, 0, 16), -5, 0) is None  # wholly outside the window
    full = band_block((0, 32, 16), (0, 0, 16), -math.inf, 0)
    assert full.full and (full.q0, full.q1, full.k0, full.k1) == (0, 16, 0, 16)


def test_zigzag_balances_causal_work_and_skips_nothing_needed():
    for P in (2, 4, 8, 16):
        sched = RingSchedule(make_layout("zigzag", P), 2 * P * 64, True)
        work = [sched.work(r) for r in range(P)]
        assert max(work) == min(work)
        contiguous = RingSchedule(make_layout("contiguous", P), 2 * P * 64, True)
        cw = [contiguous.work(r) for r in range(P)]
        assert max(cw) / min(cw) > 1.5  # the imbalance zigzag removes
