"""The fused unpad-add of FA4's padded varlen accumulators (kernels/fa4/unpad_add_triton.py)
equals the index_select + add it replaces (and its store form the index_select + copy, in fp32 and
bf16, as for :class:`~ringfa4.kernels.spec.Written`): on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess since it is read at import), on the GPU natively."""

import pytest
import torch
from helpers import run_triton_script

SCRIPT = r"""
import torch
from ringfa4.kernels.fa4 import varlen_bwd
from ringfa4.kernels.fa4.unpad_add_triton import unpad_add_triton_
from ringfa4.kernels.spec import Written
g = torch.Generator().manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
for lengths, heads, d, d_r, tile in [([5, 0, 17, 1, 40], 3, 64, 64, 16), ([33], 2, 80, 96, 32),
                                     ([1, 1, 2, 70, 9], 4, 128, 128, 64)]:
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device=dev)
    total = sum(lengths)
    pad = varlen_bwd.padded_rows(total, cu.numel(), tile)
    accum = torch.randn(heads, pad * d_r, generator=g).to(dev)
    order = torch.randperm(tile * d_r, generator=g)[: tile * d].to(dev)  # in-tile offsets, each used once
    acc0 = torch.randn(total + 3, heads, d, generator=g).to(dev)[2:-1]  # a strided view (rows offset)
    want = acc0.clone()
    prow = varlen_bwd._padded_rows_of(cu, total, tile)
    idx = varlen_bwd._gather_index(cu, total, tile, order, d, d_r)
    want.add_(accum.index_select(1, idx).view(heads, total, d).permute(1, 0, 2), alpha=0.37)
    got = acc0.clone()
    assert unpad_add_triton_(got, accum, prow, order, tile, d_r, 0.37)
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    got32 = acc0.clone()  # int32 indices (what varlen_bwd passes on CUDA): the same sums
    assert unpad_add_triton_(got32, accum, prow.int(), order.int(), tile, d_r, 0.37)
    assert torch.equal(got32, got)
    assert not unpad_add_triton_(got.double(), accum, prow, order, tile, d_r, 1.0)  # not fp32: declined
    # the store form: rows written in the destination's dtype, never read (NaN there stays out)
    rows = accum.index_select(1, idx).view(heads, total, d).permute(1, 0, 2).mul(0.37)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        got_s = torch.full((total + 3, heads, d), float("nan"), device=dev).to(dtype)[2:-1]
        assert unpad_add_triton_(got_s, accum, prow, order, tile, d_r, 0.37, store=True)
        err = (got_s.float() - rows.to(dtype).float()).abs().max()
        assert err <= tol, err
    assert not unpad_add_triton_(got.double(), accum, prow, order, tile, d_r, 1.0, store=True)
    # varlen_bwd's entry point, both ways (Triton here; the torch fallback where it declines)
    for target in (torch.full_like(acc0, float("nan")), torch.full_like(acc0, float("nan")).double()):
        varlen_bwd._add_rows_(Written(target), accum, cu, tile, order, d_r, 0.37)
        assert torch.allclose(target.float(), rows, rtol=0, atol=1e-5)
    for target in (acc0.clone(), acc0.double()):
        varlen_bwd._add_rows_(target, accum, cu, tile, order, d_r, 0.37)
        assert torch.allclose(target.float(), want, rtol=0, atol=1e-5)
    # the padded rows themselves: document i starts at (cu[i] + i * tile) // tile * tile
    starts = [(int(cu[i]) + i * tile) // tile * tile for i in range(len(lengths))]
    assert [int(prow[int(cu[i])]) for i in range(len(lengths)) if lengths[i]] == \
        [s for s, n in zip(starts, lengths) if n]
print("ok")
"""


def test_unpad_add_interpreted_on_cpu():
    pytest.importorskip("triton")
    r = run_triton_script(SCRIPT, interpret=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.gpu
def test_unpad_add_on_gpu():
    assert torch.cuda.is_available()
    r = run_triton_script(SCRIPT, interpret=False)
    assert r.returncode == 0, r.stdout + r.stderr
